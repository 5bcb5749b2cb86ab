"""The OpenAI-compatible surface: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``.

Routes are thin: authenticate, parse and validate, resolve the alias, call the engine,
shape the answer for the client. The gateway always asks the engine for what training
needs (exact token ids, logprobs, stream usage) and removes from the client's copy
whatever the client did not ask for, so clients see plain OpenAI responses.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from enum import StrEnum

import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from capture.assembler import StreamAssembler
from capture.turns import CapturedExchange
from gateway.api.common import read_body
from gateway.api.openapi import ERRORS, json_body
from gateway.engines.base import Body, Chunk
from gateway.errors import OpenAIError, UpstreamError
from gateway.loop.canary import CanarySplit
from gateway.protocol import ChatCompletionRequest, CompletionRequest, parse_json_object, validate_request
from gateway.routing import ServedModel
from gateway.state import GatewayState
from gateway.store.capture_plan import CapturePlan, flywheel_headers, plan_capture
from gateway.store.link import StoreLink

log = logging.getLogger("flywheel.api")
router = APIRouter()

_JSON_MEDIA = "application/json"
_SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}
_DONE = b"data: [DONE]\n\n"


class Endpoint(StrEnum):
    CHAT = "chat.completions"
    COMPLETIONS = "completions"


@dataclass(frozen=True, slots=True)
class ClientAsks:
    """What the client asked to see of the extras the gateway always requests."""

    token_ids: bool
    logprobs: bool
    usage: bool  # streaming only: the final usage chunk
    choices: int | None = None  # forked request: the client sees only choices below this index

    @classmethod
    def of(cls, body: Body, endpoint: Endpoint) -> ClientAsks:
        logprobs = body.get("logprobs")
        options = body.get("stream_options") or {}
        return cls(token_ids=bool(body.get("return_token_ids")),
                   logprobs=bool(logprobs) if endpoint is Endpoint.CHAT else logprobs is not None,
                   usage=bool(options.get("include_usage")))


def engine_request(body: Body, served: ServedModel, endpoint: Endpoint) -> Body:
    """The client's request as sent to the engine: its model name, plus token ids and logprobs."""
    out = dict(body)
    out["model"] = served.engine_model
    out["return_token_ids"] = True
    if endpoint is Endpoint.CHAT:
        out["logprobs"] = True
    elif out.get("logprobs") is None:
        out["logprobs"] = 0  # legacy completions: 0 = the sampled token's logprob only
    if out.get("stream"):
        out["stream_options"] = {**(out.get("stream_options") or {}), "include_usage": True}
    return out


def shape_for_client(payload: Body, asks: ClientAsks, requested_model: str) -> Body:
    """A copy without the extras the client did not ask for, under the model name it sent."""
    out = {**payload, "model": requested_model}
    if not asks.token_ids:
        out.pop("prompt_token_ids", None)
    if asks.choices is not None and out.get("choices"):
        out["choices"] = [c for c in out["choices"] if c.get("index", 0) < asks.choices]
        if out.get("usage") and all(c.get("token_ids") is not None for c in out["choices"]):
            out["usage"] = usage_of(out["usage"]["prompt_tokens"], sum(len(c["token_ids"]) for c in out["choices"]))
    if out.get("choices") and not (asks.token_ids and asks.logprobs):
        out["choices"] = [_shape_choice(choice, asks) for choice in out["choices"]]
    return out


def usage_of(prompt_tokens: int, completion_tokens: int) -> Body:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _shape_choice(choice: Body, asks: ClientAsks) -> Body:
    out = dict(choice)
    if not asks.token_ids:
        out.pop("token_ids", None)
        out.pop("prompt_token_ids", None)
    if not asks.logprobs and "logprobs" in out:
        out["logprobs"] = None
    return out


@router.post("/v1/chat/completions", openapi_extra=json_body(ChatCompletionRequest), responses=ERRORS)
async def create_chat_completion(request: Request) -> Response:
    return await _generate(request, Endpoint.CHAT)


@router.post("/v1/completions", openapi_extra=json_body(CompletionRequest), responses=ERRORS)
async def create_completion(request: Request) -> Response:
    return await _generate(request, Endpoint.COMPLETIONS)


@router.get("/v1/models", responses=ERRORS)
async def list_models(request: Request) -> Response:
    state = GatewayState.of(request)
    state.auth.client(request)
    data = [_model_card(state, served.alias) for served in state.router.all()]
    return Response(orjson.dumps({"object": "list", "data": data}), media_type=_JSON_MEDIA)


@router.get("/v1/models/{model_id:path}", responses=ERRORS)
async def retrieve_model(model_id: str, request: Request) -> Response:
    state = GatewayState.of(request)
    state.auth.client(request)
    state.router.get(model_id)
    return Response(orjson.dumps(_model_card(state, model_id)), media_type=_JSON_MEDIA)


def _model_card(state: GatewayState, alias: str) -> Body:
    return {"id": alias, "object": "model", "created": state.started_at, "owned_by": "flywheel"}


async def _generate(request: Request, endpoint: Endpoint) -> Response:
    state = GatewayState.of(request)
    started = time.perf_counter()
    alias = ""
    try:
        key_id = state.auth.client(request)
        body = parse_json_object(await read_body(request, state.settings.max_body_bytes))
        validate_request(ChatCompletionRequest if endpoint is Endpoint.CHAT else CompletionRequest, body)
        served = state.router.resolve(body["model"])
        alias = served.alias
        canary = state.router.canaries.get(alias) if endpoint is Endpoint.CHAT else None
        if canary is not None:
            trajectory_id = flywheel_headers(request).get("trajectory-id") or (body.get("metadata") or {}).get(
                "trajectory_id")
            on_candidate, _ = canary.assign(body["messages"], trajectory_id)
            served = canary.served if on_candidate else served
        asks = ClientAsks.of(body, endpoint)
        to_engine = engine_request(body, served, endpoint)
        plan = plan_capture(request, state.settings.capture, state.settings.groups, endpoint=endpoint.value,
                            served=served, requested_model=body["model"], client_key_id=key_id, started=started)
        if plan is not None and plan.fork_k:  # k extra samples of the same context; the client sees its n
            client_n = int(body.get("n") or 1)
            asks = replace(asks, choices=client_n)
            to_engine["n"] = client_n + plan.fork_k
        if body.get("stream"):
            return await _stream(state, served, endpoint, to_engine, asks, body, started, plan, canary)
        served.in_flight += 1
        try:
            if endpoint is Endpoint.CHAT:
                result = await served.engine.chat(to_engine)
            else:
                result = await served.engine.completion(to_engine)
        finally:
            served.in_flight -= 1
    except OpenAIError as exc:
        state.metrics.requests.labels(endpoint.value, alias, str(exc.status_code)).inc()
        raise
    state.metrics.count_usage(alias, result.get("usage"))
    if canary is not None:
        remember_answers(canary, result, served is canary.served)
    content = orjson.dumps(shape_for_client(result, asks, body["model"]))
    state.metrics.requests.labels(endpoint.value, alias, "200").inc()
    state.metrics.latency.labels(endpoint.value, alias).observe(time.perf_counter() - started)
    if plan is None:
        return Response(content, media_type=_JSON_MEDIA)
    return RecordedResponse(content, state.store_link, plan.exchange(body, result))


class RecordedResponse(Response):
    """A JSON response whose exchange goes to the store link once its last byte is sent.

    Not a ``BackgroundTask``: that one inspects its callable on every request (~1% of the
    gateway's CPU at saturation) to decide between the event loop and a worker thread.
    """

    media_type = _JSON_MEDIA

    def __init__(self, content: bytes, store_link: StoreLink, exchange: CapturedExchange) -> None:
        super().__init__(content)
        self.store_link = store_link
        self.exchange = exchange

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await super().__call__(scope, receive, send)
        self.store_link.submit(self.exchange)


async def _stream(state: GatewayState, served: ServedModel, endpoint: Endpoint, to_engine: Body,
                  asks: ClientAsks, body: Body, started: float, plan: CapturePlan | None,
                  canary: CanarySplit | None) -> Response:
    """Start the engine's stream; errors before its first chunk are plain HTTP errors."""
    if endpoint is Endpoint.CHAT:
        chunks = served.engine.chat_stream(to_engine)
    else:
        chunks = served.engine.completion_stream(to_engine)
    served.in_flight += 1
    try:
        first = await anext(chunks)
    except StopAsyncIteration:
        served.in_flight -= 1
        raise UpstreamError("the engine ended the stream without sending anything") from None
    except BaseException:
        served.in_flight -= 1
        await chunks.aclose()  # type: ignore[attr-defined]
        raise
    state.metrics.first_chunk.labels(endpoint.value, served.alias).observe(time.perf_counter() - started)
    events = _sse_events(state, served, endpoint, first, chunks, asks, body, started, plan, canary)
    return StreamingResponse(events, media_type="text/event-stream", headers=_SSE_HEADERS)


async def _sse_events(state: GatewayState, served: ServedModel, endpoint: Endpoint, first: Chunk,
                      chunks: AsyncIterator[Chunk], asks: ClientAsks, body: Body, started: float,
                      plan: CapturePlan | None, canary: CanarySplit | None) -> AsyncIterator[bytes]:
    """OpenAI's SSE framing; a failure mid-stream becomes an error event, then ``[DONE]``."""
    status = "200"
    assembler = StreamAssembler(endpoint.value) if plan is not None or canary is not None else None
    try:
        chunk: Chunk | None = first
        while chunk is not None:
            if not chunk.get("choices"):
                state.metrics.count_usage(served.alias, chunk.get("usage"))
            if assembler is not None:
                assembler.add(chunk)
            if asks.choices is not None and chunk.get("usage") and assembler is not None:
                chunk = {**chunk, "usage": usage_of(chunk["usage"]["prompt_tokens"],
                                                    assembler.completion_tokens(below=asks.choices))}
            shaped = _shape_chunk(chunk, asks, body["model"])
            if shaped is not None:
                yield b"data: " + orjson.dumps(shaped) + b"\n\n"
            chunk = await anext(chunks, None)
    except OpenAIError as exc:
        status = str(exc.status_code)
        state.metrics.errors.labels(status, str(exc.code)).inc()
        yield b"data: " + exc.to_json() + b"\n\n"
    except Exception:
        log.exception("stream failed after it started")
        status = "500"
        yield b"data: " + UpstreamError("the engine failed while streaming").to_json() + b"\n\n"
    finally:
        served.in_flight -= 1
        await chunks.aclose()  # type: ignore[attr-defined]
        state.metrics.requests.labels(endpoint.value, served.alias, status).inc()
        state.metrics.latency.labels(endpoint.value, served.alias).observe(time.perf_counter() - started)
    yield _DONE
    if assembler is not None and status == "200":  # after the last byte went out
        response = assembler.response()
        if canary is not None:
            remember_answers(canary, response, served is canary.served)
        if plan is not None:
            state.store_link.submit(plan.exchange(body, response))


def remember_answers(canary: CanarySplit, response: Body, on_candidate: bool) -> None:
    """Every choice the client may continue with keeps its conversation on this arm."""
    for choice in response.get("choices") or []:
        canary.remember(choice.get("message"), on_candidate)


def _shape_chunk(chunk: Chunk, asks: ClientAsks, requested_model: str) -> Chunk | None:
    if not chunk.get("choices") and not asks.usage:
        return None  # the usage chunk the gateway asked for, not the client
    shaped = shape_for_client(chunk, asks, requested_model)
    if chunk.get("choices") and not shaped["choices"]:
        return None  # only forked siblings in this chunk
    if not asks.usage:
        shaped.pop("usage", None)
    return shaped

