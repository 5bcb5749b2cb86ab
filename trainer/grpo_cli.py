"""``python -m flywheel.trainer.grpo``: one GRPO round on groups read from a JSON-lines file.

Its command line and its output; ``flywheel.trainer.grpo.main`` runs the round between the two.

    # one round on groups exported as JSON lines (TrainingGroup.to_json), tiny model, CPU:
    python -m flywheel.trainer.grpo --base ~/.flywheel/models/tiny --groups groups.jsonl --out /tmp/adapter --tiny
    # a real model on one GPU (bf16 picked automatically), continuing from the alias's adapter:
    python -m flywheel.trainer.grpo --base Qwen/Qwen2.5-7B-Instruct --groups groups.jsonl --out data/adapters/a/8 \\
        --init-adapter data/adapters/a/7 --optimizer-state data/adapters/a/7/optimizer.pt
    # several GPUs: the same through accelerate
    accelerate launch -m flywheel.trainer.grpo --base ... --groups ... --out ...
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from flywheel.capture.batches import TrainingGroup
from flywheel.trainer.grpo_args import GRPOArgs, RoundResult


@dataclass
class RoundCommand:
    """One round as the command line asks for it."""

    base: str
    groups: list[TrainingGroup]
    args: GRPOArgs
    out: str
    init_adapter: str | None
    optimizer_state: str | None
    result_json: str | None


def _parse_field(annotation: str, raw: str) -> Any:
    """A command-line string as the type a GRPOArgs field is annotated with."""
    if raw.lower() == "none" and "None" in annotation:
        return None
    if annotation.startswith("bool"):
        return raw.lower() in ("1", "true", "yes")
    if annotation.startswith("int"):
        return int(raw)
    if annotation.startswith("float"):
        return float(raw)
    if annotation.startswith("list[str]") and raw != "all-linear":
        return raw.split(",")
    return raw


def parse_command(argv: list[str] | None = None) -> RoundCommand:
    """The round the command line asks for: its flags, the ``--args-json`` file and the groups file, read."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m flywheel.trainer.grpo", description=__doc__.split("\n")[0])
    parser.add_argument("--base", required=True, help="base model directory or Hugging Face id (from the cache)")
    parser.add_argument("--groups", required=True, help="JSON lines, one TrainingGroup.to_json() per line")
    parser.add_argument("--out", required=True, help="adapter directory to write (absent or empty)")
    parser.add_argument("--init-adapter", default=None)
    parser.add_argument("--optimizer-state", default=None)
    parser.add_argument("--tiny", action="store_true", help="start from GRPOArgs.tiny() (CPU, random tiny model)")
    parser.add_argument("--args-json", default=None, help="a JSON file of GRPOArgs fields (the flags below win)")
    parser.add_argument("--result-json", default=None, help="write the RoundResult here as JSON (the main process)")
    for f in fields(GRPOArgs):
        parser.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, default=None, help=f"GRPOArgs.{f.name}")
    ns = parser.parse_args(argv)
    defaults = GRPOArgs.tiny() if ns.tiny else GRPOArgs()
    overrides = {f.name: _parse_field(str(f.type), raw) for f in fields(GRPOArgs)
                 if (raw := getattr(ns, f.name)) is not None}
    given = json.loads(Path(ns.args_json).read_text()) if ns.args_json else {}
    groups = [TrainingGroup.from_json(json.loads(line)) for line in Path(ns.groups).read_text().splitlines()
              if line.strip()]
    return RoundCommand(ns.base, groups, GRPOArgs(**{**asdict(defaults), **given, **overrides}), ns.out,
                        ns.init_adapter, ns.optimizer_state, ns.result_json)


def report(command: RoundCommand, result: RoundResult, seconds: float) -> None:
    """Write ``--result-json`` (the main process) and print the round's summary as JSON."""
    if command.result_json and int(os.environ.get("RANK", "0")) == 0:  # under accelerate every rank returns the same
        Path(command.result_json).write_text(json.dumps(result.to_json()))
    print(json.dumps({"status": result.status, "adapter_dir": str(result.adapter_dir), "metrics": result.metrics,
                      "seconds": seconds}, indent=2, default=str))
