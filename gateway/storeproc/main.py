"""The store process: owns the store, records captured turns, serves the store-backed routes.

The gateway starts it (:mod:`flywheel.gateway.serving.store_link`) as ``python -m flywheel.gateway.storeproc.main``
with its settings on stdin, and it lives as long as the gateway. Why a process of its own
(docs/gateway.md, "Two processes"): DuckDB lets one process open a file (architecture §8), and
capture's CPU — redaction, hashing, linking, inserts — must not take the GIL from the request
path (docs/benchmarks.md, "How the capture cost came down").

- Ingest: the gateway streams finished exchanges, one JSON line each, over a Unix socket;
  each goes to the recorder (batches, spool, re-ingest: ``capture/recorder.py``). Back on the
  same socket it acknowledges, once per batch, how many of them are durable (written or spooled).
- API: the gateway forwards the store-backed routes here unchanged over a second Unix
  socket (Stored Completions, trajectories, feedback, jobs), and calls the ``/internal``
  routes below for what it composes itself (training rounds, promoted adapters, metrics).
- Jobs: idle trajectories close, groups form (APScheduler).
- Exit: on SIGTERM, or once the gateway is gone (even SIGKILLed), it reads the ingest
  socket to its end, writes what it holds, and exits.
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import logging
import os
import pickle
import signal
import sys
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import APIRouter, FastAPI, Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from flywheel.capture.recorder import Recorder, Spool
from flywheel.capture.store import Store, printable_url
from flywheel.gateway.core.auth import Authenticator
from flywheel.gateway.core.config import Settings
from flywheel.gateway.core.error_handlers import install_error_handlers
from flywheel.gateway.core.errors import BadRequest
from flywheel.gateway.core.http import json_response
from flywheel.gateway.core.log_setup import configure_logging
from flywheel.gateway.core.processes import tune_gc
from flywheel.gateway.core.protocol import parse_json_object
from flywheel.gateway.core.store_wire import (
    CLIENT_HOST_HEADER,
    STORE_KEEPALIVE_S,
    VERSIONS_STAMP_HEADER,
    redactor_for,
)
from flywheel.gateway.core.tracing import Tracing
from flywheel.gateway.storeproc.memory import limit_memory, memory_report
from flywheel.gateway.storeproc.redacted_bodies import RedactedBodies
from flywheel.gateway.storeproc.routes import STORE_ROUTERS
from flywheel.gateway.storeproc.store_api_local import LocalStore, answer
from flywheel.gateway.storeproc.store_state import StoreState
from flywheel.gateway.storeproc.versions import VersionError

log = logging.getLogger("flywheel.store")

_CHUNK = 1 << 20  # ingest socket reads
# capture.link_wait_s unset, shared store: another replica's batch_wait_s, handoff and write, with room to spare
SHARED_LINK_WAIT_S = 5.0


def open_state(settings: Settings) -> StoreState:
    """Open (or migrate, or refuse) the store and build the recorder around it."""
    store = open_store(settings)
    capture = settings.capture
    link_wait_s = capture.link_wait_s if capture.link_wait_s is not None else SHARED_LINK_WAIT_S * store.shared
    limit_memory(store, capture.store_memory_mb)
    recorder = Recorder(store, Spool(settings.spool_path), redactor=redactor_for(settings),
                        queue_size=capture.queue_size, batch_size=capture.batch_size,
                        batch_wait_s=capture.batch_wait_s, retry_s=capture.retry_s, link_wait_s=link_wait_s)
    return StoreState(settings=settings, auth=Authenticator.from_config(settings.auth), store=store,
                      recorder=recorder)


def open_store(settings: Settings) -> Store:
    """The store; with tracing on, one that emits a span per completion it writes (docs/observability.md)."""
    tracing = Tracing.start(settings.telemetry, process="store")
    if tracing is None:
        return Store(settings.database)
    from flywheel.gateway.storeproc.traced_store import TracedStore

    return TracedStore(settings.database, tracing, capture_content=settings.telemetry.capture_content)


class Acknowledgements:
    """What one ingest connection has read, to tell the gateway how much of it is durable: one line, the number
    of exchanges, per advance of the recorder's ``durable`` (a batch), never per exchange."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.marks: deque[tuple[int, int]] = deque()  # after a chunk: (exchanges read, the recorder's accepted)

    def read(self, received: int, accepted: int) -> None:
        self.marks.append((received, accepted))

    def durable(self, accepted: int) -> None:
        done = None
        while self.marks and self.marks[0][1] <= accepted:
            done = self.marks.popleft()[0]
        if done is not None and not self.writer.is_closing():
            self.writer.write(b"%d\n" % done)


class IngestListener:
    """Reads the gateway's stream of exchanges into the recorder, and acknowledges what is durable."""

    def __init__(self, state: StoreState) -> None:
        self.state = state
        self.server: asyncio.AbstractServer | None = None
        self.connections: set[asyncio.Task[None]] = set()
        self.acknowledgements: set[Acknowledgements] = set()
        state.recorder.on_durable = self._durable

    def _durable(self, accepted: int) -> None:
        for acknowledgements in self.acknowledgements:
            acknowledgements.durable(accepted)

    async def start(self, path: Path) -> None:
        self.server = await asyncio.start_unix_server(self._read, str(path))
        os.chmod(path, 0o600)

    async def _read(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.connections.add(task)
        self.state.received = 0  # a (re)started gateway counts from zero on its new connection
        acknowledgements = Acknowledgements(writer)
        self.acknowledgements.add(acknowledgements)
        partial: list[bytes] = []  # the start of a line whose end has not arrived yet
        try:
            # Whole chunks, split here: one readline() per exchange cost more than the split.
            while chunk := await reader.read(_CHUNK):
                *lines, rest = chunk.split(b"\n")
                if lines and partial:
                    lines[0] = b"".join([*partial, lines[0]])
                    partial = []
                if rest:
                    partial.append(rest)
                for line in lines:
                    self.state.recorder.submit(line)
                if lines:
                    self.state.received += len(lines)
                    acknowledgements.read(self.state.received, self.state.recorder.accepted)
        finally:
            writer.close()
            self.acknowledgements.discard(acknowledgements)
            self.connections.discard(task)

    async def close(self, timeout_s: float = 10.0) -> None:
        """Stop accepting; read what the open connections still hold, up to their end."""
        if self.server is not None:
            self.server.close()
        if self.connections:
            await asyncio.wait(set(self.connections), timeout=timeout_s)


async def exit_with_parent(parent_pid: int) -> None:
    """SIGTERM ourselves once the gateway is gone, so a killed gateway leaves no store process behind."""
    while os.getppid() == parent_pid:
        await asyncio.sleep(1.0)
    log.warning("the gateway (pid %d) is gone: writing what is left, then exiting", parent_pid)
    os.kill(os.getpid(), signal.SIGTERM)


# -- internal routes: the gateway's own calls (never forwarded from clients) -------------------------------

internal = APIRouter(prefix="/internal")


@internal.get("/ready")
async def ready() -> Response:
    return json_response({"status": "ok"})


@internal.get("/capture-stats")
async def capture_stats(request: Request) -> Response:
    """The recorder's counters: turns by state (queued, written, ...) and by link rule, tails refused."""
    return json_response(dict(StoreState.of(request).recorder.stats))


@internal.get("/telemetry-stats")
async def telemetry_stats(request: Request) -> Response:
    """The completion spans' counters (exported, dropped, queued); empty with tracing off."""
    tracing: Tracing | None = getattr(StoreState.of(request).store, "tracing", None)  # a TracedStore's
    return json_response(tracing.counts.snapshot() if tracing is not None else {})


@internal.get("/memory")
async def memory(request: Request) -> Response:
    """What this process holds (``gateway/storeproc/memory.py``): bench/soak.py tells a leak from a bounded cache."""
    return json_response(await asyncio.to_thread(memory_report, StoreState.of(request).store))


@internal.post("/store/{method}")
async def store_method(method: str, request: Request) -> Response:
    """One method of the store interface (``core/store_api.py``), its arguments as the JSON body."""
    state = StoreState.of(request)
    arguments = parse_json_object(await request.body())
    await state.caught_up(request)
    try:
        result = await answer(LocalStore(state.store, state.settings), method, arguments)
    except VersionError as exc:
        raise BadRequest(str(exc), param="version") from None
    return json_response(result)


class ForwardedClient:
    """ASGI middleware: a forwarded request's client is the one the gateway saw (the socket shows none).

    Only the gateway reaches this process (a Unix socket in a private directory), and it always
    sets the header, overwriting a client's own.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            for name, value in scope["headers"]:
                if name == CLIENT_HOST_HEADER_BYTES:
                    scope = {**scope, "client": (value.decode("latin-1"), 0)}
                    break
        await self.app(scope, receive, send)


CLIENT_HOST_HEADER_BYTES = CLIENT_HOST_HEADER.encode()


class VersionsStamp:
    """ASGI middleware: every answer says how many writes of ``adapter_versions`` this process has committed, so the
    gateway keeps its version reads exactly as long as no answer shows a change (``serving/store_client.py``).

    The count is taken before the request runs and again as its answer starts: ``N`` when both are N (what the
    request read is all of N's writes and no later one), ``~N`` when a write committed meanwhile (what it read may
    predate N), empty while a write is committing."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        before = _versions_written(scope)

        async def stamped(message: Message) -> None:
            if message["type"] == "http.response.start":
                after = _versions_written(scope)
                value = b"" if after is None else (b"" if after == before else b"~") + str(after).encode()
                message = {**message, "headers": [*message.get("headers", []), (VERSIONS_STAMP_BYTES, value)]}
            await send(message)

        await self.app(scope, receive, stamped)


def _versions_written(scope: Scope) -> int | None:
    """This process's committed writes of ``adapter_versions``; None while one is committing (or before start)."""
    state: StoreState | None = getattr(scope["app"].state, "store_state", None)
    stamp = state.store.stamps.stamp(("adapter_versions",)) if state is not None else None
    return None if stamp is None else stamp[0]


VERSIONS_STAMP_BYTES = VERSIONS_STAMP_HEADER.encode()


def build_store_app(settings: Settings, ingest_socket: Path) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state = await asyncio.to_thread(open_state, settings)
        app.state.store_state = state
        await asyncio.to_thread(state.store.warm_up)
        state.recorder.start()
        await state.recorder.reingest()  # what an earlier run left in the spool
        ingest = IngestListener(state)
        await ingest.start(ingest_socket)
        watchdog = asyncio.create_task(exit_with_parent(os.getppid()))
        tune_gc()  # last: everything the process keeps is allocated by now
        log.info("flywheel store process ready: store=%s", printable_url(settings.database))
        try:
            yield
        finally:
            watchdog.cancel()
            await ingest.close()  # the gateway closed its end first: everything it sent is read
            await state.recorder.drain()  # nothing queued is lost
            state.store.close()

    app = FastAPI(title="Flywheel store", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.include_router(internal)  # first: the gateway's own calls, several a second, match without trying the rest
    for router in STORE_ROUTERS:
        app.include_router(router)
    install_error_handlers(app)
    app.add_middleware(RedactedBodies, redactor=redactor_for(settings))  # what the routes write is redacted
    app.add_middleware(ForwardedClient)
    app.add_middleware(VersionsStamp)
    return app


def main() -> None:
    faulthandler.enable()  # a crash in native code (DuckDB, PostgreSQL's driver) leaves the Python stacks in the log
    parser = argparse.ArgumentParser(description="Flywheel's store process (started by the gateway).")
    parser.add_argument("--api-socket", type=Path, required=True)
    parser.add_argument("--ingest-socket", type=Path, required=True)
    args = parser.parse_args()
    settings = Settings.model_validate(pickle.load(sys.stdin.buffer))  # the gateway's own, secrets included
    os.nice(settings.capture.store_nice)  # before any thread starts: DuckDB's and the writer's inherit it
    configure_logging(settings)
    from flywheel.gateway.storeproc import quiet_server

    # Keep-alive past the gateway's (STORE_KEEPALIVE_S): it drops an idle connection first, never sends on a closing one
    quiet_server.run(build_store_app(settings, args.ingest_socket), uds=str(args.api_socket), log_config=None,
                     log_level=settings.log_level, timeout_graceful_shutdown=30,
                     timeout_keep_alive=int(4 * STORE_KEEPALIVE_S))


if __name__ == "__main__":
    main()
