"""What the loop costs serving: latency while a training round runs vs idle, swap time, failures during swaps.

    python -m bench.loop                          # tiny model, local engine, CPU (~3 min)
    python -m bench.loop --idle-s 60 --clients 8 --json-out loop.json

One gateway (local engine, the tiny model taught one answer) serves a steady load from
``clients`` concurrent clients (short chat completions) throughout. In the same run:

1. **idle**: ``idle_s`` seconds of load, nothing else running;
2. **training**: one GRPO round through ``POST /flywheel/v1/aliases/{alias}/train`` (the loop's
   own path: a child process at nice 10 with one torch thread), on groups captured from this
   traffic with random rewards, recorded a candidate (as the loop's rounds are); the load goes on;
3. **promotion**: the candidate made to serve (``PUT /flywheel/v1/aliases/{alias}/adapter``: the
   engine loads it, probes it, switches), what the loop's gate does after a round;
4. **swaps**: ``swaps`` switches between the trained version and the base model under the same
   load; every failed request is counted (the target is 0).

A request belongs to the phase in which it finished: one the promotion held up is the promotion's,
even if it started while the round trained. Printed: p50 and p99 latency per phase and their ratios
(training / idle; target p99 <= 2x on 2 cores), the promotion's slowest request, the round's length,
the time from the round's end (its run's ``finished_at`` in the store) to the new version serving
(its ``promoted_at``), and failed requests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, fields
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from flywheel.gateway.core.processes import free_port, wait_until_answering

ROOT = Path(__file__).resolve().parent.parent
QUESTION = [{"role": "user", "content": "Who are you?"}]


@dataclass
class Args:
    clients: int = 4
    """concurrent clients sending chat completions throughout"""
    idle_s: float = 30.0
    """length of the idle phase"""
    groups: int = 4
    """groups of 8 captured trajectories (random rewards) the round trains on"""
    swaps: int = 20
    """version switches under load in the last phase"""
    max_tokens: int = 8
    """tokens per answer"""
    seed: int = 0
    json_out: str = ""
    """also write the results here as JSON"""


def parse_args(argv: list[str] | None = None) -> Args:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for f in fields(Args):
        default = getattr(Args, f.name)
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=type(default), default=default)
    return Args(**vars(parser.parse_args(argv)))


class Load:
    """``clients`` loops of chat completions; each records (finished_at, seconds, ok) under the current phase."""

    def __init__(self, url: str, clients: int, max_tokens: int) -> None:
        self.url, self.clients, self.max_tokens = url, clients, max_tokens
        self.phase = "warmup"
        self.samples: dict[str, list[float]] = {}
        self.failures: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    async def _run(self) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=120) as client:
            await asyncio.gather(*(self._client(client) for _ in range(self.clients)))

    async def _client(self, client: httpx.AsyncClient) -> None:
        body = {"model": "agent", "messages": QUESTION, "max_tokens": self.max_tokens, "temperature": 1.0}
        while not self._stop.is_set():
            started = time.perf_counter()
            try:
                response = await client.post("/v1/chat/completions", json=body,
                                             headers={"X-Flywheel-Capture": "off"})
                ok = response.status_code == 200
            except httpx.HTTPError:
                ok = False
            phase = self.phase  # where it finished: what held it up happened last
            if ok:
                self.samples.setdefault(phase, []).append(time.perf_counter() - started)
            else:
                self.failures[phase] = self.failures.get(phase, 0) + 1


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def build_model(root: Path) -> Path:
    sys.path.insert(0, str(ROOT))
    from flywheel.trainer.tiny_model import build_tiny_model
    from tests.support import memorize

    tiny = build_tiny_model(root / "tiny")
    return memorize(tiny, root / "agent", [(QUESTION, "I am the agent.")])


def capture_groups(url: str, groups: int, rng: random.Random) -> None:
    """Explicit groups of 8 with random rewards, grouped and scored: what the round trains on."""
    for g in range(groups):
        for _ in range(8):
            reply = httpx.post(f"{url}/v1/chat/completions", timeout=60, headers={"X-Flywheel-Group-Id": f"g{g}"},
                               json={"model": "agent", "messages": QUESTION, "max_tokens": 8, "temperature": 1.0})
            httpx.post(f"{url}/flywheel/v1/feedback", timeout=60,
                       json={"completion_id": reply.json()["id"], "reward": rng.random()}).raise_for_status()
    httpx.post(f"{url}/flywheel/v1/jobs/groups", timeout=60).raise_for_status()
    scored = httpx.post(f"{url}/flywheel/v1/jobs/score", timeout=120).json()
    assert scored["scored"] == groups, scored


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="flywheel-bench-loop-") as scratch:
        root = Path(scratch)
        model = build_model(root)
        port = free_port()
        config = root / "flywheel.toml"
        config.write_text(f"""data_dir = "{root / 'data'}"
log_level = "warning"
[engines.local]
model = "{model}"
[aliases.agent]
engine = "local"
[judge]
enabled = false
[train.args]
learning_rate = 5e-3
precision = "fp32"
gradient_accumulation_steps = 1
max_prompt_tokens = 128
max_completion_tokens = 16
[loop]
enabled = false
""")
        gateway = subprocess.Popen([sys.executable, "-m", "flywheel.gateway",
                                    "serve", "--config", str(config), "--port",
                                    str(port)], cwd=ROOT)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_until_answering(url, gateway, timeout_s=300.0, require_ok=True)
            capture_groups(url, args.groups, rng)
            load = Load(url, args.clients, args.max_tokens)
            load.start()
            time.sleep(5.0)  # warm-up: not counted
            load.phase = "idle"
            time.sleep(args.idle_s)
            load.phase = "training"
            started = time.perf_counter()
            trained = httpx.post(f"{url}/flywheel/v1/aliases/agent/train", json={}, timeout=3600)
            round_s = time.perf_counter() - started
            assert trained.status_code == 200 and trained.json()["version"], trained.text
            version = trained.json()["version"]
            load.phase = "promotion"
            started = time.perf_counter()
            promoted = httpx.put(f"{url}/flywheel/v1/aliases/agent/adapter", json={"version": version}, timeout=300)
            serving_since = datetime.now(UTC)  # the route answers once the new version serves
            promotion_s = time.perf_counter() - started
            assert promoted.status_code == 200, promoted.text
            load.phase = "swaps"
            for swap in range(args.swaps):
                target = 0 if swap % 2 == 0 else version
                switched = httpx.put(f"{url}/flywheel/v1/aliases/agent/adapter", json={"version": target},
                                     timeout=300)
                assert switched.status_code == 200, switched.text
            load.phase = "done"
            load.stop()
        finally:
            gateway.terminate()
            gateway.wait(timeout=120)
        swap_latency_s = _round_end_to_serving(root / "data" / "flywheel.duckdb", version, serving_since)
    idle, training = load.samples.get("idle", []), load.samples.get("training", [])
    promotion = load.samples.get("promotion", [])
    result: dict[str, Any] = {
        "args": asdict(args), "round_s": round_s, "promotion_s": promotion_s,
        "round_end_to_serving_s": swap_latency_s,
        "idle": {"n": len(idle), "p50_ms": 1000 * statistics.median(idle), "p99_ms": 1000 * percentile(idle, 0.99)},
        "training": {"n": len(training), "p50_ms": 1000 * statistics.median(training),
                     "p99_ms": 1000 * percentile(training, 0.99)},
        "promotion": {"n": len(promotion), "max_ms": 1000 * max(promotion, default=float("nan"))},
        "failed": load.failures, "swaps": args.swaps, "requests_during_swaps": len(load.samples.get("swaps", [])),
    }
    result["p50_ratio"] = result["training"]["p50_ms"] / result["idle"]["p50_ms"]
    result["p99_ratio"] = result["training"]["p99_ms"] / result["idle"]["p99_ms"]
    print(json.dumps(result, indent=2))
    print(f"p99 while training / idle: {result['p99_ratio']:.2f} (target <= 2.0: "
          f"{'met' if result['p99_ratio'] <= 2.0 else 'MISSED'}); p50 ratio {result['p50_ratio']:.2f}; "
          f"round {round_s:.1f} s; promotion {promotion_s:.2f} s, its slowest request "
          f"{result['promotion']['max_ms']:.0f} ms; round end -> serving {swap_latency_s:.2f} s; "
          f"failed during {args.swaps} swaps: {load.failures.get('swaps', 0)} (target 0)")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2) + "\n")


def _round_end_to_serving(database: Path, version: int, serving_since: datetime) -> float:
    """Seconds from the round's recorded end (its run's ``finished_at``) to the new version serving."""
    from sqlmodel import select

    from flywheel.capture.models import AdapterVersion, TrainingRun
    from flywheel.capture.store import Store

    store = Store(database)
    try:
        with store.session() as session:
            row = session.exec(select(AdapterVersion).where(AdapterVersion.version == version)).one()
            run = session.get(TrainingRun, row.training_run_id)
            assert run is not None and run.finished_at is not None
            return (serving_since - run.finished_at).total_seconds()
    finally:
        store.close()


if __name__ == "__main__":
    main()
