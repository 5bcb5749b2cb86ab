"""A fast OpenAI-compatible mock upstream with a fixed reply, for benchmarks.

    python -m bench.mock_openai_server --port 8001
    curl -s 127.0.0.1:8001/v1/chat/completions \\
        -d '{"model": "m", "messages": [{"role": "user", "content": "hi"}], "return_token_ids": true}'

It answers like vLLM, so the gateway sees what it sees in production:

- ``POST /v1/chat/completions`` and ``POST /v1/completions``: always the same five-token
  reply. ``stream: true`` gives one ``chat.completion.chunk`` / ``text_completion`` event per
  token (same ``id`` and ``created``), a usage chunk when ``stream_options.include_usage``,
  then ``data: [DONE]``. ``return_token_ids`` adds ``prompt_token_ids`` and
  ``choices[].token_ids`` (fixed ids); ``logprobs`` / ``top_logprobs`` add fixed logprobs.
- ``GET /v1/models``: one model, ``mock-model``.

It is a raw asyncio protocol on uvloop with httptools' parser (the parser uvicorn uses):
the request body is parsed with orjson for the few fields that change the reply, and the
whole HTTP response, headers included, is rendered once per variant and cached and written
with one ``write``. That makes it ~3x cheaper per request than uvicorn serving the same
bytes from a bare ASGI app (0.037 vs 0.110 ms of CPU; docs/benchmarks.md), so in a gateway
benchmark nearly all the time is the gateway's. HTTP/1.1 keep-alive; no pipelining while
``--token-delay-ms`` spaces out a stream.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import httptools
import orjson

MODEL = "mock-model"
COMPLETION_ID = "cmpl-mock0000000000000000"  # one id for every reply: the mock keeps no state
CREATED = 1_700_000_000
TOKENS = ("Hello", " from", " the", " mock", ".")
TOKEN_IDS = (9707, 504, 279, 7860, 13)
PROMPT_TOKEN_IDS = (151644, 872, 198, 9707, 151645, 198, 151644, 77091, 198)
LOGPROB = -0.125  # every sampled token's logprob
USAGE = {"prompt_tokens": len(PROMPT_TOKEN_IDS), "completion_tokens": len(TOKENS),
         "total_tokens": len(PROMPT_TOKEN_IDS) + len(TOKENS)}

Body = dict[str, Any]
VariantKey = tuple[bytes, bool, bool, bool, int | None, str]  # path, stream, usage, ids, logprobs, model


# ---------------------------------------------------------------------------------------------
# What the reply looks like (vLLM's flavour of the OpenAI API)
# ---------------------------------------------------------------------------------------------

def chat_logprobs(tokens: tuple[str, ...], top: int) -> Body:
    """``choices[].logprobs`` of a chat reply: one entry per token, ``top`` alternatives each."""
    def entry(token: str) -> Body:
        return {"token": token, "logprob": LOGPROB, "bytes": list(token.encode())}

    return {"content": [{**entry(t), "top_logprobs": [entry(t)] * top} for t in tokens]}


def completion_logprobs(tokens: tuple[str, ...], offset: int = 0) -> Body:
    """``choices[].logprobs`` of a legacy completion (tokens, token_logprobs, top_logprobs)."""
    offsets, at = [], offset
    for token in tokens:
        offsets.append(at)
        at += len(token)
    return {"text_offset": offsets, "token_logprobs": [LOGPROB] * len(tokens), "tokens": list(tokens),
            "top_logprobs": [{t: LOGPROB} for t in tokens]}


def chat_completion(model: str, token_ids: bool, logprobs: int | None) -> Body:
    """A non-streaming ``chat.completion``; ``logprobs`` is None (off) or the top_logprobs count."""
    choice: Body = {"index": 0,
                    "message": {"role": "assistant", "content": "".join(TOKENS), "refusal": None,
                                "tool_calls": []},
                    "logprobs": chat_logprobs(TOKENS, logprobs) if logprobs is not None else None,
                    "finish_reason": "stop", "stop_reason": None}
    reply: Body = {"id": "chat" + COMPLETION_ID, "object": "chat.completion", "created": CREATED,
                   "model": model, "choices": [choice], "usage": USAGE}
    if token_ids:
        choice["token_ids"] = list(TOKEN_IDS)
        reply["prompt_token_ids"] = list(PROMPT_TOKEN_IDS)
    return reply


def text_completion(model: str, token_ids: bool, logprobs: int | None) -> Body:
    """A non-streaming legacy ``text_completion`` (vLLM puts prompt_token_ids per choice)."""
    choice: Body = {"index": 0, "text": "".join(TOKENS),
                    "logprobs": completion_logprobs(TOKENS) if logprobs is not None else None,
                    "finish_reason": "stop", "stop_reason": None}
    if token_ids:
        choice["prompt_token_ids"] = list(PROMPT_TOKEN_IDS)
        choice["token_ids"] = list(TOKEN_IDS)
    return {"id": COMPLETION_ID, "object": "text_completion", "created": CREATED, "model": model,
            "choices": [choice], "usage": USAGE}


def chat_chunks(model: str, usage: bool, token_ids: bool, logprobs: int | None) -> list[Body]:
    """The events of a streamed chat reply: role, one per token (the last one stops), usage."""
    base = {"id": "chat" + COMPLETION_ID, "object": "chat.completion.chunk", "created": CREATED, "model": model}
    first: Body = {**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}]}
    if token_ids:
        first["prompt_token_ids"] = list(PROMPT_TOKEN_IDS)
    chunks = [first]
    for i, (token, token_id) in enumerate(zip(TOKENS, TOKEN_IDS, strict=True)):
        choice: Body = {"index": 0, "delta": {"content": token},
                        "logprobs": chat_logprobs((token,), logprobs) if logprobs is not None else None,
                        "finish_reason": "stop" if i == len(TOKENS) - 1 else None}
        if token_ids:
            choice["token_ids"] = [token_id]
        chunks.append({**base, "choices": [choice]})
    if usage:
        chunks.append({**base, "choices": [], "usage": USAGE})
    return chunks


def completion_chunks(model: str, usage: bool, token_ids: bool, logprobs: int | None) -> list[Body]:
    """The events of a streamed legacy completion: one per token, then usage."""
    base = {"id": COMPLETION_ID, "object": "text_completion", "created": CREATED, "model": model}
    chunks, offset = [], 0
    for i, (token, token_id) in enumerate(zip(TOKENS, TOKEN_IDS, strict=True)):
        choice: Body = {"index": 0, "text": token,
                        "logprobs": completion_logprobs((token,), offset) if logprobs is not None else None,
                        "finish_reason": "stop" if i == len(TOKENS) - 1 else None, "stop_reason": None}
        if token_ids:
            if i == 0:
                choice["prompt_token_ids"] = list(PROMPT_TOKEN_IDS)
            choice["token_ids"] = [token_id]
        chunks.append({**base, "choices": [choice]})
        offset += len(token)
    if usage:
        chunks.append({**base, "choices": [], "usage": USAGE})
    return chunks


# ---------------------------------------------------------------------------------------------
# HTTP: whole responses rendered once per variant, then cached
# ---------------------------------------------------------------------------------------------

def http_response(status: int, body: bytes, content_type: bytes = b"application/json") -> bytes:
    reason = {200: b"OK", 400: b"Bad Request", 404: b"Not Found", 405: b"Method Not Allowed"}[status]
    return (b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n"
            % (status, reason, content_type, len(body)) + body)


def sse_events(chunks: list[Body]) -> list[bytes]:
    """Each event as one HTTP/1.1 chunk (``transfer-encoding: chunked``), ``[DONE]`` last."""
    events = [b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks] + [b"data: [DONE]\n\n"]
    return [b"%x\r\n%s\r\n" % (len(e), e) for e in events]


SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n" \
           b"transfer-encoding: chunked\r\n\r\n"
SSE_END = b"0\r\n\r\n"


def error_response(status: int, message: str) -> bytes:
    error = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}}
    return http_response(status, orjson.dumps(error))


MODELS_RESPONSE = http_response(200, orjson.dumps(
    {"object": "list", "data": [{"id": MODEL, "object": "model", "created": CREATED, "owned_by": "mock",
                                 "root": MODEL, "parent": None, "max_model_len": 4096}]}))

_cache: dict[VariantKey, list[bytes]] = {}


def variant(path: bytes, body: Body) -> VariantKey:
    """The request fields that change the reply."""
    chat = path.endswith(b"/chat/completions")
    logprobs = body.get("logprobs")
    if chat:
        top = body.get("top_logprobs")
        n_top = top if isinstance(top, int) and 0 <= top <= 20 else 0
        logprobs_key = n_top if logprobs else None
    else:
        logprobs_key = logprobs if isinstance(logprobs, int) and not isinstance(logprobs, bool) else None
    model = body.get("model")
    return (path, bool(body.get("stream")), bool((body.get("stream_options") or {}).get("include_usage")),
            bool(body.get("return_token_ids")), logprobs_key, model if isinstance(model, str) else MODEL)


def render(key: VariantKey) -> list[bytes]:
    """The response for one variant, as the pieces written one after another (one for JSON)."""
    path, stream, usage, token_ids, logprobs, model = key
    chat = path.endswith(b"/chat/completions")
    if not stream:
        reply = (chat_completion if chat else text_completion)(model, token_ids, logprobs)
        return [http_response(200, orjson.dumps(reply))]
    chunks = (chat_chunks if chat else completion_chunks)(model, usage, token_ids, logprobs)
    events = sse_events(chunks)
    return [SSE_HEAD + events[0], *events[1:-1], events[-1] + SSE_END]


def respond(method: bytes, path: bytes, raw_body: bytes) -> list[bytes]:
    """The response pieces for one request."""
    path = path.split(b"?", 1)[0]
    if path in (b"/v1/chat/completions", b"/v1/completions"):
        if method != b"POST":
            return [error_response(405, "Method Not Allowed")]
        try:
            body = orjson.loads(raw_body)
        except orjson.JSONDecodeError as exc:
            return [error_response(400, f"invalid JSON body: {exc}")]
        if not isinstance(body, dict):
            return [error_response(400, "the body must be a JSON object")]
        key = variant(path, body)
        pieces = _cache.get(key)
        if pieces is None:
            if len(_cache) > 4096:  # many model names: stay bounded
                _cache.clear()
            pieces = _cache[key] = render(key)
        return pieces
    if path == b"/v1/models" and method == b"GET":
        return [MODELS_RESPONSE]
    return [error_response(404, f"no route for {path.decode(errors='replace')}")]


class MockOpenAIProtocol(asyncio.Protocol):
    """One keep-alive connection: parse with httptools, answer from the cache."""

    def __init__(self, token_delay_s: float = 0.0) -> None:
        self.token_delay_s = token_delay_s
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not an asyncio.Transport

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            assert self.transport is not None
            self.transport.write(error_response(400, "malformed HTTP request"))
            self.transport.close()

    # httptools callbacks
    def on_message_begin(self) -> None:
        self.url = b""
        self.body = []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        transport = self.transport
        assert transport is not None
        pieces = respond(self.parser.get_method(), self.url, b"".join(self.body))
        keep_alive = self.parser.should_keep_alive()
        if len(pieces) == 1 or self.token_delay_s <= 0:
            transport.write(b"".join(pieces))  # one write: no partial-segment latency
            if not keep_alive:
                transport.close()
            return
        transport.pause_reading()  # no pipelining while a slow stream is being written
        asyncio.get_running_loop().create_task(self._slow_stream(pieces, keep_alive))

    async def _slow_stream(self, pieces: list[bytes], keep_alive: bool) -> None:
        assert self.transport is not None
        for i, piece in enumerate(pieces):
            if i:
                await asyncio.sleep(self.token_delay_s)
            if self.transport.is_closing():
                return
            self.transport.write(piece)
        if keep_alive:
            self.transport.resume_reading()
        else:
            self.transport.close()


async def serve(host: str = "127.0.0.1", port: int = 0, *, token_delay_s: float = 0.0) -> asyncio.Server:
    """Start listening (``port=0``: a free one, see ``server.sockets[0].getsockname()``)."""
    loop = asyncio.get_running_loop()
    return await loop.create_server(lambda: MockOpenAIProtocol(token_delay_s), host, port, backlog=1024)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (loopback by default)")
    parser.add_argument("--port", type=int, default=8001, help="port to listen on")
    parser.add_argument("--token-delay-ms", type=float, default=0.0,
                        help="streaming: pause between events (0: write the whole stream at once)")
    args = parser.parse_args()

    async def run() -> None:
        server = await serve(args.host, args.port, token_delay_s=args.token_delay_ms / 1000)
        print(f"mock OpenAI upstream on http://{args.host}:{args.port}/v1", flush=True)
        async with server:
            await server.serve_forever()

    try:
        import uvloop
    except ImportError:  # plain asyncio works too, a little slower
        asyncio.run(run())
    else:
        uvloop.run(run())


if __name__ == "__main__":
    main()
