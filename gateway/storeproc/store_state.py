"""The store process's state, built once in its lifespan: the store, the recorder, what it read."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from starlette.requests import Request

from flywheel.capture.recorder import Recorder
from flywheel.capture.store import Store
from flywheel.gateway.core.auth import Authenticator
from flywheel.gateway.core.config import Settings
from flywheel.gateway.core.store_wire import INGEST_SEQ_HEADER


@dataclass
class StoreState:
    """Settings, auth, store and recorder of the store process, and what it read from the gateway."""

    settings: Settings
    auth: Authenticator
    store: Store
    recorder: Recorder
    received: int = 0  # exchanges read from the gateway's current ingest connection

    @staticmethod
    def of(request: Request) -> StoreState:
        state: StoreState = request.app.state.store_state
        return state

    async def caught_up(self, request: Request, timeout_s: float = 5.0) -> None:
        """Wait until what the gateway had streamed before forwarding ``request`` is written.

        A client that just got a response may read that conversation at once; its turn may still
        be on the ingest socket or in the recorder's batch. A request without the header (the
        loop's own reads, docs/gateway.md) reads the store as it is.
        """
        if INGEST_SEQ_HEADER not in request.headers:
            return
        deadline = time.monotonic() + timeout_s
        await self.received_all(request, timeout_s)
        await self.recorder.flush(max(0.0, deadline - time.monotonic()))

    async def received_all(self, request: Request, timeout_s: float = 5.0) -> None:
        """Wait until the exchanges the gateway had streamed before forwarding ``request`` are read (submitted
        to the recorder, not yet written)."""
        seq = int(request.headers.get(INGEST_SEQ_HEADER) or 0)
        deadline = time.monotonic() + timeout_s
        while self.received < seq and time.monotonic() < deadline:
            await asyncio.sleep(0.002)
