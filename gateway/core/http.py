"""What every process's HTTP app needs: a bounded body read and a JSON answer."""

from __future__ import annotations

from typing import Any

import orjson
from pydantic_core import to_jsonable_python
from starlette.requests import Request
from starlette.responses import Response

from flywheel.gateway.core.errors import PayloadTooLarge


def json_response(body: Any, status_code: int = 200) -> Response:
    """``body`` as JSON; the store interface's models (``core/store_api.py``) in it as pydantic dumps them."""
    return Response(orjson.dumps(body, default=to_jsonable_python), status_code=status_code,
                    media_type="application/json")


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body, refusing (413) anything over ``limit`` bytes before reading it all."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"Request body is {declared} bytes; the limit is {limit}.")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"Request body is over the limit of {limit} bytes.")
        chunks.append(chunk)
    return b"".join(chunks)
