"""Admin API for a trainer in another process: fetch a batch, report a round (``flywheel train`` uses it)."""

from __future__ import annotations

import orjson
from fastapi import APIRouter, Request
from pydantic import BaseModel
from starlette.responses import Response

from gateway.api.admin import alias_info
from gateway.errors import BadRequest
from gateway.loop.training import base_model_path
from gateway.protocol import parse_json_object, validate_request
from gateway.state import GatewayState

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
    groups = await state.store_link.call("GET", "/internal/training/batch",
                                         params={"alias": alias, "max_groups": str(max_groups)})
    current = {"version": served.version, "path": served.adapter_path} if served.adapter_path else None
    body = {"alias": alias, "base_model": base, "current": current, "groups": groups}
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
    served = state.router.get(report.alias)
    adapter = await state.store_link.call("POST", "/internal/training/rounds", json=report.model_dump(mode="json"))
    if report.promote and adapter is not None:
        served = await state.router.switch_adapter(report.alias, adapter["path"], version=adapter["version"])
    out = {"adapter_version": adapter, "served": alias_info(served)}
    return Response(orjson.dumps(out), media_type="application/json")
