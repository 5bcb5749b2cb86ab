#!/usr/bin/env bash
# The checks that need a GPU, as one short script for a lent machine (docs/benchmarks.md, "On a GPU").
#
#     bash bench/gpu_session.sh OUT_DIR        # in the checkout, with the wheels in .whl/ (docs/benchmarks.md)
#
# Each step runs under its own timeout and writes its log into OUT_DIR; a step that fails does not stop
# the next. About 8 minutes on one H100.
set -u
out=${1:?usage: bash bench/gpu_session.sh OUT_DIR}
mkdir -p "$out"
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD/sdk:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 MPLBACKEND=Agg
python3 -c "import torch, transformers, trl, peft
print('torch', torch.__version__, 'transformers', transformers.__version__, 'trl', trl.__version__, 'peft', peft.__version__)
print(torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0).total_memory // 2**30, 'GiB')" \
    > "$out/versions.txt" 2>&1
cat "$out/versions.txt"

step() {  # step NAME SECONDS COMMAND...: run one check, its output into OUT_DIR/NAME.log
    local name=$1 seconds=$2
    shift 2
    local started=$SECONDS
    timeout "$seconds" "$@" > "$out/$name.log" 2>&1
    echo "== $name: exit $? in $((SECONDS - started)) s"
    tail -n 4 "$out/$name.log"
}

# The loss that trains against TRL's reference, on CUDA (bf16/TF32 tolerance), and TRL's contract.
step loss_tests 240 python3 -m pytest -q -p no:randomly tests/test_grpo_loss.py tests/test_trl_contract.py
# A round's wall time against its train(), warm rounds in one training process.
step warm_round 200 python3 -m bench.warm_round --rounds 4 --cold 1 --groups 32 --json-out "$out/warm_round.json"
# Training throughput at real shapes (random weights, bf16): tokens/s, padding, MFU, peak memory.
step train_step_1.5b 240 python3 -m bench.train_step --shape 1.5b --groups 16 --group-size 8 \
    --completion-tokens 512 --min-completion-tokens 64 --gradient-accumulation-steps 2 --steps 8 \
    --max-tokens-per-micro-batch 16384 --peak-tflops 989 --repeats 1 --compare captured,budget \
    --json-out "$out/train_step_1.5b.json"
