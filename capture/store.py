"""The trajectory store: SQLModel tables on a DuckDB file (default) or PostgreSQL.

DuckDB lets one process open a file (architecture §8): the gateway owns it while it runs;
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
from operator import itemgetter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from orjson import dumps
from sqlalchemy import JSON, Engine, bindparam, insert, inspect, text
from sqlalchemy import select as sa_select
from sqlmodel import Session, SQLModel, col, create_engine, select

from capture.models import SCHEMA_VERSION, SchemaMeta, Trajectory, Turn, utcnow
from capture.turns import PreparedTurn, new_id

log = logging.getLogger("flywheel.store")



def _loop_tables(connection: Any) -> None:
    """1 -> 2: the loop's ``job_runs`` table; versions record their source, predecessor, decision and gate."""
    SQLModel.metadata.tables["job_runs"].create(connection)
    for column, kind in (("source", "VARCHAR DEFAULT 'trained'"), ("previous_version", "INTEGER"),
                         ("decided_at", "TIMESTAMP WITH TIME ZONE"), ("reason", "VARCHAR"), ("gate", "JSON")):
        connection.execute(text(f"ALTER TABLE adapter_versions ADD COLUMN {column} {kind}"))
    connection.execute(text("CREATE UNIQUE INDEX uq_adapter_versions_alias_version "
                            "ON adapter_versions (alias, version)"))


def _eval_metrics_table(connection: Any) -> None:
    """2 -> 3: the SDK's ``eval_metrics`` table (``model.log``: evaluation results per alias version)."""
    SQLModel.metadata.tables["eval_metrics"].create(connection)


# Named migrations: version N -> N+1. Each runs in its own transaction and is recorded.
MIGRATIONS: dict[int, tuple[str, Any]] = {1: ("loop: job_runs, adapter version decisions", _loop_tables),
                                          2: ("sdk: eval_metrics", _eval_metrics_table)}


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
        # One JSON text form for every writer (ORM, Core, the Arrow bulk path): compact orjson.
        self.engine: Engine = create_engine(self.url, json_serializer=_json_text, connect_args=_connect_args(self.url))
        try:
            self.migrate()
        except BaseException:
            self.engine.dispose()  # release the file: a refused store must not stay open
            raise

    def close(self) -> None:
        self.engine.dispose()

    def warm_up(self) -> None:
        """Pay the write path's one-time costs now, not on the first batch (DuckDB's first Arrow
        scan imports pandas: ~0.4 s; pyarrow's first time-zone-aware timestamp: ~0.3 s)."""
        if self.engine.dialect.name != "duckdb":
            return
        import pyarrow as pa

        with self.engine.connect() as connection:
            dbapi = connection.connection.dbapi_connection
            assert dbapi is not None
            dbapi.register("_flywheel_warm_up", pa.table({"created_at": [utcnow()]}))
            dbapi.unregister("_flywheel_warm_up")

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

    def write_turns(self, prepared: Iterable[PreparedTurn], *, skip_stored: bool = False) -> int:
        """Link and insert turns in one transaction.

        ``skip_stored`` (re-ingesting a spool, which may hold turns already written before a
        crash) first drops the turns whose ids are stored; fresh turns need no such query.
        """
        prepared = list(prepared)
        with self.session() as session:
            known: set[str] = set()
            if skip_stored:
                ids = [p.row["id"] for p in prepared]
                for chunk in _chunks(ids, 500):
                    known |= set(session.exec(select(Turn.id).where(col(Turn.id).in_(chunk))))
            todo = [item for item in prepared if item.row["id"] not in known]
            linker = TrajectoryLinker(session)
            linker.prefetch(todo)
            for item in todo:
                linker.link(item)
            linker.add_all()
            session.commit()
        return len(todo)

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



# The linker's two hot queries as plain SQL: duckdb_engine turns off SQLAlchemy's statement
# cache, and compiling an ORM select costs more than DuckDB's indexed lookup itself.
_CANDIDATES = text("SELECT id, trajectory_id, depth, client_key_id, h_out FROM turns WHERE h_out IN :hashes "
                   "ORDER BY created_at, id").bindparams(bindparam("hashes", expanding=True))
_PARENTS = text("SELECT DISTINCT parent_turn_id FROM turns WHERE parent_turn_id IN :ids").bindparams(
    bindparam("ids", expanding=True))


_TRAJECTORIES = Trajectory.__table__  # type: ignore[attr-defined]
# The trajectory columns linking a turn changes (TrajectoryLinker._touch_trajectory).
_TOUCHED = ("status", "closed_at", "close_reason", "turn_count", "branch_count", "latest_turn_id", "updated_at",
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
        for chunk in _chunks(wanted, 500):
            query = sa_select(*_TRAJECTORIES.columns).where(_TRAJECTORIES.c.id.in_(chunk))
            for row in self.session.execute(query).mappings().all():
                self._trajectories[row["id"]] = SimpleNamespace(**row)
        latest_ids = sorted(t.latest_turn_id for t in self._trajectories.values() if t.explicit and t.latest_turn_id)
        columns = (col(Turn.id), col(Turn.trajectory_id), col(Turn.depth), col(Turn.client_key_id))
        for chunk in _chunks(latest_ids, 500):
            for turn_id, trajectory_id, depth, key in self.session.execute(sa_select(*columns)
                                                                           .where(col(Turn.id).in_(chunk))).all():
                self._latest[trajectory_id] = self._candidate(turn_id, trajectory_id, depth, key)
        # Which candidates already have a child (claimed): a second indexed lookup, by parent id.
        by_id = self._candidates
        for chunk in _chunks(sorted(by_id), 500):
            for (parent_id,) in self.session.execute(_PARENTS, {"ids": chunk}).all():
                by_id[parent_id].has_children = True

    def _probe(self, hashes: set[str]) -> None:
        """Stored turns whose ``h_out`` is one of ``hashes``, into ``_by_hash`` (oldest first)."""
        for chunk in _chunks(sorted(hashes), 500):
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

    def add_all(self) -> None:
        """Write the batch: one multi-row INSERT per table, one UPDATE for the stored trajectories it continued."""
        bulk_insert(self.session, Turn, self.turns)
        bulk_insert(self.session, Trajectory, [vars(t) for t in self._new_trajectories.values()])
        bulk_update(self.session, Trajectory, [vars(t) for t in self._trajectories.values()], _TOUCHED)

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


def _connect_args(url: str) -> dict[str, Any]:
    # One DuckDB worker thread: the store serves small batches; more threads only compete with
    # the gateway's event loop for the cores (measured: -40% capture CPU on 2 cores).
    return {"config": {"threads": 1}} if url.startswith("duckdb:") else {}


def bulk_insert(session: Session, model: type[SQLModel], rows: list[dict[str, Any]]) -> None:
    """Insert many rows at once: an Arrow table appended by DuckDB's relation API on DuckDB, executemany elsewhere.

    DuckDB spends ~2-3 ms of CPU per parameter-bound INSERT row (executemany included); an Arrow
    table goes in at a few microseconds per row. ``insert_into`` costs ~2 ms less per statement than
    registering the table and running ``INSERT ... SELECT`` through SQLAlchemy (measured).
    """
    if not rows:
        return
    table = model.__table__  # type: ignore[attr-defined]
    if session.get_bind().dialect.name != "duckdb":
        session.execute(insert(table), rows)
        return
    connection = _duckdb_connection(session)
    stored = connection.table(table.name).columns  # insert_into is positional: the file's own column order
    connection.from_arrow(_arrow_table(table, rows, stored)).insert_into(table.name)


def bulk_update(session: Session, model: type[SQLModel], rows: list[dict[str, Any]], columns: tuple[str, ...]) -> None:
    """Set ``columns`` of many rows (matched by ``id``) at once: one ``UPDATE ... FROM`` an Arrow table on
    DuckDB (a parameter-bound UPDATE costs ~1 ms per row there), executemany elsewhere."""
    if not rows:
        return
    table = model.__table__  # type: ignore[attr-defined]
    if session.get_bind().dialect.name != "duckdb":
        # Bind names must differ from the column names SQLAlchemy reserves for the SET clause.
        values: dict[str, Any] = {c: bindparam(f"_{c}") for c in columns}
        statement = table.update().where(table.c.id == bindparam("_id")).values(values)
        session.execute(statement, [{"_id": r["id"], **{f"_{c}": r[c] for c in columns}} for r in rows])
        return
    assignments = ", ".join(f'"{c}" = source."{c}"' for c in columns)
    with _arrow_view(session, table, rows, ["id", *columns]) as view:
        session.connection().exec_driver_sql(
            f'UPDATE "{table.name}" SET {assignments} FROM {view} AS source WHERE "{table.name}".id = source.id')


@contextmanager
def _arrow_view(session: Session, table: Any, rows: list[dict[str, Any]], columns: list[str]) -> Iterator[str]:
    """``rows`` as an Arrow table registered on the session's DuckDB connection, by name, for one statement."""
    connection = _duckdb_connection(session)
    view = f"_flywheel_rows_{table.name}"
    connection.register(view, _arrow_table(table, rows, columns))
    try:
        yield view
    finally:
        connection.unregister(view)


def _arrow_table(table: Any, rows: list[dict[str, Any]], columns: list[str]) -> Any:
    """``columns`` of ``rows`` as an Arrow table, JSON columns as their text."""
    import pyarrow as pa

    json_columns = {c.name for c in table.columns if isinstance(c.type, JSON)}
    pick = itemgetter(*columns)
    try:  # rows to columns, one C call per row (itemgetter of one name gives a value, not a tuple)
        by_column = list(zip(*(map(pick, rows) if len(columns) > 1 else ((pick(r),) for r in rows)), strict=True))
    except KeyError:  # a row without some column (a turn spooled by an older version): NULL there
        by_column = [tuple(r.get(name) for r in rows) for name in columns]
    return pa.table({name: [_json_text(v) for v in values] if name in json_columns else values
                     for name, values in zip(columns, by_column, strict=True)})


def _duckdb_connection(session: Session) -> Any:
    """The DuckDB connection under the session, inside its transaction."""
    connection = session.connection().connection.dbapi_connection
    assert connection is not None
    return connection


def _json_text(value: Any) -> str | None:
    return None if value is None else dumps(value).decode()


def _chunks(items: list[str], size: int) -> Iterator[list[str]]:
    for start in range(0, len(items), size):
        yield items[start:start + size]
