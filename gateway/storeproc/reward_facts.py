"""What each trajectory's reward is made of, kept from the facts this process's writes committed
(:class:`~flywheel.capture.write_stamps.FollowedFacts`), so that ``reward_by_version`` answers the trajectories
written since it began following without reading the store.

A trajectory is known only when its insert was among the facts: then every later write of it is too (the store
process is the DuckDB store's one writer). Anything the facts cannot tell exactly (an update of a turn, a
feedback or a score row: which row changed is not said) makes the trajectory unknown again, and
``reward_by_version`` reads it from the store as it reads the trajectories written before it began.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from datetime import datetime
from typing import overload

import numpy as np

from flywheel.capture.models import epoch
from flywheel.capture.write_stamps import Fact
from flywheel.judge.rewards import InvalidFeedbackError, feedback_reward

MAX_KNOWN = 100_000  # trajectories kept; the oldest is forgotten first (and read from the store when it changes)


@dataclass
class Known:
    """One trajectory's reward, in parts: what ``store_ops._rewarded`` reads for it."""

    alias: str
    status: str
    close_reason: str | None
    low: int | None = None  # the lowest and highest adapter version of its turns that are not forks
    high: int | None = None
    told: tuple[float, float] | None = None  # the latest valid feedback: (when, reward)
    final: tuple[float, float] | None = None  # the latest final reward: (when, value)


Answer = tuple[int, float] | str | None  # (version, reward); "mixed"; None: neither


class RewardFacts:
    """The trajectories whose reward is known from facts alone (:meth:`answer`), bounded to ``MAX_KNOWN``."""

    def __init__(self, *, single_precision: bool, limit: int = MAX_KNOWN) -> None:
        self.known: dict[str, Known] = {}
        self.heard_of: dict[str, None] = {}  # ids with facts before any insert: never trusted (bounded too)
        self.single_precision = single_precision  # the store keeps rewards as 4-byte floats (DuckDB's FLOAT)
        self.limit = limit

    def clear(self) -> None:
        self.known.clear()
        self.heard_of.clear()

    def apply(self, facts: list[Fact]) -> set[str]:
        """Take in what committed; the ids touched. Inserts of trajectories first: a batch writes a trajectory's
        turns before the trajectory."""
        for table, trajectory_id, inserted, values in facts:
            if table == "trajectories" and inserted and trajectory_id not in self.heard_of:
                self.known[trajectory_id] = Known(values["alias"], values["status"], values.get("close_reason"))
        for table, trajectory_id, inserted, values in facts:
            if table == "trajectories" and inserted:
                continue
            known = self.known.get(trajectory_id)
            if known is None:
                self._heard(trajectory_id)
            elif table == "trajectories":
                known.status = values.get("status", known.status)
                known.close_reason = values.get("close_reason", known.close_reason)
                known.alias = values.get("alias", known.alias)
            elif not inserted:
                del self.known[trajectory_id]  # which turn, feedback or score changed is not said
            elif table == "turns":
                if values["source"] != "fork":
                    version = int(values["adapter_version"])
                    known.low = version if known.low is None else min(known.low, version)
                    known.high = version if known.high is None else max(known.high, version)
            elif table == "feedback":
                with contextlib.suppress(InvalidFeedbackError):
                    known.told = _latest(known.told, values["created_at"],
                                         feedback_reward(self._stored(values["reward"]), values["label"]))
            elif table == "scores":
                known.final = _latest(known.final, values["created_at"], self._stored(values["value"]))
        while len(self.known) > self.limit:
            del self.known[next(iter(self.known))]
        return {trajectory_id for _, trajectory_id, _, _ in facts}

    def answer(self, trajectory_id: str, alias: str, judge_only: bool) -> Answer:
        """What ``store_ops._rewarded`` makes of the trajectory: its version and reward, "mixed", or None.
        Raises KeyError for a trajectory not known."""
        known = self.known[trajectory_id]
        if known.alias != alias or known.status != "closed" or known.close_reason == "fork" or known.low is None:
            return None
        if known.low != known.high:
            return "mixed"
        winner = known.final or (None if judge_only else known.told)
        if winner is None or not math.isfinite(winner[1]):
            return None
        return known.low, winner[1]

    @overload
    def _stored(self, value: float) -> float: ...
    @overload
    def _stored(self, value: None) -> None: ...

    def _stored(self, value: float | None) -> float | None:
        """``value`` as the store gives it back."""
        if value is None or not self.single_precision:
            return value
        with np.errstate(over="ignore"):
            return float(np.float32(value))

    def _heard(self, trajectory_id: str) -> None:
        self.heard_of[trajectory_id] = None
        if len(self.heard_of) > self.limit:
            del self.heard_of[next(iter(self.heard_of))]


def _latest(current: tuple[float, float] | None, at: datetime | None, value: float) -> tuple[float, float]:
    """The later of ``current`` and (``at``, ``value``); a moment not given sorts last, a tie goes to the newer
    write (the store's reads order by ``created_at``, nulls last)."""
    when = math.inf if at is None else epoch(at)
    return (when, value) if current is None or when >= current[0] else current
