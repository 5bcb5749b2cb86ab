"""What a demo-shaped round costs to train, three ways: checkpointed, not, and with its prompt prefix shared.

    python -m bench.prompt_prefix                      # 32 groups of 4, 2 repeats, one torch thread (~1 min)
    python -m bench.prompt_prefix --groups 16 --repeats 3 --json-out prefix.json

The round is the demo agent's (``examples/demo/task.py``): the format-only warm start answers
``groups`` requests four times each (first turn, tool result, final answer), as the gateway would
capture them, and ``train_round`` trains them on the small-model configuration's ``[train.args]``
(``deploy/flywheel.small-model.toml``). Modes, each the same round from the same adapter:

- ``checkpointed``: activation checkpointing on, which TRL's ``GRPOConfig`` turns on unless told
  otherwise (rounds ran so until 2026-11-29), no prefix sharing: the baseline;
- ``plain``: activation checkpointing off, no prefix sharing: TRL's forward;
- ``shared``: off, and the prompt tokens a micro-batch's rows all begin with forwarded once
  (``GRPOArgs.share_prompt_prefix``, ``trainer/shared_prefix.py``).

Printed per mode: the median ``train()`` seconds (TRL's train_runtime), its ratio to the baseline,
the positions the forwards processed, and the round's loss and KL, which must agree across modes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

MODES = {"checkpointed": {"gradient_checkpointing": True, "share_prompt_prefix": False},
         "plain": {"gradient_checkpointing": False, "share_prompt_prefix": False},
         "shared": {"gradient_checkpointing": False, "share_prompt_prefix": True}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--groups", type=int, default=32, help="requests per round, four episodes each")
    parser.add_argument("--repeats", type=int, default=2, help="rounds per mode, interleaved")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (the loop's training child: 1)")
    parser.add_argument("--out", default="/tmp/flywheel-prompt-prefix", help="tiny model, warm start, adapters")
    parser.add_argument("--json-out", default="", help="also write the results here")
    args = parser.parse_args()

    import torch
    from transformers import AutoTokenizer

    from bench.demo_learning import DEFAULT_GRPO, load_policy, run_episodes
    from examples.demo import task
    from flywheel.trainer.grpo import train_round
    from flywheel.trainer.grpo_args import GRPOArgs
    from flywheel.trainer.tiny_model import ensure_tiny_model
    from flywheel.trainer.warm_start import warm_start

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tiny = ensure_tiny_model(out / "tiny", seed=0)
    base = warm_start(tiny, out / "warm-start", task.warm_start_examples(512, seed=0), steps=80, batch_size=16,
                      learning_rate=6e-3, seed=0, progress=False)
    tokenizer = AutoTokenizer.from_pretrained(base)
    requests = task.request_pool(max(64, args.groups), seed=0)[:args.groups]
    episodes = run_episodes(load_policy(base, None), tokenizer, requests, group_size=4, temperature=1.0, seed=1,
                            tag="round")
    print(f"round: {args.groups} groups of 4, {args.threads} thread(s), {args.repeats} repeats per mode", flush=True)

    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    for repeat in range(args.repeats):
        for mode, switches in MODES.items():
            grpo = GRPOArgs.tiny(**{**DEFAULT_GRPO, "num_generations": 4, **switches})
            started = time.perf_counter()
            result = train_round(base, episodes.groups, grpo, out_dir=tempfile.mkdtemp(dir=out))
            metrics = result.metrics
            runs[mode].append({"train_s": metrics["charts/train_seconds"], "wall_s": time.perf_counter() - started,
                               "forward_tokens": metrics["samples/forward_tokens"], "loss": metrics["losses/loss"],
                               "kl": metrics["losses/kl"], "steps": metrics["charts/steps"]})
            print(f"  {repeat + 1}/{args.repeats} {mode:>12}: train() {metrics['charts/train_seconds']:.2f} s, "
                  f"{metrics['samples/forward_tokens']:.0f} forwarded positions", flush=True)

    baseline = statistics.median(run["train_s"] for run in runs["checkpointed"])
    plain = statistics.median(run["train_s"] for run in runs["plain"])
    summary = {}
    print(f"{'mode':>12}  {'train() s':>9}  {'x checkpointed':>14}  {'x plain':>7}  {'positions':>9}  "
          f"{'loss':>8}  {'kl':>8}")
    for mode, rows in runs.items():
        seconds = statistics.median(row["train_s"] for row in rows)
        summary[mode] = {"train_s": seconds, "vs_checkpointed": seconds / baseline, "vs_plain": seconds / plain,
                         "forward_tokens": rows[0]["forward_tokens"], "loss": rows[0]["loss"], "kl": rows[0]["kl"],
                         "steps": rows[0]["steps"]}
        print(f"{mode:>12}  {seconds:>9.2f}  {seconds / baseline:>14.2f}  {seconds / plain:>7.2f}  "
              f"{rows[0]['forward_tokens']:>9.0f}  {rows[0]['loss']:>8.4f}  {rows[0]['kl']:>8.5f}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"args": vars(args), "runs": runs, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
