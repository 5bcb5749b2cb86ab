"""What forked traffic says about the training head and the canary, read from a stopped run's DuckDB store.

    python -m bench.fork_diagnostics flywheel-data/demo/flywheel.duckdb
    python -m bench.fork_diagnostics STORE --pairs 41 31      # also: version 41's canary pairs against 31

Per minute of the run, over the fork groups of first turns (a context with no assistant message yet):

- ``client``: the mean score of the answers sampled independently: the client's (serving version or
  candidate) and, during a canary, the other arm's sibling;
- ``head >=``: a lower bound on the probability the training head gives a top-scored answer
  (score >= ``--top``): the summed probabilities (exp of the captured logprobs at T = 1) of its distinct
  siblings drawn without replacement that scored it. Distinct draws never count a sequence twice,
  so the sum is at most the head's probability of such an answer;
- ``drawn mass``: the same sum over every drawn sibling (how much of the head's distribution the draw saw);
- ``any top``: the share of groups in which a drawn sibling scored it (is the right answer in the group?);
- the head versions the siblings came from.

``--pairs CANDIDATE BASELINE`` splits the canary's same-context pairs (the fork groups holding an
independent answer of each version) by the context's length in messages: pairs of turns that always
tie add zeros to the test's mean gain per pair (docs/loop.md, on `min_gain`).
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from datetime import datetime
from pathlib import Path
from typing import NamedTuple

import duckdb

_MEMBERS = """
select g.key, g.created_at, json_array_length(t.request_messages), t.adapter_version, t.inclusion_logprob,
       t.completion_logprobs, s.value
from groups g join group_members m on m.group_id = g.id join turns t on t.id = m.leaf_turn_id
join scores s on s.group_id = g.id and s.trajectory_id = m.trajectory_id and s.source in ('hook', 'ruler')
where g.source = 'fork'
order by g.created_at
"""


class Member(NamedTuple):
    """One scored answer of a fork group (a row of ``_MEMBERS``)."""

    key: str
    at: datetime
    n_messages: int | None  # the context's length: which turn it answers
    version: int
    inclusion: float | None  # log q of a sibling drawn without replacement; None: sampled independently
    logprobs: str | None  # JSON list of the sampled tokens' logprobs
    score: float


def per_minute(members: list[Member], top: float) -> None:
    groups: dict[str, list[Member]] = defaultdict(list)
    for member in members:
        if member.n_messages is not None and member.n_messages <= 2:  # (system +) user: a first turn
            groups[member.key].append(member)
    if not groups:
        print("no fork groups of first turns")
        return
    start = min(group[0].at for group in groups.values())
    minutes: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for group in groups.values():
        minute = minutes[int((group[0].at - start).total_seconds() // 60)]
        minute["client"] += [m.score for m in group if m.inclusion is None]
        drawn = [(m, json.loads(m.logprobs)) for m in group if m.inclusion is not None and m.logprobs]
        drawn = [(m, lps) for m, lps in drawn if lps and None not in lps]
        if drawn:
            p = [math.exp(sum(lps)) for _, lps in drawn]
            minute["head"].append(sum(pi for pi, (m, _) in zip(p, drawn, strict=True) if m.score >= top))
            minute["mass"].append(sum(p))
            minute["any"].append(float(any(m.score >= top for m, _ in drawn)))
            minute["version"] += [float(m.version) for m, _ in drawn]

    def mean(xs: list[float]) -> str:
        return f"{sum(xs) / len(xs):.2f}" if xs else "  - "

    print(f"{'minute':>6} {'groups':>6} {'client':>6} {'head >=':>7} {'drawn mass':>10} {'any top':>7}  head versions")
    for m in sorted(minutes):
        d = minutes[m]
        versions = f"{int(min(d['version']))}-{int(max(d['version']))}" if d["version"] else "-"
        print(f"{m:>6} {len(d['mass']):>6} {mean(d['client']):>6} {mean(d['head']):>7} {mean(d['mass']):>10} "
              f"{mean(d['any']):>7}  {versions}")


def pairs_by_turn(members: list[Member], candidate: int, baseline: int) -> None:
    first: dict[tuple[str, int | None], dict[int, float]] = defaultdict(dict)
    for m in members:
        if m.inclusion is None and m.version in (candidate, baseline):
            first[(m.key, m.n_messages)].setdefault(m.version, m.score)
    by_length: dict[int | None, list[float]] = defaultdict(list)
    for (_, n_messages), scores in first.items():
        if candidate in scores and baseline in scores:
            by_length[n_messages].append(scores[candidate] - scores[baseline])
    everything = [d for ds in by_length.values() for d in ds]
    for n_messages, ds in sorted(by_length.items(), key=lambda item: item[0] or 0):
        print(f"context of {n_messages} messages: {len(ds)} pairs, mean difference {sum(ds) / len(ds):+.3f}, "
              f"{sum(1 for d in ds if d) / len(ds):.0%} not tied")
    if everything:
        print(f"all: {len(everything)} pairs, mean difference {sum(everything) / len(everything):+.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("store", type=Path, help="the run's flywheel.duckdb (stopped: opened read-only)")
    parser.add_argument("--top", type=float, default=1.0, help="the score that counts as a top answer")
    parser.add_argument("--pairs", type=int, nargs=2, metavar=("CANDIDATE", "BASELINE"))
    args = parser.parse_args()
    if not args.store.is_file():
        parser.error(f"no store at {args.store}")
    with duckdb.connect(str(args.store), read_only=True) as db:
        members = [Member(*row) for row in db.execute(_MEMBERS).fetchall()]
    per_minute(members, args.top)
    if args.pairs:
        pairs_by_turn(members, *args.pairs)


if __name__ == "__main__":
    main()
