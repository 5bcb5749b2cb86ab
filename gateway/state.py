"""App state, built once in a lifespan: everything a route needs.

Two processes serve one gateway (docs/gateway.md, "Two processes"): the gateway process
(:class:`GatewayState`: engines, routing, the request path) and the store process
(:class:`StoreState`: the DuckDB file, the recorder, the store-backed routes).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from starlette.requests import Request

from capture.recorder import Recorder
from capture.store import Store
from gateway.auth import Authenticator
from gateway.config import Settings
from gateway.engines.base import Engine
from gateway.metrics import GatewayMetrics
from gateway.routing import ModelRouter

if TYPE_CHECKING:
    from gateway.store_link import StoreLink

INGEST_SEQ_HEADER = "x-flywheel-ingest-seq"  # exchanges the gateway had streamed when it forwarded a request


@dataclass
class GatewayState:
    """Settings, engines, router, auth, metrics and the link to the store process."""

    settings: Settings
    engines: dict[str, Engine]
    router: ModelRouter
    auth: Authenticator
    store_link: StoreLink
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    started_at: int = 0

    @staticmethod
    def of(request: Request) -> GatewayState:
        state: GatewayState = request.app.state.gateway
        return state


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

        A client that just got a response may close or rate that conversation at once; its
        turn may still be on the ingest socket or in the recorder's batch.
        """
        seq = int(request.headers.get(INGEST_SEQ_HEADER) or 0)
        deadline = time.monotonic() + timeout_s
        while self.received < seq and time.monotonic() < deadline:
            await asyncio.sleep(0.002)
        await self.recorder.flush(max(0.0, deadline - time.monotonic()))
