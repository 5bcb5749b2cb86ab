"""The gateway's side of the store process (:mod:`flywheel.gateway.storeproc.main`).

:class:`StoreLink` starts the store process, restarts it if it dies, streams every
captured exchange to it, and forwards the store-backed routes to it. On the request
path capture costs one ``orjson.dumps`` of the exchange (a big one is serialized off the event loop:
:mod:`flywheel.gateway.serving.exchange_lines`) and, every ``capture.handoff_s``
(50 ms), one socket write for all the exchanges finished in it.

The gateway keeps every exchange it streamed until the store process acknowledges it as
durable (one line on the same socket per batch it wrote or spooled: the number of exchanges
durable so far). If the store process dies, what it had not acknowledged is spooled here, and
re-ingesting skips what the dead process had committed after all (turn ids derive from the
exchange's id), so a SIGKILL of it loses no turn and stores none twice.

When the store process cannot take an exchange (it is restarting, or more than
``max_unacked_bytes`` are not yet acknowledged) the gateway redacts it and appends it to the spool
itself; the store process re-ingests the spool, so nothing is dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import pickle
import shutil
import sys
import tempfile
from collections import Counter, deque
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from yarl import URL

from flywheel.capture.recorder import Spool
from flywheel.capture.redaction import Redactor
from flywheel.capture.turns import CapturedExchange, prepare_lines
from flywheel.gateway.core.config import Settings
from flywheel.gateway.core.errors import OpenAIError, UpstreamError
from flywheel.gateway.core.store_wire import (
    CLIENT_HOST_HEADER,
    INGEST_SEQ_HEADER,
    STORE_KEEPALIVE_S,
    VERSIONS_STAMP_HEADER,
)
from flywheel.gateway.serving.exchange_lines import OFF_LOOP_LINE_BYTES, estimated_bytes, line_in_pieces

log = logging.getLogger("flywheel.store_link")

# Headers that describe one hop of a connection, not the request: never forwarded.
_HOP_BY_HOP = frozenset({"host", "connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
                         "proxy-authorization", "proxy-authenticate", "content-length"})
_NOT_RETURNED = _HOP_BY_HOP | {"date", "server", VERSIONS_STAMP_HEADER}  # the gateway's own server sets these


class StoreProcessError(RuntimeError):
    """The store process could not start (its own error is in the log just above)."""


class StoreLink:
    """Starts, feeds, and forwards to the store process."""

    def __init__(self, settings: Settings, redactor: Redactor | None, *, max_unacked_bytes: int = 64 << 20) -> None:
        self.settings = settings
        self.redactor = redactor
        # One socket write per handoff, not per exchange: every write wakes the store process on the other core
        self.handoff_s = settings.capture.handoff_s
        self.max_unacked_bytes = max_unacked_bytes
        self.spool = Spool(settings.spool_path)
        self.stats: Counter[str] = Counter()  # the gateway's own: spooled, failed
        self.capture_counts: Counter[str] = Counter()  # for /metrics: the store process's counters plus ours
        self.sent = 0  # exchanges written to the current ingest connection
        self.acked = 0  # of those, the ones the store process has written or spooled
        self.versions_changes = 0  # how often the store process's answers showed its versions stamp change
        self._versions_stamp: int | None = None  # the newest answer's, when it read at a settled count
        self._versions_newest = -1  # the most writes of versions any answer showed
        self._unacked: deque[bytes] = deque()  # the lines sent after the first ``acked``, in order
        self._unacked_bytes = 0
        self._acks: asyncio.Task[None] | None = None  # reads the acknowledgements until the connection ends
        self._dir = Path(tempfile.mkdtemp(prefix="flywheel-store-"))  # 0700; short enough for a socket path
        self.api_socket, self.ingest_socket = self._dir / "api.sock", self._dir / "ingest.sock"
        self._proc: asyncio.subprocess.Process | None = None
        self._http: aiohttp.ClientSession | None = None
        self._ingest: asyncio.StreamWriter | None = None
        self._ingest_eof: asyncio.StreamReader | None = None  # acknowledgements; at EOF once the store process is gone
        self._pending: list[bytes] = []  # CapturedExchange lines
        self._serializer = ThreadPoolExecutor(1, thread_name_prefix="flywheel-serializer")  # one: lines keep order
        self._serializing: deque[asyncio.Future[bytes]] = deque()  # big exchanges on the serializer, in order
        self._spooling: set[asyncio.Future[Counter[str]]] = set()
        self._closing = False
        self._supervisor: asyncio.Task[None] | None = None

    @property
    def up(self) -> bool:
        return self._ingest is not None and not self._ingest.is_closing() and \
            self._ingest_eof is not None and not self._ingest_eof.at_eof()

    async def start(self, timeout_s: float = 120.0) -> None:
        await self._spawn(timeout_s)
        self._supervisor = asyncio.create_task(self._supervise(), name="flywheel-store-supervisor")

    async def aclose(self, timeout_s: float = 60.0) -> None:
        """Hand over what is pending, close the stream, and let the store process drain and exit."""
        self._closing = True
        if self._supervisor is not None:
            self._supervisor.cancel()
        await self._caught_up()
        self._flush()
        if self._spooling:
            await asyncio.wait(set(self._spooling))
        self._serializer.shutdown(wait=False)
        if self._ingest is not None:
            self._ingest.close()  # the store process reads to this end before it drains
            with contextlib.suppress(OSError):  # already gone: it read what it could
                await self._ingest.wait_closed()
        if self._http is not None:
            await self._http.close()
        proc = self._proc
        if proc is not None and proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), timeout_s)
            except TimeoutError:
                log.error("the store process did not exit within %.0f s; killing it", timeout_s)
                proc.kill()
                await proc.wait()
        if proc is not None and proc.returncode != 0:  # it did not drain: what it never acknowledged may be lost
            await self._keep_unacknowledged()
        if self._acks is not None:
            self._acks.cancel()  # done: a clean exit wrote everything it read
        shutil.rmtree(self._dir, ignore_errors=True)

    # -- capture -----------------------------------------------------------------------------------------

    def submit(self, exchange: CapturedExchange, request_bytes: int = 0) -> None:
        """Queue a finished exchange for the store process; never blocks, never raises.

        It is serialized now, while its dicts are still in the CPU's caches, and only the line is
        kept: holding the dicts until the handoff (and walking them then, cold) cost the gateway
        more (docs/benchmarks.md, "How the capture cost came down"). A big one
        (``gateway/serving/exchange_lines.py``) is serialized on the serializer thread instead, and
        so is every exchange submitted while one is there, so lines keep the order of submission.
        """
        if self._serializing or estimated_bytes(exchange, request_bytes) > OFF_LOOP_LINE_BYTES:
            future = asyncio.get_running_loop().run_in_executor(self._serializer, line_in_pieces, exchange)
            self._serializing.append(future)
            future.add_done_callback(lambda done: self._serialized(exchange, done))
            return
        try:
            line = exchange.to_line()
        except Exception:  # capture must never fail a client request
            log.exception("could not serialize exchange %s", exchange.completion_id)
            self.stats["failed"] += 1
            return
        self._queue(line)

    def _serialized(self, exchange: CapturedExchange, done: asyncio.Future[bytes]) -> None:
        self._serializing.remove(done)
        if done.cancelled() or done.exception() is not None:  # capture must never fail a client request
            log.error("could not serialize exchange %s: %r", exchange.completion_id, done.exception())
            self.stats["failed"] += 1
            return
        self._queue(done.result())

    def _queue(self, line: bytes) -> None:
        if not self._pending:
            asyncio.get_running_loop().call_later(self.handoff_s, self._flush)
        self._pending.append(line)

    async def _caught_up(self) -> None:
        """Wait for the serializer thread: what was answered before now is on the stream before what follows."""
        if self._serializing:
            await asyncio.wait(list(self._serializing))

    def _flush(self) -> None:
        batch, self._pending = self._pending, []
        if not batch:
            return
        writer = self._ingest
        try:
            if writer is None or not self.up or self._unacked_bytes > self.max_unacked_bytes:
                self._spool(batch)
                return
            writer.write(b"".join(batch))
            self.sent += len(batch)
            self._unacked.extend(batch)
            self._unacked_bytes += sum(map(len, batch))
        except Exception:  # capture must never fail a client request
            log.exception("could not hand %d exchanges to the store process", len(batch))
            self.stats["failed"] += len(batch)

    async def _read_acks(self, reader: asyncio.StreamReader) -> None:
        """Let go of the exchanges the store process acknowledges as durable, until the connection ends."""
        try:
            while line := await reader.readline():
                durable = int(line)
                while self.acked < durable and self._unacked:
                    self._unacked_bytes -= len(self._unacked.popleft())
                    self.acked += 1
        except (OSError, ValueError) as exc:  # a broken connection is the supervisor's to handle
            log.warning("reading the store process's acknowledgements stopped: %r", exc)

    async def _keep_unacknowledged(self, timeout_s: float = 5.0) -> None:
        """The store process is gone: spool what it never acknowledged (re-ingesting skips what it wrote)."""
        if self._ingest is not None:
            self._ingest.close()  # nothing more goes to the dead connection: from now on _flush spools
        if self._acks is not None:
            with contextlib.suppress(TimeoutError):  # its last acknowledgements, up to the end of the connection
                await asyncio.wait_for(asyncio.shield(self._acks), timeout_s)
            self._acks.cancel()
        lost, self._unacked, self._unacked_bytes = list(self._unacked), deque(), 0
        if lost:
            log.warning("%d exchanges were not acknowledged as durable by the store process: spooling them",
                        len(lost))
            self._spool(lost)
        if self._spooling:  # on the spool before a new store process re-ingests it at its start
            await asyncio.wait(set(self._spooling))

    def _spool(self, batch: list[bytes]) -> None:
        """Redact and append ``batch`` to the spool on a worker thread: preparing turns (parse, redact, hash)
        grows with them, and the spool's file lock may wait for the store process."""
        future = asyncio.get_running_loop().run_in_executor(None, self._spool_lines, batch)
        self._spooling.add(future)
        future.add_done_callback(self._spooled)

    def _spool_lines(self, batch: list[bytes]) -> Counter[str]:
        outcome: Counter[str] = Counter()  # counted on this thread, merged on the event loop
        try:
            self.spool.keep(prepare_lines(batch, self.redactor, outcome), outcome)  # redacted, as always
        except Exception:  # capture must never fail a client request
            log.exception("could not spool %d exchanges", len(batch))
            outcome["failed"] += len(batch)
        return outcome

    def _spooled(self, done: asyncio.Future[Counter[str]]) -> None:
        self._spooling.discard(done)
        if not done.cancelled():
            self.stats.update(done.result())

    async def refresh_capture_counts(self) -> None:
        try:
            theirs = await self.call("GET", "/internal/capture-stats")
        except OpenAIError:
            theirs = {}  # restarting: what the gateway counted itself still shows
        self.capture_counts.clear()
        self.capture_counts.update(theirs)
        self.capture_counts.update(self.stats)

    # -- the process -------------------------------------------------------------------------------------

    async def _spawn(self, timeout_s: float) -> None:
        for path in (self.api_socket, self.ingest_socket):
            path.unlink(missing_ok=True)
        # Its own session: a terminal's Ctrl-C reaches the gateway only, which then stops it in order.
        self._proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "flywheel.gateway.storeproc.main", "--api-socket", str(self.api_socket),
            "--ingest-socket", str(self.ingest_socket), stdin=asyncio.subprocess.PIPE, start_new_session=True)
        assert self._proc.stdin is not None
        self._proc.stdin.write(pickle.dumps(self.settings.model_dump()))
        await self._proc.stdin.drain()
        self._proc.stdin.close()
        if self._http is None:
            connector = aiohttp.UnixConnector(path=str(self.api_socket), keepalive_timeout=STORE_KEEPALIVE_S)
            self._http = aiohttp.ClientSession(connector=connector,
                                               timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))
        await self._wait_ready(timeout_s)
        self._versions_stamp, self._versions_newest = None, -1  # a new process counts from zero
        self.versions_changes += 1
        self._ingest_eof, self._ingest = await asyncio.open_unix_connection(str(self.ingest_socket))
        self.sent = self.acked = 0
        self._acks = asyncio.create_task(self._read_acks(self._ingest_eof), name="flywheel-store-acks")

    async def _wait_ready(self, timeout_s: float) -> None:
        assert self._proc is not None and self._http is not None
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            if self._proc.returncode is not None:
                raise StoreProcessError(f"the store process exited with code {self._proc.returncode} "
                                        "(its error is in the log above)")
            try:
                async with self._http.get("http://store/internal/ready") as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            if asyncio.get_running_loop().time() > deadline:
                self._proc.kill()
                raise StoreProcessError(f"the store process did not start within {timeout_s:.0f} s")
            await asyncio.sleep(0.05)

    async def _supervise(self) -> None:
        """Restart the store process if it dies; captured turns go to the spool meanwhile."""
        backoff_s = 1.0
        while True:
            assert self._proc is not None
            code = await self._proc.wait()
            log.error("the store process exited with code %s; restarting it in %.0f s", code, backoff_s)
            await self._keep_unacknowledged()
            await asyncio.sleep(backoff_s)
            try:
                await self._spawn(120.0)
                backoff_s = 1.0
            except (StoreProcessError, OSError) as exc:
                log.error("restarting the store process failed: %s", exc)
                backoff_s = min(60.0, backoff_s * 2)

    # -- requests ----------------------------------------------------------------------------------------

    async def call(self, method: str, path: str, *, params: dict[str, str] | None = None,
                   json: Any = None, fresh: bool = True) -> Any:
        """An internal JSON call; the store process's error comes back as the same OpenAIError. ``fresh``: its
        answer sees every turn answered before it (the store process writes them first); else the store as it is."""
        return (await self.call_seen(method, path, params=params, json=json, fresh=fresh))[0]

    async def call_seen(self, method: str, path: str, *, params: dict[str, str] | None = None,
                        json: Any = None, fresh: bool = True) -> tuple[Any, int | None]:
        """``call``, and ``versions_changes`` as its answer left it (None: it may predate a write of versions)."""
        headers = {}
        if fresh:
            await self._caught_up()
            self._flush()
            headers[INGEST_SEQ_HEADER] = str(self.sent)
        try:
            assert self._http is not None
            async with self._http.request(method, f"http://store{path}", params=params, json=json,
                                          headers=headers) as response:
                seen = self._saw(response)
                body = await response.read()
        except aiohttp.ClientError as exc:
            raise UpstreamError(f"The store process is not reachable ({type(exc).__name__}); try again.") from None
        if response.status >= 400:
            raise _error_from(response.status, body)
        return orjson.loads(body), seen

    def _saw(self, response: aiohttp.ClientResponse) -> int | None:
        """Count a change of the store process's versions stamp (``storeproc/main.py: VersionsStamp``); the
        count an answer read at, or None when what it read may be older than a write already committed."""
        value = response.headers.get(VERSIONS_STAMP_HEADER) or ""
        written = int(value.lstrip("~")) if value.lstrip("~").isdigit() else None
        if written is not None:
            self._versions_newest = max(self._versions_newest, written)
        if value.startswith("~") or written is None or written < self._versions_newest:
            self.versions_changes += 1  # answers come back in any order: one older than a seen write is no stamp
            self._versions_stamp = None
            return None
        if written != self._versions_stamp:
            self.versions_changes += 1
            self._versions_stamp = written
        return self.versions_changes

    async def forward(self, request: Request, body: bytes) -> Response:
        """Send a client's request (its ``body`` already read) to the store process as it came; stream the
        answer back."""
        await self._caught_up()
        self._flush()  # what this client was just answered is on the stream before its request is
        headers = {k: v for k, v in request.headers.items() if k not in _HOP_BY_HOP}
        headers[INGEST_SEQ_HEADER] = str(self.sent)
        # Overwrites any client's own: the store process sees a Unix socket, and admits loopback by this header
        headers[CLIENT_HOST_HEADER] = request.client.host if request.client else ""
        raw_path = request.scope.get("raw_path") or request.url.path.encode()
        query = request.scope.get("query_string") or b""
        url = URL("http://store" + raw_path.decode("latin-1") + ("?" + query.decode("latin-1") if query else ""),
                  encoded=True)
        try:
            assert self._http is not None
            response = await self._http.request(request.method, url, headers=headers, data=body)
            self._saw(response)
        except aiohttp.ClientError as exc:
            raise UpstreamError(f"The store process is not reachable ({type(exc).__name__}); try again.") from None
        if response.status >= 400:  # raised here, so the gateway's handler answers it and counts it in /metrics
            async with response:
                raise _error_from(response.status, await response.read())
        out_headers = {k: v for k, v in response.headers.items() if k.lower() not in _NOT_RETURNED}
        return StreamingResponse(_body(response), status_code=response.status, headers=out_headers,
                                 background=BackgroundTask(response.release))


async def _body(response: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    async for chunk in response.content.iter_chunked(1 << 16):
        yield chunk


def _error_from(status: int, body: bytes) -> OpenAIError:
    try:
        error = orjson.loads(body)["error"]
        return OpenAIError(error["message"], status_code=status, error_type=error.get("type"),
                           param=error.get("param"), code=error.get("code"))
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return UpstreamError(f"The store process answered HTTP {status}.")
