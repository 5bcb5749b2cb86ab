"""The OpenAI-compatible surface: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``.

Routes are thin: authenticate, parse and validate, resolve the alias, call the engine,
shape the answer for the client. The gateway always asks the engine for what training
needs (exact token ids, logprobs, stream usage) and removes from the client's copy
whatever the client did not ask for, so clients see plain OpenAI responses.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import TypeVar

import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from flywheel.capture.assembler import StreamAssembler
from flywheel.capture.turns import CapturedExchange, turn_position
from flywheel.gateway.core.errors import OpenAIError, UpstreamError
from flywheel.gateway.core.http import read_body
from flywheel.gateway.core.openapi import ERRORS, json_body
from flywheel.gateway.core.protocol import ChatCompletionRequest, CompletionRequest, parse_request
from flywheel.gateway.serving import cross_fork
from flywheel.gateway.serving.canary import CanarySplit
from flywheel.gateway.serving.capture_plan import CapturePlan, flywheel_headers, plan_capture
from flywheel.gateway.serving.cross_fork import CrossFork
from flywheel.gateway.serving.engines.base import Body, Chunk
from flywheel.gateway.serving.gateway_state import GatewayState
from flywheel.gateway.serving.served_model import ServedModel
from flywheel.gateway.serving.store_link import StoreLink

log = logging.getLogger("flywheel.api")
router = APIRouter()
T = TypeVar("T")

_JSON_MEDIA = "application/json"
_SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}
_DONE = b"data: [DONE]\n\n"
DISCONNECTED = "client_disconnected"  # finish_reason of a captured choice whose client left mid-stream
DISCONNECTED_STATUS = "499"  # /metrics status of such a stream (nginx's "client closed request")


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
        raw = await read_body(request, state.settings.max_body_bytes)
        body = await parse_request(raw, ChatCompletionRequest if endpoint is Endpoint.CHAT else CompletionRequest)
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
        position = 0 if endpoint is Endpoint.COMPLETIONS else turn_position(body["messages"])
        plan = plan_capture(request, state.settings.capture, state.settings.groups, endpoint=endpoint.value,
                            served=served, requested_model=body["model"], client_key_id=key_id, started=started,
                            position=position, fork_share=state.fork_yield.share(alias, position))
        sides: list[CrossFork] = []
        if plan is not None and plan.fork_k:  # k extra samples of the same context; the client sees its n
            client_n = int(body.get("n") or 1)
            asks = replace(asks, choices=client_n)
            siblings = plan.fork_k
            if canary is not None:  # one more, from the other version: the canary's same-context pair, not trained on
                other = state.router.get(alias) if served is canary.served else canary.served
                sides.append(CrossFork.start(to_engine, other, client_n + siblings))
            head = state.router.explorers.get(alias)
            distinct = state.settings.groups.fork_draw == "without_replacement"
            if head is not None and siblings and head.version != served.version:  # samples of the policy in training
                sides.append(CrossFork.start(to_engine, head, client_n, siblings, kind="head",
                                             without_replacement=distinct))
                siblings = 0
            elif distinct and siblings > 1 and served.engine.draws_without_replacement:
                sides.append(CrossFork.start(to_engine, served, client_n, siblings, kind="drawn",
                                             without_replacement=True))
                siblings = 0
            to_engine["n"] = client_n + siblings
        if body.get("stream"):
            return await _stream(state, served, endpoint, to_engine, asks, body, started, plan, canary, len(raw),
                                 sides)
        served.in_flight += 1
        try:
            answer = served.engine.chat(to_engine) if endpoint is Endpoint.CHAT else served.engine.completion(to_engine)
            result = await unless_client_leaves(request.receive, answer)
        finally:
            served.in_flight -= 1
    except OpenAIError as exc:
        state.metrics.requests.labels(endpoint.value, alias, str(exc.status_code)).inc()
        raise
    except ClientLeft:
        state.metrics.requests.labels(endpoint.value, alias, DISCONNECTED_STATUS).inc()
        return Response(status_code=int(DISCONNECTED_STATUS))  # nobody reads it: uvicorn drops it
    state.metrics.count_usage(alias, result.get("usage"))
    if canary is not None:
        remember_answers(canary, result, served is canary.served)
    content = orjson.dumps(shape_for_client(result, asks, body["model"]))
    state.metrics.requests.labels(endpoint.value, alias, "200").inc()
    state.metrics.latency.labels(endpoint.value, alias).observe(time.perf_counter() - started)
    if plan is None:
        return Response(content, media_type=_JSON_MEDIA)
    return RecordedResponse(content, state.store_link, plan.exchange(body, result), len(raw), sides)


class ClientLeft(Exception):
    """The client hung up before its non-streaming answer was ready."""


async def unless_client_leaves(receive: Receive, answer: Awaitable[T]) -> T:
    """The engine's answer, unless the client hangs up first: the answer is then cancelled, which stops the
    generation nobody would read (the local engine drops the job; the upstream request is closed).

    One watcher task that cancels this one, not two tasks raced: the cheaper (docs/benchmarks.md).
    """
    task = asyncio.current_task()
    assert task is not None
    waiting = True

    def hung_up(watcher: asyncio.Future[None]) -> None:
        if waiting and not watcher.cancelled() and watcher.exception() is None:
            task.cancel()

    watcher = asyncio.ensure_future(_hangup(receive))
    watcher.add_done_callback(hung_up)
    try:
        return await answer
    except asyncio.CancelledError:
        if watcher.done() and not watcher.cancelled() and task.uncancel() == 0:
            raise ClientLeft from None
        raise  # cancelled from elsewhere (shutdown)
    finally:
        waiting = False  # a hang-up noticed from now on cancels nothing
        watcher.cancel()


async def _hangup(receive: Receive) -> None:
    # The body has been read: what the server sends next is http.disconnect, when the client goes.
    while (await receive())["type"] != "http.disconnect":
        pass


class RecordedResponse(Response):
    """A JSON response whose exchange goes to the store link once its last byte is sent.

    Not a ``BackgroundTask``: that one inspects its callable on every request to decide between
    the event loop and a worker thread.
    """

    media_type = _JSON_MEDIA

    def __init__(self, content: bytes, store_link: StoreLink, exchange: CapturedExchange, request_bytes: int,
                 sides: Sequence[CrossFork] = ()) -> None:
        super().__init__(content)
        self.store_link = store_link
        self.exchange = exchange
        self.request_bytes = request_bytes
        self.sides = sides

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await super().__call__(scope, receive, send)
        cross_fork.submit(self.store_link, self.exchange, self.request_bytes, self.sides)


async def _stream(state: GatewayState, served: ServedModel, endpoint: Endpoint, to_engine: Body,
                  asks: ClientAsks, body: Body, started: float, plan: CapturePlan | None,
                  canary: CanarySplit | None, request_bytes: int, sides: Sequence[CrossFork] = ()) -> Response:
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
    on_candidate = canary is not None and served is canary.served
    stream_end = (StreamEnd(endpoint, body, request_bytes, plan, canary, on_candidate, sides)
                  if plan is not None or canary is not None else None)
    return EventStream(_sse_events(state, served, endpoint, first, chunks, asks, body, started, stream_end))


class EventStream(StreamingResponse):
    """SSE whose event generator is closed the moment the response ends, also when the client left mid-stream.

    On ``http.disconnect`` Starlette stops iterating; closing the generator now runs its cleanup (cancel the
    engine's generation, count and record the truncated turn) instead of whenever it is garbage-collected.
    """

    def __init__(self, events: AsyncGenerator[bytes, None]) -> None:
        super().__init__(events, media_type="text/event-stream", headers=_SSE_HEADERS)
        self.events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.events.aclose()


@dataclass(slots=True)
class StreamEnd:
    """A stream's response put back together chunk by chunk, for capture and the canary split."""

    endpoint: Endpoint
    body: Body
    request_bytes: int
    plan: CapturePlan | None
    canary: CanarySplit | None
    on_candidate: bool
    sides: Sequence[CrossFork] = ()  # siblings another version answers (cross_fork), joined when they are in
    assembler: StreamAssembler = field(init=False)

    def __post_init__(self) -> None:
        self.assembler = StreamAssembler(self.endpoint.value)

    def finish(self, store_link: StoreLink, *, truncated: bool) -> None:
        """Capture the exchange; a truncated one ends every unfinished choice with :data:`DISCONNECTED`, and
        only a whole answer keeps its conversation on its canary arm (the client never saw the rest)."""
        response = self.assembler.response()
        if truncated:
            for choice in response["choices"]:
                choice["finish_reason"] = choice["finish_reason"] or DISCONNECTED
        elif self.canary is not None:
            remember_answers(self.canary, response, self.on_candidate)
        if self.plan is not None:
            cross_fork.submit(store_link, self.plan.exchange(self.body, response), self.request_bytes, self.sides)


async def _sse_events(state: GatewayState, served: ServedModel, endpoint: Endpoint, first: Chunk,
                      chunks: AsyncIterator[Chunk], asks: ClientAsks, body: Body, started: float,
                      stream_end: StreamEnd | None) -> AsyncGenerator[bytes, None]:
    """OpenAI's SSE framing; a failure mid-stream becomes an error event, then ``[DONE]``.

    A client that goes away mid-stream (the generator is cancelled or closed before its end) is counted
    under :data:`DISCONNECTED_STATUS`, its turn recorded as far as it got, and the engine's stream closed,
    which stops the generation (the local engine drops the job; the upstream request is closed).
    """
    status = "200"
    ended = False  # the engine's stream ended, well or with an error: anything else is a disconnect
    try:
        chunk: Chunk | None = first
        while chunk is not None:
            if not chunk.get("choices"):
                state.metrics.count_usage(served.alias, chunk.get("usage"))
            if stream_end is not None:
                stream_end.assembler.add(chunk)
            if asks.choices is not None and chunk.get("usage") and stream_end is not None:
                chunk = {**chunk, "usage": usage_of(chunk["usage"]["prompt_tokens"],
                                                    stream_end.assembler.completion_tokens(below=asks.choices))}
            shaped = _shape_chunk(chunk, asks, body["model"])
            if shaped is not None:
                yield b"data: " + orjson.dumps(shaped) + b"\n\n"
            chunk = await anext(chunks, None)
        ended = True
    except OpenAIError as exc:
        ended, status = True, str(exc.status_code)
        state.metrics.errors.labels(status, str(exc.code)).inc()
        yield b"data: " + exc.to_json() + b"\n\n"
    except Exception:
        log.exception("stream failed after it started")
        ended, status = True, "500"
        yield b"data: " + UpstreamError("the engine failed while streaming").to_json() + b"\n\n"
    finally:
        served.in_flight -= 1
        if not ended:
            status = DISCONNECTED_STATUS
            if stream_end is not None:
                stream_end.finish(state.store_link, truncated=True)
        state.metrics.requests.labels(endpoint.value, served.alias, status).inc()
        state.metrics.latency.labels(endpoint.value, served.alias).observe(time.perf_counter() - started)
        await chunks.aclose()  # type: ignore[attr-defined]  # last: nothing above may be skipped if it raises
    try:
        yield _DONE
    finally:  # after the last byte went out, or when the client left just before it
        if stream_end is not None and status == "200":
            stream_end.finish(state.store_link, truncated=False)


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

