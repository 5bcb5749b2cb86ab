"""What capture costs: gateway throughput with capture on vs off, linker lookups, bytes per turn.

    python -m bench.capture                               # ~9 min; prints three tables
    python -m bench.capture --sizes 1000 100000 --rounds 12      # quicker look
    python -m bench.capture --same-request --sizes 1000   # calibration: the ratio must come out ~1
    python -m bench.capture --json capture.json
    python -m bench.capture --pin                         # the gateway on a vCPU of its own
    python -m bench.capture --parts lookups               # lookups only (~1 min)

1. Throughput: one gateway (upstream engine) in front of the fast mock
   (``bench/mock_openai_server.py``); clients send the same chat request at concurrency 16,
   one continuous load that switches every phase between the plain request and the same
   request with ``X-Flywheel-Capture: off`` (so both share the process, the warm caches and
   the machine's noise). After each switch ``warmup_s`` goes unmeasured — longer than the
   store's batch timer, so the store process works in the phase's steady state, carrying
   in about as much work as it carries out — then requests are counted for ``duration_s``.
   The cost is the median over rounds of each round's on/off ratio, the two phases of a
   round in ABBA order: on a shared 2-core VM the machine's speed drifts by +-20% within a
   minute, and pairing neighbouring phases cancels the drift. ``--same-request`` sends the
   capture-off request in both arms: a calibration whose ratio must come out ~1.
2. Linker lookups: stores holding 1k, 100k and 1M synthetic turns (bulk-inserted with SQL
   into the real schema and indexes); each lookup is what a 4-assistant-message request
   costs through the real ``TrajectoryLinker``: ``prefix``, one of its prefixes is stored
   (probes of the ``h_out`` index, and of ``h_answer`` when the last prefix missed);
   ``tail``, none is (its system prompt carries the time) but its last answer is (every
   prefix probed and missed, then the ``h_answer`` probe that finds it). The stores are
   filled first; then the sizes take turns, 50 lookups each, so drift hits all alike.
3. Bytes per 1k turns: 1000 realistic multi-turn exchanges (a ~1 KB system prompt, tool
   calls, ~150 completion token ids with logprobs each) through the real prepare + write
   path, checkpointed; the file's growth.
4. Store CPU per turn (``--parts store``): 4000 turns parsed, prepared, linked and written
   by ``Store.write_turns`` in one process, in batches of 200: first requests, 4-turn
   conversations that repeat their history (prefix links), and the same conversations with
   the time in their system prompt (tail links and history edits), the last two as a ratio.

Targets (docs/benchmarks.md): capture costs at most 5% of throughput; lookup time grows
less than 2x from 1k to 1M turns.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from sqlalchemy import text

from bench.gateway_overhead import Args as OverheadArgs
from bench.gateway_overhead import Connection, Target, check, settle, start_flywheel, start_mock
from flywheel.capture.canonical import message_hash, prefix_hashes
from flywheel.capture.linker import TrajectoryLinker
from flywheel.capture.store import Store
from flywheel.capture.turns import CapturedExchange, PreparedTurn, prepare_turns


@dataclass
class Args:
    duration_s: float = 2.5
    """measured window of each throughput phase"""
    warmup_s: float = 1.5
    """unmeasured load after each switch of mode: longer than the store's batch timer (1 s)"""
    rounds: int = 40
    """throughput rounds: one capture-off and one capture-on phase each, in ABBA order"""
    concurrency: int = 16
    """concurrent clients in the throughput runs"""
    same_request: bool = False
    """calibration: both arms send the capture-off request (the ratio must come out ~1)"""
    pin: bool = False
    """gateway on the first CPU; store process, mock and client on the last"""
    sizes: tuple[int, ...] = (1_000, 100_000, 1_000_000)
    """stored turns for the lookup measurement"""
    lookups: int = 2000
    """lookups timed per store size and rule"""
    parts: tuple[str, ...] = ("throughput", "lookups", "size", "store")
    """what to measure (the throughput part takes most of the time)"""
    json: str | None = None
    """also write the results here"""


def parse_args() -> Args:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration-s", type=float, default=Args.duration_s)
    parser.add_argument("--warmup-s", type=float, default=Args.warmup_s)
    parser.add_argument("--rounds", type=int, default=Args.rounds)
    parser.add_argument("--concurrency", type=int, default=Args.concurrency)
    parser.add_argument("--same-request", action="store_true")
    parser.add_argument("--pin", action="store_true", help="gateway on the first CPU; store process, mock and "
                                                           "client on the last")
    parser.add_argument("--sizes", type=int, nargs="+", default=list(Args.sizes))
    parser.add_argument("--lookups", type=int, default=Args.lookups)
    parser.add_argument("--parts", nargs="+", choices=list(Args.parts), default=list(Args.parts))
    parser.add_argument("--json", default=None)
    ns = parser.parse_args()
    return Args(duration_s=ns.duration_s, warmup_s=ns.warmup_s, rounds=ns.rounds, concurrency=ns.concurrency,
                same_request=ns.same_request, pin=ns.pin, sizes=tuple(ns.sizes), lookups=ns.lookups,
                parts=tuple(ns.parts), json=ns.json)


# ---------------------------------------------------------------------------------------------
# 1. throughput, capture on vs off
# ---------------------------------------------------------------------------------------------

def thread_cpu_s(pid: int) -> float:
    """CPU seconds of all of a process's threads, in nanoseconds from the scheduler (psutil counts 10 ms ticks)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):  # a thread that just exited
            total += int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
    return total / 1e9


def pin_threads(pid: int, cpu: int) -> None:
    """Every thread of ``pid`` onto ``cpu`` (``sched_setaffinity`` on a pid sets one thread)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that just exited
            os.sched_setaffinity(int(tid), {cpu})


async def throughput(args: Args, workdir: Path) -> dict[str, Any]:
    mock = start_mock(workdir)
    gateway = None
    try:
        mock.wait_ready("/v1/models", 60)
        gateway = start_flywheel(workdir, mock.port)
        gateway.wait_ready("/healthz", 120)
        gateway_pid, store_pid = gateway.pids[:2]
        if args.pin:
            cpus = sorted(os.sched_getaffinity(0))
            if len(cpus) < 2:
                raise SystemExit("--pin needs at least two CPUs")
            pin_threads(gateway_pid, cpus[0])
            for pid in (store_pid, mock.proc.pid, os.getpid()):
                pin_threads(pid, cpus[-1])
        on = Target("capture on", gateway.port, [gateway_pid, store_pid, mock.proc.pid])
        body = {"model": "gpt-4o", "messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 16}
        raw = {"capture on": on.raw_request(body),
               "capture off": replace(on, headers={"x-flywheel-capture": "off"}).raw_request(body)}
        if args.same_request:  # calibration: both arms send the capture-off request; the ratio must come out ~1
            raw["capture on"] = raw["capture off"]
        await load_warm(on, raw["capture on"], args)
        mode, completed, stop = ["capture off"], [0], [False]

        async def client(i: int) -> None:
            while not stop[0]:
                sample = await on.send(i, raw[mode[0]], 30.0)
                check(sample, on, stream=False)
                completed[0] += 1

        clients = asyncio.gather(*(client(i) for i in range(args.concurrency)))
        windows: dict[str, list[dict[str, float]]] = {"capture on": [], "capture off": []}
        try:
            for round_index in range(args.rounds):
                # ABBA: off-on, on-off, ... so a drift of the machine's speed during a round cancels out
                for name in ("capture off", "capture on") if round_index % 2 == 0 else ("capture on", "capture off"):
                    mode[0] = name
                    await asyncio.sleep(args.warmup_s)  # the store process reaches this mode's steady state
                    n0, t0 = completed[0], time.perf_counter()
                    gw0, store0 = thread_cpu_s(gateway_pid), thread_cpu_s(store_pid)
                    await asyncio.sleep(args.duration_s)
                    n, elapsed = completed[0] - n0, time.perf_counter() - t0
                    windows[name].append({"req_per_s": n / elapsed,
                                          "gateway_cpu_ms": 1000 * (thread_cpu_s(gateway_pid) - gw0) / n,
                                          "store_cpu_ms": 1000 * (thread_cpu_s(store_pid) - store0) / n})
        finally:
            stop[0] = True
            await clients
        ratios = [a["req_per_s"] / b["req_per_s"]
                  for a, b in zip(windows["capture on"], windows["capture off"], strict=True)]
        return {"req_per_s": {k: statistics.median(w["req_per_s"] for w in v) for k, v in windows.items()},
                "cpu_ms_per_req": {k: {part: statistics.median(w[part] for w in v)
                                       for part in ("gateway_cpu_ms", "store_cpu_ms")} for k, v in windows.items()},
                "windows": windows, "ratios": ratios, "ratio_on_off": statistics.median(ratios),
                "ratio_mean": statistics.mean(ratios),
                "ratio_mean_se": statistics.stdev(ratios) / len(ratios) ** 0.5}
    finally:
        for server in (gateway, mock):
            if server is not None:
                server.stop()


async def load_warm(target: Target, raw: bytes, args: Args) -> None:
    """Open the connections and warm the path (unmeasured)."""
    target.connections = [await Connection.open(target.port) for _ in range(args.concurrency)]
    for i in range(args.concurrency):
        for _ in range(10):
            await target.send(i, raw, 30.0)
    await settle(target.pids, quiet_s=OverheadArgs.quiet_s)


# ---------------------------------------------------------------------------------------------
# 2. linker lookups vs store size
# ---------------------------------------------------------------------------------------------

def fill_store(store: Store, n: int, answers: dict[int, tuple[str, str]]) -> None:
    """``n`` synthetic turns, 5 per trajectory, with real-looking hashes, in one SQL statement; turn ``i`` in
    ``answers`` gets the real ``h_answer``/``h_replied_to`` given there (the tail lookups' targets)."""
    import pyarrow as pa

    targets = pa.table({"i": list(answers), "h_answer": [a for a, _ in answers.values()],
                        "h_replied_to": [r for _, r in answers.values()]})
    with store.engine.begin() as connection:
        dbapi = connection.connection.dbapi_connection
        assert dbapi is not None
        dbapi.register("_tail_targets", targets)
        connection.execute(text("""
            INSERT INTO turns (id, trajectory_id, parent_turn_id, depth, choice_index, completion_id, source,
                               endpoint, created_at, latency_ms, requested_model, alias, engine_model,
                               adapter_version, client_key_id, prompt_tokens, completion_tokens, h_ctx, h_out,
                               redacted, h_answer, h_replied_to, link_rule)
            SELECT 'turn_' || i, 'traj_' || (i // 5), CASE WHEN i % 5 = 0 THEN NULL ELSE 'turn_' || (i - 1) END,
                   i % 5, 0, 'chatcmpl-' || i, 'client', 'chat.completions',
                   TIMESTAMPTZ '2026-01-01 00:00:00+00' + to_microseconds(i), 1.0, 'gpt-4o', 'bench', 'bench', 0,
                   NULL, 100, 20, sha256('ctx' || i), sha256('out' || i), false,
                   coalesce(t.h_answer, sha256('answer' || i)), coalesce(t.h_replied_to, sha256('asked' || i)),
                   CASE WHEN i % 5 = 0 THEN 'new' ELSE 'prefix' END
            FROM range(:n) r(i) LEFT JOIN _tail_targets t USING (i)
        """), {"n": n})
        dbapi.unregister("_tail_targets")


def tail_exchange(i: int) -> tuple[dict[str, str], dict[str, str]]:
    """Turn ``i``'s question and answer, as a later request repeats them."""
    return ({"role": "user", "content": f"Question {i}: what about the museums?"},
            {"role": "assistant", "content": f"Answer {i}: the tile museum opens at ten."})


def lookup_request(rng: random.Random, hit: int, kind: str, stored_h_out: str) -> PreparedTurn:
    """A request with four assistant messages. ``prefix``: the prefix up to one of them (at random) is stored.
    ``tail``: none is (its system prompt carries the time), but its last answer is turn ``hit``'s."""
    question, answer = tail_exchange(hit if kind == "tail" else -1 - rng.getrandbits(32))
    older = [m for k in range(3) for m in ({"role": "user", "content": f"q{rng.getrandbits(64)}"},
                                          {"role": "assistant", "content": f"a{rng.getrandbits(64)}"})]
    messages = [{"role": "system", "content": f"You plan trips. It is {rng.getrandbits(32)}."}, *older, question,
                answer, {"role": "user", "content": "And on Sunday?"}]
    hashes = prefix_hashes(messages)
    assistant_hashes = [hashes[i] for i in range(len(messages) - 1, -1, -1) if messages[i]["role"] == "assistant"]
    if kind == "prefix":  # three that miss, one that is stored
        assistant_hashes[rng.randrange(4)] = stored_h_out
    row = {"id": f"turn_new{rng.getrandbits(64)}", "h_out": "", "client_key_id": None, "source": "client",
           "request_messages": messages}
    return PreparedTurn(row=row, explicit_trajectory_id=None, assistant_prefix_hashes=assistant_hashes)


def time_lookups(store: Store, hits: list[int], kind: str, seed: int) -> list[float]:
    """Seconds per request, one linker per request (as one batch of one), through prefetch and the rules; the hit
    must be found."""
    rng = random.Random(seed)
    durations = []
    with store.session() as session:
        for hit in hits:
            stored_h_out = str(session.execute(text("SELECT sha256(:v)"), {"v": f"out{hit}"}).scalar())
            request = lookup_request(rng, hit, kind, stored_h_out)
            started = time.perf_counter()
            linker = TrajectoryLinker(session)  # one per batch, as Store.write_turns does; here a batch of one
            linker.prefetch([request])
            match = linker._find_parent(request)
            session.expunge_all()  # the store opens a fresh session per batch
            durations.append(time.perf_counter() - started)
            assert match is not None and match.how == kind and match.parent.trajectory_id == f"traj_{hit // 5}"
    return durations


LOOKUP_CHUNK = 50  # lookups per store and rule before moving to the next: the sizes take turns


def lookups_by_size(args: Args, workdir: Path) -> dict[int, dict[str, dict[str, float]]]:
    """Every store filled first, then the sizes and rules take turns, ``LOOKUP_CHUNK`` lookups at a time, in a
    rotating order: the machine's drift (a shared VM's speed moves within minutes) lands on all sizes alike."""
    stores: dict[int, Store] = {}
    hits: dict[int, list[int]] = {}
    insert_s: dict[int, float] = {}
    durations: dict[int, dict[str, list[float]]] = {n: {"prefix": [], "tail": []} for n in args.sizes}
    try:
        for n in args.sizes:
            stores[n] = Store(workdir / f"lookup-{n}.duckdb")
            rng = random.Random(n)
            hits[n] = [5 * rng.randrange(n // 5) + 4 for _ in range(args.lookups)]  # trajectories' latest turns
            started = time.perf_counter()
            exchanges = {hit: tail_exchange(hit) for hit in hits[n]}
            fill_store(stores[n], n, {hit: (message_hash(answer), message_hash(question))
                                      for hit, (question, answer) in exchanges.items()})
            insert_s[n] = time.perf_counter() - started
        for round_index, start in enumerate(range(0, args.lookups, LOOKUP_CHUNK)):
            turn = args.sizes[round_index % len(args.sizes):] + args.sizes[:round_index % len(args.sizes)]
            for n in turn:
                for kind in ("prefix", "tail"):
                    durations[n][kind] += time_lookups(stores[n], hits[n][start:start + LOOKUP_CHUNK], kind,
                                                       seed=round_index)
    finally:
        for n, store in stores.items():
            store.close()
            (workdir / f"lookup-{n}.duckdb").unlink(missing_ok=True)
    return {n: {kind: {**_percentiles(values), "insert_s": insert_s[n]} for kind, values in by_kind.items()}
            for n, by_kind in durations.items()}


def _percentiles(durations: list[float]) -> dict[str, float]:
    ordered = sorted(durations)
    return {"p50_us": 1e6 * ordered[len(ordered) // 2], "p99_us": 1e6 * ordered[int(len(ordered) * 0.99)],
            "mean_us": 1e6 * statistics.fmean(ordered)}


# ---------------------------------------------------------------------------------------------
# 4. store CPU per turn, by how turns link
# ---------------------------------------------------------------------------------------------

STORE_BATCH, STORE_CONVERSATIONS, STORE_TURNS = 200, 1000, 4


def conversation_exchanges(dynamic_system: bool) -> list[bytes]:
    """Exchange lines of ``STORE_CONVERSATIONS`` conversations of ``STORE_TURNS`` turns, turn by turn (the first
    turn of every conversation, then the second, ...); the system prompt carries the time when ``dynamic_system``."""
    lines = []
    histories: list[list[dict[str, Any]]] = [[] for _ in range(STORE_CONVERSATIONS)]
    for turn in range(STORE_TURNS):
        for c, history in enumerate(histories):
            history.append({"role": "user", "content": f"Conversation {c}, question {turn}: and then?"})
            system = f"You plan trips. It is 10:{turn:02d}." if dynamic_system else "You plan trips."
            answer = {"role": "assistant", "content": f"Answer {turn} of conversation {c}: a plan for the day."}
            completion_id = f"chatcmpl-{c}-{turn}"
            exchange = CapturedExchange(
                completion_id=completion_id, endpoint="chat.completions", requested_model="gpt-4o", alias="bench",
                engine_model="bench", adapter_version=0, client_key_id=None,
                request={"model": "gpt-4o", "messages": [{"role": "system", "content": system}, *history]},
                response={"id": completion_id, "choices": [{"index": 0, "finish_reason": "stop", "message": answer}]},
                created_at=datetime.now(UTC), latency_ms=1.0)
            lines.append(exchange.to_line())
            history.append(answer)
    return lines


def store_cpu(workdir: Path) -> dict[str, float]:
    """CPU per turn of parsing, preparing, linking and writing (``Store.write_turns``, one process, batches of
    ``STORE_BATCH``): first requests (the throughput benchmark's), conversations that repeat their history
    (prefix links), and conversations whose system prompt carries the time (tail links, history edits)."""
    from collections import Counter

    from flywheel.capture.turns import prepare_lines

    say_hello = [CapturedExchange(
        completion_id=f"chatcmpl-{i}", endpoint="chat.completions", requested_model="gpt-4o", alias="bench",
        engine_model="bench", adapter_version=0, client_key_id=None,
        request={"model": "gpt-4o", "messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 16},
        response={"id": f"chatcmpl-{i}", "choices": [{"index": 0, "finish_reason": "stop", "message": {
            "role": "assistant", "content": "Hello there, how can I help?"}}]},
        created_at=datetime.now(UTC), latency_ms=1.0).to_line() for i in range(STORE_CONVERSATIONS * STORE_TURNS)]
    out = {}
    for name, lines in (("first requests", say_hello), ("verbatim history (prefix)", conversation_exchanges(False)),
                        ("changing system prompt (tail)", conversation_exchanges(True))):
        path = workdir / "store-cpu.duckdb"
        store = Store(path)
        store.warm_up()
        try:
            started = time.process_time()
            for start in range(0, len(lines), STORE_BATCH):
                store.write_turns(prepare_lines(lines[start:start + STORE_BATCH], None, Counter()))
            out[name] = 1e6 * (time.process_time() - started) / len(lines)
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
    results: dict[str, Any] = {"args": asdict(args)}
    with tempfile.TemporaryDirectory(prefix="flywheel-bench-capture-") as tmp:
        workdir = Path(tmp)
        if "throughput" in args.parts:
            results["throughput"] = asyncio.run(throughput(args, workdir))
            print_throughput(console, args, results["throughput"])
        if "lookups" in args.parts:
            results["lookups"] = lookups_by_size(args, workdir)
            results["lookup_growth"] = print_lookups(console, args, results["lookups"])
        if "size" in args.parts:
            results["size"] = bytes_per_1k_turns(workdir)
            console.print(f"DuckDB bytes per 1k realistic turns: {results['size']['bytes_per_1k_turns']:,}")
        if "store" in args.parts:
            results["store_cpu_us_per_turn"] = cpu = store_cpu(workdir)
            baseline = cpu["verbatim history (prefix)"]
            for name, us in cpu.items():
                console.print(f"store CPU per turn, {name}: {us:.0f} us ({us / baseline:.2f}x the prefix-linked turn)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str))


def print_throughput(console: Console, args: Args, thr: dict[str, Any]) -> None:
    calibration = ", calibration: the same request in both arms" if args.same_request else ""
    calibration += ", pinned: gateway | store, mock, client" if args.pin else ""
    table = Table(title=f"Throughput, concurrency {args.concurrency} (median of {args.rounds} windows of "
                        f"{args.duration_s:g} s{calibration})")
    for column in ("mode", "req/s", "gateway CPU ms/req", "store process CPU ms/req"):
        table.add_column(column, justify="right")
    for name, value in thr["req_per_s"].items():
        cpu = thr["cpu_ms_per_req"][name]
        table.add_row(name, f"{value:.0f}", f"{cpu['gateway_cpu_ms']:.3f}", f"{cpu['store_cpu_ms']:.3f}")
    console.print(table)
    ratio = thr["ratio_on_off"]
    quartiles = statistics.quantiles(thr["ratios"], n=4)
    console.print(f"capture on / off, median of {args.rounds} paired rounds: {ratio:.3f} "
                  f"(cost {100 * (1 - ratio):.1f}%, target <= 5%); quartiles {quartiles[0]:.3f}-{quartiles[2]:.3f}; "
                  f"mean {thr['ratio_mean']:.3f} +- {thr['ratio_mean_se']:.3f} (standard error)")


def print_lookups(console: Console, args: Args, lookups: dict[int, dict[str, dict[str, float]]]) -> dict[str, float]:
    """The lookup table, and each rule's p50 growth from the smallest store to the largest."""
    table = Table(title=f"Linker lookup per request with 4 assistant messages ({args.lookups} requests)")
    for column in ("stored turns", "rule", "p50 us", "p99 us", "mean us", "bulk insert s"):
        table.add_column(column, justify="right")
    for n, kinds in lookups.items():
        for kind, row in kinds.items():
            table.add_row(f"{n:,}", kind, f"{row['p50_us']:.0f}", f"{row['p99_us']:.0f}", f"{row['mean_us']:.0f}",
                          f"{row['insert_s']:.1f}")
    console.print(table)
    sizes = sorted(lookups)
    growth = {kind: lookups[sizes[-1]][kind]["p50_us"] / lookups[sizes[0]][kind]["p50_us"]
              for kind in ("prefix", "tail")}
    for kind, ratio in growth.items():
        console.print(f"{kind} lookup p50 growth {sizes[0]:,} -> {sizes[-1]:,} turns: {ratio:.2f}x (target < 2x)")
    return growth


if __name__ == "__main__":
    main()
