"""What capture costs: gateway throughput with capture on vs off, linker lookups, bytes per turn.

    python -m bench.capture                               # ~6 min; prints three tables
    python -m bench.capture --sizes 1000 100000 --duration-s 2   # quicker look
    python -m bench.capture --json capture.json

1. Throughput: one gateway (upstream engine) in front of the fast mock
   (``bench/mock_openai_server.py``); clients send the same chat request at concurrency 16,
   alternately with ``X-Flywheel-Capture: off`` and without (so both share the process,
   the warm caches and the machine's noise), in rounds. The rate counted is *sustained*:
   requests divided by the load time plus the CPU time the servers (the store process
   included) spent afterwards on work they had deferred — capture work deferred past the
   window is not free. The cost is the median over rounds of each round's on/off ratio: on
   a shared 2-core VM the machine's speed drifts by +-20% within a minute, and pairing
   neighbouring runs cancels the drift.
2. Linker lookups: stores holding 1k, 100k and 1M synthetic turns (bulk-inserted with SQL
   into the real schema and indexes); each lookup is what a 4-assistant-message request
   costs: up to four probes of the ``h_out`` index through the real ``TrajectoryLinker``.
3. Bytes per 1k turns: 1000 realistic multi-turn exchanges (a ~1 KB system prompt, tool
   calls, ~150 completion token ids with logprobs each) through the real prepare + write
   path, checkpointed; the file's growth.

Targets (docs/benchmarks.md): capture costs at most 5% of throughput; lookup time grows
less than 2x from 1k to 1M turns.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from sqlalchemy import text

from bench.gateway_overhead import Args as OverheadArgs
from bench.gateway_overhead import Connection, Target, load, settle, start_flywheel, start_mock
from capture.store import Store, TrajectoryLinker
from capture.turns import CapturedExchange, PreparedTurn, prepare_turns


@dataclass
class Args:
    duration_s: float = 8.0
    """length of each throughput run"""
    rounds: int = 12
    """throughput runs per mode, alternating on/off"""
    concurrency: int = 16
    """concurrent clients in the throughput runs"""
    sizes: tuple[int, ...] = (1_000, 100_000, 1_000_000)
    """stored turns for the lookup measurement"""
    lookups: int = 2000
    """lookups timed per store size"""
    json: str | None = None
    """also write the results here"""


def parse_args() -> Args:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration-s", type=float, default=Args.duration_s)
    parser.add_argument("--rounds", type=int, default=Args.rounds)
    parser.add_argument("--concurrency", type=int, default=Args.concurrency)
    parser.add_argument("--sizes", type=int, nargs="+", default=list(Args.sizes))
    parser.add_argument("--lookups", type=int, default=Args.lookups)
    parser.add_argument("--json", default=None)
    ns = parser.parse_args()
    return Args(duration_s=ns.duration_s, rounds=ns.rounds, concurrency=ns.concurrency, sizes=tuple(ns.sizes),
                lookups=ns.lookups, json=ns.json)


# ---------------------------------------------------------------------------------------------
# 1. throughput, capture on vs off
# ---------------------------------------------------------------------------------------------

async def throughput(args: Args, workdir: Path) -> dict[str, Any]:
    mock = start_mock(workdir)
    gateway = None
    try:
        mock.wait_ready("/v1/models", 60)
        gateway = start_flywheel(workdir, mock.port)
        gateway.wait_ready("/healthz", 120)
        pids = [*gateway.pids, mock.proc.pid]  # the store process's CPU counts too
        on = Target("capture on", gateway.port, pids)
        off = Target("capture off", gateway.port, pids, headers={"x-flywheel-capture": "off"})
        body = {"model": "gpt-4o", "messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 16}
        runs: dict[str, list[float]] = {on.name: [], off.name: []}
        raw_runs: dict[str, list[float]] = {on.name: [], off.name: []}  # requests / window, nothing deferred added
        for target in (on, off):
            await load_warm(target, target.raw_request(body), args)
        for _ in range(args.rounds):
            for target in (off, on):
                result = await load(target, target.raw_request(body), args.concurrency, args.duration_s,
                                    OverheadArgs())
                runs[target.name].append(result["sustained_req_per_s"])
                raw_runs[target.name].append(result["req_per_s"])
        ratios = [on_rate / off_rate for on_rate, off_rate in zip(runs[on.name], runs[off.name], strict=True)]
        raw_ratios = [a / b for a, b in zip(raw_runs[on.name], raw_runs[off.name], strict=True)]
        return {"req_per_s": {name: statistics.median(values) for name, values in runs.items()},
                "runs": runs, "ratios": ratios, "ratio_on_off": statistics.median(ratios),
                "raw_runs": raw_runs, "raw_ratio_on_off": statistics.median(raw_ratios)}
    finally:
        for server in (gateway, mock):
            if server is not None:
                server.stop()


async def load_warm(target: Target, raw: bytes, args: Args) -> None:
    """Open the connections and warm both paths (unmeasured)."""
    target.connections = [await Connection.open(target.port) for _ in range(args.concurrency)]
    for i in range(args.concurrency):
        for _ in range(10):
            await target.send(i, raw, 30.0)
    await settle(target.pids, quiet_s=OverheadArgs.quiet_s)


# ---------------------------------------------------------------------------------------------
# 2. linker lookups vs store size
# ---------------------------------------------------------------------------------------------

def fill_store(store: Store, n: int) -> None:
    """``n`` synthetic turns, 5 per trajectory, with real-looking hashes, in one SQL statement."""
    with store.engine.begin() as connection:
        connection.execute(text("""
            INSERT INTO turns (id, trajectory_id, parent_turn_id, depth, choice_index, completion_id, source,
                               endpoint, created_at, latency_ms, requested_model, alias, engine_model,
                               adapter_version, client_key_id, prompt_tokens, completion_tokens, h_ctx, h_out,
                               redacted)
            SELECT 'turn_' || i, 'traj_' || (i // 5), CASE WHEN i % 5 = 0 THEN NULL ELSE 'turn_' || (i - 1) END,
                   i % 5, 0, 'chatcmpl-' || i, 'client', 'chat.completions',
                   TIMESTAMPTZ '2026-01-01 00:00:00+00' + to_microseconds(i), 1.0, 'gpt-4o', 'bench', 'bench', 0,
                   NULL, 100, 20, sha256('ctx' || i), sha256('out' || i), false
            FROM range(:n) t(i)
        """), {"n": n})


def time_lookups(store: Store, n: int, lookups: int, seed: int = 0) -> dict[str, float]:
    rng = random.Random(seed)
    durations = []
    with store.session() as session:
        for _ in range(lookups):
            hit = rng.randrange(n)
            # The request's assistant prefixes, last first: three that miss, then one that is stored.
            hashes = [f"{rng.getrandbits(256):064x}" for _ in range(3)]
            hashes.insert(rng.randrange(4), session.execute(text("SELECT sha256(:v)"), {"v": f"out{hit}"}).scalar())
            started = time.perf_counter()
            linker = TrajectoryLinker(session)  # one per batch, as Store.write_turns does; here a batch of one
            request = PreparedTurn(row={"h_out": "", "client_key_id": None}, explicit_trajectory_id=None,
                                   assistant_prefix_hashes=hashes)
            linker.prefetch([request])
            parent = linker._find_parent(hashes, None)
            session.expunge_all()  # the store opens a fresh session per batch
            durations.append(time.perf_counter() - started)
            assert parent is not None and parent.trajectory_id == f"traj_{hit // 5}"
    durations.sort()
    return {"p50_us": 1e6 * durations[len(durations) // 2], "p99_us": 1e6 * durations[int(len(durations) * 0.99)],
            "mean_us": 1e6 * statistics.fmean(durations)}


def lookups_by_size(args: Args, workdir: Path) -> dict[int, dict[str, float]]:
    out = {}
    for n in args.sizes:
        path = workdir / f"lookup-{n}.duckdb"
        store = Store(path)
        try:
            started = time.perf_counter()
            fill_store(store, n)
            insert_s = time.perf_counter() - started
            out[n] = {**time_lookups(store, n, args.lookups), "insert_s": insert_s}
        finally:
            store.close()
            path.unlink(missing_ok=True)
    return out


# ---------------------------------------------------------------------------------------------
# 3. bytes per 1k turns
# ---------------------------------------------------------------------------------------------

def realistic_exchange(i: int) -> CapturedExchange:
    system = {"role": "system", "content": "You are a careful travel agent. " * 32}  # ~1 KB
    messages = [system, {"role": "user", "content": f"Plan a weekend in city {i} for two people."},
                {"role": "assistant", "content": None, "tool_calls": [{"id": f"call_{i}", "type": "function",
                 "function": {"name": "search_hotels", "arguments": json.dumps({"city": f"city {i}", "n": 2})}}]},
                {"role": "tool", "tool_call_id": f"call_{i}", "content": json.dumps({"hotels": ["A", "B", "C"]})}]
    completion = list(range(1000 + i % 7, 1150 + i % 7))
    response = {"id": f"chatcmpl-{i}", "choices": [{
        "index": 0, "finish_reason": "stop", "token_ids": completion,
        "message": {"role": "assistant", "content": "Here is a plan for your weekend: " + "visit, eat, rest. " * 20},
        "logprobs": {"content": [{"token": "x", "logprob": -0.1 * (j % 9)} for j in range(len(completion))]}}],
        "prompt_token_ids": list(range(400)), "usage": {"prompt_tokens": 400, "completion_tokens": 150}}
    return CapturedExchange(completion_id=f"chatcmpl-{i}", endpoint="chat.completions", requested_model="gpt-4o",
                            alias="bench", engine_model="bench", adapter_version=0, client_key_id="key_0123456789ab",
                            request={"model": "gpt-4o", "messages": messages, "temperature": 0.7},
                            response=response, created_at=datetime.now(UTC), latency_ms=100.0)


def bytes_per_1k_turns(workdir: Path) -> dict[str, float]:
    path = workdir / "size.duckdb"
    store = Store(path)
    try:
        with store.engine.begin() as connection:
            connection.execute(text("CHECKPOINT"))
        empty = path.stat().st_size
        prepared = [turn for i in range(1000) for turn in prepare_turns(realistic_exchange(i), None)]
        for start in range(0, len(prepared), 100):
            store.write_turns(prepared[start:start + 100])
        with store.engine.begin() as connection:
            connection.execute(text("CHECKPOINT"))
        return {"bytes_per_1k_turns": path.stat().st_size - empty, "empty_file_bytes": empty}
    finally:
        store.close()


def main() -> None:
    args = parse_args()
    console = Console()
    with tempfile.TemporaryDirectory(prefix="flywheel-bench-capture-") as tmp:
        workdir = Path(tmp)
        results: dict[str, Any] = {"args": asdict(args)}
        results["throughput"] = asyncio.run(throughput(args, workdir))
        results["lookups"] = lookups_by_size(args, workdir)
        results["size"] = bytes_per_1k_turns(workdir)

    table = Table(title=f"Throughput, concurrency {args.concurrency} (sustained req/s, median of {args.rounds})")
    table.add_column("mode")
    table.add_column("req/s", justify="right")
    for name, value in results["throughput"]["req_per_s"].items():
        table.add_row(name, f"{value:.0f}")
    console.print(table)
    ratio = results["throughput"]["ratio_on_off"]
    quartiles = statistics.quantiles(results["throughput"]["ratios"], n=4)
    console.print(f"capture on / off, median of {args.rounds} paired rounds: {ratio:.3f} "
                  f"(cost {100 * (1 - ratio):.1f}%, target <= 5%); quartiles {quartiles[0]:.3f}-{quartiles[2]:.3f}")
    console.print(f"the same rounds without the deferred CPU added (requests / window): "
                  f"{results['throughput']['raw_ratio_on_off']:.3f}")

    table = Table(title=f"Linker lookup, 4 probes per request ({args.lookups} requests)")
    for column in ("stored turns", "p50 us", "p99 us", "mean us", "bulk insert s"):
        table.add_column(column, justify="right")
    for n, row in results["lookups"].items():
        table.add_row(f"{n:,}", f"{row['p50_us']:.0f}", f"{row['p99_us']:.0f}", f"{row['mean_us']:.0f}",
                      f"{row['insert_s']:.1f}")
    console.print(table)
    sizes = sorted(results["lookups"])
    growth = results["lookups"][sizes[-1]]["p50_us"] / results["lookups"][sizes[0]]["p50_us"]
    results["lookup_growth"] = growth
    console.print(f"lookup p50 growth {sizes[0]:,} -> {sizes[-1]:,} turns: {growth:.2f}x (target < 2x)")
    console.print(f"DuckDB bytes per 1k realistic turns: {results['size']['bytes_per_1k_turns']:,}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main()
