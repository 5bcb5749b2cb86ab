"""How much latency and CPU the Flywheel gateway adds in front of an upstream, next to LiteLLM.

    python -m bench.gateway_overhead                          # 3-4 min on 2 cores; tables + verdict
    python -m bench.gateway_overhead --json gateway_overhead.json
    python -m bench.gateway_overhead --no-litellm --requests 300 --stream-requests 100 --duration-s 1  # quick look

Needs the ``[bench]`` extra for the LiteLLM column (``pip install -e '.[bench]'``); without
it the other numbers are still reported, with the reason LiteLLM is missing.

It starts three processes on free loopback ports, stopped by their handles at the end:
the fast mock upstream (``bench/mock_openai_server.py``), the Flywheel gateway
(``python -m flywheel.gateway serve``) pointed at it, and the LiteLLM proxy (one worker) pointed at
it. Then, for each target (the mock directly; through Flywheel; through Flywheel with
``X-Flywheel-Capture: off``, which isolates the proxy from the capture path; through
LiteLLM), with the same chat request:

1. sequential non-stream requests on one keep-alive connection: p50 / p99 latency, and what
   the gateway adds over going direct (p50 / p99 difference and ratio); the targets take
   turns in rounds, so background noise lands on all of them alike;
2. throughput (req/s) with 1, 16 and 64 concurrent connections, each for a fixed time;
3. sequential streaming requests: time to the first body chunk (p50) and what it adds;
4. the server processes' CPU time per request (``/proc`` via psutil; Flywheel's store
   process included), including work they defer past the response (capture writes):
   after every segment the script waits until the servers are idle again, so one
   target's leftovers never land on the next one.

The load generator is a raw HTTP/1.1 client (asyncio + httptools on uvloop: ~0.05 ms of
CPU per request, where ``httpx.AsyncClient`` takes ~1 ms), but it still shares the
machine's cores with the servers: on a 2-core machine the throughput columns measure the
whole system, not the gateway alone. Latency differences at concurrency 1 and CPU per
request are the clean numbers. The report says how busy other processes kept the
machine meanwhile; repeat the run when that is high.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import dataclasses
import importlib.util
import inspect
import itertools
import json
import os
import platform
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import httptools
import orjson
import psutil

from flywheel.gateway.core.processes import NotAnswering, free_port, wait_until_answering

REPO = Path(__file__).resolve().parents[1]
NO_CAPTURE = "flywheel, capture off"  # the same gateway, asked per request not to record the turn


@dataclass
class Args:
    requests: int = 1000
    """sequential non-stream requests per target (after warm-up): the p50/p99 latency sample"""
    stream_requests: int = 300
    """sequential streaming requests per target: the time-to-first-chunk sample"""
    warmup: int = 200
    """requests per target before anything is measured (connection pools, caches)"""
    rounds: int = 5
    """the sequential samples are taken in this many rounds, targets taking turns"""
    concurrency: tuple[int, ...] = (1, 16, 64)
    """concurrent connections for the throughput runs"""
    duration_s: float = 3.0
    """how long each throughput run lasts (after 0.5 s of unmeasured warm-up)"""
    max_tokens: int = 16
    """max_tokens in the benchmark request (the mock always answers five tokens)"""
    litellm: bool = True
    """also measure the LiteLLM proxy (needs litellm[proxy]); --no-litellm skips it"""
    startup_timeout_s: float = 120.0
    """how long to wait for each server to answer (LiteLLM's import alone takes ~10-20 s)"""
    request_timeout_s: float = 30.0
    """a request slower than this fails the run"""
    quiet_s: float = 1.5
    """idle time after which the servers count as settled: longer than Flywheel's capture batch timer (1 s)"""
    json: str | None = None
    """also write the results to this JSON file"""
    keep_logs: bool = False
    """keep the temp dir with configs and server logs (its path is printed)"""


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each dataclass field, read from the source (one place to write help)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, after in itertools.pairwise(body):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)):
            docs[node.target.id] = str(after.value.value)
    return docs


def parse_args() -> Args:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    docs = field_docs(Args)
    for f in dataclasses.fields(Args):
        flag, default = "--" + f.name.replace("_", "-"), f.default
        if isinstance(default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=docs[f.name])
        elif isinstance(default, tuple):
            parser.add_argument(flag, type=int, nargs="+", default=default, help=docs[f.name])
        else:
            parser.add_argument(flag, type=type(default) if default is not None else str, default=default,
                                help=docs[f.name])
    ns = parser.parse_args()
    ns.concurrency = tuple(ns.concurrency)
    return Args(**vars(ns))


# ---------------------------------------------------------------------------------------------
# TRY NOT TO MODIFY: processes (free loopback ports, Popen handles, bounded readiness polls)
# ---------------------------------------------------------------------------------------------

@dataclass
class Server:
    """A server subprocess we started; stopped by its handle, never by name."""

    name: str
    port: int
    proc: subprocess.Popen[bytes]
    log_file: Path

    @property
    def pids(self) -> list[int]:
        """The server and the processes it started (Flywheel's store process): all their CPU counts."""
        return [self.proc.pid, *(child.pid for child in psutil.Process(self.proc.pid).children(recursive=True))]

    def log_tail(self, lines: int = 15) -> str:
        text = self.log_file.read_text(errors="replace") if self.log_file.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def wait_ready(self, path: str, timeout_s: float) -> None:
        """Poll ``path`` until it answers 2xx; raise with the log tail if it exits or times out."""
        try:
            wait_until_answering(f"http://127.0.0.1:{self.port}", self.proc, timeout_s=timeout_s, require_ok=True,
                                 path=path)
        except NotAnswering as exc:
            raise RuntimeError(f"{self.name}: {exc}:\n{self.log_tail()}") from exc

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)


def spawn(name: str, argv: list[str], workdir: Path, env: dict[str, str] | None = None) -> Server:
    port = free_port()
    log_file = workdir / f"{name}.log"
    with log_file.open("wb") as log:
        proc = subprocess.Popen([*argv, "--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
                                cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    return Server(name, port, proc, log_file)


def start_mock(workdir: Path) -> Server:
    return spawn("mock", [sys.executable, "-m", "bench.mock_openai_server"], workdir)


def start_flywheel(workdir: Path, mock_port: int) -> Server:
    config = workdir / "flywheel.toml"
    config.write_text(textwrap.dedent(f"""\
        data_dir = "{workdir / 'data'}"
        log_level = "warning"
        [engines.mock]
        kind = "openai"
        base_url = "http://127.0.0.1:{mock_port}/v1"
        [aliases.bench]
        engine = "mock"
        base_model = "mock-model"
        """))
    return spawn("flywheel", [sys.executable, "-m", "flywheel.gateway", "serve", "--config", str(config)], workdir)


def start_litellm(workdir: Path, mock_port: int, master_key: str) -> Server:
    config = workdir / "litellm.yaml"
    config.write_text(textwrap.dedent(f"""\
        model_list:
          - model_name: bench
            litellm_params:
              model: openai/mock-model
              api_base: http://127.0.0.1:{mock_port}/v1
              api_key: x
        """))
    env = {"LITELLM_MASTER_KEY": master_key,  # 1.106+ refuses a missing or well-known key
           "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # offline: do not try to download the cost map
           "LITELLM_LOG": "ERROR"}  # no per-request access log, like Flywheel at log_level warning
    argv = [sys.executable, "-m", "litellm.proxy.proxy_cli", "--config", str(config),
            "--host", "127.0.0.1", "--num_workers", "1"]
    return spawn("litellm", argv, workdir, env)


# ---------------------------------------------------------------------------------------------
# The load generator: one raw keep-alive HTTP/1.1 connection per concurrent client
# ---------------------------------------------------------------------------------------------

@dataclass(slots=True)
class Sample:
    status: int
    first_chunk_s: float  # request written -> first body bytes received
    total_s: float  # request written -> response complete
    body: bytes


class Connection(asyncio.Protocol):
    """One HTTP/1.1 connection; httptools parses the responses (chunked bodies decoded)."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.done: asyncio.Future[None] | None = None
        self.first_body_at = 0.0
        self.body: list[bytes] = []

    @classmethod
    async def open(cls, port: int) -> Connection:
        _, conn = await asyncio.get_running_loop().create_connection(cls, "127.0.0.1", port)
        return conn

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    @property
    def closed(self) -> bool:
        return self.transport is None or self.transport.is_closing()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_exception(ConnectionError(f"server closed the connection ({exc})"))

    def on_message_begin(self) -> None:
        self.first_body_at = 0.0
        self.body = []

    def on_body(self, data: bytes) -> None:
        if not self.first_body_at:
            self.first_body_at = time.perf_counter()
        self.body.append(data)

    def on_message_complete(self) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_result(None)

    async def request(self, raw: bytes, timeout_s: float) -> Sample:
        if self.transport is None or self.transport.is_closing():
            raise ConnectionError("connection closed")
        self.done = asyncio.get_running_loop().create_future()
        start = time.perf_counter()
        self.transport.write(raw)
        async with asyncio.timeout(timeout_s):
            await self.done
        end = time.perf_counter()
        return Sample(self.parser.get_status_code(), self.first_body_at - start, end - start, b"".join(self.body))

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


@dataclass
class Target:
    """One way to reach the mock: directly, through Flywheel, through LiteLLM."""

    name: str
    port: int
    pids: list[int]  # server processes whose CPU time counts against this target
    api_key: str = "unused"
    headers: dict[str, str] = field(default_factory=dict)  # extra request headers
    connections: list[Connection] = field(default_factory=list)
    # results
    latency: list[float] = field(default_factory=list)
    first_chunk: list[float] = field(default_factory=list)
    cpu_s: float = 0.0
    throughput: dict[int, dict[str, float]] = field(default_factory=dict)

    async def send(self, i: int, raw: bytes, timeout_s: float) -> Sample:
        """A request on connection ``i``, reopened when the server has closed it (idle keep-alive)."""
        conn = self.connections[i]
        if conn.closed:
            conn = self.connections[i] = await Connection.open(self.port)
        try:
            return await conn.request(raw, timeout_s)
        except ConnectionError:  # the server closed it as we sent (uvicorn: after 5 s idle): once more
            conn.close()
            conn = self.connections[i] = await Connection.open(self.port)
            return await conn.request(raw, timeout_s)

    def raw_request(self, body: dict[str, Any]) -> bytes:
        payload = orjson.dumps(body)
        extra = "".join(f"{k}: {v}\r\n" for k, v in self.headers.items()).encode()
        return (b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:%d\r\n"
                b"content-type: application/json\r\nauthorization: Bearer %s\r\n%scontent-length: %d\r\n\r\n"
                % (self.port, self.api_key.encode(), extra, len(payload))) + payload


def check(sample: Sample, target: Target, stream: bool) -> None:
    """Every response must be a real answer from the mock, not an error that happens to be fast."""
    ok = sample.status == 200 and b"Hello" in sample.body and (not stream or b"data: [DONE]" in sample.body)
    if not ok:
        raise RuntimeError(f"{target.name}: bad {'stream' if stream else 'response'} "
                           f"(HTTP {sample.status}): {sample.body[:300]!r}")


def cpu_seconds(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        times = psutil.Process(pid).cpu_times()
        total += times.user + times.system
    return total


async def settle(pids: list[int], *, quiet_s: float, timeout_s: float = 120.0) -> float:
    """Wait until the servers stop using CPU (deferred work: capture writes, logging callbacks).

    Returns how long they stayed busy. Without this, one target's leftover work would
    land on the next target's measurements.
    """
    started = time.perf_counter()
    last, quiet_since = cpu_seconds(pids), None
    while time.perf_counter() - started < timeout_s:
        await asyncio.sleep(0.1)
        now = cpu_seconds(pids)
        if now - last <= 0.011:  # at most one 10 ms clock tick in 100 ms: idle
            if quiet_since is None:
                quiet_since = time.perf_counter() - 0.1
            elif time.perf_counter() - quiet_since >= quiet_s:
                return quiet_since - started
        else:
            quiet_since = None
        last = now
    raise RuntimeError(f"servers {pids} still busy after {timeout_s:g} s")


async def sequential(target: Target, raw: bytes, n: int, args: Args, *, stream: bool) -> list[Sample]:
    for _ in range(2):  # unmeasured: reopens the connection if the server closed it while idle
        await target.send(0, raw, args.request_timeout_s)
    samples = []
    for _ in range(n):
        sample = await target.send(0, raw, args.request_timeout_s)
        check(sample, target, stream)
        samples.append(sample)
    return samples


async def load(target: Target, raw: bytes, concurrency: int, duration_s: float, args: Args) -> dict[str, float]:
    """``concurrency`` clients, each sending back to back on its own connection for ``duration_s``."""
    end = time.perf_counter() + duration_s
    latencies: list[float] = []

    async def client(i: int) -> None:
        while time.perf_counter() < end:
            sample = await target.send(i, raw, args.request_timeout_s)
            check(sample, target, stream=False)
            latencies.append(sample.total_s)

    started, cpu0, client_cpu0 = time.perf_counter(), cpu_seconds(target.pids), time.process_time()
    await asyncio.gather(*(client(i) for i in range(concurrency)))
    elapsed = time.perf_counter() - started
    client_cpu = time.process_time() - client_cpu0
    cpu_at_end = cpu_seconds(target.pids)
    busy_after = await settle(target.pids, quiet_s=args.quiet_s)
    # Deferred work (capture writes) counts by its CPU time, not its wall time, which includes idle batch timers
    deferred_cpu = cpu_seconds(target.pids) - cpu_at_end
    n = len(latencies)
    return {"requests": n, "req_per_s": n / elapsed, "p50_ms": 1000 * percentile(latencies, 50),
            "p99_ms": 1000 * percentile(latencies, 99), "busy_after_s": busy_after, "deferred_cpu_s": deferred_cpu,
            "sustained_req_per_s": n / (elapsed + deferred_cpu),
            "server_cpu_ms_per_req": 1000 * (cpu_seconds(target.pids) - cpu0) / n,
            "client_cpu_ms_per_req": 1000 * client_cpu / n}


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (p99 of 1000 samples is the 990th smallest)."""
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))  # ceil
    return ordered[int(rank) - 1]


# ---------------------------------------------------------------------------------------------
# ALGO LOGIC: the measurements
# ---------------------------------------------------------------------------------------------

def busy_cpu_seconds() -> float:
    """CPU time the whole machine has spent busy (all cores, all processes)."""
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


async def measure(targets: list[Target], args: Args) -> float:
    """Fill in each target's results; returns how many cores other processes kept busy meanwhile."""
    pids = sorted({pid for t in targets for pid in t.pids})
    started, machine0, ours0 = time.perf_counter(), busy_cpu_seconds(), cpu_seconds(pids) + time.process_time()
    chat = {"model": "bench", "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": args.max_tokens}
    stream_chat = {**chat, "stream": True}
    most = max(args.concurrency)
    for t in targets:
        t.connections = [await Connection.open(t.port) for _ in range(most)]

    # warm-up: both request kinds, and every connection (so the gateways' upstream pools fill up)
    for t in targets:
        raw, raw_stream = t.raw_request(chat), t.raw_request(stream_chat)
        await sequential(t, raw, args.warmup, args, stream=False)
        await sequential(t, raw_stream, args.warmup // 4, args, stream=True)
        await load(t, raw, most, 0.5, args)

    # 1. + 4. sequential non-stream latency and server CPU, targets taking turns
    per_round = max(1, args.requests // args.rounds)
    for _ in range(args.rounds):
        for t in targets:
            cpu0 = cpu_seconds(t.pids)
            samples = await sequential(t, t.raw_request(chat), per_round, args, stream=False)
            await settle(t.pids, quiet_s=args.quiet_s)
            t.cpu_s += cpu_seconds(t.pids) - cpu0
            t.latency += [s.total_s for s in samples]
    print(f"  sequential: {per_round * args.rounds} requests per target done", flush=True)

    # 3. streaming time to first chunk, targets taking turns
    per_round = max(1, args.stream_requests // args.rounds)
    for _ in range(args.rounds):
        for t in targets:
            samples = await sequential(t, t.raw_request(stream_chat), per_round, args, stream=True)
            await settle(t.pids, quiet_s=args.quiet_s)
            t.first_chunk += [s.first_chunk_s for s in samples]
    print(f"  streaming: {per_round * args.rounds} requests per target done", flush=True)

    # 2. throughput at each concurrency
    for concurrency in args.concurrency:
        for t in targets:
            raw = t.raw_request(chat)
            await load(t, raw, concurrency, 0.5, args)  # settle at this concurrency first
            t.throughput[concurrency] = await load(t, raw, concurrency, args.duration_s, args)
        print(f"  throughput at concurrency {concurrency} done", flush=True)

    for t in targets:
        for conn in t.connections:
            conn.close()
    ours = cpu_seconds(pids) + time.process_time() - ours0
    return max(0.0, busy_cpu_seconds() - machine0 - ours) / (time.perf_counter() - started)


def summarize(targets: list[Target], args: Args) -> dict[str, dict[str, Any]]:
    """Per target: latency percentiles, added latency vs direct, throughput, CPU."""
    direct = targets[0]
    d50, d99 = percentile(direct.latency, 50), percentile(direct.latency, 99)
    dfc = percentile(direct.first_chunk, 50)
    out: dict[str, dict[str, Any]] = {}
    for t in targets:
        p50, p99, fc50 = percentile(t.latency, 50), percentile(t.latency, 99), percentile(t.first_chunk, 50)
        out[t.name] = {
            "p50_ms": 1000 * p50, "p99_ms": 1000 * p99, "mean_ms": 1000 * statistics.fmean(t.latency),
            "added_p50_ms": 1000 * (p50 - d50), "added_p99_ms": 1000 * (p99 - d99),
            "ratio_p50": p50 / d50, "ratio_p99": p99 / d99,
            "first_chunk_p50_ms": 1000 * fc50, "first_chunk_p99_ms": 1000 * percentile(t.first_chunk, 99),
            "added_first_chunk_p50_ms": 1000 * (fc50 - dfc),
            "server_cpu_ms_per_req": 1000 * t.cpu_s / len(t.latency),
            "throughput": {str(c): v for c, v in t.throughput.items()},
        }
    return out


def machine() -> dict[str, Any]:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass

    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    return {"cpus": os.cpu_count(), "cpu_model": model, "platform": platform.platform(),
            "python": platform.python_version(),
            "versions": {d: version(d) for d in ("flywheel-rl", "litellm", "fastapi", "starlette", "uvicorn",
                                                  "httpx", "uvloop", "httptools")}}


def verdict_line(results: dict[str, dict[str, Any]], name: str) -> str:
    """The target: <= 1 ms added at p50, and <= 0.1 x what LiteLLM adds."""
    added = results[name]["added_p50_ms"]
    if "litellm" in results:
        ratio = added / results["litellm"]["added_p50_ms"]
        versus, met = f"{ratio:.3f} x LiteLLM's (target <= 0.1)", added <= 1.0 and ratio <= 0.1
    else:
        versus, met = "n/a x LiteLLM's (target <= 0.1; LiteLLM not measured)", added <= 1.0
    label = "Flywheel" if name == "flywheel" else f"Flywheel ({name.removeprefix('flywheel, ')})"
    return (f"{label} p50 added latency {added:.3f} ms (target <= 1 ms) and {versus}: "
            f"{'target met' if met else 'target MISSED'}")


def print_report(results: dict[str, dict[str, Any]], args: Args, info: dict[str, Any],
                 litellm_missing: str | None, background_cores: float) -> list[str]:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=150, markup=False, highlight=False)  # plain text: "[bench]" is not a style
    console.print(f"\nmachine: {info['cpus']} cores ({info['cpu_model']}), loopback, Python {info['python']}; "
                  f"the load generator runs on the same cores as the servers")
    console.print("versions: " + ", ".join(f"{k} {v}" for k, v in info["versions"].items() if v))
    console.print(f"background: other processes kept {background_cores:.2f} of {info['cpus']} cores busy during "
                  f"the measurements{' (noisy: repeat on a quiet machine)' if background_cores > 0.2 else ''}")

    latency = Table(title=f"Latency, sequential on one keep-alive connection: {args.requests} chat requests "
                          f"and {args.stream_requests} streaming ones per target (ms)")
    for column in ("target", "p50", "p99", "added p50", "added p99", "x direct p50", "TTFC p50",
                   "added TTFC p50", "server CPU/req"):
        latency.add_column(column, justify="left" if column == "target" else "right")
    for name, r in results.items():
        base = name == "direct"
        latency.add_row(name, f"{r['p50_ms']:.3f}", f"{r['p99_ms']:.3f}",
                        "-" if base else f"{r['added_p50_ms']:+.3f}", "-" if base else f"{r['added_p99_ms']:+.3f}",
                        "-" if base else f"{r['ratio_p50']:.1f}", f"{r['first_chunk_p50_ms']:.3f}",
                        "-" if base else f"{r['added_first_chunk_p50_ms']:+.3f}",
                        f"{r['server_cpu_ms_per_req']:.3f}")
    console.print(latency)
    console.print("added = target minus direct; TTFC = time to the first streamed body chunk; server CPU = "
                  "user+system time of the server's processes (mock excluded; Flywheel's store process included) "
                  "per request, deferred work included")

    top = args.concurrency[-1]
    throughput = Table(title=f"Throughput, {args.duration_s:g} s per run (req/s; the whole 2-core box: "
                             f"client, gateway and mock together)")
    for column in ("target", *(f"c={c}" for c in args.concurrency), f"deferred CPU c={top} (s)",
                   f"sustained c={top}", f"server CPU/req c={top} (ms)", f"client CPU/req c={top} (ms)"):
        throughput.add_column(column, justify="left" if column == "target" else "right")
    for name, r in results.items():
        t = r["throughput"]
        throughput.add_row(name, *(f"{t[str(c)]['req_per_s']:.0f}" for c in args.concurrency),
                           f"{t[str(top)]['deferred_cpu_s']:.2f}", f"{t[str(top)]['sustained_req_per_s']:.0f}",
                           f"{t[str(top)]['server_cpu_ms_per_req']:.3f}",
                           f"{t[str(top)]['client_cpu_ms_per_req']:.3f}")
    console.print(throughput)
    console.print("deferred CPU = CPU seconds the servers spent once the run ended (deferred work, e.g. "
                  "capture writes); sustained = requests / (run + deferred CPU)")
    if litellm_missing:
        console.print(f"LiteLLM not measured: {litellm_missing}")
    verdicts = [verdict_line(results, name) for name in ("flywheel", NO_CAPTURE) if name in results]
    for line in verdicts:
        console.print(line)
    return verdicts


def main() -> None:
    args = parse_args()
    run_name = f"gateway_overhead__{int(time.time())}"
    run_started = time.perf_counter()
    workdir = Path(tempfile.mkdtemp(prefix=run_name + "_"))
    servers: list[Server] = []
    litellm_missing: str | None = None if args.litellm else "skipped (--no-litellm)"
    try:
        # TRY NOT TO MODIFY: start the mock, then both gateways at once (LiteLLM's import is slow)
        mock = start_mock(workdir)
        servers.append(mock)
        mock.wait_ready("/v1/models", args.startup_timeout_s)
        flywheel = start_flywheel(workdir, mock.port)
        servers.append(flywheel)
        litellm: Server | None = None
        master_key = "sk-bench-" + secrets.token_hex(16)
        if args.litellm:
            if importlib.util.find_spec("litellm") is None:
                litellm_missing = "litellm is not installed: pip install -e '.[bench]'"
            else:
                litellm = start_litellm(workdir, mock.port, master_key)
                servers.append(litellm)
        flywheel.wait_ready("/healthz", args.startup_timeout_s)
        targets = [Target("direct", mock.port, mock.pids),
                   Target("flywheel", flywheel.port, flywheel.pids),
                   Target(NO_CAPTURE, flywheel.port, flywheel.pids,
                          headers={"x-flywheel-capture": "off"})]
        if litellm is not None:
            try:
                litellm.wait_ready("/health/liveliness", args.startup_timeout_s)
                targets.append(Target("litellm", litellm.port, litellm.pids, api_key=master_key))
            except RuntimeError as exc:  # e.g. litellm without the [proxy] extra: an ImportError in its log
                litellm_missing = f"the proxy did not start ({exc}); pip install -e '.[bench]'"
                litellm.stop()
        print(f"{run_name}: servers up ({', '.join(f'{s.name} :{s.port}' for s in servers)}); "
              f"logs in {workdir}", flush=True)

        try:
            import uvloop
        except ImportError:
            background_cores = asyncio.run(measure(targets, args))
        else:
            background_cores = uvloop.run(measure(targets, args))

        results = summarize(targets, args)
        info = machine()
        verdicts = print_report(results, args, info, litellm_missing, background_cores)
        print(f"{run_name}: {time.perf_counter() - run_started:.0f} s in all, start-up included")
        if args.json:
            Path(args.json).write_text(json.dumps(
                {"run_name": run_name, "args": dataclasses.asdict(args), "machine": info, "results": results,
                 "background_cores": background_cores, "litellm_missing": litellm_missing,
                 "verdicts": verdicts}, indent=2) + "\n")
            print(f"results written to {args.json}")
    finally:
        for server in reversed(servers):
            server.stop()
        if not args.keep_logs:
            import shutil

            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
