"""Soak: a fixed request rate through the gateway for minutes; memory, latency and lost turns over time.

    python -m bench.soak                        # 10 minutes at 20 requests/s
    python -m bench.soak --minutes 2 --rate 10  # a quick look
    python -m bench.soak --trace-malloc 10      # the store process under tracemalloc (slower: a diagnosis, not a run)

Everything a deployment runs, on loopback: the gateway with capture and the loop on (idle
close, group formation, scoring with a judge stand-in; training is never due), in front of a
scripted upstream (``tests/scripted_openai.py``, in a process of its own, so the gateway is what
is measured). The load is open-loop: conversations start on a fixed schedule whatever the
latency, each three requests — a weather question answered with a tool call, the tool's result,
a follow-up — half of them streamed, some under an explicit trajectory id, cities drawn from a
small set so the same task recurs and groups form; a fifth end with client feedback.

Printed per window: requests, failures, p50 and p99 latency, the RSS of the gateway and of the
store process; then each RSS's slope in MB per hour (least squares over the samples after the
warm-up), what the store process holds at the start and at the end (``GET /internal/memory``:
DuckDB's memory by tag, Python objects by type, tracemalloc's sites when tracing), and the
turns lost: every completion id the clients got, per conversation, against the store file read
after the gateway stopped (SIGTERM drains), and the conversations whose turns landed in more
than one trajectory.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
from rich.console import Console
from rich.table import Table

from flywheel.gateway.core.processes import NotAnswering, free_ports, wait_until_answering

CITIES = ("Paris", "Lima", "Oslo", "Kyoto", "Quito", "Accra", "Perth", "Turin", "Hanoi", "Cusco")
SYSTEM = {"role": "system", "content": "You are a travel agent. Use the weather tool before you answer."}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather for a city.",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]


@dataclass
class Args:
    minutes: float = 10.0
    rate: float = 20.0  # requests per second, all conversations together
    window_s: float = 60.0  # the printed table's rows
    sample_s: float = 5.0  # RSS sampling period
    warmup_s: float = 60.0  # slopes and the first memory report start after this
    seed: int = 0
    trace_malloc: int = 0  # frames per tracemalloc trace in the store process (0: off)
    json_out: str | None = None


@dataclass
class Sent:
    """One conversation as its client saw it."""

    completion_ids: list[str] = field(default_factory=list)
    explicit_id: str | None = None
    failed: int = 0


@dataclass
class Run:
    latencies: list[tuple[float, float, bool]] = field(default_factory=list)  # (start offset, seconds, ok)
    rss: list[tuple[float, int, int]] = field(default_factory=list)  # (offset, gateway bytes, store bytes)
    memory: list[tuple[float, dict[str, Any]]] = field(default_factory=list)  # (offset, the store's /internal/memory)
    conversations: list[Sent] = field(default_factory=list)


def parse_args(argv: list[str] | None = None) -> tuple[Args, list[int] | None]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, value in asdict(Args()).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value) if value is not None else str,
                            default=value)
    parser.add_argument("--stand-ins", type=int, nargs=2, metavar=("UPSTREAM_PORT", "JUDGE_PORT"),
                        help=argparse.SUPPRESS)  # the child process that serves the upstream and the judge
    ns = vars(parser.parse_args(argv))
    stand_ins = ns.pop("stand_ins")
    return Args(**ns), stand_ins


# -- the stand-ins (a child process) ------------------------------------------------------------------------

def serve_stand_ins(upstream_port: int, judge_port: int) -> None:
    from tests.scripted_judge import ScriptedJudge
    from tests.scripted_openai import ScriptedOpenAI

    with ScriptedOpenAI(reply=agent_reply, port=upstream_port) as upstream, ScriptedJudge(port=judge_port) as judge:
        while True:
            time.sleep(30)
            upstream.requests.clear()  # the stand-ins keep every request; the soak would measure that otherwise
            judge.requests.clear()


def agent_reply(body: dict[str, Any]) -> Any:
    from tests.scripted_openai import Reply

    last = body["messages"][-1]
    if last["role"] == "tool":
        return Reply(content=f"It is {json.loads(last['content'])['sky']} there; good travels.")
    if "weather in" in str(last.get("content")):
        city = str(last["content"]).rsplit("weather in ", 1)[1].rstrip("?")
        call = {"id": f"call_{random.getrandbits(48):x}", "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}
        return Reply(content=None, tool_calls=[call], finish_reason="tool_calls")
    return Reply(content=f"Noted: {last.get('content')}")


# -- the load ------------------------------------------------------------------------------------------------

async def conversation(client: httpx.AsyncClient, number: int, rng: random.Random, run: Run, t0: float) -> None:
    sent = Sent(explicit_id=f"soak-{number}" if rng.random() < 0.3 else None)
    run.conversations.append(sent)
    stream = rng.random() < 0.5
    city = rng.choice(CITIES)
    # A trip number: identical histories may swap trajectories (docs/capture.md); the task header still groups them
    headers = {"X-Flywheel-Task": f"weather-{city}"}
    if sent.explicit_id:
        headers["X-Flywheel-Trajectory-Id"] = sent.explicit_id
    messages: list[dict[str, Any]] = [SYSTEM, {"role": "user",
                                               "content": f"Trip {number}: what is the weather in {city}?"}]
    for turn in range(3):
        body = {"model": "gpt-4o", "messages": messages, "tools": TOOLS, "stream": stream}
        started = time.monotonic()
        try:
            completion_id, message = await (_streamed(client, body, headers) if stream else
                                            _plain(client, body, headers))
        except (httpx.HTTPError, KeyError, ValueError):
            run.latencies.append((started - t0, time.monotonic() - started, False))
            sent.failed += 1
            return
        run.latencies.append((started - t0, time.monotonic() - started, True))
        sent.completion_ids.append(completion_id)
        messages = [*messages, message]
        if message.get("tool_calls"):
            messages.append({"role": "tool", "tool_call_id": message["tool_calls"][0]["id"],
                             "content": json.dumps({"sky": rng.choice(["sunny", "grey", "windy"])})})
        else:
            messages.append({"role": "user", "content": f"Thanks, and on day {turn + 2}?"})
    if rng.random() < 0.2:
        await client.post("/flywheel/v1/feedback", json={"completion_id": sent.completion_ids[-1],
                                                          "label": rng.choice(["good", "bad"])})


async def _plain(client: httpx.AsyncClient, body: dict[str, Any], headers: dict[str, str]
                 ) -> tuple[str, dict[str, Any]]:
    response = await client.post("/v1/chat/completions", json=body, headers=headers)
    response.raise_for_status()
    reply = response.json()
    message = reply["choices"][0]["message"]
    return reply["id"], {k: v for k, v in message.items() if v is not None}


async def _streamed(client: httpx.AsyncClient, body: dict[str, Any], headers: dict[str, str]
                    ) -> tuple[str, dict[str, Any]]:
    completion_id, content = "", ""
    calls: dict[int, dict[str, Any]] = {}
    async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise ValueError(chunk["error"]["message"])
            completion_id = chunk["id"]
            for choice in chunk["choices"]:
                delta = choice["delta"]
                content += delta.get("content") or ""
                for call in delta.get("tool_calls") or ():
                    calls.setdefault(call["index"], call)
    message: dict[str, Any] = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = [{k: v for k, v in call.items() if k != "index"} for call in calls.values()]
    return completion_id, message


async def drive(url: str, args: Args, run: Run, t0: float) -> None:
    """Conversations start every 3/rate seconds (three requests each) for the run's length, whatever the latency."""
    rng = random.Random(args.seed)
    interval = 3.0 / args.rate
    tasks = []
    async with httpx.AsyncClient(base_url=url, timeout=120.0,
                                 limits=httpx.Limits(max_connections=None, max_keepalive_connections=64)) as client:
        number = 0
        while (due := t0 + number * interval) < t0 + args.minutes * 60:
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            tasks.append(asyncio.create_task(conversation(client, number, random.Random(rng.random()), run, t0)))
            number += 1
        await asyncio.gather(*tasks)


async def sample_rss(gateway: psutil.Process, run: Run, t0: float, every_s: float) -> None:
    while True:
        store = _store_process(gateway)
        run.rss.append((time.monotonic() - t0, gateway.memory_info().rss, store.memory_info().rss if store else 0))
        await asyncio.sleep(every_s)


async def sample_memory(gateway: psutil.Process, run: Run, t0: float, every_s: float) -> None:
    """What the store process holds, once a window (a report walks every Python object: ~0.1 s of its CPU)."""
    while True:
        run.memory.append((time.monotonic() - t0, await asyncio.to_thread(store_memory, gateway)))
        await asyncio.sleep(every_s)


def _store_process(gateway: psutil.Process) -> psutil.Process | None:
    for child in gateway.children():
        try:
            if "flywheel.gateway.storeproc.main" in " ".join(child.cmdline()):
                return child
        except psutil.NoSuchProcess:
            continue
    return None


def store_memory(gateway: psutil.Process) -> dict[str, Any]:
    """``GET /internal/memory`` of the store process, over its own socket (the gateway does not forward it)."""
    store = _store_process(gateway)
    assert store is not None
    argv = store.cmdline()
    socket_path = argv[argv.index("--api-socket") + 1]
    with httpx.Client(transport=httpx.HTTPTransport(uds=socket_path), timeout=120.0) as client:
        report: dict[str, Any] = client.get("http://store/internal/memory").json()
    return report


# -- the run -------------------------------------------------------------------------------------------------

def start(args: Args, workdir: Path) -> tuple[subprocess.Popen[bytes], subprocess.Popen[bytes], str]:
    upstream_port, judge_port, gateway_port = free_ports(3)
    stand_ins = subprocess.Popen([sys.executable, "-m", "bench.soak", "--stand-ins", str(upstream_port),
                                  str(judge_port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    config = workdir / "flywheel.toml"
    config.write_text(f"""
data_dir = "{workdir / 'data'}"
log_level = "warning"
[engines.up]
base_url = "http://127.0.0.1:{upstream_port}/v1"
[aliases.agent]
engine = "up"
[capture]
idle_close_s = 10
[groups]
form_every_s = 5
min_size = 2
[judge]
model = "openai/judge"
api_base = "http://127.0.0.1:{judge_port}/v1"
api_key = "unused"
[loop]
enabled = true
score_every_s = 10
min_groups = 1000000
train_every_s = 1000000000
""")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    if args.trace_malloc:
        env["PYTHONTRACEMALLOC"] = str(args.trace_malloc)
    try:
        wait_until_answering(f"http://127.0.0.1:{upstream_port}", stand_ins, timeout_s=60.0, path="/v1/models")
    except NotAnswering as exc:
        raise SystemExit(f"the stand-ins did not start: {exc}") from exc
    gateway = subprocess.Popen([sys.executable, "-m", "flywheel.gateway", "serve", "--config", str(config),
                                "--port", str(gateway_port)], env=env, stdout=(workdir / "gateway.log").open("wb"),
                               stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{gateway_port}"
    try:
        wait_until_answering(url, gateway, timeout_s=120.0, require_ok=True)
    except NotAnswering as exc:
        raise SystemExit(f"the gateway did not start: {exc}: {(workdir / 'gateway.log').read_text()[-2000:]}") from exc
    if _store_process(psutil.Process(gateway.pid)) is None:  # started before the gateway answers
        raise SystemExit(f"the gateway has no store process: {(workdir / 'gateway.log').read_text()[-2000:]}")
    return stand_ins, gateway, url


def lost_turns(database: Path, conversations: list[Sent]) -> dict[str, int]:
    """Sent against stored, per conversation: completion ids never stored, and conversations split across
    trajectories (or not in the one they named)."""
    from sqlalchemy import text

    from flywheel.capture.store import Store

    store = Store(database)
    try:
        with store.engine.connect() as connection:
            rows = connection.execute(text("SELECT completion_id, trajectory_id FROM turns WHERE source = 'client'"))
            trajectory_of: dict[str, set[str]] = {}
            for completion_id, trajectory_id in rows:
                trajectory_of.setdefault(completion_id, set()).add(trajectory_id)
    finally:
        store.close()
    sent = sum(len(c.completion_ids) for c in conversations)
    lost = sum(1 for c in conversations for i in c.completion_ids if i not in trajectory_of)
    split = 0
    for c in conversations:
        trajectories = set().union(*(trajectory_of.get(i, set()) for i in c.completion_ids))
        if len(trajectories) > 1 or (c.explicit_id is not None and trajectories - {c.explicit_id}):
            split += 1
    return {"conversations": len(conversations), "requests_answered": sent, "turns_lost": lost,
            "conversations_split": split, "client_failures": sum(c.failed for c in conversations)}


def slope_mb_per_hour(points: list[tuple[float, int]]) -> float:
    if len(points) < 2:
        return float("nan")
    n = len(points)
    mean_t = sum(t for t, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    cov = sum((t - mean_t) * (y - mean_y) for t, y in points)
    var = sum((t - mean_t) ** 2 for t, _ in points)
    return cov / var * 3600 / 1e6 if var else float("nan")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def windows(run: Run, args: Args) -> list[dict[str, Any]]:
    out = []
    length = args.minutes * 60
    start = 0.0
    while start < length:
        end = start + args.window_s
        done = [(s, ok) for t, s, ok in run.latencies if start <= t < end]
        rss = [(g, st) for t, g, st in run.rss if start <= t < end]
        held = [m for t, m in run.memory if start <= t < end]
        ok = [s for s, good in done if good]
        out.append({"from_s": start, "requests": len(done), "failed": len(done) - len(ok),
                    "p50_ms": percentile(ok, 0.5) * 1e3, "p99_ms": percentile(ok, 0.99) * 1e3,
                    "gateway_rss_mb": max((g for g, _ in rss), default=0) / 1e6,
                    "store_rss_mb": max((s for _, s in rss), default=0) / 1e6,
                    "store_duckdb_mb": sum(held[-1].get("duckdb_bytes", {}).values()) / 1e6 if held else float("nan"),
                    "store_python_objects": held[-1]["python_objects"]["total"] if held else 0})
        start = end
    return out


def report(args: Args, rows: list[dict[str, Any]], run: Run, memory: dict[str, Any], lost: dict[str, int]) -> None:
    console = Console(width=160)
    table = Table(title=f"soak: {args.rate:g} requests/s for {args.minutes:g} min (load {os.getloadavg()[0]:.1f} "
                        f"at the end, {os.cpu_count()} CPUs)")
    for column in ("from", "requests", "failed", "p50 ms", "p99 ms", "gateway RSS MB", "store RSS MB",
                   "store: DuckDB MB", "store: Python objects"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(f"{row['from_s'] / 60:.1f} min", str(row["requests"]), str(row["failed"]),
                      f"{row['p50_ms']:.1f}", f"{row['p99_ms']:.1f}", f"{row['gateway_rss_mb']:.1f}",
                      f"{row['store_rss_mb']:.1f}", f"{row['store_duckdb_mb']:.1f}", str(row["store_python_objects"]))
    console.print(table)
    late = [(t, g, s) for t, g, s in run.rss if t >= args.warmup_s]
    console.print(f"RSS slope after the {args.warmup_s:.0f}-s warm-up: gateway "
                  f"{slope_mb_per_hour([(t, g) for t, g, _ in late]):+.1f} MB/h, store process "
                  f"{slope_mb_per_hour([(t, s) for t, _, s in late]):+.1f} MB/h")
    for when in ("start", "end"):
        m = memory[when]
        mb = {k: round(v / 1e6, 1) for k, v in m.get("malloc", {}).items()}
        console.print(f"store process at the {when}: RSS {m['rss_bytes'] / 1e6:.1f} MB; glibc malloc MB {mb}; "
                      f"Arrow pool MB {(m.get('arrow') or {}).get('allocated', 0) / 1e6:.1f} "
                      f"(peak {(m.get('arrow') or {}).get('peak', 0) / 1e6:.1f}); DuckDB "
                      f"{sum(m.get('duckdb_bytes', {}).values()) / 1e6:.1f} MB of {m.get('duckdb_memory_limit')} "
                      f"{m.get('duckdb_bytes')}; Python objects "
                      f"{m['python_objects']['total']}" + (f", traced {m['traced_bytes'] / 1e6:.1f} MB"
                                                            if "traced_bytes" in m else ""))
    grown = Counter(memory["end"]["python_objects"]) - Counter(memory["start"]["python_objects"])
    console.print(f"Python objects that grew most: {dict(grown.most_common(8))}")
    if "traced_sites" in memory["end"]:
        for site in memory["end"]["traced_sites"][:8]:
            console.print(f"  {site['bytes'] / 1e6:8.2f} MB  {site['blocks']:8d} blocks  {site['site']}")
    console.print(f"turns: {lost}")


async def soak(args: Args) -> None:
    with tempfile.TemporaryDirectory(prefix="flywheel-soak-") as tmp:
        workdir = Path(tmp)
        stand_ins, gateway, url = start(args, workdir)
        process = psutil.Process(gateway.pid)
        run = Run()
        memory: dict[str, Any] = {}
        try:
            t0 = time.monotonic()
            samplers = [asyncio.create_task(sample_rss(process, run, t0, args.sample_s)),
                        asyncio.create_task(sample_memory(process, run, t0, args.window_s / 2))]
            load = asyncio.create_task(drive(url, args, run, t0))
            await asyncio.sleep(args.warmup_s)
            memory["start"] = await asyncio.to_thread(store_memory, process)
            await load
            await asyncio.sleep(args.sample_s)  # the last batches reach the store
            memory["end"] = await asyncio.to_thread(store_memory, process)
            for sampler in samplers:
                sampler.cancel()
        finally:
            gateway.send_signal(signal.SIGTERM)  # the store process writes everything it was sent, then exits
            gateway.wait(timeout=120)
            stand_ins.terminate()
            stand_ins.wait(timeout=30)
        lost = lost_turns(workdir / "data" / "flywheel.duckdb", run.conversations)
        rows = windows(run, args)
        report(args, rows, run, memory, lost)
        if args.json_out:
            Path(args.json_out).write_text(json.dumps({"args": asdict(args), "windows": rows, "memory": memory,
                                                       "turns": lost, "rss": run.rss, "store_memory": run.memory},
                                                      indent=1))


def main(argv: list[str] | None = None) -> None:
    args, stand_ins = parse_args(argv)
    if stand_ins is not None:
        serve_stand_ins(*stand_ins)
        return
    asyncio.run(soak(args))


if __name__ == "__main__":
    main()
