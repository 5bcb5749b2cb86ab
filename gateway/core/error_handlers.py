"""Every error either process's HTTP API reports goes out in OpenAI's shape (``flywheel.gateway.core.errors``)."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

from flywheel.gateway.core.errors import BadRequest, OpenAIError
from flywheel.gateway.core.metrics import GatewayMetrics
from flywheel.gateway.core.protocol import format_param

log = logging.getLogger("flywheel.api")


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(OpenAIError, _openai_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _unexpected_error)


def _error_response(request: Request, exc: OpenAIError) -> Response:
    metrics: GatewayMetrics | None = getattr(request.app.state, "metrics", None)
    if metrics is not None:
        metrics.errors.labels(str(exc.status_code), str(exc.code)).inc()
    return Response(exc.to_json(), status_code=exc.status_code, media_type="application/json")


async def _openai_error(request: Request, exc: OpenAIError) -> Response:
    return _error_response(request, exc)


async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
    error = exc.errors()[0]
    param = format_param(tuple(p for p in error["loc"] if p != "body"))
    return _error_response(request, BadRequest(f"Invalid value for '{param}': {error['msg']}", param=param))


async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
    error = OpenAIError(str(exc.detail), status_code=exc.status_code, error_type="invalid_request_error",
                        code="not_found" if exc.status_code == 404 else None)
    return _error_response(request, error)


async def _unexpected_error(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    body = OpenAIError("The server had an error while processing your request.").to_dict()
    return JSONResponse(body, status_code=500)
