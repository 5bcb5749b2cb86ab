"""The one piece of app state: everything a route needs, built once in the lifespan."""

from __future__ import annotations

from dataclasses import dataclass, field

from starlette.requests import Request

from capture.recorder import Recorder
from capture.store import Store
from gateway.auth import Authenticator
from gateway.config import Settings
from gateway.engines.base import Engine
from gateway.metrics import GatewayMetrics
from gateway.routing import ModelRouter


@dataclass
class GatewayState:
    """Settings, engines, router, auth and metrics of one running gateway."""

    settings: Settings
    engines: dict[str, Engine]
    router: ModelRouter
    auth: Authenticator
    store: Store | None = None
    recorder: Recorder | None = None
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    started_at: int = 0

    @staticmethod
    def of(request: Request) -> GatewayState:
        state: GatewayState = request.app.state.gateway
        return state
