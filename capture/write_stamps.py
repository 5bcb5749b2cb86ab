"""What this process has committed: how many write transactions touched each table (a stamp that tells a kept
read from a stale one), and which rows the loop's incremental jobs follow (:class:`Followed`).

SQLAlchemy's events on the store's engine see every statement that writes a table (the ORM's and Core's
INSERT, UPDATE and DELETE; the store's Arrow writes, which bypass SQLAlchemy, say so with :func:`wrote`).
The rows a job follows are noted by the writes that change them (:func:`note_rows`, :func:`WriteStamps.noted`;
the ORM's flushes are read before they run). A transaction's tables and rows count once it has committed and
its connection went back to the pool, never before: a read that sees a stamp also sees what the stamp counts,
and a rolled-back transaction (a conflict retried) notes nothing. Only where this process is the store's one
writer (DuckDB) does this cover every write; on a shared store other replicas write too.
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

CLOSED = "closed"  # a trajectory closed: its id
REWARDED = "rewarded"  # a trajectory's feedback or final reward written: its id
FORKED = "forked"  # a forked turn written: its completion id
MAX_FOLLOWED = 100_000  # keys a follower holds before it must look at everything instead


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


class WriteStamps:
    """Committed write transactions per table on ``engine``, how many are being committed now, and the rows
    followed."""

    def __init__(self, engine: Engine) -> None:
        self._done: Counter[str] = Counter()
        self._in_flight: Counter[str] = Counter()
        self._followers: dict[str, list[Followed]] = {}
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

    def unfollow(self, followed: Followed) -> None:
        with self._lock:
            for followers in self._followers.values():
                if followed in followers:
                    followers.remove(followed)

    def forget(self) -> None:
        """Rows were deleted: every follower looks at everything next time."""
        with self._lock:
            for followers in self._followers.values():
                for followed in followers:
                    followed.overflowed = True

    @staticmethod
    def wrote(connection: Connection, table: str) -> None:
        """Count ``table`` as written by the connection's open transaction (a write SQLAlchemy did not see)."""
        connection.info.setdefault(_WRITES, set()).add(table)

    @staticmethod
    def noted(connection: Connection, kind: str, keys: Iterable[str | None]) -> None:
        """Note ``keys`` of ``kind`` as changed by the connection's open transaction."""
        rows: dict[str, set[str]] = connection.info.setdefault(_ROWS, {})
        rows.setdefault(kind, set()).update(key for key in keys if key is not None)

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
        if not tables and not rows:
            return
        with self._lock:
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


def note_rows(connection: Connection, table: str, rows: Iterable[Any]) -> None:
    for kind, keys in followed_rows(table, rows).items():
        if keys:
            WriteStamps.noted(connection, kind, keys)


def _note_flush(session: Session, flush_context: Any, instances: Any) -> None:
    """The ORM's writes of followed rows (a route's, a test's), noted before they are flushed."""
    by_table: dict[str, list[Any]] = {}
    for row in (*session.new, *session.dirty):
        table = getattr(row, "__tablename__", None)
        if table in ("trajectories", "feedback", "scores", "turns"):
            by_table.setdefault(table, []).append(row)
    if by_table:
        connection = session.connection()
        for table, rows in by_table.items():
            note_rows(connection, table, rows)


event.listen(Session, "before_flush", _note_flush)
