"""A small real OpenAI-compatible server whose replies a test scripts.

It runs uvicorn in a background thread on a free loopback port. Each request to
``/v1/chat/completions`` is answered by the test's ``reply`` function, which gets
the request body and returns a :class:`Reply`: the assistant message, the finish
reason, and how to misbehave (HTTP status, a delay, a stream that breaks or stalls
after some chunks). Every request body is kept in ``requests`` so tests can assert what
the gateway sent upstream.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from flywheel.gateway.core.processes import free_port


@dataclass
class Reply:
    """What the scripted upstream answers to one request."""

    content: str | None = "ok"
    tool_calls: list[dict[str, Any]] | None = None
    finish_reason: str = "stop"
    status: int = 200  # != 200: answer with an OpenAI error body of this status
    delay_s: float = 0.0  # sleep before answering
    break_after_chunks: int | None = None  # streaming: drop the connection after this many chunks
    stall_after_chunks: int | None = None  # streaming: send nothing more after this many chunks, until hung up on


def sample_text(content: str | None, index: int) -> str | None:
    """The text of choice ``index``: the scripted content, marked for every sample after the first."""
    return content if index == 0 or content is None else f"{content} (sample {index})"


class LoopbackServer:
    """An ASGI app served by uvicorn on a background thread, on ``127.0.0.1:port``."""

    def __init__(self, app: Starlette, port: int, timeout_s: float = 10.0) -> None:
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError(f"server on port {port} did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)


@dataclass
class ScriptedOpenAI:
    reply: Callable[[dict[str, Any]], Reply] = field(default=lambda body: Reply())
    requests: list[dict[str, Any]] = field(default_factory=list)
    port: int = field(default_factory=free_port)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self) -> ScriptedOpenAI:
        self._server = LoopbackServer(Starlette(routes=[
            Route("/v1/chat/completions", self._chat, methods=["POST"]),
            Route("/v1/models", self._models, methods=["GET"])]), self.port)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.stop()

    async def _models(self, request: Request) -> Response:
        return Response(orjson.dumps({"object": "list", "data": [{"id": "scripted", "object": "model"}]}),
                        media_type="application/json")

    async def _chat(self, request: Request) -> Response:
        body = orjson.loads(await request.body())
        self.requests.append(body)
        reply = self.reply(body)
        if reply.delay_s:
            await asyncio.sleep(reply.delay_s)
        if reply.status != 200:
            error = {"error": {"message": f"scripted failure {reply.status}", "type": "server_error",
                               "param": None, "code": None}}
            return Response(orjson.dumps(error), status_code=reply.status, media_type="application/json")
        if body.get("stream"):
            return StreamingResponse(self._chunks(body, reply), media_type="text/event-stream")
        choices = []
        for index in range(int(body.get("n") or 1)):  # choice i > 0 says which sample it is
            message: dict[str, Any] = {"role": "assistant", "content": sample_text(reply.content, index)}
            if reply.tool_calls:
                message["tool_calls"] = reply.tool_calls
            choices.append({"index": index, "message": message, "logprobs": None,
                            "finish_reason": reply.finish_reason, "token_ids": [1, 2, 3]})
        result = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": 1,
                  "model": body["model"], "choices": choices,
                  "usage": {"prompt_tokens": 5, "completion_tokens": 3 * len(choices),
                            "total_tokens": 5 + 3 * len(choices)},
                  "prompt_token_ids": [7, 7, 7, 7, 7]}
        return Response(orjson.dumps(result), media_type="application/json")

    async def _chunks(self, body: dict[str, Any], reply: Reply) -> AsyncIterator[bytes]:
        base = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk", "created": 1,
                "model": body["model"]}
        deltas: list[dict[str, Any]] = [{"role": "assistant", "content": ""}]
        deltas += [{"content": piece} for piece in re.findall(r"\S+\s*", reply.content or "")]
        for index, call in enumerate(reply.tool_calls or ()):
            deltas.append({"tool_calls": [{"index": index, **call}]})
        for sent, delta in enumerate(deltas):
            if reply.break_after_chunks is not None and sent >= reply.break_after_chunks:
                raise ConnectionAbortedError("scripted break")  # uvicorn drops the connection mid-body
            if reply.stall_after_chunks is not None and sent >= reply.stall_after_chunks:
                await asyncio.Event().wait()  # never set: Starlette cancels this when the gateway hangs up
            chunk: dict[str, Any] = {**base, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                                          "finish_reason": None}]}
            if body.get("return_token_ids"):  # vLLM: prompt ids on the first chunk, sampled ids on each
                chunk["choices"][0]["token_ids"] = [] if sent == 0 else [100 + sent]
                if sent == 0:
                    chunk["prompt_token_ids"] = [7, 7, 7, 7, 7]
            yield b"data: " + orjson.dumps(chunk) + b"\n\n"
        yield b"data: " + orjson.dumps({**base, "choices": [{"index": 0, "delta": {}, "logprobs": None,
                                                             "finish_reason": reply.finish_reason}]}) + b"\n\n"
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": 5, "completion_tokens": len(deltas), "total_tokens": 5 + len(deltas)}
            yield b"data: " + orjson.dumps({**base, "choices": [], "usage": usage}) + b"\n\n"
        yield b"data: [DONE]\n\n"
