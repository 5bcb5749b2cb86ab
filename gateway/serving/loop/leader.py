"""Which replica runs the loop's jobs: leader election through the store's database.

- DuckDB (one gateway per file): this gateway leads, from start to stop.
- PostgreSQL (several replicas): every replica campaigns for one advisory lock
  (``pg_try_advisory_lock``) on a connection of its own, every ``replicas.campaign_s``; the one
  that holds it leads. The lock lives as long as that connection: a leader that dies releases it
  (a killed process at once, when the server sees the socket close; a host that vanished within
  ~15 s, the connection's TCP keepalives), and a follower takes it at its next try. A leader
  checks its connection at the same pace and steps down the moment it fails, so two replicas
  never lead at once for longer than one ``campaign_s`` of a cut network (and then the old leader
  cannot reach the store either).

``on_change(True)`` runs when this replica becomes the leader, ``on_change(False)`` when it stops
being one; the loop schedules or removes its jobs there (``gateway/serving/loop/scheduler.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from flywheel.capture.store import database_url, lock_key, printable_url

log = logging.getLogger("flywheel.leader")

OnChange = Callable[[bool], Awaitable[None]]
LOOP_LOCK = "loop"  # the advisory lock's name (flywheel.capture.store.lock_key): one per database


def shared_store(database: str) -> bool:
    """Whether several gateway replicas may share this store (PostgreSQL), so one leads and all follow."""
    return database_url(database).startswith("postgresql")


class Leadership:
    """This process's part in the election: ``leading`` now, and the task that keeps it up to date."""

    def __init__(self, on_change: OnChange) -> None:
        self.on_change = on_change
        self.leading = False

    @staticmethod
    def for_database(database: str, campaign_s: float, on_change: OnChange) -> Leadership:
        """A sole leader for a DuckDB file, an election for a PostgreSQL URL."""
        if shared_store(database):
            return Election(database_url(database), campaign_s, on_change)
        return Leadership(on_change)

    @property
    def role(self) -> str:
        return "leader" if self.leading else "follower"

    async def start(self) -> None:
        await self._set(True)

    async def stop(self) -> None:
        await self._set(False)

    async def _set(self, leading: bool) -> None:
        if leading != self.leading:
            self.leading = leading
            await self.on_change(leading)


class Election(Leadership):
    """Campaign for the loop's advisory lock on a dedicated PostgreSQL connection (module docstring)."""

    def __init__(self, url: str, campaign_s: float, on_change: OnChange) -> None:
        super().__init__(on_change)
        self.url = url
        self.campaign_s = campaign_s
        self._connection: Any = None  # psycopg.AsyncConnection, imported when a campaign starts
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self._try()  # the first try before the gateway answers: a lone replica leads from the start
        self._task = asyncio.create_task(self._campaign(), name="flywheel-election")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._set(False)
        await self._disconnect()  # closing the connection releases the lock: a follower takes over at once

    async def _campaign(self) -> None:
        while True:
            await asyncio.sleep(self.campaign_s)
            await self._try()

    async def _try(self) -> None:
        """Take the lock when free, or check that the connection holding it is alive; step down when it is not."""
        import psycopg

        try:
            if self._connection is None or self._connection.closed:
                self._connection = await psycopg.AsyncConnection.connect(
                    _conninfo(self.url), autocommit=True, connect_timeout=10, keepalives=1, keepalives_idle=5,
                    keepalives_interval=2, keepalives_count=3, application_name="flywheel-leader")
            if self.leading:
                await self._connection.execute("SELECT 1")
                return
            cursor = await self._connection.execute("SELECT pg_try_advisory_lock(%s)", [lock_key(LOOP_LOCK)])
            row = await cursor.fetchone()
            if row and row[0]:
                log.info("this replica now runs the loop (it holds the leader lock on %s)", printable_url(self.url))
                await self._set(True)
        except (psycopg.Error, OSError) as exc:
            if self.leading:
                log.error("lost the connection holding the leader lock (%s); this replica stops running the loop",
                          type(exc).__name__)
            await self._set(False)
            await self._disconnect()

    async def _disconnect(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            with contextlib.suppress(Exception):
                await connection.close()


def _conninfo(url: str) -> str:
    """A libpq URI for psycopg from the store's SQLAlchemy URL (``postgresql+psycopg://`` -> ``postgresql://``)."""
    from sqlalchemy.engine import make_url

    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
