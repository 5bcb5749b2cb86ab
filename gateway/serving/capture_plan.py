"""Deciding whether a request is captured, and what the recorder gets when it is.

Headers a client may send (all optional; ``flywheel.headers()`` builds the first four):
``X-Flywheel-Capture: on|off``, ``X-Flywheel-Trajectory-Id``, ``X-Flywheel-Task``,
``X-Flywheel-Group-Id``, and ``X-Flywheel-Parent-Trajectory-Id`` (a sub-agent's call, for the
trajectory of the agent it works for). ``metadata.trajectory_id`` and
``metadata.parent_trajectory_id`` in the body work like the headers.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from starlette.requests import Request

from flywheel.capture.turns import CapturedExchange
from flywheel.gateway.core.config import CaptureConfig, GroupsConfig
from flywheel.gateway.core.errors import BadRequest
from flywheel.gateway.serving.served_model import ServedModel

_PREFIX = b"x-flywheel-"


@dataclass(slots=True)
class CapturePlan:
    """What is known about a captured request before the engine answers."""

    endpoint: str
    served: ServedModel
    requested_model: str
    client_key_id: str | None
    started_at: datetime
    started: float  # perf_counter at arrival
    trajectory_id: str | None
    task: str | None
    group_id: str | None
    fork_k: int = 0  # extra samples drawn for this request and kept from the client
    parent_trajectory_id: str | None = None  # X-Flywheel-Parent-Trajectory-Id

    def exchange(self, request_body: dict[str, Any], response: dict[str, Any]) -> CapturedExchange:
        return CapturedExchange(
            completion_id=str(response.get("id") or ""), endpoint=self.endpoint,
            requested_model=self.requested_model, alias=self.served.alias,
            engine_model=self.served.engine_model, adapter_version=self.served.version,
            client_key_id=self.client_key_id, request=request_body, response=response,
            created_at=self.started_at, latency_ms=(time.perf_counter() - self.started) * 1000,
            trajectory_id=self.trajectory_id, task=self.task, group_id=self.group_id,
            parent_trajectory_id=self.parent_trajectory_id,
            client_choices=int(request_body.get("n") or 1) if self.fork_k else None)


def flywheel_headers(request: Request) -> dict[str, str]:
    """The request's ``X-Flywheel-*`` headers by the rest of their (lowercase) name: one pass over the raw
    ASGI list: five ``request.headers.get`` calls were a measurable share of the gateway's CPU."""
    return {name[len(_PREFIX):].decode("latin-1"): value.decode("latin-1")
            for name, value in request.scope["headers"] if name.startswith(_PREFIX)}


def plan_capture(request: Request, config: CaptureConfig, groups: GroupsConfig, *, endpoint: str,
                 served: ServedModel, requested_model: str, client_key_id: str | None,
                 started: float, position: int = 0, fork_share: float = 1.0) -> CapturePlan | None:
    """None when this request is not to be captured (header, config default, sampling). ``position``: the
    assistant messages before this turn; ``fork_share``: the share of ``fork_fraction`` its position gets."""
    headers = flywheel_headers(request)
    switch = (headers.get("capture") or "").strip().lower()
    if switch in ("off", "0", "false", "no"):
        return None
    forced = switch in ("on", "1", "true", "yes")
    if not forced and (not config.enabled or random.random() >= config.sample_rate):
        return None
    return CapturePlan(endpoint=endpoint, served=served, requested_model=requested_model,
                       client_key_id=client_key_id, started_at=datetime.now(UTC), started=started,
                       trajectory_id=headers.get("trajectory-id") or None, task=headers.get("task") or None,
                       group_id=headers.get("group-id") or None,
                       fork_k=fork_count(headers.get("fork"), groups, position, fork_share)
                       if endpoint == "chat.completions" else 0,
                       parent_trajectory_id=headers.get("parent-trajectory-id") or None)


def fork_count(header: str | None, groups: GroupsConfig, position: int = 0, share: float = 1.0) -> int:
    """Extra samples to draw: ``X-Flywheel-Fork: k`` or, for a ``fork_fraction`` of turns (of first turns only
    with ``fork_turns = "first"``; ``share`` of that with ``"untied"``), ``fork_k``."""
    if header is not None:
        if not header.strip().isdigit() or not 0 <= int(header) <= 16:
            raise BadRequest("Invalid value for 'X-Flywheel-Fork': an integer from 0 to 16", param="X-Flywheel-Fork")
        return int(header)
    if groups.fork_turns == "first" and position:
        return 0
    rate = groups.fork_fraction * (share if groups.fork_turns == "untied" else 1.0)
    return groups.fork_k if rate and random.random() < rate else 0
