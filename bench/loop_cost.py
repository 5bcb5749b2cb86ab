"""What the loop's bookkeeping costs: store-process and serving-process CPU per episode, loop on vs capture alone.

    python -m bench.loop_cost                                  # 10k and 200k stored turns, forks off and on (~5 min)
    python -m bench.loop_cost --sizes 10000 1000000            # a larger store (the pre-fill takes ~1 min per 1M)
    python -m bench.loop_cost --forks off --window-s 60 --json-out cost.json

For each store size a store file is pre-filled once with that many turns of past traffic of the run's shape
(closed, grouped, scored, with feedback; one ``INSERT ... SELECT`` per table into the real schema), then copied
for every configuration. Each configuration starts a gateway on it (``deploy/flywheel.small-model.toml`` under a
layer of this script's) in front of the soak's stand-ins (``bench/soak.py``: a scripted upstream and a judge, in
a process of their own), and drives the demo's traffic shape open-loop at ``rate`` episodes per second: an
episode is a question answered with a tool call, the tool's result, and the final answer:

- ``forks off`` (``flywheel demo``): each request four times in a row, every episode's reward posted as feedback
  (which closes its trajectory), no judge;
- ``forks on`` (the learning suite's ``unique`` shape): every request new, every turn forked (``fork_k = 3``), no
  feedback, the judge scores the fork groups.

Two modes per shape, measured in the same run:

- ``capture``: ``[loop] enabled = false`` and groups formed once an hour: what capture alone costs;
- ``loop``: the loop on (idle close, group formation, scoring, the train/gate/ab ticks; training is never due, so
  no training child runs), and ``GET /flywheel/v1/status`` plus the versions polled once a second, as the demo's
  screen does. Traffic starts once the loop's first runs, which read the whole store once (the reward per version,
  the trajectories waiting for a group), are done: their time and store CPU are printed apart.

After ``warmup_s`` of traffic, CPU (user + system, from /proc via psutil) of the store process and of the serving
process is counted over ``window_s``, and divided by the episodes finished in that window. Printed: ms of CPU per
episode per configuration, and the loop's store CPU as a ratio to capture alone's. Targets (docs/benchmarks.md,
"Loop bookkeeping cost"): the loop's store CPU <= 5 ms per episode, and < 1.5x from the small store to the large.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
from rich.console import Console
from rich.table import Table
from sqlalchemy import text

from bench.soak import SYSTEM, TOOLS, _plain, _store_process
from flywheel.gateway.cli.demo import SMALL_MODEL_CONFIG
from flywheel.gateway.core.processes import NotAnswering, free_ports, stop, wait_until_answering

CITIES = ("Paris", "Lima", "Oslo", "Kyoto", "Quito", "Accra", "Perth", "Turin", "Hanoi", "Cusco")
GROUP = 4  # the demo's group size: each request this many times in a row (forks: the turn and 3 siblings)


@dataclass
class Args:
    sizes: list[int] = field(default_factory=lambda: [10_000, 200_000])
    forks: list[str] = field(default_factory=lambda: ["off", "on"])
    rate: float = 5.0  # episodes per second
    warmup_s: float = 10.0
    window_s: float = 20.0
    seed: int = 0
    json_out: str = ""
    profile: str = ""  # a directory: py-spy records the store process over each window there (collapsed stacks)


def parse_args(argv: list[str] | None = None) -> Args:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=Args().sizes, help="stored turns before the run")
    parser.add_argument("--forks", nargs="+", choices=("off", "on"), default=Args().forks)
    for name in ("rate", "warmup_s", "window_s"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=float, default=getattr(Args(), name))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json-out", default="")
    parser.add_argument("--profile", default="", help="a directory: py-spy (on PATH) records the store process "
                                                      "over each window, one collapsed-stack file per configuration")
    return Args(**vars(parser.parse_args(argv)))


# -- the store before the run --------------------------------------------------------------------------------

def prefill(path: Path, turns: int, forks: bool) -> float:
    """A store holding ``turns`` turns of past episodes of the run's shape; seconds it took.

    Forks off: two turns per episode, one trajectory each, closed by feedback, in task groups of four, each
    with a final reward. Forks on: each of an episode's two turns forked three times (one-turn sibling
    trajectories), a fork group per turn, judged and rewarded."""
    from flywheel.capture.store import Store

    started = time.perf_counter()
    store = Store(path)
    per_episode = 8 if forks else 2
    episodes = max(1, turns // per_episode)
    try:
        with store.engine.begin() as connection:
            for statement in (FORKED if forks else REPEATED):
                connection.execute(text(statement), {"episodes": episodes})
    finally:
        store.close()
    return time.perf_counter() - started


# One timestamp per episode, a day ago onwards, 10 ms apart; every row of the episode near it.
_AT = "(now() - INTERVAL 1 DAY + to_milliseconds(e * 10))"
_TURN = f"""
    INSERT INTO turns (id, trajectory_id, parent_turn_id, depth, choice_index, completion_id, source, endpoint,
                       created_at, latency_ms, requested_model, alias, engine_model, adapter_version, request_messages,
                       response_message, prompt_tokens, completion_tokens, h_ctx, h_out, task_key, redacted, h_answer,
                       h_replied_to, link_rule)
    SELECT {{id}}, {{trajectory}}, {{parent}}, {{depth}}, {{choice}}, 'chatcmpl-' || e || '-' || d, {{source}},
           'chat.completions', {_AT} + to_milliseconds(d), 5.0, 'agent', 'agent', 'scripted', 0,
           '[{{{{"role": "user", "content": "question"}}}}]', '{{{{"role": "assistant", "content": "answer"}}}}',
           40, 12, sha256('ctx' || e || d), sha256('out' || e || d || {{choice}}), {{task}}, false,
           sha256('answer' || e || d || {{choice}}), sha256('asked' || e || d), {{rule}}
    FROM range(:episodes) r(e), range(2) s(d)"""
_TRAJECTORY = f"""
    INSERT INTO trajectories (id, alias, status, explicit, task_key, created_at, updated_at, closed_at, close_reason,
                              turn_count, branch_count, latest_turn_id)
    SELECT {{id}}, 'agent', 'closed', false, {{task}}, {_AT}, {_AT}, {_AT} + INTERVAL 1 SECOND,
           {{reason}}, {{count}}, 1, {{latest}}
    FROM {{rows}}"""
_SCORES = """
    INSERT INTO scores (id, trajectory_id, group_id, source, value, prompt_tokens, completion_tokens, created_at)
    SELECT 'score_' || m.group_id || '_' || m.trajectory_id || '_' || k.source, m.trajectory_id, m.group_id,
           k.source, (hash(m.trajectory_id) % 100) / 100.0, 0, 0, m.added_at
    FROM group_members m, (SELECT unnest({sources}) AS source) k"""

REPEATED_TASK, UNIQUE_TASK = "'task-' || (e // 4)", "'task-' || e"  # four attempts at a task, or one
REPEATED = [
    _TURN.format(id="'turn_' || e || '_' || d", trajectory="'traj_' || e", depth="d", choice="0",
                 parent="CASE WHEN d = 1 THEN 'turn_' || e || '_0' END", source="'client'",
                 rule="CASE WHEN d = 0 THEN 'new' ELSE 'prefix' END", task=REPEATED_TASK),
    _TRAJECTORY.format(id="'traj_' || e", reason="'feedback'", count="2", latest="'turn_' || e || '_1'",
                       task=REPEATED_TASK,
                       rows="range(:episodes) r(e)"),
    f"""INSERT INTO groups (id, source, key, alias, status, size, created_at, closed_at)
        SELECT 'grp_' || g, 'task', 'task-' || g, 'agent', 'trained', 4, {_AT.replace('e *', 'g * 4 *')},
               {_AT.replace('e *', 'g * 4 *')} FROM range(:episodes // 4) r(g)""",
    f"""INSERT INTO group_members (group_id, trajectory_id, leaf_turn_id, added_at)
        SELECT 'grp_' || (e // 4), 'traj_' || e, 'turn_' || e || '_1', {_AT} FROM range((:episodes // 4) * 4) r(e)""",
    _SCORES.format(sources="['reward']"),
    f"""INSERT INTO feedback (id, trajectory_id, completion_id, reward, created_at)
        SELECT 'fb_' || e, 'traj_' || e, 'chatcmpl-' || e || '-1', (hash(e) % 100) / 100.0, {_AT}
        FROM range(:episodes) r(e)""",
]
FORKED = [
    _TURN.format(id="'turn_' || e || '_' || d", trajectory="'traj_' || e", depth="d", choice="0",
                 parent="CASE WHEN d = 1 THEN 'turn_' || e || '_0' END", source="'client'",
                 rule="CASE WHEN d = 0 THEN 'new' ELSE 'prefix' END", task=UNIQUE_TASK),
    _TURN.replace("range(2) s(d)", "range(2) s(d), range(1, 4) c(c)").format(
        id="'turn_' || e || '_' || d || '_' || c", trajectory="'traj_' || e || '_' || d || '_' || c", depth="0",
        choice="c", parent="NULL", source="'fork'", rule="'new'", task=UNIQUE_TASK),
    _TRAJECTORY.format(id="'traj_' || e", reason="'idle'", count="2", latest="'turn_' || e || '_1'", task=UNIQUE_TASK,
                       rows="range(:episodes) r(e)"),
    _TRAJECTORY.format(id="'traj_' || e || '_' || d || '_' || c", reason="'fork'", count="1",
                       latest="'turn_' || e || '_' || d || '_' || c", task=UNIQUE_TASK,
                       rows="range(:episodes) r(e), range(2) s(d), range(1, 4) c(c)"),
    f"""INSERT INTO groups (id, source, key, alias, status, size, created_at, closed_at)
        SELECT 'grp_' || e || '_' || d, 'fork', 'chatcmpl-' || e || '-' || d, 'agent', 'trained', 4, {_AT}, {_AT}
        FROM range(:episodes) r(e), range(2) s(d)""",
    f"""INSERT INTO group_members (group_id, trajectory_id, leaf_turn_id, added_at)
        SELECT 'grp_' || e || '_' || d, CASE WHEN c = 0 THEN 'traj_' || e ELSE 'traj_' || e || '_' || d || '_' || c END,
               CASE WHEN c = 0 THEN 'turn_' || e || '_' || d ELSE 'turn_' || e || '_' || d || '_' || c END, {_AT}
        FROM range(:episodes) r(e), range(2) s(d), range(4) c(c)""",
    _SCORES.format(sources="['ruler', 'reward']"),
]


# -- the traffic ---------------------------------------------------------------------------------------------

async def episode(client: httpx.AsyncClient, number: int, forks: bool, done: list[float]) -> None:
    """A question, the tool call, its result, the answer; with forks off the same question four times in a row
    and the reward posted as feedback."""
    city = CITIES[(number // GROUP) % len(CITIES)]
    asked = f"Ticket {number}" if forks else f"Request {number // GROUP}"
    messages: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": f"{asked}: what is the weather in {city}?"}]
    try:
        for _ in range(2):
            completion_id, message = await _plain(client, {"model": "agent", "messages": messages, "tools": TOOLS},
                                                  {})
            messages.append(message)
            if not message.get("tool_calls"):
                break
            messages.append({"role": "tool", "tool_call_id": message["tool_calls"][0]["id"],
                             "content": json.dumps({"sky": "sunny"})})
        if not forks:
            response = await client.post("/flywheel/v1/feedback", json={"completion_id": completion_id,
                                                                        "reward": random.random()})
            response.raise_for_status()
    except (httpx.HTTPError, KeyError, ValueError) as exc:
        print(f"episode {number} failed: {exc!r}", file=sys.stderr)
        return
    done.append(time.monotonic())


async def drive(client: httpx.AsyncClient, rate: float, seconds: float, forks: bool, done: list[float]) -> None:
    """Episodes start every 1/rate seconds for ``seconds``, whatever the latency (open loop)."""
    t0 = time.monotonic()
    tasks = []
    number = 0
    while (due := t0 + number / rate) < t0 + seconds:
        await asyncio.sleep(max(0.0, due - time.monotonic()))
        tasks.append(asyncio.create_task(episode(client, number, forks, done)))
        number += 1
    await asyncio.gather(*tasks)


async def settled(client: httpx.AsyncClient, timeout_s: float = 900.0) -> None:
    """Until the loop's first runs are done: they read the whole store once (the reward per version, what waits for a
    group); the steady state is measured after them, their cost apart."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = (await client.get("/flywheel/v1/status")).json()["aliases"][0]
        if (status["jobs"].get("form_groups") or {}).get("finished_at"):
            return
        await asyncio.sleep(0.5)
    raise SystemExit(f"the loop's first group formation did not finish within {timeout_s:.0f} s")


async def poll_status(client: httpx.AsyncClient) -> None:
    """What ``flywheel demo``'s screen reads once a second."""
    while True:
        await client.get("/flywheel/v1/status")
        await client.get("/flywheel/v1/aliases/agent/versions")
        await asyncio.sleep(1.0)


# -- one configuration ---------------------------------------------------------------------------------------

def layer(data_dir: Path, upstream_port: int, judge_port: int, *, forks: bool, loop: bool) -> str:
    groups = "fork_fraction = 1.0\n" if forks else ""
    if not loop:
        groups += "form_every_s = 1000000\n"
    return f"""data_dir = "{data_dir}"
log_level = "warning"
[engines.up]
base_url = "http://127.0.0.1:{upstream_port}/v1"
[aliases.agent]
engine = "up"
[capture]
idle_close_s = 5
[groups]
{groups}
[judge]
enabled = {"true" if forks else "false"}
model = "openai/judge"
api_base = "http://127.0.0.1:{judge_port}/v1"
api_key = "unused"
[loop]
enabled = {"true" if loop else "false"}
min_groups = 1000000000
train_every_s = 1000000000
"""


def profile(args: Args, pid: int, name: str) -> subprocess.Popen[bytes] | None:
    """py-spy sampling ``pid`` for the window (``--profile``), written as collapsed stacks."""
    if not args.profile:
        return None
    Path(args.profile).mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(["py-spy", "record", "--pid", str(pid), "--duration", str(int(args.window_s)),
                             "--format", "raw", "--rate", "50", "--output", str(Path(args.profile) / f"{name}.txt")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def cpu_s(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


async def measure(args: Args, template: Path, workdir: Path, ports: tuple[int, int], *, size: int, forks: bool,
                  loop: bool) -> dict[str, Any]:
    data_dir = workdir / "data"
    shutil.rmtree(data_dir, ignore_errors=True)
    data_dir.mkdir(parents=True)
    shutil.copy(template, data_dir / "flywheel.duckdb")
    config = workdir / "flywheel.toml"
    config.write_text(layer(data_dir, *ports, forks=forks, loop=loop))
    (gateway_port,) = free_ports(1)
    log = workdir / "gateway.log"
    gateway = subprocess.Popen([sys.executable, "-m", "flywheel.gateway", "serve", "-c", str(SMALL_MODEL_CONFIG),
                                "-c", str(config), "--port", str(gateway_port)],
                               stdout=log.open("wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{gateway_port}"
    try:
        try:
            await asyncio.to_thread(wait_until_answering, url, gateway, timeout_s=180.0, require_ok=True)
        except NotAnswering as exc:
            raise SystemExit(f"the gateway did not start: {exc}: {log.read_text()[-2000:]}") from exc
        serving = psutil.Process(gateway.pid)
        store = _store_process(serving)
        assert store is not None, "the gateway has no store process"
        done: list[float] = []
        async with httpx.AsyncClient(base_url=url, timeout=900.0,
                                     limits=httpx.Limits(max_connections=None, max_keepalive_connections=64)) as client:
            first = (time.monotonic(), cpu_s(store))
            if loop:
                await settled(client)
            startup = (time.monotonic() - first[0], cpu_s(store) - first[1])
            poller = asyncio.create_task(poll_status(client)) if loop else None
            load = asyncio.create_task(drive(client, args.rate, args.warmup_s + args.window_s + 5.0, forks, done))
            await asyncio.sleep(args.warmup_s)
            start = (time.monotonic(), cpu_s(store), cpu_s(serving))
            spy = profile(args, store.pid, f"{'forks' if forks else 'plain'}-{size}-{'loop' if loop else 'capture'}")
            await asyncio.sleep(args.window_s)
            end = (time.monotonic(), cpu_s(store), cpu_s(serving))
            await load
            if poller is not None:
                poller.cancel()
            if spy is not None:
                spy.wait(timeout=60)
        episodes = sum(1 for t in done if start[0] <= t < end[0])
        return {"episodes": episodes, "episodes_per_s": episodes / (end[0] - start[0]),
                "store_ms": (end[1] - start[1]) * 1e3 / max(1, episodes),
                "serving_ms": (end[2] - start[2]) * 1e3 / max(1, episodes),
                "store_cores": (end[1] - start[1]) / (end[0] - start[0]),
                "startup_s": startup[0], "startup_store_cpu_s": startup[1]}
    finally:
        stop(gateway)


async def run(args: Args) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    upstream_port, judge_port = free_ports(2)
    stand_ins = subprocess.Popen([sys.executable, "-m", "bench.soak", "--stand-ins", str(upstream_port),
                                  str(judge_port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until_answering(f"http://127.0.0.1:{upstream_port}", stand_ins, timeout_s=60.0, path="/v1/models")
        with tempfile.TemporaryDirectory(prefix="flywheel-loop-cost-") as tmp:
            workdir = Path(tmp)
            for forks in (f == "on" for f in args.forks):
                for size in args.sizes:
                    template = workdir / f"template-{size}-{forks}.duckdb"
                    fill_s = prefill(template, size, forks)
                    for loop in (False, True):
                        result = await measure(args, template, workdir, (upstream_port, judge_port), size=size,
                                               forks=forks, loop=loop)
                        rows.append({"forks": forks, "size": size, "mode": "loop" if loop else "capture",
                                     "prefill_s": fill_s, **result})
                        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
                    template.unlink()
    finally:
        stand_ins.terminate()
        stand_ins.wait(timeout=30)
    return rows


def report(rows: list[dict[str, Any]]) -> None:
    table = Table(title="loop bookkeeping: CPU ms per episode")
    for column in ("forks", "stored turns", "mode", "episodes/s", "store ms", "serving ms", "store cores",
                   "store: loop / capture", "first runs: s (store CPU s)"):
        table.add_column(column, justify="right")
    capture = {(r["forks"], r["size"]): r["store_ms"] for r in rows if r["mode"] == "capture"}
    for r in rows:
        ratio = r["store_ms"] / capture[(r["forks"], r["size"])] if r["mode"] == "loop" else 1.0
        table.add_row("on" if r["forks"] else "off", f"{r['size']:,}", r["mode"], f"{r['episodes_per_s']:.2f}",
                      f"{r['store_ms']:.1f}", f"{r['serving_ms']:.1f}", f"{r['store_cores']:.2f}", f"{ratio:.2f}",
                      f"{r['startup_s']:.1f} ({r['startup_store_cpu_s']:.1f})" if r["mode"] == "loop" else "")
    Console(width=140).print(table)
    for forks in sorted({r["forks"] for r in rows}):
        loop = sorted((r["size"], r["store_ms"]) for r in rows if r["forks"] == forks and r["mode"] == "loop")
        if len(loop) > 1:
            print(f"forks {'on' if forks else 'off'}: loop store ms, {loop[-1][0]:,} vs {loop[0][0]:,} turns: "
                  f"{loop[-1][1] / loop[0][1]:.2f}x")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rows = asyncio.run(run(args))
    report(rows)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"args": asdict(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
