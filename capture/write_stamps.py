"""How many write transactions this process has committed on each table: a stamp that tells a kept read
from a stale one.

SQLAlchemy's events on the store's engine see every statement that writes a table (the ORM's and Core's
INSERT, UPDATE and DELETE; the store's Arrow writes, which bypass SQLAlchemy, say so with :func:`wrote`).
A transaction's tables count once it has committed and its connection went back to the pool, never
before: a read that sees a stamp also sees what the stamp counts. Only where this process is the
store's one writer (DuckDB) does the stamp cover every write; on a shared store other replicas write too.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable
from typing import Any

from sqlalchemy import Connection, Engine, event

_WRITES = "flywheel_writes"  # tables written in the connection's open transaction
_COMMITTING = "flywheel_committing"  # tables of the transaction being committed


class WriteStamps:
    """Committed write transactions per table on ``engine``, and how many are being committed now."""

    def __init__(self, engine: Engine) -> None:
        self._done: Counter[str] = Counter()
        self._in_flight: Counter[str] = Counter()
        self._lock = threading.Lock()
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

    @staticmethod
    def wrote(connection: Connection, table: str) -> None:
        """Count ``table`` as written by the connection's open transaction (a write SQLAlchemy did not see)."""
        connection.info.setdefault(_WRITES, set()).add(table)

    def _executed(self, connection: Connection, cursor: Any, statement: str, parameters: Any, context: Any,
                  executemany: bool) -> None:
        if context is None or not (context.isinsert or context.isupdate or context.isdelete):
            return
        table = getattr(getattr(context.compiled, "statement", None), "table", None)
        if table is not None:
            self.wrote(connection, table.name)

    def _committing(self, connection: Connection) -> None:
        tables = connection.info.pop(_WRITES, set())
        if not tables:
            return
        with self._lock:
            self._in_flight.update(tables)
        connection.info[_COMMITTING] = tables | connection.info.get(_COMMITTING, set())

    def _rolled_back(self, connection: Connection) -> None:
        connection.info.pop(_WRITES, None)

    def _reset(self, dbapi_connection: Any, record: Any, reset_state: Any) -> None:
        self._released(record)

    def _invalidated(self, dbapi_connection: Any, record: Any, exception: BaseException | None) -> None:
        self._released(record)

    def _released(self, record: Any) -> None:
        """The connection is back in the pool (or gone): what it committed is visible to every reader now."""
        tables = record.info.pop(_COMMITTING, None) if record is not None else None
        if not tables:
            return
        with self._lock:
            self._in_flight.subtract(tables)
            self._done.update(tables)
