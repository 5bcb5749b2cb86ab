"""The linker: which trajectory, and which parent turn, each captured turn continues (architecture §4).

It runs in the store process, on the recorder's writer thread, once per batch
(:meth:`capture.store.Store.write_turns`): :meth:`TrajectoryLinker.prefetch` reads every
candidate the batch can need with a few indexed queries, :meth:`TrajectoryLinker.link`
then decides each turn in memory, and the store writes the rows it produced.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from sqlalchemy import bindparam, text
from sqlalchemy import select as sa_select
from sqlmodel import Session, col

from capture.models import Trajectory, Turn
from capture.turns import PreparedTurn, new_id

log = logging.getLogger("flywheel.linker")

# The linker's two hot queries as plain SQL: duckdb_engine turns off SQLAlchemy's statement
# cache, and compiling an ORM select costs more than DuckDB's indexed lookup itself.
_CANDIDATES = text("SELECT id, trajectory_id, depth, client_key_id, h_out FROM turns WHERE h_out IN :hashes "
                   "ORDER BY created_at, id").bindparams(bindparam("hashes", expanding=True))
_PARENTS = text("SELECT DISTINCT parent_turn_id FROM turns WHERE parent_turn_id IN :ids").bindparams(
    bindparam("ids", expanding=True))


_TRAJECTORIES = Trajectory.__table__  # type: ignore[attr-defined]
# The trajectory columns linking a turn changes (TrajectoryLinker._touch_trajectory).
TOUCHED_COLUMNS = ("status", "closed_at", "close_reason", "turn_count", "branch_count", "latest_turn_id", "updated_at",
            "group_key")


@dataclass
class _Candidate:
    turn_id: str
    trajectory_id: str
    depth: int
    client_key_id: str | None
    has_children: bool


class TrajectoryLinker:
    """Finds the trajectory (and the parent turn) each new turn of a batch continues (architecture §4).

    The request's assistant messages are walked from the last one back; each prefix
    ending at one is looked up by its hash in ``turns.h_out`` (indexed). Among stored
    turns with that hash (same client key), an unclaimed one (no child yet) is
    continued, oldest first, so identical conversations are claimed one each instead
    of merged; if all are claimed, the client rewound or retried and the new turn
    starts a branch. An explicit trajectory id skips the guessing.

    :meth:`prefetch` reads every candidate a batch can need in one indexed query
    (``h_out IN (...)``); linking then runs in memory, and turns of the same batch see
    each other. Per request that is O(messages) hashing and one probe per assistant
    message, never a scan.
    """

    def __init__(self, session: Session) -> None:
        self.session = session
        # Plain records, not ORM objects: building SQLModel objects costs ~0.4 ms each, and the ORM
        # would flush every changed one as its own UPDATE (~1 ms each on DuckDB).
        self._trajectories: dict[str, SimpleNamespace] = {}  # stored ones this batch touches
        self._new_trajectories: dict[str, SimpleNamespace] = {}  # created by this batch
        self._by_hash: dict[str, list[_Candidate]] = {}
        self._latest: dict[str, _Candidate] = {}  # explicit trajectories' latest turns
        self._candidates: dict[str, _Candidate] = {}  # by turn id
        self.turns: list[dict[str, Any]] = []

    def prefetch(self, batch: list[PreparedTurn]) -> None:
        # Most requests continue their last assistant message: probe that prefix for every turn, and
        # the older ones (a rewind, a retry) only for the turns it did not resolve. Each hash is an
        # ART index probe (~35 us on DuckDB), so this is one probe per turn in the common case.
        # Results are read with .all(): iterating a duckdb_engine result fetches row by row (~40 us each).
        last = {item.assistant_prefix_hashes[0] for item in batch if item.assistant_prefix_hashes}
        self._probe(last)
        older: set[str] = set()
        answered_in_batch: set[str] = set()
        for item in batch:
            hashes = item.assistant_prefix_hashes
            if hashes and hashes[0] not in answered_in_batch and not self._resolves(item, hashes[0]):
                older.update(hashes[1:])
            answered_in_batch.add(item.row["h_out"])
        self._probe(older - last)
        wanted = sorted({c.trajectory_id for c in self._candidates.values()} |
                        {item.explicit_trajectory_id for item in batch if item.explicit_trajectory_id})
        for chunk in chunks(wanted, 500):
            query = sa_select(*_TRAJECTORIES.columns).where(_TRAJECTORIES.c.id.in_(chunk))
            for row in self.session.execute(query).mappings().all():
                self._trajectories[row["id"]] = SimpleNamespace(**row)
        latest_ids = sorted(t.latest_turn_id for t in self._trajectories.values() if t.explicit and t.latest_turn_id)
        columns = (col(Turn.id), col(Turn.trajectory_id), col(Turn.depth), col(Turn.client_key_id))
        for chunk in chunks(latest_ids, 500):
            for turn_id, trajectory_id, depth, key in self.session.execute(sa_select(*columns)
                                                                           .where(col(Turn.id).in_(chunk))).all():
                self._latest[trajectory_id] = self._candidate(turn_id, trajectory_id, depth, key)
        # Which candidates already have a child (claimed): a second indexed lookup, by parent id.
        by_id = self._candidates
        for chunk in chunks(sorted(by_id), 500):
            for (parent_id,) in self.session.execute(_PARENTS, {"ids": chunk}).all():
                by_id[parent_id].has_children = True

    def _probe(self, hashes: set[str]) -> None:
        """Stored turns whose ``h_out`` is one of ``hashes``, into ``_by_hash`` (oldest first)."""
        for chunk in chunks(sorted(hashes), 500):
            for turn_id, trajectory_id, depth, key, h_out in self.session.execute(_CANDIDATES, {"hashes": chunk}).all():
                self._by_hash.setdefault(h_out, []).append(self._candidate(turn_id, trajectory_id, depth, key))

    def _resolves(self, item: PreparedTurn, h: str) -> bool:
        """Whether a stored turn ending in ``h`` can be this turn's parent (same key; same explicit trajectory)."""
        return any(c.client_key_id == item.row["client_key_id"] and
                   item.explicit_trajectory_id in (None, c.trajectory_id) for c in self._by_hash.get(h, ()))

    def _candidate(self, turn_id: str, trajectory_id: str, depth: int, key: str | None) -> _Candidate:
        """One object per stored turn, so marking it claimed is seen by every path that found it."""
        if turn_id not in self._candidates:
            self._candidates[turn_id] = _Candidate(turn_id, trajectory_id, depth, key, False)
        return self._candidates[turn_id]

    def link(self, item: PreparedTurn) -> dict[str, Any]:
        """The turn's row with its trajectory, parent and depth filled in."""
        row = item.row
        parent: _Candidate | None = None
        if row["source"] == "fork":  # a sibling the client never saw: its own one-turn trajectory
            trajectory_id = new_id("traj")
        elif item.explicit_trajectory_id and self._owned_by(item.explicit_trajectory_id, row["client_key_id"]):
            trajectory_id = item.explicit_trajectory_id
            parent = self._parent_in(trajectory_id, item.assistant_prefix_hashes)
        else:
            parent = self._find_parent(item.assistant_prefix_hashes, row["client_key_id"])
            trajectory_id = parent.trajectory_id if parent else new_id("traj")
            existing = self._trajectory(trajectory_id) if parent else None
            if existing is not None and existing.status == "closed":
                trajectory_id = new_id("traj")  # closed ones are never reopened; parent_turn_id keeps the history
        turn = {**row, "trajectory_id": trajectory_id, "parent_turn_id": parent.turn_id if parent else None,
                "depth": parent.depth + 1 if parent else 0}
        self._touch_trajectory(turn, explicit=trajectory_id == item.explicit_trajectory_id,
                               branched=parent is not None and parent.has_children)
        if parent is not None:
            parent.has_children = True
        mine = _Candidate(turn["id"], trajectory_id, turn["depth"], turn["client_key_id"], False)
        self._by_hash.setdefault(turn["h_out"], []).append(mine)  # later turns of this batch see this one
        self._latest[trajectory_id] = mine
        self.turns.append(turn)
        return turn

    def new_trajectories(self) -> list[dict[str, Any]]:
        """Rows of the trajectories this batch started (the store inserts them)."""
        return [vars(t) for t in self._new_trajectories.values()]

    def touched_trajectories(self) -> list[dict[str, Any]]:
        """Stored trajectories this batch continued: the store updates their :data:`TOUCHED_COLUMNS`."""
        return [vars(t) for t in self._trajectories.values()]

    def _find_parent(self, prefix_hashes: list[str], client_key_id: str | None) -> _Candidate | None:
        for h in prefix_hashes:
            candidates = [c for c in self._by_hash.get(h, ()) if c.client_key_id == client_key_id]
            if candidates:
                unclaimed = [c for c in candidates if not c.has_children]
                return unclaimed[0] if unclaimed else candidates[-1]
        return None

    def _parent_in(self, trajectory_id: str, prefix_hashes: list[str]) -> _Candidate | None:
        for h in prefix_hashes:
            found = [c for c in self._by_hash.get(h, ()) if c.trajectory_id == trajectory_id]
            if found:
                return found[-1]
        return self._latest.get(trajectory_id)

    def _owned_by(self, trajectory_id: str, client_key_id: str | None) -> bool:
        """An explicit id binds only within one client key: key B cannot append to key A's trajectory."""
        existing = self._trajectory(trajectory_id)
        if existing is None or existing.client_key_id == client_key_id:
            return True
        log.warning("explicit trajectory id %s belongs to another client key; starting a new trajectory",
                    trajectory_id)
        return False

    def _trajectory(self, trajectory_id: str) -> SimpleNamespace | None:
        return self._trajectories.get(trajectory_id) or self._new_trajectories.get(trajectory_id)

    def _touch_trajectory(self, turn: dict[str, Any], *, explicit: bool, branched: bool) -> None:
        trajectory = self._trajectory(turn["trajectory_id"])
        if trajectory is None:
            trajectory = SimpleNamespace(
                id=turn["trajectory_id"], alias=turn["alias"], status="open", explicit=explicit,
                client_key_id=turn["client_key_id"], task_key=turn["task_key"], group_key=turn["group_key"],
                created_at=turn["created_at"], updated_at=turn["created_at"], closed_at=None, close_reason=None,
                turn_count=0, branch_count=1, latest_turn_id=None, extra_metadata=turn["request_metadata"])
            self._new_trajectories[trajectory.id] = trajectory
        if trajectory.status == "closed":  # only an explicit id gets here: the client chose to continue it
            trajectory.status, trajectory.closed_at, trajectory.close_reason = "open", None, None
        if turn["source"] == "fork":
            trajectory.status, trajectory.closed_at, trajectory.close_reason = "closed", turn["created_at"], "fork"
        trajectory.turn_count += 1
        trajectory.branch_count += 1 if branched else 0
        trajectory.latest_turn_id = turn["id"]
        trajectory.updated_at = turn["created_at"]
        trajectory.group_key = trajectory.group_key or turn["group_key"]


def chunks(items: list[str], size: int) -> Iterator[list[str]]:
    for start in range(0, len(items), size):
        yield items[start:start + size]
