"""OpenAI's Stored Completions API over the capture store, so existing tooling can read captured traffic.

    GET    /v1/chat/completions                          list (after, limit, order, model, metadata[k]=v)
    GET    /v1/chat/completions/{completion_id}          one chat.completion (all its choices)
    POST   /v1/chat/completions/{completion_id}          update its metadata ({"metadata": {...}})
    DELETE /v1/chat/completions/{completion_id}          delete it
    GET    /v1/chat/completions/{completion_id}/messages its request messages (after, limit, order)

Every captured chat completion is "stored" (the gateway captures unless told not to; the
request's ``store`` flag is not consulted). A client key sees only its own completions;
with no client keys configured every completion is visible. ``POST /v1/chat/completions``
(creating one) lives in :mod:`flywheel.gateway.serving.routes.completions`; only the methods differ.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field
from starlette.responses import Response

from flywheel.capture import queries
from flywheel.capture.queries import EVERY_KEY, CompletionFilter, Owner, QueryError
from flywheel.capture.store import Store
from flywheel.gateway.core.errors import BadRequest
from flywheel.gateway.core.http import json_response, read_body
from flywheel.gateway.core.openapi import ERRORS, json_body, query
from flywheel.gateway.core.protocol import parse_json_object
from flywheel.gateway.storeproc import store_ops
from flywheel.gateway.storeproc.routes.helpers import caught_up_store, not_found, query_error, run_query
from flywheel.gateway.storeproc.store_state import StoreState

router = APIRouter()

_METADATA_PARAM = re.compile(r"^metadata\[(.+)\]$")
_MAX_LIMIT = 100  # OpenAI's cap on list pages
_MAX_METADATA_KEYS, _MAX_KEY_CHARS, _MAX_VALUE_CHARS = 16, 64, 512  # OpenAI's metadata limits



class MessageListQuery(BaseModel):
    after: str | None = Field(default=None, description="the last id of the previous page")
    limit: int = Field(default=20, ge=1, le=_MAX_LIMIT)
    order: Literal["asc", "desc"] = "asc"


class CompletionListQuery(MessageListQuery):
    model: str | None = Field(default=None, description="the model name the client sent, or the alias")
    metadata: dict[str, str] = Field(default_factory=dict, description="metadata[KEY]=VALUE, every pair must match")


class MetadataUpdate(BaseModel):
    metadata: dict[str, str] | None = Field(max_length=_MAX_METADATA_KEYS, description="null clears")


async def _caller(request: Request) -> tuple[Store, Owner]:
    """The store, and whose completions the caller may see (every key's when no client keys are set)."""
    store, key_id = await caught_up_store(request, admin=False)
    return store, (key_id if key_id is not None else EVERY_KEY)



@router.get("/v1/chat/completions", openapi_extra=query(CompletionListQuery), responses=ERRORS)
async def list_chat_completions(request: Request) -> Response:
    store, owner = await _caller(request)
    params = request.query_params
    metadata = {match.group(1): value for name, value in params.multi_items()
                if (match := _METADATA_PARAM.match(name))}
    try:
        limit = queries.parse_limit(params.get("limit"), "limit", default=20, maximum=_MAX_LIMIT)
        order = queries.parse_order(params.get("order"))
    except QueryError as exc:
        raise query_error(exc) from None
    flt = CompletionFilter(model=params.get("model") or None, metadata=metadata)
    page = await run_query(queries.list_completions, store, owner, flt, limit=limit, after=params.get("after") or None,
                      order=order)
    return json_response(page.to_json())


@router.get("/v1/chat/completions/{completion_id}", responses=ERRORS)
async def retrieve_chat_completion(completion_id: str, request: Request) -> Response:
    store, owner = await _caller(request)
    found = await run_query(queries.get_completion, store, completion_id, owner)
    if found is None:
        raise not_found("chat completion", completion_id)
    return json_response(found)


@router.post("/v1/chat/completions/{completion_id}", openapi_extra=json_body(MetadataUpdate), responses=ERRORS)
async def update_chat_completion(completion_id: str, request: Request) -> Response:
    store, owner = await _caller(request)
    body = parse_json_object(await read_body(request, StoreState.of(request).settings.max_body_bytes))
    if "metadata" not in body:
        raise BadRequest("Missing required parameter: 'metadata'.", param="metadata",
                         code="missing_required_parameter")
    metadata = _valid_metadata(body["metadata"])
    updated = await run_query(queries.update_completion_metadata, store, completion_id, owner, metadata)
    if updated is None:
        raise not_found("chat completion", completion_id)
    return json_response(updated)


@router.delete("/v1/chat/completions/{completion_id}", responses=ERRORS)
async def delete_chat_completion(completion_id: str, request: Request) -> Response:
    store, owner = await _caller(request)
    if not await run_query(queries.delete_completion, store, completion_id, owner):
        raise not_found("chat completion", completion_id)
    store_ops.forget_rewards(store)
    return json_response({"object": "chat.completion.deleted", "id": completion_id, "deleted": True})


@router.get("/v1/chat/completions/{completion_id}/messages", openapi_extra=query(MessageListQuery),
            responses=ERRORS)
async def list_chat_completion_messages(completion_id: str, request: Request) -> Response:
    store, owner = await _caller(request)
    params = request.query_params
    try:
        limit = queries.parse_limit(params.get("limit"), "limit", default=20, maximum=_MAX_LIMIT)
        order = queries.parse_order(params.get("order"))
    except QueryError as exc:
        raise query_error(exc) from None
    page = await run_query(queries.completion_messages, store, completion_id, owner, limit=limit,
                      after=params.get("after") or None, order=order)
    if page is None:
        raise not_found("chat completion", completion_id)
    return json_response(page.to_json())


def _valid_metadata(value: Any) -> dict[str, str] | None:
    """OpenAI's rules: at most 16 string pairs, keys up to 64 characters, values up to 512; null clears."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise BadRequest("Invalid value for 'metadata': expected an object of string keys and values.",
                         param="metadata", code="invalid_type")
    if len(value) > _MAX_METADATA_KEYS:
        raise BadRequest(f"Invalid value for 'metadata': at most {_MAX_METADATA_KEYS} keys, got {len(value)}.",
                         param="metadata", code="invalid_value")
    for key, item in value.items():
        if not isinstance(item, str):
            raise BadRequest(f"Invalid value for 'metadata.{key}': values must be strings.",
                             param=f"metadata.{key}", code="invalid_type")
        if len(key) > _MAX_KEY_CHARS or len(item) > _MAX_VALUE_CHARS:
            raise BadRequest(f"Invalid value for 'metadata.{key}': keys are at most {_MAX_KEY_CHARS} characters, "
                             f"values at most {_MAX_VALUE_CHARS}.", param=f"metadata.{key}", code="invalid_value")
    return dict(value)
