"""How well does a RULER judge rank trajectories the way known rewards do?

    python -m bench.ruler_agreement --judge-model openai/o3                        # needs OPENAI_API_KEY
    python -m bench.ruler_agreement --judge-model hosted_vllm/Qwen/Qwen3-32B --api-base http://127.0.0.1:8001/v1
    python -m bench.ruler_agreement --scripted                                     # plumbing only, offline
    python -m bench.ruler_agreement --groups my_groups.json --json agreement.json

For each group in the file it calls the judge once (:func:`judge.ruler_score_group`, all
groups concurrently up to ``--max-concurrency``) and compares the judge's scores with the
known rewards:

- pairwise ranking accuracy: over the pairs of trajectories whose known rewards differ, the
  share the judge orders the same way (a judge tie counts half). Pooled over all groups.
- Kendall tau-b per group (ties handled; undefined when either side is all ties), and its mean.

Only the order inside a group matters to GRPO, so these are the numbers to watch; absolute
score levels are not compared.

``--scripted`` starts the keyword-counting stand-in from ``tests/scripted_judge.py`` on a
loopback port instead of calling a model: it scores a trajectory by how often the group's
``reference`` words occur in it. Its numbers show the bench runs, not how good any judge is,
and the output says so.

Input format (``bench/data/ruler_groups.json`` is an example)::

    {"format": "flywheel-ruler-groups/1",
     "groups": [{"id": "arithmetic",                       # optional, for the report
                 "task": "Answer correctly.",              # optional, passed to the judge
                 "tools": [...],                           # optional OpenAI tool schemas, shared by the group
                 "reference": ["391"],                     # optional, used only by --scripted
                 "trajectories": [{"messages": [...OpenAI chat messages...], "reward": 1.0}, ...]}]}

A bare list of groups is accepted too.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # so `python bench/ruler_agreement.py` finds judge/ and tests/ too
    sys.path.insert(0, str(REPO))

from flywheel.capture.trajectory import Trajectory, TrajectoryGroup  # noqa: E402
from flywheel.judge import DEFAULT_RUBRIC, ruler_score_group  # noqa: E402


@dataclass
class Args:
    groups: str = str(REPO / "bench" / "data" / "ruler_groups.json")
    """JSON file of groups with known rewards (format in the module docstring)"""
    judge_model: str = "openai/o3"
    """litellm model string of the judge"""
    api_base: str | None = None
    """the judge's OpenAI-style base URL, with /v1 (a local vLLM, the gateway); unset: the provider's"""
    api_key_env: str | None = None
    """name of the environment variable holding the judge's API key; unset: litellm's usual variable"""
    rubric_file: str | None = None
    """a file whose text replaces the default rubric"""
    scripted: bool = False
    """judge with the keyword-counting stand-in on loopback (offline plumbing check; not a real judge)"""
    max_concurrency: int = 4
    """judge calls in flight at once"""
    timeout_s: float = 300.0
    """per judge call"""
    max_retries: int = 2
    """retries per group after the first call"""
    json: str | None = None
    """also write the per-group and pooled results to this JSON file"""


def parse_args(argv: list[str] | None = None) -> Args:
    docs = _field_docs()
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in dataclasses.fields(Args):
        flag, default = "--" + f.name.replace("_", "-"), f.default
        if isinstance(default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=docs[f.name])
        else:
            kind = type(default) if default is not None else str
            parser.add_argument(flag, type=kind, default=default, help=docs[f.name])
    return Args(**vars(parser.parse_args(argv)))


def _field_docs() -> dict[str, str]:
    """The string under each Args field (read from the source: one place to write help)."""
    import ast
    import inspect
    import itertools
    import textwrap

    body = ast.parse(textwrap.dedent(inspect.getsource(Args))).body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, after in itertools.pairwise(body):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)):
            docs[node.target.id] = str(after.value.value)
    return docs


# ---------------------------------------------------------------------------------------------
# AGREEMENT MATH
# ---------------------------------------------------------------------------------------------

def _sign(value: float) -> int:
    return (value > 0) - (value < 0)


def kendall_tau_b(x: list[float], y: list[float]) -> float | None:
    """Kendall's tau-b: (C - D) / sqrt((n0 - n1) (n0 - n2)), ties counted per side; None if undefined."""
    assert len(x) == len(y), "tau needs paired samples"
    concordant = discordant = ties_x = ties_y = 0
    for i in range(len(x)):
        for j in range(i + 1, len(x)):
            dx, dy = _sign(x[i] - x[j]), _sign(y[i] - y[j])
            ties_x += dx == 0
            ties_y += dy == 0
            if dx and dy:
                concordant += dx == dy
                discordant += dx != dy
    pairs = len(x) * (len(x) - 1) // 2
    denominator = math.sqrt((pairs - ties_x) * (pairs - ties_y))
    return (concordant - discordant) / denominator if denominator else None


def pairwise_agreement(known: list[float], judged: list[float]) -> tuple[float, int]:
    """(credit, pairs): over pairs whose known rewards differ, 1 per pair ordered alike, 0.5 per judge tie."""
    credit, pairs = 0.0, 0
    for i in range(len(known)):
        for j in range(i + 1, len(known)):
            dk = _sign(known[i] - known[j])
            if not dk:
                continue
            pairs += 1
            dj = _sign(judged[i] - judged[j])
            credit += 1.0 if dj == dk else 0.5 if dj == 0 else 0.0
    return credit, pairs


# ---------------------------------------------------------------------------------------------
# DATA AND JUDGING
# ---------------------------------------------------------------------------------------------

def load_groups(path: str | Path) -> list[dict[str, Any]]:
    data = json.loads(Path(path).read_text())
    groups = data["groups"] if isinstance(data, dict) else data
    for index, group in enumerate(groups):
        group.setdefault("id", f"group-{index + 1}")
        if len(group["trajectories"]) < 2:
            raise ValueError(f"group {group['id']}: a ranking needs at least 2 trajectories")
    return list(groups)


def to_trajectory_group(group: dict[str, Any]) -> TrajectoryGroup:
    return TrajectoryGroup(id=group["id"], trajectories=[
        Trajectory(messages_and_choices=t["messages"], tools=group.get("tools"), reward=float(t["reward"]))
        for t in group["trajectories"]])


async def judge_all(args: Args, groups: list[dict[str, Any]], api_base: str | None, rubric: str
                    ) -> list[TrajectoryGroup | None]:
    semaphore = asyncio.Semaphore(args.max_concurrency)
    api_key = os.environ.get(args.api_key_env) if args.api_key_env else ("scripted" if args.scripted else None)
    return await asyncio.gather(*(
        ruler_score_group(to_trajectory_group(g), args.judge_model, rubric=rubric, task=g.get("task"),
                          swallow_exceptions=True, api_base=api_base, api_key=api_key, timeout_s=args.timeout_s,
                          max_retries=args.max_retries, semaphore=semaphore)
        for g in groups))


def report(groups: list[dict[str, Any]], scored: list[TrajectoryGroup | None]) -> dict[str, Any]:
    rows, taus = [], []
    credit_total, pairs_total = 0.0, 0
    prompt_tokens = completion_tokens = 0
    cost: float | None = None
    for group, result in zip(groups, scored, strict=True):
        known = [float(t["reward"]) for t in group["trajectories"]]
        if result is None:
            rows.append({"id": group["id"], "known": known, "judged": None, "error": "judge failed (see log)"})
            continue
        judged = [t.reward for t in result.trajectories]
        credit, pairs = pairwise_agreement(known, judged)
        tau = kendall_tau_b(known, judged)
        credit_total += credit
        pairs_total += pairs
        if tau is not None:
            taus.append(tau)
        usage = result.metadata["ruler"]
        prompt_tokens += usage["prompt_tokens"]
        completion_tokens += usage["completion_tokens"]
        if usage["cost_usd"] is not None:
            cost = (cost or 0.0) + usage["cost_usd"]
        rows.append({"id": group["id"], "known": known, "judged": judged,
                     "pairwise_accuracy": credit / pairs if pairs else None, "kendall_tau": tau})
    return {"groups": rows, "groups_judged": sum(r is not None for r in scored), "groups_total": len(groups),
            "pairwise_accuracy": credit_total / pairs_total if pairs_total else None, "pairs": pairs_total,
            "mean_kendall_tau": statistics.fmean(taus) if taus else None, "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens, "cost_usd": cost}


def _fmt(value: float | None) -> str:
    return "  n/a" if value is None else f"{value:5.2f}"


def print_report(summary: dict[str, Any], judge_label: str, scripted: bool) -> None:
    if scripted:
        print("NOTE: scores come from the SCRIPTED STAND-IN (keyword counting on loopback), not a model.\n"
              "      These numbers show the bench's plumbing works; they say nothing about any judge.\n")
    print(f"judge: {judge_label}")
    print(f"{'group':<20} {'pairs acc':>9} {'tau':>6}  known -> judged")
    for row in summary["groups"]:
        if row["judged"] is None:
            print(f"{row['id']:<20} {'':>9} {'':>6}  {row['error']}")
            continue
        pairs = " ".join(f"{k:.2f}->{j:.2f}" for k, j in zip(row["known"], row["judged"], strict=True))
        print(f"{row['id']:<20} {_fmt(row['pairwise_accuracy']):>9} {_fmt(row['kendall_tau']):>6}  {pairs}")
    cost = (f"${summary['cost_usd']:.4f}" if summary["cost_usd"] is not None
            else "unknown (model not in litellm's price map)")
    print(f"\npooled pairwise accuracy: {_fmt(summary['pairwise_accuracy']).strip()} over {summary['pairs']} pairs")
    print(f"mean Kendall tau-b:       {_fmt(summary['mean_kendall_tau']).strip()}")
    print(f"groups judged:            {summary['groups_judged']} of {summary['groups_total']}")
    print(f"tokens:                   {summary['prompt_tokens']} prompt + {summary['completion_tokens']} completion;"
          f" cost {cost}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    groups = load_groups(args.groups)
    rubric = Path(args.rubric_file).read_text() if args.rubric_file else DEFAULT_RUBRIC
    started = time.monotonic()
    with ExitStack() as stack:
        api_base = args.api_base
        judge_label = f"{args.judge_model} at {api_base or 'the provider default endpoint'}"
        if args.scripted:
            from tests.scripted_judge import ScriptedJudge

            references = sorted({word for g in groups for word in g.get("reference", [])}) or ["good"]
            stand_in = stack.enter_context(ScriptedJudge(target=references))
            api_base = stand_in.base_url
            args.judge_model = "openai/scripted-stand-in"
            judge_label = f"scripted stand-in at {api_base} (counts the reference words {references})"
        scored = asyncio.run(judge_all(args, groups, api_base, rubric))
    summary = report(groups, scored)
    summary.update(judge=judge_label, scripted=args.scripted, seconds=round(time.monotonic() - started, 2))
    print_report(summary, judge_label, args.scripted)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
