"""What this process has committed: how many write transactions touched each table (a stamp that tells a kept
read from a stale one), which rows the loop's incremental jobs follow (:class:`Followed`), and the facts a
trajectory's reward and its idle close are made of, as written (:class:`FollowedFacts`).

SQLAlchemy's events on the store's engine see every statement that writes a table (the ORM's and Core's
INSERT, UPDATE and DELETE; the store's Arrow writes, which bypass SQLAlchemy, say so with :func:`wrote`).
The rows a job follows are noted by the writes that change them (:func:`note_rows`, :func:`note_closed`,
:func:`WriteStamps.noted`; the ORM's flushes are read before they run). A transaction's tables and rows count
once it has committed and its connection went back to the pool, never before: a read that sees a stamp also
sees what the stamp counts, and a rolled-back transaction (a conflict retried) notes nothing. Only where this
process is the store's one writer (DuckDB) does this cover every write; on a shared store other replicas write
too.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable
from typing import Any

from sqlalchemy import Connection, Engine, event
from sqlalchemy.orm import Session

_WRITES = "flywheel_writes"  # tables written in the connection's open transaction
_COMMITTING = "flywheel_committing"  # tables of the transaction being committed
_ROWS = "flywheel_rows"  # rows noted in the connection's open transaction: kind -> keys
_ROWS_COMMITTING = "flywheel_rows_committing"
_FACTS = "flywheel_facts"  # facts noted in the connection's open transaction
_FACTS_COMMITTING = "flywheel_facts_committing"

CLOSED = "closed"  # a trajectory closed: its id
REWARDED = "rewarded"  # a trajectory's feedback or final reward written: its id
FORKED = "forked"  # a forked turn written: its completion id
MAX_FOLLOWED = 100_000  # keys (or facts) a follower holds before it must look at everything instead

# What a trajectory's reward and its idle close are made of, as written: (table, trajectory id, inserted, the
# columns that count).
Fact = tuple[str, str, bool, dict[str, Any]]
_FACT_COLUMNS = {"trajectories": ("alias", "status", "close_reason", "updated_at"),
                 "turns": ("adapter_version", "source"), "feedback": ("reward", "label", "created_at"),
                 "scores": ("value", "created_at")}


class Followed:
    """The keys of one kind committed since the follower last took them (:meth:`WriteStamps.follow`)."""

    def __init__(self, lock: threading.Lock) -> None:
        self.keys: set[str] = set()
        self.overflowed = False
        self._lock = lock  # the stamps', which publish under it

    def take(self) -> set[str] | None:
        """What was committed since the last take; None when too much was (or a deletion was): look at everything."""
        with self._lock:
            keys, overflowed = self.keys, self.overflowed
            self.keys, self.overflowed = set(), False
        return None if overflowed else keys

    def give_back(self, keys: Iterable[str] | None) -> None:
        """What a take handed to a run that failed: the next take hands it again (None: everything)."""
        with self._lock:
            if keys is None:
                self.overflowed = True
            else:
                self.keys |= set(keys)


class FollowedFacts:
    """The facts committed since the follower last took them, in commit order (:meth:`WriteStamps.follow_facts`)."""

    def __init__(self, lock: threading.Lock) -> None:
        self.facts: list[Fact] = []
        self.overflowed = False
        self._lock = lock

    def take(self) -> list[Fact] | None:
        """What was committed since the last take; None when too much was (or a deletion was): forget what you
        know."""
        with self._lock:
            facts, overflowed = self.facts, self.overflowed
            self.facts, self.overflowed = [], False
        return None if overflowed else facts


class WriteStamps:
    """Committed write transactions per table on ``engine``, how many are being committed now, and the rows
    followed."""

    def __init__(self, engine: Engine) -> None:
        self._done: Counter[str] = Counter()
        self._in_flight: Counter[str] = Counter()
        self._followers: dict[str, list[Followed]] = {}
        self._fact_followers: list[FollowedFacts] = []
        self._lock = threading.Lock()
        self.engine = engine
        event.listen(engine, "after_cursor_execute", self._executed)
        event.listen(engine, "commit", self._committing)
        event.listen(engine, "rollback", self._rolled_back)
        event.listen(engine.pool, "reset", self._reset)
        event.listen(engine.pool, "invalidate", self._invalidated)

    def stamp(self, tables: Iterable[str]) -> tuple[int, ...] | None:
        """The committed count of each table, or None while a commit that wrote one of them is on its way."""
        with self._lock:
            names = tuple(tables)
            if any(self._in_flight[name] for name in names):
                return None
            return tuple(self._done[name] for name in names)

    def follow(self, kind: str) -> Followed:
        """A follower of ``kind``'s rows from now on (what committed before, the caller reads itself)."""
        followed = Followed(self._lock)
        with self._lock:
            self._followers.setdefault(kind, []).append(followed)
        return followed

    def follow_facts(self) -> FollowedFacts:
        """A follower of the facts of trajectories' rewards from now on (``note_rows``, ``note_closed``)."""
        followed = FollowedFacts(self._lock)
        with self._lock:
            self._fact_followers.append(followed)
        return followed

    def unfollow(self, followed: Followed | FollowedFacts) -> None:
        with self._lock:
            for followers in self._all_followers():
                if followed in followers:
                    followers.remove(followed)

    def forget(self) -> None:
        """Rows were deleted: every follower looks at everything next time."""
        with self._lock:
            for followers in self._all_followers():
                for followed in followers:
                    followed.overflowed = True

    def _all_followers(self) -> list[list[Any]]:
        return [*self._followers.values(), self._fact_followers]

    @staticmethod
    def wrote(connection: Connection, table: str) -> None:
        """Count ``table`` as written by the connection's open transaction (a write SQLAlchemy did not see)."""
        connection.info.setdefault(_WRITES, set()).add(table)

    @staticmethod
    def noted(connection: Connection, kind: str, keys: Iterable[str | None]) -> None:
        """Note ``keys`` of ``kind`` as changed by the connection's open transaction."""
        rows: dict[str, set[str]] = connection.info.setdefault(_ROWS, {})
        rows.setdefault(kind, set()).update(key for key in keys if key is not None)

    @staticmethod
    def noted_facts(connection: Connection, facts: Iterable[Fact]) -> None:
        """Note ``facts`` as written by the connection's open transaction."""
        connection.info.setdefault(_FACTS, []).extend(facts)

    def _executed(self, connection: Connection, cursor: Any, statement: str, parameters: Any, context: Any,
                  executemany: bool) -> None:
        if context is None or not (context.isinsert or context.isupdate or context.isdelete):
            return
        table = getattr(getattr(context.compiled, "statement", None), "table", None)
        if table is not None:
            self.wrote(connection, table.name)

    def _committing(self, connection: Connection) -> None:
        tables = connection.info.pop(_WRITES, set())
        rows = connection.info.pop(_ROWS, {})
        facts = connection.info.pop(_FACTS, None)
        if facts:
            connection.info.setdefault(_FACTS_COMMITTING, []).extend(facts)
        if rows:
            committing: dict[str, set[str]] = connection.info.setdefault(_ROWS_COMMITTING, {})
            for kind, keys in rows.items():
                committing.setdefault(kind, set()).update(keys)
        if not tables:
            return
        with self._lock:
            self._in_flight.update(tables)
        connection.info[_COMMITTING] = tables | connection.info.get(_COMMITTING, set())

    def _rolled_back(self, connection: Connection) -> None:
        connection.info.pop(_WRITES, None)
        connection.info.pop(_ROWS, None)
        connection.info.pop(_FACTS, None)

    def _reset(self, dbapi_connection: Any, record: Any, reset_state: Any) -> None:
        self._released(record)

    def _invalidated(self, dbapi_connection: Any, record: Any, exception: BaseException | None) -> None:
        self._released(record)

    def _released(self, record: Any) -> None:
        """The connection is back in the pool (or gone): what it committed is visible to every reader now."""
        if record is None:
            return
        tables = record.info.pop(_COMMITTING, None)
        rows: dict[str, set[str]] = record.info.pop(_ROWS_COMMITTING, None) or {}
        facts: list[Fact] = record.info.pop(_FACTS_COMMITTING, None) or []
        if not tables and not rows and not facts:
            return
        with self._lock:
            for follower in self._fact_followers if facts else ():
                follower.facts += facts
                if len(follower.facts) > MAX_FOLLOWED:
                    follower.facts, follower.overflowed = [], True
            if tables:
                self._in_flight.subtract(tables)
                self._done.update(tables)
            for kind, keys in rows.items():
                for followed in self._followers.get(kind, ()):
                    followed.keys |= keys
                    if len(followed.keys) > MAX_FOLLOWED:
                        followed.keys, followed.overflowed = set(), True


def followed_rows(table: str, rows: Iterable[Any]) -> dict[str, list[str]]:
    """The followed keys among ``rows`` written to ``table`` (dicts, or ORM objects): trajectories closed, feedback
    and final rewards, forked turns."""
    def get(row: Any, name: str) -> Any:
        return row.get(name) if isinstance(row, dict) else getattr(row, name, None)

    if table == "trajectories":
        return {CLOSED: [get(r, "id") for r in rows
                         if get(r, "status") == "closed" and get(r, "close_reason") != "fork"]}
    if table == "feedback":
        return {REWARDED: [get(r, "trajectory_id") for r in rows]}
    if table == "scores":
        return {REWARDED: [get(r, "trajectory_id") for r in rows if get(r, "source") == "reward"]}
    if table == "turns":
        return {FORKED: [get(r, "completion_id") for r in rows if get(r, "source") == "fork"]}
    return {}


def row_facts(table: str, rows: Iterable[Any], inserted: bool) -> list[Fact]:
    """The facts of trajectories' rewards among ``rows`` written to ``table`` (dicts, or ORM objects): a
    trajectory's alias and state, a turn's version, feedback, a final reward. An update's row holds only the columns
    it sets."""
    columns = _FACT_COLUMNS.get(table)
    if columns is None:
        return []
    owner = "id" if table == "trajectories" else "trajectory_id"
    facts: list[Fact] = []
    for row in rows:
        values = row if isinstance(row, dict) else {name: getattr(row, name, None)
                                                    for name in (owner, "source", *columns)}
        if table == "scores" and values.get("source") != "reward":
            continue
        facts.append((table, str(values[owner]), inserted, {name: values[name] for name in columns if name in values}))
    return facts


def note_rows(connection: Connection, table: str, rows: Iterable[Any], *, inserted: bool = True) -> None:
    rows = list(rows)
    for kind, keys in followed_rows(table, rows).items():
        if keys:
            WriteStamps.noted(connection, kind, keys)
    facts = row_facts(table, rows, inserted)
    if facts:
        WriteStamps.noted_facts(connection, facts)


def note_closed(connection: Connection, trajectory_ids: Iterable[str], reason: str) -> None:
    """Trajectories a set-based ``UPDATE`` closed with ``reason``: followed as closed, and as facts."""
    ids = list(trajectory_ids)
    WriteStamps.noted(connection, CLOSED, ids)
    WriteStamps.noted_facts(connection, [("trajectories", trajectory_id, False,
                                          {"status": "closed", "close_reason": reason}) for trajectory_id in ids])


def _note_flush(session: Session, flush_context: Any, instances: Any) -> None:
    """The ORM's writes of followed rows (a route's, a test's), noted before they are flushed."""
    for inserted, written in ((True, session.new), (False, session.dirty)):
        by_table: dict[str, list[Any]] = {}
        for row in written:
            table = getattr(row, "__tablename__", None)
            if table in ("trajectories", "feedback", "scores", "turns"):
                by_table.setdefault(table, []).append(row)
        if by_table:
            connection = session.connection()
            for table, rows in by_table.items():
                note_rows(connection, table, rows, inserted=inserted)


event.listen(Session, "before_flush", _note_flush)
