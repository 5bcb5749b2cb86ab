"""The gateway process's state, built once in its lifespan: everything a route needs.

Two processes serve one gateway (docs/gateway.md, "Two processes"): the gateway process
(:class:`GatewayState`: engines, routing, the request path) and the store process
(:class:`flywheel.gateway.storeproc.store_state.StoreState`: the DuckDB file, the recorder, the store-backed routes).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from starlette.requests import Request

from flywheel.gateway.core.auth import Authenticator
from flywheel.gateway.core.config import Settings
from flywheel.gateway.core.metrics import GatewayMetrics
from flywheel.gateway.core.store_api import StoreApi
from flywheel.gateway.serving.engines.base import Engine
from flywheel.gateway.serving.fork_yield import ForkYield
from flywheel.gateway.serving.routing import ModelRouter
from flywheel.gateway.serving.store_link import StoreLink


@dataclass
class GatewayState:
    """Settings, engines, router, auth, metrics, the link to the store process and the store interface over it,
    and what forking taught (``fork_turns = "untied"``)."""

    settings: Settings
    engines: dict[str, Engine]
    router: ModelRouter
    auth: Authenticator
    store_link: StoreLink
    store: StoreApi
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    fork_yield: ForkYield = field(default_factory=ForkYield)  # what forking each turn position taught (scoring)
    started_at: int = 0

    @staticmethod
    def of(request: Request) -> GatewayState:
        state: GatewayState = request.app.state.gateway
        return state
