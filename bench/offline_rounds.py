"""The training recipe without the loop: GRPO rounds on a task's first turn, sampled in-process.

    python -m bench.offline_rounds --task tool_choice --rounds 40           # on-policy
    python -m bench.offline_rounds --task tool_choice --rounds 40 --stale   # sampled by the warm start
    python -m bench.offline_rounds --task argument --set '{"proximal_policy": "behaviour"}'

Each round samples ``--groups`` requests of a bench/learning_tasks.py task ``--k`` times from the model
(transformers' ``generate`` at temperature 1, the behaviour logprobs kept as the engine would capture
them), scores each first turn with the task's gate reward (``gate_reward``: the reward a conversation
ending there would get), and trains one round with ``trainer.train_round`` on
``deploy/flywheel.small-model.toml``'s ``[train.args]`` (``--set`` overrides fields), continuing the
last round's adapter and optimizer state. ``--stale``: the samples always come from the warm start,
as when the loop's training line runs ahead of a serving version that never changes; then the head of
the line is measured on its own samples every four rounds.

What it separates: whether a recipe learns a task at all (on-policy, fast, no gateway, no canary),
and whether it still learns from an older policy's samples. One JSON line per round (and per
evaluation) on stdout and in ``<out>/rounds.jsonl``. docs/learning.md shows what it measured.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import time
from pathlib import Path
from typing import Any

from bench.learning_suite import warm_model
from bench.learning_tasks import TASKS, Task, gate_reward
from flywheel.capture.batches import BranchTurn, GroupMember, TrainingGroup
from flywheel.gateway.cli.demo import small_model_train_args
from flywheel.gateway.serving.engines.local.toolcalls import parse_tool_calls
from flywheel.trainer.grpo import train_round
from flywheel.trainer.grpo_args import GRPOArgs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.offline_rounds", description=__doc__.split("\n")[0])
    parser.add_argument("--task", choices=sorted(TASKS), default="tool_choice")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--groups", type=int, default=16, help="requests a round")
    parser.add_argument("--k", type=int, default=4, help="samples of each request: the group size")
    parser.add_argument("--stale", action="store_true", help="sample every round from the warm start")
    parser.add_argument("--set", default="{}", help="GRPOArgs fields over the small-model configuration, as JSON")
    parser.add_argument("--data-dir", type=Path, default=Path("flywheel-data") / "learning")
    parser.add_argument("--out", type=Path, default=Path("flywheel-data") / "offline-rounds")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--seed", type=int, default=1)
    return parser.parse_args(argv)


def round_args(overrides: dict[str, Any]) -> GRPOArgs:
    return GRPOArgs(**{**small_model_train_args(), "progress": False, **overrides})


def sample_groups(model_dir: Path, adapter: Path | None, task: Task, args: argparse.Namespace,
                  rng: random.Random, tag: str) -> list[TrainingGroup]:
    """``args.groups`` requests, each answered ``args.k`` times by the model (with ``adapter``), scored."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer: Any = AutoTokenizer.from_pretrained(model_dir)
    stops = [tokenizer.eos_token_id, tokenizer.pad_token_id]
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    groups = []
    for g in range(args.groups):
        messages = task.first_messages(task.request(rng))
        prompt = tokenizer.apply_chat_template(messages, tools=task.tools, add_generation_prompt=True, tokenize=False)
        b_prompt = tokenizer([prompt] * args.k, return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**b_prompt, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                 max_new_tokens=task.max_tokens, output_scores=True, return_dict_in_generate=True,
                                 pad_token_id=tokenizer.pad_token_id, eos_token_id=stops)
        b_logps = torch.stack(out.scores, 1).float().log_softmax(-1)  # (k, T, V)
        members = []
        for i in range(args.k):
            ids = out.sequences[i, b_prompt["input_ids"].shape[1]:].tolist()
            ended = next((t for t, token in enumerate(ids) if token in stops), None)
            ids = ids if ended is None else ids[:ended + 1]  # the engine's ids end with the stop token
            logps = b_logps[i, torch.arange(len(ids)), torch.tensor(ids)].tolist()
            content, calls = parse_tool_calls(tokenizer.decode([t for t in ids if t not in stops]))
            answer = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
            reward = gate_reward(messages, task.tools, answer, truncated=ended is None)
            members.append(GroupMember(f"{tag}-{g}-{i}", [BranchTurn(
                messages, answer, task.tools, prompt_token_ids=b_prompt["input_ids"][i].tolist(),
                completion_token_ids=ids, completion_logprobs=logps,
                finish_reason="length" if ended is None else "stop")], reward))
        groups.append(TrainingGroup(f"{tag}-{g}", "task", "agent", members))
    return groups


def mean_reward(groups: list[TrainingGroup]) -> float:
    rewards = [m.reward for g in groups for m in g.members]
    return round(sum(rewards) / len(rewards), 3)


def main(argv: list[str] | None = None) -> None:
    import torch

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    task, train_args = TASKS[args.task], round_args(json.loads(args.set))
    model_dir = warm_model(args.data_dir, args.task)
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    rng = random.Random(args.seed)
    head: Path | None = None  # the newest adapter of the line
    optimizer: Path | None = None
    started = time.monotonic()
    with (args.out / "rounds.jsonl").open("w") as log:
        def emit(record: dict[str, Any]) -> None:
            line = json.dumps({"t": round(time.monotonic() - started, 1), **record})
            print(line, flush=True)
            log.write(line + "\n")

        for r in range(args.rounds):
            if args.stale and head is not None and r % 4 == 0:
                emit({"round": r, "head_reward": mean_reward(sample_groups(model_dir, head, task, args, rng, "eval"))})
            groups = sample_groups(model_dir, None if args.stale else head, task, args, rng, f"r{r}")
            result = train_round(model_dir, groups, train_args, init_adapter=head, out_dir=args.out / f"v{r + 1}",
                                 optimizer_state=optimizer)
            if result.status == "finished":
                head, optimizer = result.adapter_dir, result.optimizer_state
            m = result.metrics
            emit({"round": r, "sampled_reward": mean_reward(groups), "status": result.status,
                  **{k: round(m[k], 4) for k in ("losses/approx_kl", "losses/clipfrac", "losses/entropy", "losses/kl",
                                                  "behaviour/kl", "samples/skipped_groups/zero_variance") if k in m}})


if __name__ == "__main__":
    main()
