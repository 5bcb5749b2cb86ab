"""Gateway replicas on one PostgreSQL store: throughput with one replica vs two, and the linker's lookup time.

    python -m bench.replicas                       # ~3.5 min on 2 cores: both parts, three tables
    python -m bench.replicas --out replicas.json   # also the raw numbers
    python -m bench.replicas --quick               # smoke run (~1 min): short windows, 1k and 10k turns
    python -m bench.replicas --parts throughput --upstream fixed --rounds 4   # every answer the same
    python -m bench.replicas --parts lookups --turns 1000,100000,1000000
    python -m bench.replicas --parts conversations --runs 10   # tool-using conversations, whole or split

It starts a throwaway PostgreSQL cluster (``initdb`` + ``pg_ctl`` on a free loopback port, as
``tests/postgres.py`` does, but with PostgreSQL's default durability: fsync and synchronous commit
on), an upstream and gateways (``python -m flywheel.gateway serve``, capture on, ``[capture] database`` a
PostgreSQL URL, the loop off), and stops them all by their handles at the end. The upstream is the
fast mock (``bench/mock_openai_server.py``) with one change by default (``--upstream echo``): a chat
answer names the question it answers, so answers differ between conversations as an LLM's do;
``--upstream fixed`` is the mock as it is, the same five-token reply to every request.

1. Throughput, one replica vs two. Three gateways run throughout: ``one`` on database ``one``, and
   ``two-a`` and ``two-b`` on database ``two``. ``--concurrency`` clients each hold a multi-turn
   conversation (``--conversation-turns`` requests; each sends the whole history back, so every turn
   after the first continues the one before it), then start the next; closed loop, back to back, on
   raw keep-alive connections (``bench/gateway_overhead.py``'s client, ~0.05 ms of CPU a request).
   Every phase the clients switch configuration at their next conversation: all turns to ``one``,
   or each conversation's turns alternating between ``two-a`` and ``two-b`` (the case a load balancer
   without affinity makes; docs/deploy.md). After ``--warmup-s`` unmeasured (longer than the store's
   1-s batches) requests are counted for ``--seconds``. ``--rounds`` rounds, the two phases of a
   round in ABBA order: the ratio two/one is the median of the rounds' ratios, so the machine's drift
   lands on both. CPU per request by process group comes from ``/proc`` (schedstat); the capture
   backlog (turns answered in a configuration and not in its database yet: ``count(*)``) is read at
   each window's end. After the load the clients finish their conversations, the script waits
   until every store process has written what it was sent (up to ``--drain-timeout-s``), stops the
   gateways (each store process writes what it holds), and then every turn sent must be stored and
   every conversation be one trajectory of ``--conversation-turns`` turns: the run fails otherwise.
2. Linker lookup per request against stores of ``--turns`` turns (one database each on the same
   server). The bulk are synthetic turns inserted by SQL into the real schema (5 per trajectory, real
   hash formats; one in ten gave the same greeting answer); 100 two-turn conversations are written
   through the real prepare + write path (``Store.write_turns``). A lookup is what the store process
   does for a request, as a batch of one: ``TrajectoryLinker(session, lock=True)`` (the PostgreSQL
   setting), ``prefetch`` and ``link``, in a transaction that is then rolled back (so each lookup sees
   the same store). ``continuing``: the next request of one of those conversations (its last
   assistant prefix is stored: one ``h_out`` probe, the trajectory locked ``FOR UPDATE``, its turns'
   children read). ``unknown history``: a request with three assistant messages no stored turn gave
   (the ``h_out`` probe, the ``h_answer`` probe and the older prefixes all miss: a new trajectory).
   ``popular answer``: a new conversation (its system prompt carries the time) whose one answer is the
   greeting a tenth of the stored turns gave (the tail rule reads all of them, finds them ambiguous:
   a new trajectory). A first request (no assistant message) makes no query. The sizes take turns, 50
   lookups at a time (10 for ``popular answer``). ``EXPLAIN`` shows how PostgreSQL runs each of the
   linker's queries at each size (after ``ANALYZE``, what autovacuum does within a minute of a bulk
   load).
3. Whole conversations (``--parts conversations``, not in the default run): what a new user tries. ``--runs``
   runs, each of ``--conversations`` tool-using conversations, ``--concurrency`` at a time, each conversation's
   requests alternating between ``two-a`` and ``two-b`` (database ``conv_two``); run 0 also sends the same
   conversations to one replica (``conv_one``). A conversation is ``--user-turns`` questions; each is two requests
   (the upstream answers a question with a tool call, the tool result with text), so a conversation holds
   ``2 x --user-turns`` turns. After each run the script waits until every turn sent is stored, then counts the
   conversations stored whole: all their turns in one trajectory that holds nothing else.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import pwd
import random
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import orjson
import psutil
import psycopg
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from sqlalchemy import bindparam, text
from sqlalchemy import select as sa_select
from sqlalchemy.dialects import postgresql

from bench.capture import thread_cpu_s
from bench.gateway_overhead import Connection, Server, Target, free_port, percentile, spawn, start_mock
from flywheel.capture import linker as linker_module
from flywheel.capture.canonical import message_hash
from flywheel.capture.linker import TrajectoryLinker
from flywheel.capture.store import Store
from flywheel.capture.turns import CapturedExchange, PreparedTurn, prepare_turns

MODES = ("one replica", "two replicas")
PARTS = ("throughput", "lookups", "conversations")


@dataclass
class Args:
    seconds: float = 5.0
    """measured window of each throughput phase"""
    warmup_s: float = 2.5
    """unmeasured load after each switch (the store's batches are 1 s; a held turn waits for its parent)"""
    rounds: int = 10
    """throughput rounds: one phase of each configuration, in ABBA order"""
    concurrency: int = 16
    """concurrent conversations"""
    conversation_turns: int = 4
    """requests per conversation"""
    upstream: str = "echo"
    """echo: each answer names the question it answers (answers differ, as an LLM's do); fixed: the mock's one
    reply to every request"""
    drain_timeout_s: float = 180.0
    """after the load: how long to wait for every store process to write what it was sent"""
    turns: tuple[int, ...] = (1_000, 100_000)
    """stored turns for the lookup measurement"""
    lookups: int = 1000
    """lookups timed per store size and request kind"""
    popular_lookups: int = 50
    """lookups timed per store size for the ``popular answer`` kind (slow on a large store)"""
    conversations: int = 200
    """conversations per run (``conversations`` part)"""
    user_turns: int = 6
    """questions per conversation (``conversations`` part): two requests each, a tool call and its answer"""
    runs: int = 1
    """runs of the ``conversations`` part"""
    parts: tuple[str, ...] = ("throughput", "lookups")
    out: str | None = None
    """also write the results here (JSON)"""
    keep_logs: bool = False
    """keep the work directory (configs, gateway and PostgreSQL logs)"""


def parse_args() -> Args:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=Args.seconds, help="measured window of each phase")
    parser.add_argument("--warmup-s", type=float, default=Args.warmup_s, help="unmeasured load after each switch")
    parser.add_argument("--rounds", type=int, default=Args.rounds, help="ABBA rounds of the two configurations")
    parser.add_argument("--concurrency", type=int, default=Args.concurrency, help="concurrent conversations")
    parser.add_argument("--conversation-turns", type=int, default=Args.conversation_turns)
    parser.add_argument("--upstream", choices=("echo", "fixed"), default=Args.upstream,
                        help="echo: answers differ (each names its question); fixed: the mock's one reply")
    parser.add_argument("--drain-timeout-s", type=float, default=Args.drain_timeout_s)
    parser.add_argument("--turns", default=",".join(map(str, Args.turns)),
                        help="stored turns for the lookups, comma-separated")
    parser.add_argument("--lookups", type=int, default=Args.lookups, help="per size and request kind")
    parser.add_argument("--popular-lookups", type=int, default=Args.popular_lookups)
    parser.add_argument("--conversations", type=int, default=Args.conversations, help="per run (conversations part)")
    parser.add_argument("--user-turns", type=int, default=Args.user_turns, help="questions per conversation")
    parser.add_argument("--runs", type=int, default=Args.runs, help="runs of the conversations part")
    parser.add_argument("--parts", nargs="+", choices=list(PARTS), default=list(Args.parts))
    parser.add_argument("--out", default=None, help="also write the results to this JSON file")
    parser.add_argument("--keep-logs", action="store_true")
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 round of 1 s, 1k and 10k turns")
    ns = parser.parse_args()
    args = Args(seconds=ns.seconds, warmup_s=ns.warmup_s, rounds=ns.rounds, concurrency=ns.concurrency,
                conversation_turns=ns.conversation_turns, upstream=ns.upstream, drain_timeout_s=ns.drain_timeout_s,
                turns=tuple(int(n) for n in ns.turns.split(",")), lookups=ns.lookups,
                popular_lookups=ns.popular_lookups, conversations=ns.conversations, user_turns=ns.user_turns,
                runs=ns.runs, parts=tuple(ns.parts), out=ns.out, keep_logs=ns.keep_logs)
    if ns.quick:
        args.seconds, args.warmup_s, args.rounds, args.turns = 1.0, 1.5, 1, (1_000, 10_000)
        args.lookups, args.popular_lookups = 100, 20
    return args


# ---------------------------------------------------------------------------------------------
# PostgreSQL: a throwaway cluster (the approach of tests/postgres.py, default durability)
# ---------------------------------------------------------------------------------------------

class Postgres:
    """``initdb`` + ``pg_ctl start`` on a free loopback port; ``stop`` stops it and removes its directory."""

    def __init__(self) -> None:
        found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parent.parent.name))
        initdb = found[-1] if found else shutil.which("initdb")
        if initdb is None:
            raise SystemExit("PostgreSQL is not installed (no initdb): apt-get install postgresql")
        self.bin = Path(initdb).parent
        self.port = free_port()
        self.password = secrets.token_hex(16)
        self.root = Path(tempfile.mkdtemp(prefix="flywheel-bench-pg-"))
        self.data = self.root / "data"
        self.version = ""
        self.as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []  # initdb refuses root

    def start(self) -> Postgres:
        password_file = self.root / "password"
        password_file.write_text(self.password + "\n")
        if self.as_user:
            owner = pwd.getpwnam("postgres")
            for path in (self.root, password_file):
                os.chown(path, owner.pw_uid, owner.pw_gid)
        self._run("initdb", "-D", str(self.data), "-U", "flywheel", f"--pwfile={password_file}",
                  "--auth=scram-sha-256", "-E", "UTF8", "--locale=C.UTF-8")
        self._run("pg_ctl", "start", "-w", "-t", "60", "-D", str(self.data), "-l", str(self.root / "server.log"),
                  "-o", f"-p {self.port} -c listen_addresses=127.0.0.1 -c unix_socket_directories=''")
        with self._connect() as connection:
            self.version = str(connection.execute("SHOW server_version").fetchone()[0])  # type: ignore[index]
        return self

    def stop(self, keep: bool = False) -> None:
        if (self.data / "postmaster.pid").exists():
            self._run("pg_ctl", "stop", "-w", "-m", "fast", "-D", str(self.data))
        if not keep:
            shutil.rmtree(self.root, ignore_errors=True)

    def url(self, database: str) -> str:
        return f"postgresql+psycopg://flywheel:{self.password}@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str) -> str:
        with self._connect() as connection:
            connection.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def stored_turns(self, database: str) -> int:
        with self._connect(database) as connection:
            return int(connection.execute("SELECT count(*) FROM turns").fetchone()[0])  # type: ignore[index]

    def _connect(self, database: str = "postgres") -> psycopg.Connection[Any]:
        return psycopg.connect(host="127.0.0.1", port=self.port, user="flywheel", password=self.password,
                               dbname=database, autocommit=True)

    def pids(self) -> list[int]:
        """The postmaster and its children (backends, background workers): all their CPU counts."""
        postmaster = int((self.data / "postmaster.pid").read_text().split()[0])
        return [postmaster, *(p.pid for p in psutil.Process(postmaster).children())]

    def _run(self, tool: str, *arguments: str) -> None:
        done = subprocess.run([*self.as_user, str(self.bin / tool), *arguments], capture_output=True, text=True,
                              timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{tool} failed ({done.returncode}):\n{done.stdout}{done.stderr}")


# ---------------------------------------------------------------------------------------------
# 1. throughput: one replica vs two on one database
# ---------------------------------------------------------------------------------------------

def echo_upstream() -> None:
    """``python -m bench.replicas echo-upstream --port N``: the mock upstream, but a (non-streaming) chat answer
    names the last user message, so answers differ between conversations and turns as an LLM's do; a request
    with ``tools`` that ends with a user message is answered with a ``search`` tool call (a fresh call id)."""
    from bench import mock_openai_server as mock

    fixed = mock.respond

    def respond(method: bytes, path: bytes, raw_body: bytes) -> list[bytes]:
        if method == b"POST" and path.split(b"?", 1)[0] == b"/v1/chat/completions":
            try:
                body = orjson.loads(raw_body)
                if isinstance(body, dict) and not body.get("stream"):
                    question = next(m.get("content") for m in reversed(body["messages"]) if m.get("role") == "user")
                    reply = mock.chat_completion(str(body.get("model") or mock.MODEL), False, None)
                    message = reply["choices"][0]["message"]
                    if body.get("tools") and body["messages"][-1].get("role") == "user":  # look it up first
                        message["content"], reply["choices"][0]["finish_reason"] = None, "tool_calls"
                        message["tool_calls"] = [{"id": f"call_{secrets.token_hex(12)}", "type": "function",
                                                  "function": {"name": "search",
                                                               "arguments": orjson.dumps({"q": question}).decode()}}]
                    else:
                        message["content"] = f"Noted: {question}"
                    return [mock.http_response(200, orjson.dumps(reply))]
            except (orjson.JSONDecodeError, KeyError, TypeError, StopIteration, AttributeError):
                pass  # the mock answers (or refuses) it
        return fixed(method, path, raw_body)

    mock.respond = respond
    sys.argv = [sys.argv[0], *sys.argv[2:]]
    mock.main()


def start_upstream(workdir: Path, kind: str) -> Server:
    if kind == "fixed":
        return start_mock(workdir)
    return spawn("echo-upstream", [sys.executable, "-m", "bench.replicas", "echo-upstream"], workdir)


def start_gateway(name: str, workdir: Path, mock_port: int, database: str) -> Server:
    config = workdir / f"{name}.toml"
    config.write_text(textwrap.dedent(f"""\
        data_dir = "{workdir / name}"
        log_level = "warning"
        [engines.mock]
        kind = "openai"
        base_url = "http://127.0.0.1:{mock_port}/v1"
        [aliases.bench]
        engine = "mock"
        base_model = "mock-model"
        [capture]
        database = "{database}"
        [loop]
        enabled = false
        """))
    return spawn(name, [sys.executable, "-m", "flywheel.gateway", "serve", "--config", str(config)], workdir)


def stop_gateways(gateways: list[Server]) -> None:
    """SIGTERM all at once (replicas drain together: a held turn may wait for the other's last batch), then wait
    for them and their store processes. One signal each: a second one would make uvicorn exit at once."""
    children = [child for g in gateways if g.proc.poll() is None
                for child in psutil.Process(g.proc.pid).children(recursive=True)]
    for gateway in gateways:
        if gateway.proc.poll() is None:
            gateway.proc.terminate()
    for gateway in gateways:
        try:
            gateway.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            gateway.proc.kill()
            gateway.proc.wait(timeout=5)
    _, alive = psutil.wait_procs(children, timeout=60)
    for child in alive:
        child.kill()


SYSTEM = {"role": "system", "content": "You plan trips. Answer briefly."}


@dataclass
class Load:
    """The clients' shared state: which configuration they send to, and what they counted."""

    targets: dict[str, list[Target]]
    mode: str = MODES[0]
    measuring: str | None = None  # the mode whose latencies are being recorded
    stop: bool = False

    def __post_init__(self) -> None:
        self.completed = dict.fromkeys(MODES, 0)  # answered requests (all of them: warm-up too)
        self.conversations = dict.fromkeys(MODES, 0)  # finished conversations
        self.latencies: dict[str, list[float]] = {m: [] for m in MODES}
        self.serial = itertools.count()


async def client(load: Load, i: int, turns: int) -> None:
    """Conversations back to back; the configuration is read at each conversation's start."""
    while not load.stop:
        mode, number = load.mode, next(load.serial)
        targets = load.targets[mode]
        messages: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": f"Traveller {number}: a day in Lisbon?"}]
        for turn in range(turns):
            target = targets[(number + turn) % len(targets)]  # two replicas: every turn on the other one
            body = {"model": "bench", "messages": messages, "max_tokens": 16}
            sample = await target.send(i, target.raw_request(body), 30.0)
            if sample.status != 200:
                raise RuntimeError(f"{target.name}: HTTP {sample.status}: {sample.body[:300]!r}")
            answer = orjson.loads(sample.body)["choices"][0]["message"]
            messages = [*messages, {"role": "assistant", "content": answer["content"]},
                        {"role": "user", "content": f"Traveller {number}, question {turn + 1}: and then?"}]
            load.completed[mode] += 1
            if load.measuring == mode:
                load.latencies[mode].append(sample.total_s)
        load.conversations[mode] += 1


def busy_cpu_s() -> float:
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


def process_cpu_s(pid: int) -> float:
    try:
        return thread_cpu_s(pid)
    except OSError:  # a PostgreSQL backend that just exited
        return 0.0


def cpu_groups(groups: dict[str, list[int]]) -> dict[str, float]:
    out = {name: sum(map(process_cpu_s, pids)) for name, pids in groups.items()}
    out["machine"] = busy_cpu_s()
    return out


async def throughput(args: Args, workdir: Path, pg: Postgres, console: Console) -> dict[str, Any]:
    databases = {MODES[0]: "one", MODES[1]: "two"}
    urls = {mode: pg.create_database(name) for mode, name in databases.items()}
    mock = start_upstream(workdir, args.upstream)
    gateways: list[Server] = []
    try:
        mock.wait_ready("/v1/models", 60)
        gateways = [start_gateway("one", workdir, mock.port, urls[MODES[0]])]
        gateways[0].wait_ready("/healthz", 120)  # each database's schema is created once; then the replicas
        gateways += [start_gateway(name, workdir, mock.port, urls[MODES[1]]) for name in ("two-a", "two-b")]
        for gateway in gateways[1:]:
            gateway.wait_ready("/healthz", 120)
        console.log("servers up: " + ", ".join(f"{s.name} :{s.port}" for s in (mock, *gateways))
                    + f", PostgreSQL {pg.version} :{pg.port}")
        targets = {g.name: Target(g.name, g.port, []) for g in gateways}
        for target in targets.values():
            target.connections = [await Connection.open(target.port) for _ in range(args.concurrency)]
        load = Load({MODES[0]: [targets["one"]], MODES[1]: [targets["two-a"], targets["two-b"]]})

        async def backlog(mode: str) -> int:
            """Turns answered in this configuration and not in its database yet (queued, held, spooled)."""
            return load.completed[mode] - await asyncio.to_thread(pg.stored_turns, databases[mode])

        store_pids = [p.pid for g in gateways for p in psutil.Process(g.proc.pid).children(recursive=True)]
        groups = {"gateway": [g.proc.pid for g in gateways], "store": store_pids, "postgres": pg.pids(),
                  "mock": [mock.proc.pid], "client": [os.getpid()]}
        clients = asyncio.gather(*(client(load, i, args.conversation_turns) for i in range(args.concurrency)))
        windows: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
        try:
            with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                          TimeElapsedColumn(), console=console, transient=True) as progress:
                task = progress.add_task("throughput: warm-up", total=2 * args.rounds)
                for mode in MODES:  # warm-up: both configurations, unmeasured
                    load.mode = mode
                    await asyncio.sleep(max(args.warmup_s, 2.0))
                for round_index in range(args.rounds):
                    for mode in MODES if round_index % 2 == 0 else MODES[::-1]:  # ABBA
                        progress.update(task, description=f"throughput: round {round_index + 1}, {mode}")
                        load.mode = mode
                        await asyncio.sleep(args.warmup_s)
                        groups["postgres"] = pg.pids()  # backends come and go with the pools
                        n0, cpu0, t0 = load.completed[mode], cpu_groups(groups), time.perf_counter()
                        load.measuring = mode
                        await asyncio.sleep(args.seconds)
                        load.measuring = None
                        n, elapsed, cpu1 = load.completed[mode] - n0, time.perf_counter() - t0, cpu_groups(groups)
                        used = {name: cpu1[name] - cpu0[name] for name in cpu0}
                        ours = sum(v for name, v in used.items() if name != "machine")
                        windows[mode].append({"req_per_s": n / elapsed, "requests": n,
                                              "capture_backlog": await backlog(mode),
                                              **{f"{name}_cpu_ms": 1000 * used[name] / n for name in groups},
                                              "other_cores": max(0.0, used["machine"] - ours) / elapsed})
                        progress.advance(task)
        finally:
            load.stop = True
            await clients  # every client finishes its conversation
        for target in targets.values():
            for connection in target.connections:
                connection.close()
        console.log("load stopped; waiting for the store processes to write what they were sent")
        drain = {}
        for mode in MODES:  # how long until the database holds every turn answered
            started = time.perf_counter()
            at_stop = left = await backlog(mode)
            while left > 0 and time.perf_counter() - started < args.drain_timeout_s:
                await asyncio.sleep(0.5)
                left = await backlog(mode)
            drain[mode] = {"backlog_at_load_stop": at_stop, "seconds": time.perf_counter() - started, "left": left}
        capture_counts = {g.name: capture_metrics(g) for g in gateways}
        console.log("stopping the gateways (each store process writes what it holds)")
        stop_gateways(gateways)
        stored = {mode: stored_counts(url) for mode, url in urls.items()}
        for mode, names in ((MODES[0], ["one"]), (MODES[1], ["two-a", "two-b"])):
            stored[mode]["capture_before_stop"] = {name: capture_counts[name] for name in names}
            stored[mode]["left_in_spool"] = sum(spooled_lines(workdir / name) for name in names)
            stored[mode]["drain"] = drain[mode]
    finally:
        stop_gateways(gateways)
        mock.stop()
    ratios = [two["req_per_s"] / one["req_per_s"] for one, two in zip(*windows.values(), strict=True)]
    results: dict[str, Any] = {"windows": windows, "ratios": ratios, "ratio_two_one": statistics.median(ratios),
                               "ratio_mean": statistics.fmean(ratios),
                               "ratio_mean_se": statistics.stdev(ratios) / len(ratios) ** 0.5 if len(ratios) > 1
                               else 0.0, "modes": {}}
    for mode in MODES:
        lat = load.latencies[mode]
        results["modes"][mode] = {
            "req_per_s": statistics.median(w["req_per_s"] for w in windows[mode]),
            "p50_ms": 1000 * percentile(lat, 50), "p99_ms": 1000 * percentile(lat, 99),
            "cpu_ms_per_req": {name: statistics.median(w[f"{name}_cpu_ms"] for w in windows[mode]) for name in groups},
            "other_cores": statistics.median(w["other_cores"] for w in windows[mode]),
            "capture_backlog_max": max(w["capture_backlog"] for w in windows[mode]),
            "capture_backlog_median": statistics.median(w["capture_backlog"] for w in windows[mode]),
            "sent": load.completed[mode], "conversations": load.conversations[mode], **stored[mode]}
    return results


def capture_metrics(gateway: Server) -> dict[str, float]:
    """The gateway's capture counters (``flywheel_capture_turns_total`` by state), read before it stops."""
    body = httpx.get(f"http://127.0.0.1:{gateway.port}/metrics", timeout=10).text
    prefix = 'flywheel_capture_turns_total{state="'
    return {line[len(prefix):].split('"')[0]: float(line.rsplit(" ", 1)[1]) for line in body.splitlines()
            if line.startswith(prefix)}


def spooled_lines(data_dir: Path) -> int:
    """Turns left in a replica's spool (and files a re-ingest moved aside) once it stopped."""
    return sum(path.read_bytes().count(b"\n") for path in (data_dir / "spool").glob("turns*"))


def stored_counts(url: str) -> dict[str, Any]:
    store = Store(url)
    try:
        with store.session() as session:
            turns = session.execute(text("SELECT count(*) FROM turns")).scalar_one()
            trajectories = session.execute(text("SELECT count(*) FROM trajectories")).scalar_one()
            sizes = dict(session.execute(text("SELECT turn_count, count(*) FROM trajectories GROUP BY 1")).all())
            rules = dict(session.execute(text("SELECT link_rule, count(*) FROM turns GROUP BY 1")).all())
        return {"stored_turns": turns, "trajectories": trajectories, "trajectory_sizes": sizes, "link_rules": rules}
    finally:
        store.close()


def check_counts(args: Args, thr: dict[str, Any]) -> list[str]:
    """What went wrong, if anything: a turn sent but not stored, a conversation split or merged."""
    problems = []
    for mode, r in thr["modes"].items():
        if r["stored_turns"] != r["sent"]:
            problems.append(f"{mode}: {r['sent']} turns sent, {r['stored_turns']} stored")
        if r["trajectory_sizes"] != {args.conversation_turns: r["conversations"]}:
            problems.append(f"{mode}: {r['conversations']} conversations of {args.conversation_turns} turns, stored "
                            f"as trajectories of sizes {r['trajectory_sizes']}")
    return problems


# ---------------------------------------------------------------------------------------------
# 2. linker lookup per request vs stored turns
# ---------------------------------------------------------------------------------------------

CONVERSATIONS = 100  # two-turn conversations written through the real write path: the continuing lookups' targets
KINDS = ("continuing", "unknown history")
POPULAR = "popular answer"
# A greeting many conversations open with, and the answer they all got: one synthetic turn in POPULAR_EVERY gave it.
POPULAR_QUESTION = {"role": "user", "content": "Hi"}
POPULAR_ANSWER = {"role": "assistant", "content": "Hello! How can I help you today?"}
POPULAR_EVERY = 10


def exchange(name: str, messages: list[dict[str, Any]], answer: str) -> CapturedExchange:
    response = {"id": name, "choices": [{"index": 0, "finish_reason": "stop",
                                         "message": {"role": "assistant", "content": answer}}]}
    return CapturedExchange(completion_id=name, endpoint="chat.completions", requested_model="gpt-4o", alias="bench",
                            engine_model="mock-model", adapter_version=0, client_key_id=None,
                            request={"model": "gpt-4o", "messages": messages}, response=response,
                            created_at=datetime.now(UTC), latency_ms=1.0)


def conversation(c: int) -> list[dict[str, Any]]:
    """Conversation ``c`` up to its second answer, as its third request repeats it."""
    return [SYSTEM, {"role": "user", "content": f"Traveller {c}: a day in Lisbon?"},
            {"role": "assistant", "content": f"Traveller {c}, start at the castle, then walk down to Alfama."},
            {"role": "user", "content": f"Traveller {c}: and in the afternoon?"},
            {"role": "assistant", "content": f"Traveller {c}, take tram 28 to Estrela and the gardens there."}]


def fill(store: Store, n: int) -> dict[int, str]:
    """``n`` turns: ``n - 2 * CONVERSATIONS`` synthetic ones by SQL (older), then the conversations through
    ``Store.write_turns``; returns each conversation's trajectory id by its number."""
    synthetic = n - 2 * CONVERSATIONS
    if synthetic < 0:
        raise SystemExit(f"--turns: at least {2 * CONVERSATIONS}")
    with store.engine.begin() as connection:
        connection.execute(text("""
            INSERT INTO trajectories (id, alias, status, explicit, task_key, created_at, updated_at, closed_at,
                                      close_reason, turn_count, branch_count, latest_turn_id)
            SELECT 'traj_s' || j, 'bench', 'closed', false, 'task_s' || (j % 50),
                   TIMESTAMPTZ '2026-01-01 00:00:00+00' + j * 5 * INTERVAL '1 millisecond',
                   TIMESTAMPTZ '2026-01-01 00:00:00+00' + (j * 5 + 4) * INTERVAL '1 millisecond',
                   TIMESTAMPTZ '2026-01-01 01:00:00+00', 'idle', least(5, :n - 5 * j), 1,
                   'turn_s' || (least(5 * j + 4, :n - 1))
            FROM generate_series(0, (:n + 4) / 5 - 1) j"""), {"n": synthetic})
        connection.execute(text("""
            INSERT INTO turns (id, trajectory_id, parent_turn_id, depth, choice_index, completion_id, source,
                               endpoint, created_at, latency_ms, requested_model, alias, engine_model, adapter_version,
                               request_messages, response_message, finish_reason, prompt_tokens, completion_tokens,
                               h_ctx, h_out, task_key, redacted, h_answer, h_replied_to, link_rule)
            SELECT 'turn_s' || i, 'traj_s' || (i / 5), CASE WHEN i % 5 = 0 THEN NULL ELSE 'turn_s' || (i - 1) END,
                   i % 5, 0, 'chatcmpl-s' || i, 'client', 'chat.completions',
                   TIMESTAMPTZ '2026-01-01 00:00:00+00' + i * INTERVAL '1 millisecond', 1.0, 'gpt-4o', 'bench',
                   'mock-model', 0,
                   json_build_array(json_build_object('role', 'user', 'content', 'Question ' || i || ', museums?')),
                   json_build_object('role', 'assistant', 'content', 'Answer ' || i || ': the museum opens at ten.'),
                   'stop', 100, 20, encode(sha256(convert_to('ctx' || i, 'UTF8')), 'hex'),
                   encode(sha256(convert_to('out' || i, 'UTF8')), 'hex'), 'task_s' || (i / 5 % 50), false,
                   CASE WHEN i % :every = 0 THEN :answer ELSE encode(sha256(convert_to('answer' || i, 'UTF8')), 'hex')
                   END,
                   CASE WHEN i % :every = 0 THEN :question ELSE encode(sha256(convert_to('asked' || i, 'UTF8')), 'hex')
                   END,
                   CASE WHEN i % 5 = 0 THEN 'new' ELSE 'prefix' END
            FROM generate_series(0, :n - 1) i"""), {"n": synthetic, "every": POPULAR_EVERY,
                                                    "answer": message_hash(POPULAR_ANSWER),
                                                    "question": message_hash(POPULAR_QUESTION)})
    for turn in (0, 1):  # the first turns, then the second ones: the real path links them
        store.write_turns([item for c in range(CONVERSATIONS) for item in prepare_turns(
            exchange(f"chatcmpl-c{c}-{turn}", conversation(c)[:2 + 2 * turn], conversation(c)[2 + 2 * turn]["content"]),
            None)])
    with store.engine.connect() as connection:
        connection.execution_options(isolation_level="AUTOCOMMIT").execute(text("ANALYZE"))
        rows = connection.execute(text("SELECT completion_id, trajectory_id FROM turns WHERE completion_id LIKE "
                                       "'chatcmpl-c%-1'")).all()
    trajectories = {int(cid.split("-")[1].removeprefix("c")): trajectory for cid, trajectory in rows}
    assert len(trajectories) == CONVERSATIONS and len(set(trajectories.values())) == CONVERSATIONS
    return trajectories


def lookup_request(kind: str, c: int, rng: random.Random) -> PreparedTurn:
    if kind == "continuing":
        messages = [*conversation(c), {"role": "user", "content": f"Traveller {c}: and on Sunday?"}]
    elif kind == POPULAR:  # a new conversation (its system prompt carries the time) that opened with the greeting
        messages = [{"role": "system", "content": f"You plan trips. It is {rng.getrandbits(32)}."}, POPULAR_QUESTION,
                    POPULAR_ANSWER, {"role": "user", "content": "A day in Porto?"}]
    else:  # a history no stored turn gave: every probe misses
        tag = rng.getrandbits(64)
        messages = [SYSTEM, *(m for k in range(3) for m in (
            {"role": "user", "content": f"Stranger {tag}: question {k}?"},
            {"role": "assistant", "content": f"Stranger {tag}, answer {k}: something long enough to count."})),
            {"role": "user", "content": "And on Sunday?"}]
    (item,) = prepare_turns(exchange(f"chatcmpl-lookup{rng.getrandbits(64)}", messages, "Sure."), None)
    return item


def time_lookups(store: Store, kind: str, conversations: dict[int, str], count: int,
                 rng: random.Random) -> list[float]:
    """Seconds per request: a linker for a batch of one, prefetch and link, as ``Store.write_turns`` does on a shared
    store; rolled back after each, so every lookup sees the same store and no lock is kept."""
    durations = []
    with store.session() as session:
        for _ in range(count):
            c = rng.randrange(CONVERSATIONS)
            item = lookup_request(kind, c, rng)
            session.connection()  # check a connection out (the pool pings it) and begin, outside the timing
            started = time.perf_counter()
            linker = TrajectoryLinker(session, lock=True)
            linker.prefetch([item])
            turn = linker.link(item)
            durations.append(time.perf_counter() - started)
            session.rollback()
            if kind == "continuing":
                assert turn["link_rule"] == "prefix" and turn["trajectory_id"] == conversations[c], turn
            else:  # unknown, or given by many conversations (ambiguous): a trajectory of its own
                assert turn["link_rule"] == "new", turn
    return durations


def plans(store: Store) -> dict[str, str]:
    """How PostgreSQL runs each of the linker's queries here: the plan's scan nodes."""
    probe: dict[str, Any] = {"hashes": ["0" * 64]}
    trajectories = linker_module._TRAJECTORIES
    lock_query = (sa_select(*trajectories.columns).where(trajectories.c.id.in_(["traj_x"]))
                  .order_by(trajectories.c.id).with_for_update())
    queries: dict[str, tuple[Any, dict[str, Any]]] = {
        "h_out probe": (linker_module._CANDIDATES, probe),
        "h_answer probe": (linker_module._ANSWERS, {"h": "0" * 64, "limit": linker_module.TAIL_CANDIDATES + 1}),
        "h_answer probe, popular answer": (linker_module._ANSWERS, {"h": message_hash(POPULAR_ANSWER),
                                                                    "limit": linker_module.TAIL_CANDIDATES + 1}),
        "(h_answer, h_replied_to) probe, popular answer": (
            linker_module._AGREEING, {"h": message_hash(POPULAR_ANSWER), "r": "0" * 64,
                                      "limit": linker_module.TAIL_CANDIDATES + 1}),
        "children": (linker_module._PARENTS, {"ids": ["turn_x"]}),
        "trajectories FOR UPDATE": (text(str(lock_query.compile(dialect=postgresql.dialect(),
                                                                compile_kwargs={"literal_binds": True}))), {}),
    }
    out = {}
    with store.engine.connect() as connection:
        for name, (query, params) in queries.items():
            explain = text("EXPLAIN " + query.text)
            for key, value in params.items():
                if isinstance(value, list):
                    explain = explain.bindparams(bindparam(key, expanding=True))
            lines = [row[0].strip() for row in connection.execute(explain, params)]
            out[name] = "; ".join(line.removeprefix("->").strip().split("  (")[0] for line in lines
                                  if "Scan" in line)
        connection.rollback()
    return out


LOOKUP_CHUNK, POPULAR_CHUNK = 50, 10


def lookups(args: Args, pg: Postgres, console: Console) -> dict[int, dict[str, Any]]:
    stores: dict[int, Store] = {}
    targets: dict[int, dict[int, str]] = {}
    results: dict[int, dict[str, Any]] = {}
    durations: dict[int, dict[str, list[float]]] = {n: {k: [] for k in (*KINDS, POPULAR)} for n in args.turns}
    try:
        for n in args.turns:
            started = time.perf_counter()
            stores[n] = Store(pg.create_database(f"lookup_{n}"))
            targets[n] = fill(stores[n], n)
            results[n] = {"fill_s": time.perf_counter() - started, "plans": plans(stores[n])}
            console.log(f"lookups: {n:,} turns stored in {results[n]['fill_s']:.1f} s")
        rng = random.Random(0)
        chunks = range(0, args.lookups, LOOKUP_CHUNK)
        with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                      TimeElapsedColumn(), console=console, transient=True) as progress:
            popular_chunks = range(0, args.popular_lookups, POPULAR_CHUNK)
            task = progress.add_task("lookups", total=(len(chunks) * len(KINDS) + len(popular_chunks))
                                     * len(args.turns))
            for kinds, size, total, steps in ((KINDS, LOOKUP_CHUNK, args.lookups, chunks),
                                              ((POPULAR,), POPULAR_CHUNK, args.popular_lookups, popular_chunks)):
                for round_index, start in enumerate(steps):
                    shift = round_index % len(args.turns)
                    for n in args.turns[shift:] + args.turns[:shift]:  # the sizes take turns: drift lands on all
                        for kind in kinds:
                            count = min(size, total - start)
                            durations[n][kind] += time_lookups(stores[n], kind, targets[n], count, rng)
                            progress.advance(task)
    finally:
        for store in stores.values():
            store.close()
    for n, by_kind in durations.items():
        for kind, values in by_kind.items():
            results[n][kind] = {"p50_us": 1e6 * percentile(values, 50), "p99_us": 1e6 * percentile(values, 99),
                                "mean_us": 1e6 * statistics.fmean(values), "lookups": len(values)}
    return results


# ---------------------------------------------------------------------------------------------
# 3. whole conversations: tool-using conversations alternating between two replicas
# ---------------------------------------------------------------------------------------------

AGENT = {"role": "system", "content": "You plan trips. Look things up with search before you answer."}
SEARCH = {"type": "function", "function": {"name": "search", "description": "Search the travel guide.",
                                           "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}


async def tool_conversation(targets: list[Target], slot: int, number: int, user_turns: int) -> None:
    """One conversation: each question is answered with a tool call, the tool's result with text; every request
    goes to the next target."""
    messages: list[dict[str, Any]] = [AGENT]
    for request in range(2 * user_turns):
        if request % 2 == 0:
            messages.append({"role": "user", "content": f"Traveller {number}, question {request // 2}: what to see?"})
        target = targets[(number + request) % len(targets)]
        body = {"model": "bench", "messages": messages, "tools": [SEARCH], "max_tokens": 16}
        sample = await target.send(slot, target.raw_request(body), 30.0)
        if sample.status != 200:
            raise RuntimeError(f"{target.name}: HTTP {sample.status}: {sample.body[:300]!r}")
        reply = orjson.loads(sample.body)
        answer = {k: v for k, v in reply["choices"][0]["message"].items() if v is not None and v != []}
        messages.append(answer)
        for call in answer.get("tool_calls", ()):
            messages.append({"role": "tool", "tool_call_id": call["id"],
                             "content": f"Guide for traveller {number}: the castle, then Alfama."})


async def replay(targets: list[Target], args: Args, numbers: range) -> None:
    """``args.conversations`` conversations, ``args.concurrency`` at a time (one connection per slot)."""
    slots: asyncio.Queue[int] = asyncio.Queue()
    for slot in range(args.concurrency):
        slots.put_nowait(slot)

    async def one(number: int) -> None:
        slot = await slots.get()
        try:
            await tool_conversation(targets, slot, number, args.user_turns)
        finally:
            slots.put_nowait(slot)

    await asyncio.gather(*map(one, numbers))


def whole_conversations(url: str, numbers: range, turns: int) -> dict[str, Any]:
    """How conversations ``numbers`` were stored: whole (all their ``turns`` turns in one trajectory that holds
    nothing else, each continuing the one before it: request ``k`` holds ``2k + 2`` messages and sits at depth
    ``k``) or not (split into several trajectories, or branched in one). A turn is told to its conversation by its
    first question (the upstream's completion ids are all the same)."""
    store = Store(url)
    try:
        with store.session() as session:
            rows = session.execute(text("SELECT trajectory_id, link_rule, request_messages->1->>'content', depth, "
                                        "json_array_length(request_messages) FROM turns")).all()
    finally:
        store.close()
    mine: dict[int, list[str]] = {n: [] for n in numbers}
    owners: dict[str, set[int]] = {}
    rules: dict[str, int] = {}
    misplaced: set[int] = set()  # conversations with a turn that does not continue the one before it
    for trajectory, rule, question, depth, length in rows:
        number = int(question.split(",")[0].removeprefix("Traveller "))
        owners.setdefault(trajectory, set()).add(number)
        if number in mine:
            mine[number].append(trajectory)
            rules[rule] = rules.get(rule, 0) + 1
            if depth != length // 2 - 1:
                misplaced.add(number)
    pieces = [len(set(t)) for n, t in mine.items()
              if not (len(t) == turns and len(set(t)) == 1 and len(owners[t[0]]) == 1 and n not in misplaced)]
    return {"conversations": len(numbers), "whole": len(numbers) - len(pieces), "split_into": sorted(pieces),
            "branched": len(misplaced), "link_rules": rules}


async def wait_stored(pg: Postgres, database: str, turns: int, timeout_s: float) -> float:
    """Seconds until ``database`` holds ``turns`` turns (raises after ``timeout_s``)."""
    started = time.perf_counter()
    while (stored := await asyncio.to_thread(pg.stored_turns, database)) < turns:
        if time.perf_counter() - started > timeout_s:
            raise RuntimeError(f"{database}: {stored} of {turns} turns stored after {timeout_s:.0f} s")
        await asyncio.sleep(0.2)
    return time.perf_counter() - started


async def conversations_part(args: Args, workdir: Path, pg: Postgres, console: Console) -> dict[str, Any]:
    urls = {name: pg.create_database(name) for name in ("conv_one", "conv_two")}
    mock = start_upstream(workdir, "echo")
    gateways: list[Server] = []
    runs: list[dict[str, Any]] = []
    try:
        mock.wait_ready("/v1/models", 60)
        gateways = [start_gateway("c-one", workdir, mock.port, urls["conv_one"])]
        gateways[0].wait_ready("/healthz", 120)
        gateways += [start_gateway(name, workdir, mock.port, urls["conv_two"]) for name in ("c-two-a", "c-two-b")]
        for gateway in gateways[1:]:
            gateway.wait_ready("/healthz", 120)
        targets = {g.name: Target(g.name, g.port, []) for g in gateways}
        for target in targets.values():
            target.connections = [await Connection.open(target.port) for _ in range(args.concurrency)]
        sent = dict.fromkeys(urls, 0)
        for run in range(args.runs):
            configurations = [("conv_two", [targets["c-two-a"], targets["c-two-b"]])]
            if run == 0:
                configurations.insert(0, ("conv_one", [targets["c-one"]]))
            for database, chosen in configurations:
                started = time.perf_counter()
                numbers = range(run * args.conversations, (run + 1) * args.conversations)
                await replay(chosen, args, numbers)
                replay_s = time.perf_counter() - started
                sent[database] += 2 * args.user_turns * len(numbers)
                drain_s = await wait_stored(pg, database, sent[database], args.drain_timeout_s)
                counted = await asyncio.to_thread(whole_conversations, urls[database], numbers, 2 * args.user_turns)
                result = {"run": run, "database": database, "replicas": len(chosen), "replay_s": replay_s,
                          "stored_after_s": drain_s, **counted}
                runs.append(result)
                console.log(f"run {run}, {len(chosen)} replica(s): {counted['whole']} of {counted['conversations']} "
                            f"conversations whole ({counted['branched']} with a misplaced turn; not whole ones in "
                            f"{counted['split_into']} trajectories); replayed in "
                            f"{replay_s:.1f} s, all stored {drain_s:.1f} s later; rules {counted['link_rules']}")
        for target in targets.values():
            for connection in target.connections:
                connection.close()
    finally:
        stop_gateways(gateways)
        mock.stop()
    return {"runs": runs}


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------

def machine(pg: Postgres) -> dict[str, Any]:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), "")
    return {"cpus": os.cpu_count(), "cpu_model": model, "python": platform.python_version(),
            "postgresql": pg.version, "load_average_at_start": os.getloadavg()}


def print_throughput(console: Console, args: Args, thr: dict[str, Any]) -> None:
    table = Table(title=f"Throughput with capture on, {args.concurrency} concurrent conversations of "
                        f"{args.conversation_turns} turns, {args.upstream} upstream (median of {args.rounds} windows "
                        f"of {args.seconds:g} s; CPU in ms per request; backlog: turns not yet written at a window's "
                        f"end)")
    for column in ("configuration", "req/s", "p50 ms", "p99 ms", "gateways CPU", "store processes CPU",
                   "PostgreSQL CPU", "upstream + client CPU", "other processes (cores)",
                   "capture backlog (median / max)"):
        table.add_column(column, justify="right")
    for mode, r in thr["modes"].items():
        cpu = r["cpu_ms_per_req"]
        table.add_row(mode, f"{r['req_per_s']:.0f}", f"{r['p50_ms']:.2f}", f"{r['p99_ms']:.2f}",
                      f"{cpu['gateway']:.3f}", f"{cpu['store']:.3f}", f"{cpu['postgres']:.3f}",
                      f"{cpu['mock'] + cpu['client']:.3f}", f"{r['other_cores']:.2f}",
                      f"{r['capture_backlog_median']:,.0f} / {r['capture_backlog_max']:,.0f}")
    console.print(table)
    quartiles = statistics.quantiles(thr["ratios"], n=4) if len(thr["ratios"]) > 1 else thr["ratios"] * 3
    console.print(f"two replicas / one, median of {args.rounds} paired rounds: {thr['ratio_two_one']:.3f}; "
                  f"quartiles {quartiles[0]:.3f}-{quartiles[2]:.3f}; mean {thr['ratio_mean']:.3f} "
                  f"+- {thr['ratio_mean_se']:.3f} (standard error)")
    for mode, r in thr["modes"].items():
        d = r["drain"]
        console.print(f"{mode}: after the load, {d['backlog_at_load_stop']:,.0f} turns were still to write; "
                      + (f"written in {d['seconds']:.1f} s" if not d["left"] else
                         f"{d['left']:,.0f} still not written after {d['seconds']:.0f} s (the stop may lose them)"))
    counts = Table(title="Stored after the gateways stopped (the whole run, warm-up included)")
    for column in ("configuration", "turns sent", "turns stored", "left in spool", "conversations", "trajectories",
                   "trajectories by turn count", "turns by link rule"):
        counts.add_column(column, justify="right")
    for mode, r in thr["modes"].items():
        counts.add_row(mode, f"{r['sent']:,}", f"{r['stored_turns']:,}", f"{r['left_in_spool']:,}",
                       f"{r['conversations']:,}",
                       f"{r['trajectories']:,}", ", ".join(f"{k}: {v:,}" for k, v in r["trajectory_sizes"].items()),
                       ", ".join(f"{k}: {v:,}" for k, v in r["link_rules"].items()))
    console.print(counts)
    for mode, r in thr["modes"].items():
        by_gateway = r["capture_before_stop"].items()
        console.print(f"{mode}, capture counters before the stop: " + "; ".join(
            f"{name}: " + ", ".join(f"{k} {v:,.0f}" for k, v in c.items()) for name, c in by_gateway))


def print_lookups(console: Console, args: Args, results: dict[int, dict[str, Any]]) -> dict[str, float]:
    table = Table(title=f"Linker lookup per request on PostgreSQL ({args.lookups} requests per size and kind; "
                        f"{args.popular_lookups} with a popular answer)")
    for column in ("stored turns", "request", "p50 us", "p99 us", "mean us", "fill s"):
        table.add_column(column, justify="right")
    for n, r in results.items():
        for kind in (*KINDS, POPULAR):
            row = r[kind]
            table.add_row(f"{n:,}", kind, f"{row['p50_us']:.0f}", f"{row['p99_us']:.0f}", f"{row['mean_us']:.0f}",
                          f"{r['fill_s']:.1f}")
    console.print(table)
    small, large = min(results), max(results)
    growth = {kind: results[large][kind]["p50_us"] / results[small][kind]["p50_us"] for kind in (*KINDS, POPULAR)}
    for kind, ratio in growth.items():
        console.print(f"{kind}: lookup p50 {large:,} / {small:,} turns = {ratio:.2f}x")
    for n, r in results.items():
        console.print(f"plans at {n:,} turns: " + " | ".join(f"{name}: {plan}" for name, plan in r["plans"].items()))
    return growth


def main() -> None:
    if sys.argv[1:2] == ["echo-upstream"]:
        echo_upstream()
        return
    args = parse_args()
    console = Console(width=170, highlight=False)
    started = time.perf_counter()
    workdir = Path(tempfile.mkdtemp(prefix="flywheel-bench-replicas-"))
    pg = Postgres()
    results: dict[str, Any] = {"args": asdict(args)}
    problems: list[str] = []
    try:
        pg.start()
        results["machine"] = info = machine(pg)
        console.print(f"machine: {info['cpus']} cores ({info['cpu_model']}), Python {info['python']}, PostgreSQL "
                      f"{info['postgresql']} (default durability) on loopback; client, mock, gateways and PostgreSQL "
                      f"share the cores; load average at start {info['load_average_at_start'][0]:.2f}")
        if "throughput" in args.parts:
            try:
                import uvloop
            except ImportError:
                thr = asyncio.run(throughput(args, workdir, pg, console))
            else:
                thr = uvloop.run(throughput(args, workdir, pg, console))
            results["throughput"] = thr
            print_throughput(console, args, thr)
            problems = check_counts(args, thr)
            console.print("; ".join(problems) if problems else
                          "every turn sent was stored; every conversation is one trajectory (none split or merged)")
        if "conversations" in args.parts:
            results["conversations"] = asyncio.run(conversations_part(args, workdir, pg, console))
            split = [r for r in results["conversations"]["runs"] if r["whole"] != r["conversations"]]
            console.print(f"{len(split)} of {len(results['conversations']['runs'])} runs had a split conversation")
            problems += [f"run {r['run']} ({r['replicas']} replicas): {r['whole']} of {r['conversations']} whole"
                         for r in split]
        if "lookups" in args.parts:
            results["lookups"] = lookups(args, pg, console)
            results["lookup_growth"] = print_lookups(console, args, results["lookups"])
        console.print(f"{time.perf_counter() - started:.0f} s in all, start-up included")
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=2, default=str) + "\n")
            console.print(f"results written to {args.out}")
    finally:
        pg.stop(keep=args.keep_logs)
        if args.keep_logs:
            console.print(f"logs kept: {workdir}, {pg.root}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    if problems:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
