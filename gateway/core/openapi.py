"""The gateway's OpenAPI document, from the pydantic models the routes validate with.

Routes read their bodies by hand (``request: Request``: the raw body is bounded, parsed once and
validated into an OpenAI-shaped 400), so FastAPI cannot see them. Each route declares them in its
decorator instead, with one mechanism::

    @router.post("/promote", openapi_extra=json_body(PromoteRequest), responses=ERRORS)
    @router.get("/trajectories", openapi_extra=query(TrajectoryQuery), responses=ERRORS)

The document covers the store-backed routes too (the store process serves them; the gateway
forwards them unchanged), and ``/openapi.json`` needs the admin key when one is configured.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, get_args, get_origin

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRouter
from pydantic import BaseModel


class ErrorDetail(BaseModel):
    message: str
    type: str | None
    param: str | None  # the field at fault, e.g. messages[0].role
    code: str | None


class ErrorBody(BaseModel):
    """Every error either process reports (``gateway/core/errors.py``)."""

    error: ErrorDetail


ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorBody, "description": "A parameter is missing or invalid; `param` names it."},
    401: {"model": ErrorBody, "description": "Missing or wrong key."},
    404: {"model": ErrorBody, "description": "Unknown model, alias or id."},
    413: {"model": ErrorBody, "description": "The body is over max_body_bytes."},
}


def json_body(model: type[BaseModel], *, required: bool = True) -> dict[str, Any]:
    """``openapi_extra`` declaring ``model`` as the JSON request body."""
    return {"requestBody": {"required": required, "content": {"application/json": {"schema": schema_of(model)}}}}


def query(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` declaring each field of ``model`` as a query parameter (a ``dict`` field as
    ``name[KEY]=VALUE`` pairs, OpenAPI's deepObject style)."""
    properties = schema_of(model).get("properties", {})
    parameters = []
    for name, field in model.model_fields.items():
        key = field.alias or name
        parameter: dict[str, Any] = {"name": key, "in": "query", "required": field.is_required(),
                                     "schema": _without_null(properties[key])}
        if field.description:
            parameter["description"] = field.description
        if any(get_origin(t) is dict for t in (field.annotation, *get_args(field.annotation))):
            parameter.update(style="deepObject", explode=True)
        parameters.append(parameter)
    return {"parameters": parameters}


def _without_null(schema: dict[str, Any]) -> dict[str, Any]:
    """A query parameter is absent or a string: ``X | None`` documents as ``X``."""
    if "anyOf" not in schema:
        return schema
    variants = [v for v in schema["anyOf"] if v.get("type") != "null"]
    rest = {k: v for k, v in schema.items() if k != "anyOf" and not (k == "default" and v is None)}
    return {**rest, **variants[0]} if len(variants) == 1 else {**rest, "anyOf": variants}


def schema_of(model: type[BaseModel]) -> dict[str, Any]:
    """The model's JSON schema with its ``$defs`` inlined (a ``$ref`` inside an operation would point at the
    document's root, where they are not)."""
    schema = model.model_json_schema()
    definitions = schema.pop("$defs", {})
    inlined: dict[str, Any] = _inline(schema, definitions)
    return inlined


def _inline(node: Any, definitions: dict[str, Any]) -> Any:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            target = _inline(definitions[ref.removeprefix("#/$defs/")], definitions)
            return {**target, **{k: _inline(v, definitions) for k, v in node.items() if k != "$ref"}}
        return {k: _inline(v, definitions) for k, v in node.items()}
    if isinstance(node, list):
        return [_inline(item, definitions) for item in node]
    return node


def openapi_document(app: FastAPI, forwarded: Iterable[APIRouter]) -> dict[str, Any]:
    """The app's own routes and the ``forwarded`` routers' (served elsewhere under the same paths), once."""
    if app.openapi_schema is None:
        routes = [*app.routes, *(route for router in forwarded for route in router.routes)]
        app.openapi_schema = get_openapi(title=app.title, version=app.version, routes=routes,
                                         description="The OpenAI API, Stored Completions, and Flywheel's own "
                                                     "feedback, trajectory, training and admin APIs.")
    return app.openapi_schema

