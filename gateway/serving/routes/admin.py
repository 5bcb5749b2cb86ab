"""The admin API (``/flywheel/v1/...``): inspect aliases and hot-swap their adapters.

Every route needs the admin key (or, with none configured, a loopback client). An adapter is
loaded only from the adapters directory or an ``adapter_dirs`` entry (docs/security.md).
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import BaseModel
from starlette.responses import Response

from flywheel.gateway.core.config import AdapterVersion
from flywheel.gateway.core.errors import BadRequest
from flywheel.gateway.core.http import json_response, read_body
from flywheel.gateway.core.openapi import ERRORS, json_body
from flywheel.gateway.core.protocol import parse_json_object, validate_request
from flywheel.gateway.serving.gateway_state import GatewayState
from flywheel.gateway.serving.loop.promotion import promote_version, register_adapter
from flywheel.gateway.serving.served_model import ServedModel

router = APIRouter(prefix="/flywheel/v1")


class AdapterSwitch(BaseModel):
    path: str | None = None  # a PEFT adapter directory: registered as a new version of the alias, then served
    version: AdapterVersion | None = None  # or a version the store has (0: the base model)


def adapter_directory(state: GatewayState, path: str) -> str:
    """``path`` resolved, when it is a PEFT adapter inside the directories adapters may come from; else a 400."""
    try:
        resolved = state.settings.allowed_adapter_path(path)
    except ValueError as exc:
        raise BadRequest(f"Invalid value for 'path': {exc}", param="path") from None
    if not (resolved / "adapter_config.json").is_file():
        raise BadRequest(f"Invalid value for 'path': no PEFT adapter at {path} (adapter_config.json missing)",
                         param="path")
    return str(resolved)


def alias_info(served: ServedModel) -> dict[str, object]:
    return {"alias": served.alias, "engine": served.engine_name, "base_model": served.base_model,
            "adapter": served.adapter, "adapter_path": served.adapter_path, "version": served.version,
            "in_flight": served.in_flight}


@router.get("/aliases", responses=ERRORS)
async def list_aliases(request: Request) -> Response:
    state = GatewayState.of(request)
    state.auth.admin(request)
    return json_response({"data": [alias_info(s) for s in state.router.all()]})


@router.put("/aliases/{alias}/adapter", openapi_extra=json_body(AdapterSwitch), responses=ERRORS)
async def switch_alias_adapter(alias: str, request: Request) -> Response:
    """Serve an adapter directory (registered as the next version) or a stored version (0: the base model).

    Like every switch it goes through the store: the version survives a restart, and the engine
    loads it under a name no other weights ever had (``alias@N``).
    """
    state = GatewayState.of(request)
    state.auth.admin(request)
    body = parse_json_object(await read_body(request, state.settings.max_body_bytes))
    validate_request(AdapterSwitch, body)
    switch = AdapterSwitch.model_validate(body)
    state.router.get(alias)
    if switch.path is not None:
        path = adapter_directory(state, switch.path)
        version = (await register_adapter(state, alias, path, source="manual")).version
    elif switch.version is not None:
        version = switch.version
    elif "path" in body:  # {"path": null}: back to the base model
        version = 0
    else:
        raise BadRequest("Give 'path' (an adapter directory, or null for the base model) or 'version'.",
                         param="path", code="missing_required_parameter")
    served = await promote_version(state, alias, version, reason="switched through the admin API")
    return json_response(alias_info(served))
