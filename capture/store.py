"""The trajectory store: SQLModel tables on a DuckDB file (default) or PostgreSQL.

DuckDB lets one process open a file (architecture §8): the gateway owns it while it runs;
the CLI opens it directly only when no gateway runs. PostgreSQL is shared by several gateway
replicas: each replica's store process writes, so what one process decided alone on DuckDB is
settled in the database there (docs/storage.md, "Several writers"): the schema is created or
migrated under an advisory lock, a batch of turns locks the trajectories it continues before
it reads which of their turns are claimed, and a batch that lost a race is linked again.
The schema carries a version in ``schema_meta``; an older store is migrated by named steps,
a newer one is refused with a clear message, and nothing is ever dropped or rewritten silently.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from datetime import datetime
from operator import itemgetter
from pathlib import Path
from typing import Any, TypeVar

from orjson import JSONDecodeError, dumps, loads
from sqlalchemy import JSON, Connection, Engine, bindparam, insert, inspect, text, update
from sqlalchemy.dialects import registry
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError
from sqlmodel import Session, SQLModel, col, create_engine, select

from flywheel.capture.feedback import FeedbackBatch, Recorded, close_trajectories, insert_feedback, match_feedback
from flywheel.capture.linker import TOUCHED_COLUMNS, ParentWait, TrajectoryLinker, chunks
from flywheel.capture.models import SCHEMA_VERSION, SchemaMeta, Trajectory, Turn, utcnow
from flywheel.capture.turns import PreparedTurn
from flywheel.capture.write_stamps import WriteStamps, note_closed, note_rows

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


def _tail_links(connection: Any) -> None:
    """3 -> 4: turns record how they were linked and what their history changed (``h_answer``, indexed, is the
    tail rule's lookup); trajectories name the agent a sub-agent worked for. Older turns keep nulls there:
    their rule was not recorded, and they are not found by the tail rule."""
    for column, kind in (("h_answer", "VARCHAR"), ("h_replied_to", "VARCHAR"), ("link_rule", "VARCHAR"),
                         ("parent_message_index", "INTEGER"), ("history_edits", "JSON")):
        connection.execute(text(f"ALTER TABLE turns ADD COLUMN {column} {kind}"))
    connection.execute(text("ALTER TABLE trajectories ADD COLUMN parent_trajectory_id VARCHAR"))
    # The names SQLModel gives the indexes of a new store, so a migrated file and a new one are alike.
    connection.execute(text("CREATE INDEX ix_turns_h_answer ON turns (h_answer)"))
    connection.execute(text("CREATE INDEX ix_trajectories_parent_trajectory_id ON trajectories (parent_trajectory_id)"))


def _tail_evidence_index(connection: Any) -> None:
    """4 -> 5: an index on (h_answer, h_replied_to): the tail rule reads the turns that gave an answer after the same
    message without reading every turn that gave the answer ("OK" may be thousands)."""
    connection.execute(text("CREATE INDEX ix_turns_h_answer_h_replied_to ON turns (h_answer, h_replied_to)"))


def _inclusion_logprob(connection: Any) -> None:
    """5 -> 6: a forked sibling drawn without replacement records its inclusion probability (log q), which the
    trainer weighs it by. Older turns keep null: they were independent samples."""
    connection.execute(text("ALTER TABLE turns ADD COLUMN inclusion_logprob FLOAT"))


def _canary_pair(connection: Any) -> None:
    """6 -> 7: a forked turn's sibling answered by the canary's other arm is marked: scored with its group and
    paired by the canary, left out of training. Older turns keep null: their pair sibling trained with the rest."""
    connection.execute(text("ALTER TABLE turns ADD COLUMN canary_pair BOOLEAN"))


def _group_member_index(connection: Any) -> None:
    """7 -> 8: group members are found by their trajectory (is it grouped already?) through an index, not a scan of
    every member of every group."""
    connection.execute(text("CREATE INDEX ix_group_members_trajectory_id ON group_members (trajectory_id)"))


# Named migrations: version N -> N+1. Each runs in its own transaction and is recorded.
MIGRATIONS: dict[int, tuple[str, Any]] = {1: ("loop: job_runs, adapter version decisions", _loop_tables),
                                          2: ("sdk: eval_metrics", _eval_metrics_table),
                                          3: ("linker: tail links, history edits, sub-agent parents", _tail_links),
                                          4: ("linker: the tail rule's (answer, replied-to) index",
                                              _tail_evidence_index),
                                          5: ("forks: inclusion probabilities of siblings drawn without replacement",
                                              _inclusion_logprob),
                                          6: ("forks: the canary's pair sibling, left out of training", _canary_pair),
                                          7: ("groups: members found by their trajectory", _group_member_index)}


CONFLICT_RETRY_S = 5.0  # a job's transaction (forming groups, scoring) may hold a trajectory for a second or more
T = TypeVar("T")


def retry_on_conflict(write: Callable[[], T]) -> T:
    """Run a write transaction again when another one changed the same row first.

    DuckDB's concurrency is optimistic: two transactions updating one trajectory (a batch of turns
    continuing it, feedback closing it) is a "Conflict on update/tuple deletion", and the loser is
    rolled back. Its work is still valid, so it runs again on fresh state after a pause that doubles
    (5 ms up to 0.25 s), for up to ``CONFLICT_RETRY_S``. The conflict may come through SQLAlchemy
    (a ``DBAPIError``) or straight from DuckDB's relation API (the Arrow paths). On PostgreSQL a writer
    locks the rows it changes and the other waits, so this never triggers there.
    """
    deadline = time.monotonic() + CONFLICT_RETRY_S
    attempt = 0
    while True:
        try:
            return write()
        except Exception as exc:
            if "Conflict on" not in str(getattr(exc, "orig", exc)) or time.monotonic() > deadline:
                raise
            attempt += 1
            log.info("write conflict (attempt %d): running the transaction again", attempt)
            time.sleep(min(0.005 * 2 ** (attempt - 1), 0.25))  # the winner usually commits within milliseconds


class SchemaError(RuntimeError):
    """The store file was written by a newer Flywheel, or a migration is missing."""


def database_url(path_or_url: str | Path) -> str:
    """``duckdb:///<path>`` for a file path; ``postgresql://`` means psycopg (3), the driver ``[gateway]`` installs;
    other URLs pass through."""
    text = str(path_or_url)
    if "://" not in text:
        return f"duckdb:///{Path(text).resolve()}"
    return "postgresql+psycopg://" + text.removeprefix("postgresql://") if text.startswith("postgresql://") else text


def printable_url(url: str | Path) -> str:
    """The URL with its password masked, for logs and messages (``postgresql+psycopg://me:***@db/flywheel``)."""
    text = database_url(url)
    return text if text.startswith("duckdb:") else make_url(text).render_as_string(hide_password=True)


def lock_key(name: str) -> int:
    """A PostgreSQL advisory lock key (a signed 64-bit integer) for a name; the same in every process."""
    return int.from_bytes(hashlib.sha256(f"flywheel:{name}".encode()).digest()[:8], "big", signed=True)


# PostgreSQL errors after which a batch is linked again from the start: another writer won a race.
RACES = {"23505": "unique_violation", "40P01": "deadlock_detected", "40001": "serialization_failure"}
WRITE_ATTEMPTS = 5


class Store:
    """Opens the database, checks its schema, writes linked turns, answers reads."""

    def __init__(self, url: str | Path) -> None:
        self.url = database_url(url)
        if self.url.startswith("duckdb:///"):
            Path(self.url.removeprefix("duckdb:///")).parent.mkdir(parents=True, exist_ok=True)
        # One JSON text form for every writer (ORM, Core, the Arrow bulk path): compact orjson.
        self.engine: Engine = create_engine(_engine_url(self.url), json_serializer=_json_text,
                                            json_deserializer=_json_value, connect_args=_connect_args(self.url),
                                            **_engine_options(self.url))
        self.shared = self.engine.dialect.name == "postgresql"  # several processes (replicas) write it
        self.stamps = WriteStamps(self.engine)  # what this process committed, per table (kept reads check it)
        self._local_locks: dict[str, threading.Lock] = {}  # exclusive() where one process owns the store
        try:
            self.migrate()
            # Whether a closed trajectory may have sub-agents to close with it: set once one is written (only the
            # linker starts them); on a shared store other replicas write them, so always.
            self.sub_agents = self.shared or self._has_sub_agents()
        except BaseException:
            self.engine.dispose()  # release the file: a refused store must not stay open
            raise

    def close(self) -> None:
        self.engine.dispose()

    def _has_sub_agents(self) -> bool:
        with self.session() as session:
            return session.exec(select(Trajectory.id).where(col(Trajectory.parent_trajectory_id).is_not(None))
                                .limit(1)).first() is not None

    @contextmanager
    def exclusive(self, session: Session, name: str) -> Iterator[None]:
        """Run the session's next transaction alone among every process that asks for ``name``.

        PostgreSQL: an advisory lock taken in the session's transaction, released when it commits or
        rolls back (so the caller must commit inside). One process owns any other store: a lock of
        this object's.
        """
        if self.shared:
            session.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": lock_key(name)})
            yield
            return
        with self._local_locks.setdefault(name, threading.Lock()):
            yield

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
        where = printable_url(self.url)
        with self._schema_connection() as connection:
            with connection.begin():
                existing = set(inspect(connection).get_table_names())
            if "schema_meta" not in existing:
                if existing & {"turns", "trajectories"}:
                    raise SchemaError(f"{where}: tables without a schema version; refusing to touch them")
                with connection.begin():
                    SQLModel.metadata.create_all(connection)
                    connection.execute(_META.insert().values(key="schema_version", value=str(SCHEMA_VERSION)))
                return
            with connection.begin():
                meta = connection.execute(select(_META.c.value).where(_META.c.key == "schema_version")).scalar()
            version = int(meta) if meta else 0
            if version > SCHEMA_VERSION:
                raise SchemaError(f"{where} has schema version {version}; this Flywheel knows up to "
                                  f"{SCHEMA_VERSION}. Upgrade Flywheel; the file was not changed.")
            while version < SCHEMA_VERSION:
                if version not in MIGRATIONS:
                    raise SchemaError(f"{where}: no migration from schema version {version}")
                name, step = MIGRATIONS[version]
                with connection.begin():
                    step(connection)
                    connection.execute(_META.update().values(value=str(version + 1))
                                       .where(_META.c.key == "schema_version"))
                    connection.execute(_META.insert().values(key=f"migration:{version + 1}", value=name))
                log.info("store migrated to schema version %d (%s)", version + 1, name)
                version += 1

    @contextmanager
    def _schema_connection(self) -> Iterator[Connection]:
        """The connection the schema is created or migrated on: on PostgreSQL under an advisory lock, so replicas
        that start together create or migrate it once (the later ones find it done)."""
        with self.engine.connect() as connection:
            if not self.shared:
                yield connection
                return
            key = {"key": lock_key("migrate")}
            connection.execute(text("SELECT pg_advisory_lock(:key)"), key)
            connection.commit()
            try:
                yield connection
            finally:
                connection.rollback()
                connection.execute(text("SELECT pg_advisory_unlock(:key)"), key)
                connection.commit()

    def schema_version(self) -> int:
        with self.session() as session:
            meta = session.get(SchemaMeta, "schema_version")
            return int(meta.value) if meta else 0

    # -- writes -------------------------------------------------------------------------------------------

    def write_turns(self, prepared: Iterable[PreparedTurn], *, skip_stored: bool = False,
                    counts: Counter[str] | None = None, waiting: ParentWait | None = None,
                    feedback: FeedbackBatch | None = None) -> int:
        """Link and insert turns in one transaction; returns how many were written.

        ``skip_stored`` (re-ingesting a spool, which may hold turns already written before a
        crash) first drops the turns whose ids are stored, and repeats of an id; fresh turns need no such query.
        ``counts`` receives the linker's tallies (each turn's rule, the tails refused) once committed.
        ``waiting`` holds back the turns whose last answer no stored turn gave yet, while they may wait
        (another replica may still be writing it): they are not written now, and the caller passes them
        again with a later batch.
        ``feedback`` is written in the same transaction, after the turns (so it finds a completion of this very
        batch); its ``recorded`` is filled once committed.

        On a shared store a batch that lost a race to another writer (a trajectory both started, a deadlock)
        is rolled back and linked again from what is stored then, up to ``WRITE_ATTEMPTS`` times.
        """
        prepared = list(prepared)
        for attempt in range(1, WRITE_ATTEMPTS + 1):
            try:
                # DuckDB's write conflicts run the same attempt again; PostgreSQL's races (below) link it again
                linker, held, recorded = retry_on_conflict(
                    lambda: self._link_and_write(prepared, skip_stored=skip_stored, waiting=waiting,
                                                 feedback=feedback))
                break
            except DBAPIError as exc:
                race = RACES.get(getattr(exc.orig, "sqlstate", None) or "")
                if race is None or attempt == WRITE_ATTEMPTS:
                    raise
                log.info("a batch of %d turns lost a race (%s); linking it again", len(prepared), race)
        if feedback is not None:
            feedback.recorded = recorded
        if waiting is not None:
            linker.counts["waited"] += waiting.hold(held)  # turns that wait for their parent (once each)
        if counts is not None:
            counts.update(linker.counts)
        return len(linker.turns)

    def _link_and_write(self, prepared: list[PreparedTurn], *, skip_stored: bool, waiting: ParentWait | None,
                        feedback: FeedbackBatch | None
                        ) -> tuple[TrajectoryLinker, list[PreparedTurn], list[Recorded | None]]:
        """One attempt: link the batch, write its feedback and commit; returns the linker, the turns held back and
        what became of each feedback."""
        with self.session() as session:
            known: set[str] = set()
            if skip_stored:
                ids = [p.row["id"] for p in prepared]
                for chunk in chunks(ids, 500):
                    known |= set(session.exec(select(Turn.id).where(col(Turn.id).in_(chunk))))
            todo = []
            for item in prepared:
                if item.row["id"] not in known:
                    todo.append(item)
                    if skip_stored:  # a spool may hold a turn twice (the gateway spooled what the store had)
                        known.add(item.row["id"])
            linker = TrajectoryLinker(session, lock=self.shared)
            linker.prefetch(todo)
            held = []
            for item in todo:
                if waiting is not None and waiting.may_wait(item) and linker.awaits_parent(item):
                    held.append(item)
                else:
                    linker.link(item)
            linker.finish()
            recorded, feedback_rows = match_feedback(session, feedback.items, linker.turns, linker.owners()) \
                if feedback is not None else ([], [])
            # Feedback on a trajectory this batch writes closes it in the rows written, not by an UPDATE after them
            closed = linker.close({row["trajectory_id"] for row in feedback_rows}, "feedback", utcnow())
            started = linker.new_trajectories()
            self.sub_agents = self.sub_agents or any(t["parent_trajectory_id"] for t in started)
            # One multi-row INSERT per table, one UPDATE for the stored trajectories the batch continued.
            bulk_insert(session, Turn, linker.turns)
            bulk_insert(session, Trajectory, started)
            bulk_update(session, Trajectory, linker.touched_trajectories(), TOUCHED_COLUMNS)
            insert_feedback(session, feedback_rows, sub_agents=self.sub_agents, closed=closed)
            session.commit()
        return linker, held, recorded

    def close_idle(self, idle_s: float, now: datetime | None = None) -> int:
        """Close open trajectories with no new turn for ``idle_s`` seconds."""
        return retry_on_conflict(lambda: self._close_idle(idle_s, now or utcnow()))

    def _close_idle(self, idle_s: float, now: datetime) -> int:
        cutoff = datetime.fromtimestamp(now.timestamp() - idle_s, tz=now.tzinfo)
        with self.session() as session:  # set-based: the loop runs this every few seconds
            closed = session.execute(update(Trajectory).where(col(Trajectory.status) == "open",
                                                              col(Trajectory.updated_at) < cutoff)
                                     .values(status="closed", closed_at=now, close_reason="idle")
                                     .returning(col(Trajectory.id))
                                     .execution_options(synchronize_session=False)).all()
            note_closed(session.connection(), (trajectory_id for trajectory_id, in closed), "idle")
            session.commit()
            return len(closed)

    def close_trajectory(self, trajectory_id: str, reason: str = "client") -> None:
        """Close a trajectory, and its sub-agents' still open (reason ``parent``): the conversation they served
        is over."""
        def write() -> None:
            with self.session() as session:
                close_trajectories(session, [trajectory_id], reason, sub_agents=self.sub_agents)
                session.commit()
        retry_on_conflict(write)


_META = SchemaMeta.__table__  # type: ignore[attr-defined]


# By name: SQLAlchemy imports the dialect (and DuckDB) only when a DuckDB store is opened.
registry.register("duckdb.cached", "flywheel.capture.duckdb_dialect", "CachingDuckDBDialect")


def _engine_url(url: str) -> str:
    return url.replace("duckdb:///", "duckdb+cached:///", 1) if url.startswith("duckdb:///") else url


def _connect_args(url: str) -> dict[str, Any]:
    # One DuckDB worker thread: for small batches more threads only compete with the gateway for the cores
    if url.startswith("duckdb:"):
        return {"config": {"threads": 1}}
    if url.startswith("postgresql"):
        # A server that stopped answering (a dead host, a cut network) is noticed in ~15 s, not the kernel's hours.
        return {"connect_timeout": 10, "keepalives": 1, "keepalives_idle": 5, "keepalives_interval": 2,
                "keepalives_count": 3}
    return {}


def _engine_options(url: str) -> dict[str, Any]:
    # A pooled connection the server closed (a restart, a failover) is replaced before use, not failed on.
    return {"pool_pre_ping": True} if url.startswith("postgresql") else {}


def bulk_insert(session: Session, model: type[SQLModel], rows: list[dict[str, Any]]) -> None:
    """Insert many rows at once: an Arrow table appended by DuckDB's relation API on DuckDB, executemany elsewhere.

    DuckDB binds parameters row by row (executemany included); an Arrow table goes in at once, and
    ``insert_into`` beats registering it for ``INSERT ... SELECT`` (docs/engineering-notes.md).
    """
    if not rows:
        return
    table = model.__table__  # type: ignore[attr-defined]
    note_rows(session.connection(), table.name, rows)
    if session.get_bind().dialect.name != "duckdb":
        session.execute(insert(table), rows)
        return
    connection = _duckdb_connection(session)
    # insert_into is positional: the file's own column order, read once per connection (the schema changes only
    # when a store is opened, before any connection of its pool writes)
    known: dict[str, list[str]] = session.connection().connection.info.setdefault("flywheel_columns", {})
    stored = known.get(table.name) or known.setdefault(table.name, connection.table(table.name).columns)
    connection.from_arrow(_arrow_table(table, rows, stored)).insert_into(table.name)
    WriteStamps.wrote(session.connection(), table.name)  # DuckDB's relation API bypasses SQLAlchemy's events


def bulk_update(session: Session, model: type[SQLModel], rows: list[dict[str, Any]], columns: tuple[str, ...]) -> None:
    """Set ``columns`` of many rows (matched by ``id``) at once: one ``UPDATE ... FROM`` an Arrow table on
    DuckDB (a parameter-bound UPDATE is dear per row there), executemany elsewhere."""
    if not rows:
        return
    table = model.__table__  # type: ignore[attr-defined]
    note_rows(session.connection(), table.name, rows, inserted=False)
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
    WriteStamps.wrote(session.connection(), table.name)  # raw SQL: SQLAlchemy does not know what it writes


@contextmanager
def _arrow_view(session: Session, table: Any, rows: list[dict[str, Any]], columns: list[str]) -> Iterator[str]:
    """``rows`` as an Arrow table registered on the session's DuckDB connection, by name, for one statement."""
    connection = _duckdb_connection(session)
    view = f"_flywheel_rows_{table.name}"
    connection.register(view, _arrow_table(table, rows, columns))
    yield view
    # Not in a finally: an aborted transaction refuses it, hiding the conflict retry_on_conflict retries
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


def _json_value(text: str) -> Any:
    """A JSON column's value: orjson reads the store's JSON several times faster than the standard library."""
    try:
        return loads(text)
    except JSONDecodeError:  # what orjson refuses and json takes (NaN from an older writer, nesting past 1024)
        return json.loads(text)
