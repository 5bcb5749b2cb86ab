"""Every JSON body the store process receives is redacted before a route reads it.

The store process writes what its routes are sent — feedback comments, Stored Completions
metadata, a close reason, the loop's job errors and decisions (``/internal/ops``) — so one pass
here covers them all, the next route included, with the same rules as captured turns
(``capture/redaction.py``): an id redacted at capture is redacted the same way here, and a
lookup by it still finds the row.
"""

from __future__ import annotations

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from flywheel.capture.redaction import Redactor


class RedactedBodies:
    """ASGI middleware: the request body, when it is JSON, with every string redacted (keys and values)."""

    def __init__(self, app: ASGIApp, redactor: Redactor | None) -> None:
        self.app = app
        self.redactor = redactor

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.redactor is None or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        chunks = []
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left: let the route see it
                await self.app(scope, _replay(message, receive), send)
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        body = self._redacted(b"".join(chunks))
        headers = [(k, v) for k, v in scope["headers"] if k != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        await self.app({**scope, "headers": headers},
                       _replay({"type": "http.request", "body": body, "more_body": False}, receive), send)

    def _redacted(self, body: bytes) -> bytes:
        assert self.redactor is not None
        try:
            value = orjson.loads(body)
        except orjson.JSONDecodeError:
            return body  # not JSON: the route answers 400 itself
        redacted = self.redactor.json(value)
        return body if redacted is value else orjson.dumps(redacted)


def _replay(first: Message, receive: Receive) -> Receive:
    """``first``, then whatever the connection says next (a disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return first
        return await receive()

    return replay
