"""Admin API for a trainer in another process: fetch a batch, report a round (``flywheel train`` uses it)."""

from __future__ import annotations

import asyncio

import orjson
from fastapi import APIRouter, Request
from pydantic import BaseModel
from starlette.responses import Response

from gateway.admin_api import alias_info
from gateway.errors import BadRequest, UpstreamError
from gateway.protocol import parse_json_object, validate_request
from gateway.state import GatewayState
from gateway.training import base_model_path, record_training, round_from_json, training_batch

router = APIRouter(prefix="/flywheel/v1/training")


@router.get("/batch")
async def get_batch(request: Request) -> Response:
    """Scored, untrained groups of an alias, with the base weights and the adapter it serves now."""
    state = GatewayState.of(request)
    state.auth.admin(request)
    alias = request.query_params.get("alias") or ""
    served = state.router.get(alias)
    try:
        max_groups = int(request.query_params.get("max_groups") or state.settings.train.max_groups)
        base = base_model_path(state.settings, alias)
    except ValueError as exc:
        raise BadRequest(f"Invalid training request: {exc}", param="max_groups" if "int" in str(exc) else "alias"
                         ) from None
    if state.store is None:
        raise UpstreamError("this gateway runs without a store")
    groups = await asyncio.to_thread(training_batch, state.store, alias, max_groups)
    current = {"version": served.version, "path": served.adapter_path} if served.adapter_path else None
    body = {"alias": alias, "base_model": base, "current": current, "groups": [g.to_json() for g in groups]}
    return Response(orjson.dumps(body), media_type="application/json")


class RoundReport(BaseModel):
    alias: str
    version: int
    parent_version: int | None = None
    promote: bool = False
    result: dict[str, object]


@router.post("/rounds")
async def post_round(request: Request) -> Response:
    """Record a finished round; with ``promote``, hot-load its adapter as ``alias@version``."""
    state = GatewayState.of(request)
    state.auth.admin(request)
    body = parse_json_object(await request.body())
    validate_request(RoundReport, body)
    report = RoundReport.model_validate(body)
    state.router.get(report.alias)
    if state.store is None:
        raise UpstreamError("this gateway runs without a store")
    result = round_from_json(report.result)
    adapter = await asyncio.to_thread(record_training, state.store, report.alias, result, version=report.version,
                                      parent_version=report.parent_version, promote=report.promote)
    served = state.router.get(report.alias)
    if report.promote and adapter is not None:
        served = await state.router.switch_adapter(report.alias, adapter.path, version=adapter.version)
    out = {"adapter_version": adapter.model_dump(mode="json") if adapter else None, "served": alias_info(served)}
    return Response(orjson.dumps(out), media_type="application/json")
