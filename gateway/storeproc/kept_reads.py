"""The loop's reads, kept until a table they read is written (docs/loop.md, "Kept reads").

The train, gate and A/B ticks, the status a screen polls and the versions page ask the same few
questions every second (which version serves, what waits, the reward per version), and between two
of the recorder's batches the answers do not change. Each answer is kept with the store's write stamp
of the tables it read (``capture/write_stamps.py``) and given again while that stamp holds. A quiet
scoring run that found nothing is not run again until a group was written. Only where this process is the
store's one writer (DuckDB): on a shared store every read runs.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

from flywheel.capture.store import Store

T = TypeVar("T")

VERSION_TABLES = ("adapter_versions",)
PENDING_TABLES = ("trajectories", "groups", "adapter_versions")
REWARD_TABLES = ("turns", "trajectories", "feedback", "scores", "groups", "group_members")
SCORING_TABLES = ("groups",)
RUN_TABLES = ("job_runs",)
MAX_KEPT = 256  # answers; the oldest goes first (a canary's reads name its start, a monitor's its promotion)


class KeptReads:
    """Answers of ``store``'s reads by key, each with the write stamp of the tables it read."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._answers: dict[Hashable, tuple[tuple[int, ...], Any]] = {}

    def kept(self, key: Hashable, tables: tuple[str, ...]) -> tuple[bool, Any]:
        """(True, the answer) when one is kept for ``key`` and none of ``tables`` was written since."""
        found = self._answers.get(key)
        if found is None:
            return False, None
        stamp = self.stamp(tables)
        return (True, found[1]) if stamp is not None and stamp == found[0] else (False, None)

    def stamp(self, tables: tuple[str, ...]) -> tuple[int, ...] | None:
        """The stamp to keep an answer computed from now on with (None: do not keep it)."""
        return None if self.store.shared else self.store.stamps.stamp(tables)

    def keep(self, key: Hashable, stamp: tuple[int, ...] | None, answer: Any) -> None:
        """Keep ``answer`` under ``stamp``, taken before it was computed: a write committed meanwhile makes the next
        read compute again. With no stamp, forget what was kept."""
        self._answers.pop(key, None)
        if stamp is None:
            return
        self._answers[key] = (stamp, answer)
        while len(self._answers) > MAX_KEPT:
            self._answers.pop(next(iter(self._answers)))

    def read(self, key: Hashable, tables: tuple[str, ...], compute: Callable[[], T]) -> T:
        """The kept answer for ``key``, or ``compute()``'s, kept."""
        hit, answer = self.kept(key, tables)
        if hit:
            return answer
        stamp = self.stamp(tables)
        computed = compute()
        self.keep(key, stamp, computed)
        return computed


_KEPT: weakref.WeakKeyDictionary[Store, KeptReads] = weakref.WeakKeyDictionary()


def kept_reads(store: Store) -> KeptReads:
    kept = _KEPT.get(store)
    if kept is None:
        kept = _KEPT[store] = KeptReads(store)
    return kept
