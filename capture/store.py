"""The trajectory store: SQLModel tables on a DuckDB file (default) or PostgreSQL.

DuckDB lets one process open a file (DESIGN §8): the gateway owns it while it runs;
the CLI opens it directly only when no gateway runs. The schema carries a version in
``schema_meta``; an older file is migrated by named steps, a newer one is refused with
a clear message, and nothing is ever dropped or rewritten silently.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, func, inspect
from sqlmodel import Session, SQLModel, col, create_engine, select

from capture.models import SCHEMA_VERSION, SchemaMeta, Trajectory, Turn, utcnow
from capture.turns import PreparedTurn, new_id

log = logging.getLogger("flywheel.store")

# Named migrations: version N -> N+1. Each runs in its own transaction and is recorded.
MIGRATIONS: dict[int, tuple[str, Any]] = {}


class SchemaError(RuntimeError):
    """The store file was written by a newer Flywheel, or a migration is missing."""


def database_url(path_or_url: str | Path) -> str:
    """``duckdb:///<path>`` for a file path; URLs (``postgresql://...``) pass through."""
    text = str(path_or_url)
    return text if "://" in text else f"duckdb:///{Path(text).resolve()}"


class Store:
    """Opens the database, checks its schema, writes linked turns, answers reads."""

    def __init__(self, url: str | Path) -> None:
        self.url = database_url(url)
        if self.url.startswith("duckdb:///"):
            Path(self.url.removeprefix("duckdb:///")).parent.mkdir(parents=True, exist_ok=True)
        self.engine: Engine = create_engine(self.url)
        self.migrate()

    def close(self) -> None:
        self.engine.dispose()

    @contextmanager
    def session(self) -> Iterator[Session]:
        with Session(self.engine, expire_on_commit=False) as session:
            yield session

    def migrate(self) -> None:
        """Create a new store, or bring an older one to ``SCHEMA_VERSION``, or refuse a newer one."""
        existing = set(inspect(self.engine).get_table_names())
        if "schema_meta" not in existing:
            if existing & {"turns", "trajectories"}:
                raise SchemaError(f"{self.url}: tables without a schema version; refusing to touch them")
            SQLModel.metadata.create_all(self.engine)
            with self.session() as session:
                session.add(SchemaMeta(key="schema_version", value=str(SCHEMA_VERSION)))
                session.commit()
            return
        with self.session() as session:
            meta = session.get(SchemaMeta, "schema_version")
            version = int(meta.value) if meta else 0
        if version > SCHEMA_VERSION:
            raise SchemaError(f"{self.url} has schema version {version}; this Flywheel knows up to "
                              f"{SCHEMA_VERSION}. Upgrade Flywheel; the file was not changed.")
        while version < SCHEMA_VERSION:
            if version not in MIGRATIONS:
                raise SchemaError(f"{self.url}: no migration from schema version {version}")
            name, step = MIGRATIONS[version]
            with self.engine.begin() as connection:
                step(connection)
                connection.execute(SchemaMeta.__table__.update().values(value=str(version + 1))  # type: ignore[attr-defined]
                                   .where(SchemaMeta.__table__.c.key == "schema_version"))  # type: ignore[attr-defined]
                connection.execute(SchemaMeta.__table__.insert().values(  # type: ignore[attr-defined]
                    key=f"migration:{version + 1}", value=name))
            log.info("store migrated to schema version %d (%s)", version + 1, name)
            version += 1

    def schema_version(self) -> int:
        with self.session() as session:
            meta = session.get(SchemaMeta, "schema_version")
            return int(meta.value) if meta else 0

    # -- writes -------------------------------------------------------------------------------------------

    def write_turns(self, prepared: Iterable[PreparedTurn]) -> int:
        """Link and insert turns in one transaction; turns already stored (by id) are skipped."""
        prepared = list(prepared)
        with self.session() as session:
            known = set(session.exec(select(Turn.id).where(col(Turn.id).in_([p.row["id"] for p in prepared]))))
            linker = TrajectoryLinker(session)
            written = 0
            for item in prepared:
                if item.row["id"] in known:
                    continue
                linker.link_and_add(item)
                written += 1
            session.commit()
        return written

    def close_idle(self, idle_s: float, now: datetime | None = None) -> int:
        """Close open trajectories with no new turn for ``idle_s`` seconds."""
        now = now or utcnow()
        cutoff = datetime.fromtimestamp(now.timestamp() - idle_s, tz=now.tzinfo)
        with self.session() as session:
            rows = session.exec(select(Trajectory).where(Trajectory.status == "open",
                                                         col(Trajectory.updated_at) < cutoff)).all()
            for trajectory in rows:
                trajectory.status, trajectory.closed_at, trajectory.close_reason = "closed", now, "idle"
                session.add(trajectory)
            session.commit()
            return len(rows)

    def close_trajectory(self, trajectory_id: str, reason: str = "client") -> Trajectory | None:
        with self.session() as session:
            trajectory = session.get(Trajectory, trajectory_id)
            if trajectory is None:
                return None
            if trajectory.status != "closed":
                trajectory.status, trajectory.closed_at, trajectory.close_reason = "closed", utcnow(), reason
                session.add(trajectory)
                session.commit()
            return trajectory

    def count(self, model: type[SQLModel]) -> int:
        with self.session() as session:
            return int(session.exec(select(func.count()).select_from(model)).one())


@dataclass
class _Candidate:
    turn_id: str
    trajectory_id: str
    depth: int
    has_children: bool


class TrajectoryLinker:
    """Finds the trajectory (and the parent turn) a new turn continues (DESIGN §4).

    The request's assistant messages are walked from the last one back; each prefix
    ending at one is probed against the indexed ``turns.h_out`` column. Among stored
    turns with that hash (same client key), an unclaimed one (no child yet) is
    continued, oldest first, so identical conversations are claimed one each instead
    of merged; if all are claimed, the client rewound or retried and the new turn
    starts a branch. An explicit trajectory id skips the guessing.
    """

    def __init__(self, session: Session) -> None:
        self.session = session
        self._trajectories: dict[str, Trajectory] = {}

    def link_and_add(self, item: PreparedTurn) -> Turn:
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
        turn = Turn(**row, trajectory_id=trajectory_id, parent_turn_id=parent.turn_id if parent else None,
                    depth=parent.depth + 1 if parent else 0)
        self.session.add(turn)
        self._touch_trajectory(turn, explicit=trajectory_id == item.explicit_trajectory_id,
                               branched=parent is not None and parent.has_children)
        self.session.flush()  # later turns of the same batch must see this one
        return turn

    def _find_parent(self, prefix_hashes: list[str], client_key_id: str | None) -> _Candidate | None:
        for h in prefix_hashes:
            candidates = self._candidates(h, client_key_id)
            if candidates:
                unclaimed = [c for c in candidates if not c.has_children]
                return unclaimed[0] if unclaimed else candidates[-1]
        return None

    def _parent_in(self, trajectory_id: str, prefix_hashes: list[str]) -> _Candidate | None:
        for h in prefix_hashes:
            found = [c for c in self._candidates(h, None, trajectory_id=trajectory_id)]
            if found:
                return found[-1]
        latest = self.session.exec(select(Turn).where(Turn.trajectory_id == trajectory_id)
                                   .order_by(col(Turn.created_at).desc()).limit(1)).first()
        if latest is None:
            return None
        return _Candidate(latest.id, trajectory_id, latest.depth, self._has_children(latest.id))

    def _candidates(self, h_out: str, client_key_id: str | None, *,
                    trajectory_id: str | None = None) -> list[_Candidate]:
        """Stored turns whose prompt + answer hash to ``h_out``, oldest first."""
        query = select(Turn.id, Turn.trajectory_id, Turn.depth).where(Turn.h_out == h_out)
        if trajectory_id is not None:
            query = query.where(Turn.trajectory_id == trajectory_id)
        else:
            query = query.where(col(Turn.client_key_id).is_not_distinct_from(client_key_id))
        rows = self.session.exec(query.order_by(col(Turn.created_at), col(Turn.id))).all()
        return [_Candidate(turn_id, traj, depth, self._has_children(turn_id)) for turn_id, traj, depth in rows]

    def _has_children(self, turn_id: str) -> bool:
        return self.session.exec(select(Turn.id).where(Turn.parent_turn_id == turn_id).limit(1)).first() is not None

    def _owned_by(self, trajectory_id: str, client_key_id: str | None) -> bool:
        """An explicit id binds only within one client key: key B cannot append to key A's trajectory."""
        existing = self._trajectory(trajectory_id)
        if existing is None or existing.client_key_id == client_key_id:
            return True
        log.warning("explicit trajectory id %s belongs to another client key; starting a new trajectory",
                    trajectory_id)
        return False

    def _trajectory(self, trajectory_id: str) -> Trajectory | None:
        if trajectory_id not in self._trajectories:
            found = self.session.get(Trajectory, trajectory_id)
            if found is None:
                return None
            self._trajectories[trajectory_id] = found
        return self._trajectories[trajectory_id]

    def _touch_trajectory(self, turn: Turn, *, explicit: bool, branched: bool) -> None:
        trajectory = self._trajectory(turn.trajectory_id)
        if trajectory is None:
            trajectory = Trajectory(id=turn.trajectory_id, alias=turn.alias, explicit=explicit,
                                    client_key_id=turn.client_key_id, task_key=turn.task_key,
                                    group_key=turn.group_key, created_at=turn.created_at,
                                    extra_metadata=turn.request_metadata)
        if trajectory.status == "closed":  # only an explicit id gets here: the client chose to continue it
            trajectory.status, trajectory.closed_at, trajectory.close_reason = "open", None, None
        if turn.source == "fork":
            trajectory.status, trajectory.closed_at, trajectory.close_reason = "closed", turn.created_at, "fork"
        trajectory.turn_count += 1
        trajectory.branch_count += 1 if branched else 0
        trajectory.latest_turn_id = turn.id
        trajectory.updated_at = turn.created_at
        trajectory.group_key = trajectory.group_key or turn.group_key
        self._trajectories[turn.trajectory_id] = trajectory
        self.session.add(trajectory)
