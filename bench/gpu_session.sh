#!/usr/bin/env bash
# The checks that need a GPU, as one short script for a lent machine (docs/benchmarks.md, "On a GPU").
#
#     bash bench/gpu_session.sh OUT_DIR [STEP...]   # in the checkout, with the wheels in .whl/ (docs/benchmarks.md)
#
# STEPs, run in the order given: loss_tests warm_round train_step demo (default: the first three, about
# 8 minutes on one H100; the demo takes DEMO_MINUTES, default 4, plus ~1). Each step runs under its own
# timeout and writes its log into OUT_DIR; a step that fails does not stop the next.
set -u
out=${1:?usage: bash bench/gpu_session.sh OUT_DIR [STEP...]}
shift
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

run() {  # run NAME SECONDS COMMAND...: one check under its timeout, its output into OUT_DIR/NAME.log
    local name=$1 seconds=$2
    shift 2
    local started=$SECONDS
    timeout "$seconds" "$@" > "$out/$name.log" 2>&1
    echo "== $name: exit $? in $((SECONDS - started)) s"
    tail -n 4 "$out/$name.log"
}

# The loss that trains against TRL's reference, on CUDA (bf16/TF32 tolerance), TRL's contract, and the
# micro-batched round (pi_prox from the reference forward) against whole batches. One process, no addopts:
# the carried wheels need not include pytest-xdist.
loss_tests() {
    run loss_tests 240 python3 -m pytest -q -o addopts= tests/test_grpo_loss.py tests/test_trl_contract.py \
        tests/test_grpo_micro_batches.py
}

# A round's wall time against its train(), warm rounds in one training process (each round captures its own
# 256 requests first: most of the step's time).
warm_round() {
    run warm_round 300 python3 -m bench.warm_round --rounds 3 --cold 0 --groups 32 --json-out "$out/warm_round.json"
}

# Training throughput at real shapes (random weights, bf16): tokens/s, padding, MFU, peak memory.
train_step() {
    run train_step_1.5b 240 python3 -m bench.train_step --shape 1.5b --groups 16 --group-size 8 \
        --completion-tokens 512 --min-completion-tokens 64 --gradient-accumulation-steps 2 --steps 8 \
        --max-tokens-per-micro-batch 16384 --peak-tflops 989 --repeats 1 --compare captured,budget \
        --json-out "$out/train_step_1.5b.json"
}

# The demo with its engine and trainer on the GPU: reward over time, versions, each round's store rows.
demo() {
    local minutes=${DEMO_MINUTES:-4}
    run demo $(( ${minutes%.*} * 60 + 120 )) python3 -m flywheel.gateway demo --data-dir /tmp/demo-data --minutes "$minutes"
    tar -C /tmp/demo-data/demo -czf "$out/demo.tgz" summary.json reward.png gateway.log agent.log flywheel.duckdb
}

for name in ${*:-loss_tests warm_round train_step}; do
    case $name in
        loss_tests|warm_round|train_step|demo) $name ;;
        *) echo "unknown step: $name (loss_tests, warm_round, train_step, demo)" >&2; exit 2 ;;
    esac
done
