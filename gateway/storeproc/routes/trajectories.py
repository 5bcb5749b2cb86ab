"""The trajectories part of the admin API (``/flywheel/v1/trajectories``), plus the client's close.

    GET    /flywheel/v1/trajectories                    list: alias, since, until, status, task, has_reward,
                                                        client_key_id, limit, after, order
    GET    /flywheel/v1/trajectories/{id}               one, with turns (in order), branches, scores, feedback
    DELETE /flywheel/v1/trajectories/{id}               delete it (turns, group memberships, scores, feedback)
    DELETE /flywheel/v1/trajectories?client_key_id=K    delete everything a client key left
    GET    /flywheel/v1/trajectories/{id}/export        format=openai|art: JSON Lines, one line per branch
    POST   /flywheel/v1/trajectories/{id}/close         client key, not admin: "this conversation is done"

Trajectory ids are the client's own when it named them (``X-Flywheel-Trajectory-Id``), so they
may hold ``/``: the routes take the id as a path, and ``/export`` and ``/close`` are matched
first. All but ``close`` need the admin key. ``close`` takes the client key that made the
trajectory (any caller when no client keys are configured); a trajectory of another key
is reported as not found.
"""

from __future__ import annotations

import asyncio
from datetime import datetime
from typing import Annotated, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field
from starlette.responses import Response

from flywheel.capture import export, queries
from flywheel.capture.queries import QueryError, TrajectoryFilter
from flywheel.capture.store import Store
from flywheel.gateway.core.errors import BadRequest
from flywheel.gateway.core.http import json_response, read_body
from flywheel.gateway.core.openapi import ERRORS, json_body, query
from flywheel.gateway.core.protocol import parse_json_object
from flywheel.gateway.storeproc import store_ops
from flywheel.gateway.storeproc.routes.helpers import caught_up_store, not_found, query_error, run_query
from flywheel.gateway.storeproc.store_state import StoreState

router = APIRouter(prefix="/flywheel/v1")

_MAX_LIMIT = 1000
_FILTERS = ("alias", "since", "until", "status", "task", "has_reward", "client_key_id")



# A moment as the filters take it: unix seconds, ISO 8601 (naive: UTC), or a duration ago (30m, 2h, 7d).
Moment = float | datetime | Annotated[str, Field(pattern=r"^\d+(\.\d+)?\s*[smhdw]$")]


class TrajectoryListQuery(BaseModel):
    alias: str | None = None
    since: Moment | None = None
    until: Moment | None = None
    status: str | None = Field(default=None, description="open or closed")
    task: str | None = Field(default=None, description="a task key")
    has_reward: Literal["true", "false", "1", "0", "yes", "no", "on", "off"] | None = None
    client_key_id: str | None = None
    limit: int = Field(default=100, ge=1, le=_MAX_LIMIT)
    after: str | None = Field(default=None, description="the last id of the previous page")
    order: Literal["asc", "desc"] = "desc"


class ClientDataQuery(BaseModel):
    client_key_id: str = Field(description="delete everything this client key left")


class ExportQuery(BaseModel):
    format: Literal["openai", "art"] = "openai"


class CloseRequest(BaseModel):
    reason: str | None = Field(default=None, description="default: client")


async def _admin(request: Request) -> Store:
    """The store, caught up with what the gateway answered so far (401 without the admin key)."""
    store, _ = await caught_up_store(request, admin=True)
    return store



@router.get("/trajectories", openapi_extra=query(TrajectoryListQuery), responses=ERRORS)
async def list_trajectories(request: Request) -> Response:
    store = await _admin(request)
    params = request.query_params
    try:
        flt = TrajectoryFilter.from_query({k: params[k] for k in _FILTERS if k in params})
        limit = queries.parse_limit(params.get("limit"), "limit", default=100, maximum=_MAX_LIMIT)
        order = queries.parse_order(params.get("order"), default="desc")
    except QueryError as exc:
        raise query_error(exc) from None
    page = await run_query(queries.list_trajectories, store, flt, limit=limit, after=params.get("after") or None,
                      order=order)
    return json_response(page.to_json())


@router.delete("/trajectories", openapi_extra=query(ClientDataQuery), responses=ERRORS)
async def delete_client_trajectories(request: Request) -> Response:
    store = await _admin(request)
    client_key_id = request.query_params.get("client_key_id")
    if not client_key_id:
        raise BadRequest("Missing required parameter: 'client_key_id' (deleting every trajectory is not offered).",
                         param="client_key_id", code="missing_required_parameter")
    counts = await run_query(queries.delete_client_data, store, client_key_id)
    store_ops.forget_rewards(store)
    return json_response({"object": "client_key.deleted", "client_key_id": client_key_id, "deleted": True,
                  "rows": counts.to_json()})


@router.get("/trajectories/{trajectory_id:path}/export", openapi_extra=query(ExportQuery), responses=ERRORS)
async def export_trajectory(trajectory_id: str, request: Request) -> Response:
    store = await _admin(request)
    fmt = request.query_params.get("format", "openai")
    if fmt not in ("openai", "art"):
        raise BadRequest(f"Invalid value for 'format': expected 'openai' or 'art', got {fmt!r} "
                         "(Parquet comes from the CLI: flywheel trajectories export --format parquet).",
                         param="format", code="invalid_value")
    detail = await run_query(queries.trajectory_detail, store, trajectory_id)
    if detail is None:
        raise not_found("trajectory", trajectory_id)
    body = export.jsonl(export.records(detail, "openai" if fmt == "openai" else "art"))
    return Response(body.encode(), media_type="application/x-ndjson")


@router.post("/trajectories/{trajectory_id:path}/close", openapi_extra=json_body(CloseRequest, required=False),
             responses=ERRORS)
async def close_trajectory(trajectory_id: str, request: Request) -> Response:
    """The client says the conversation is over: it will be scored and trained on."""
    state = StoreState.of(request)
    key_id = state.auth.client(request)
    store = state.store
    raw = await read_body(request, state.settings.max_body_bytes)
    reason = "client"
    if raw.strip():
        body = parse_json_object(raw)
        reason = body.get("reason") or reason
        if not isinstance(reason, str):
            raise BadRequest("Invalid value for 'reason': expected a string.", param="reason", code="invalid_type")
    await state.caught_up(request)  # the turn answered a moment ago must be in before the close
    found = await run_query(queries.get_trajectory, store, trajectory_id)
    if found is None or (key_id is not None and found["client_key_id"] != key_id):
        raise not_found("trajectory", trajectory_id)  # another key's trajectory is not even admitted to exist
    await asyncio.to_thread(store.close_trajectory, trajectory_id, reason)
    return json_response(await run_query(queries.get_trajectory, store, trajectory_id))


@router.get("/trajectories/{trajectory_id:path}", responses=ERRORS)
async def show_trajectory(trajectory_id: str, request: Request) -> Response:
    store = await _admin(request)
    detail = await run_query(queries.trajectory_detail, store, trajectory_id)
    if detail is None:
        raise not_found("trajectory", trajectory_id)
    return json_response(detail)


@router.delete("/trajectories/{trajectory_id:path}", responses=ERRORS)
async def delete_trajectory(trajectory_id: str, request: Request) -> Response:
    store = await _admin(request)
    counts = await run_query(queries.delete_trajectory, store, trajectory_id)
    if counts is None:
        raise not_found("trajectory", trajectory_id)
    store_ops.forget_rewards(store)
    return json_response({"object": "trajectory.deleted", "id": trajectory_id, "deleted": True,
                          "rows": counts.to_json()})
