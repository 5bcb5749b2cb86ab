"""The admin API (``/flywheel/v1/...``): inspect aliases and hot-swap their adapters.

Every route needs the admin key (or, with none configured, a loopback client).
"""

from __future__ import annotations

from pathlib import Path

import orjson
from fastapi import APIRouter, Request
from pydantic import BaseModel
from starlette.responses import Response

from gateway.errors import BadRequest
from gateway.protocol import parse_json_object, validate_request
from gateway.routing import ServedModel
from gateway.state import GatewayState

router = APIRouter(prefix="/flywheel/v1")


class AdapterSwitch(BaseModel):
    path: str | None  # a PEFT adapter directory the engine can read; null serves the base model
    version: int | None = None  # the engine name becomes alias@version (default: the next number)


def alias_info(served: ServedModel) -> dict[str, object]:
    return {"alias": served.alias, "engine": served.engine_name, "base_model": served.base_model,
            "adapter": served.adapter, "adapter_path": served.adapter_path, "version": served.version,
            "in_flight": served.in_flight}


@router.get("/aliases")
async def list_aliases(request: Request) -> Response:
    state = GatewayState.of(request)
    state.auth.admin(request)
    return Response(orjson.dumps({"data": [alias_info(s) for s in state.router.all()]}),
                    media_type="application/json")


@router.put("/aliases/{alias}/adapter")
async def switch_alias_adapter(alias: str, request: Request) -> Response:
    """Load an adapter as ``alias@N``, switch the alias to it, drain and unload the previous one."""
    state = GatewayState.of(request)
    state.auth.admin(request)
    body = parse_json_object(await request.body())
    validate_request(AdapterSwitch, body)
    path = body["path"]
    state.router.get(alias)
    if path is not None and not (Path(path) / "adapter_config.json").is_file():
        raise BadRequest(f"Invalid value for 'path': no PEFT adapter at {path} (adapter_config.json missing)",
                         param="path")
    served = await state.router.switch_adapter(alias, path, version=body.get("version"))
    return Response(orjson.dumps(alias_info(served)), media_type="application/json")
