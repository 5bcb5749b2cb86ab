"""What a training round costs beyond ``trainer.train()``: the loop's warm child against a cold process per round.

    python -m bench.warm_round                    # tiny model, CPU, 4 rounds (~3 min)
    python -m bench.warm_round --rounds 6 --groups 4 --json-out warm.json

One gateway (local engine, the tiny model, loop off) runs ``rounds`` rounds through
``POST /flywheel/v1/aliases/agent/train``: the loop's own path, its warm training child (nice 10,
one torch thread), each round on ``groups`` fresh explicit groups of 8 with random rewards, recorded a candidate (a
promotion's adapter load into the engine is serving's work, not the round's). The
first round starts the child (imports, base model load); the others find it up. Then ``cold``
rounds run as the loop ran them before the child stayed up: ``flywheel train --gateway URL
--json --threads 1``, one process per round (the baseline, measured in the same run).

Printed per round: its wall time (the HTTP call, or the process, from outside), ``train()``'s
time (the whole ``trainer.train()`` call, ``charts/train_call_seconds``), the base model's load and
their ratio wall / train(); the target is a warm round <= 1.25x its train() time. TRL's own
``train_runtime`` (``charts/train_seconds``) starts after train() has built its dataloader and
prepared the model; the ratio against it is printed beside.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import httpx

from flywheel.gateway.core.processes import free_port, wait_until_answering

ROOT = Path(__file__).resolve().parent.parent
QUESTION = [{"role": "user", "content": "Who are you?"}]
CAPTURE_CONCURRENCY = 16


@dataclass
class Args:
    rounds: int = 4
    """rounds through the warm child (the first one starts it)"""
    cold: int = 2
    """rounds as a process each (the baseline)"""
    groups: int = 4
    """groups of 8 captured trajectories (random rewards) each round trains on"""
    max_tokens: int = 16
    """tokens per captured answer"""
    seed: int = 0
    json_out: str = ""


def parse_args(argv: list[str] | None = None) -> Args:
    parser = argparse.ArgumentParser(prog="python -m bench.warm_round", description=__doc__.split("\n")[0])
    for f in fields(Args):
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
    return Args(**vars(parser.parse_args(argv)))


def capture_groups(url: str, groups: int, max_tokens: int, rng: random.Random, tag: str) -> None:
    """Explicit groups of 8 with random rewards, grouped and scored: what the next round trains on."""
    rewards = [rng.random() for _ in range(groups * 8)]

    def episode(n: int, client: httpx.Client) -> None:
        reply = client.post("/v1/chat/completions", headers={"X-Flywheel-Group-Id": f"{tag}-{n // 8}"},
                            json={"model": "agent", "messages": QUESTION, "max_tokens": max_tokens,
                                  "temperature": 1.0})
        client.post("/flywheel/v1/feedback", json={"completion_id": reply.json()["id"],
                                                     "reward": rewards[n]}).raise_for_status()

    # concurrent, as agents send them: one request at a time made a 32-group round's capture outlast its step
    with httpx.Client(base_url=url, timeout=120) as client, ThreadPoolExecutor(CAPTURE_CONCURRENCY) as pool:
        list(pool.map(lambda n: episode(n, client), range(groups * 8)))
        client.post("/flywheel/v1/jobs/groups").raise_for_status()
        scored = client.post("/flywheel/v1/jobs/score").json()
    assert scored["scored"] >= groups, scored  # the store may also form a group of the same task


def row(kind: str, wall_s: float, metrics: dict[str, float]) -> dict[str, Any]:
    train_s, runtime_s = metrics["charts/train_call_seconds"], metrics["charts/train_seconds"]
    return {"kind": kind, "wall_s": wall_s, "train_s": train_s, "runtime_s": runtime_s,
            "load_s": metrics.get("charts/model_load_seconds"), "ratio": wall_s / train_s,
            "runtime_ratio": wall_s / runtime_s}


def warm_round(client: httpx.Client) -> tuple[float, dict[str, float]]:
    """One round through the admin API, on a client made before: ``httpx.post`` builds an SSL context (~50 ms)."""
    started = time.perf_counter()
    answer = client.post("/flywheel/v1/aliases/agent/train", json={"promote": False})
    wall_s = time.perf_counter() - started
    assert answer.status_code == 200 and answer.json()["status"] == "finished", answer.text
    return wall_s, answer.json()["metrics"]


def cold_round(url: str) -> tuple[float, dict[str, float]]:
    """The round as the loop's child ran it before it stayed up: a process of its own, one torch thread."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "flywheel.gateway", "train", "--alias", "agent", "--gateway", url,
                           "--json", "--threads", "1"], capture_output=True, text=True, env=env,
                          cwd=ROOT, check=False, preexec_fn=lambda: os.nice(10))
    wall_s = time.perf_counter() - started
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["status"] == "finished", summary
    return wall_s, summary["metrics"]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rng = random.Random(args.seed)
    sys.path.insert(0, str(ROOT))
    from flywheel.trainer.tiny_model import build_tiny_model
    from tests.support import TINY_TRAIN_ARGS

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="flywheel-bench-warm-") as scratch:
        root = Path(scratch)
        model = build_tiny_model(root / "tiny")
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
{TINY_TRAIN_ARGS}
[loop]
enabled = false
""")
        gateway = subprocess.Popen([sys.executable, "-m", "flywheel.gateway", "serve", "--config", str(config),
                                    "--port", str(port)], cwd=ROOT)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_until_answering(url, gateway, timeout_s=300.0, require_ok=True)
            with httpx.Client(base_url=url, timeout=3600) as client:
                for n in range(args.rounds):
                    capture_groups(url, args.groups, args.max_tokens, rng, f"warm{n}")
                    rows.append(row("warm child, first round" if n == 0 else "warm child", *warm_round(client)))
            for n in range(args.cold):
                capture_groups(url, args.groups, args.max_tokens, rng, f"cold{n}")
                rows.append(row("process per round", *cold_round(url)))
        finally:
            gateway.terminate()
            gateway.wait(timeout=120)
    def median(key: str, part: list[dict[str, Any]]) -> float:
        return statistics.median(r[key] for r in part) if part else float("nan")

    warm, cold = rows[1:args.rounds], rows[args.rounds:]
    warm_median, cold_median = median("ratio", warm), median("ratio", cold)
    result = {"args": asdict(args), "rounds": rows, "warm_ratio_median": warm_median, "cold_ratio_median": cold_median,
              "warm_runtime_ratio_median": median("runtime_ratio", warm)}
    for r in rows:
        print(f"{r['kind']:>24}: round {r['wall_s']:6.2f} s, train() {r['train_s']:6.2f} s "
              f"(train_runtime {r['runtime_s']:5.2f} s), "
              f"model load {r['load_s'] if r['load_s'] is not None else float('nan'):5.2f} s, "
              f"ratio {r['ratio']:5.2f} ({r['runtime_ratio']:5.2f})")
    print(f"warm round / train(): median {warm_median:.2f} (target <= 1.25: "
          f"{'met' if warm_median <= 1.25 else 'MISSED'}; against train_runtime "
          f"{result['warm_runtime_ratio_median']:.2f}); a process per round: {cold_median:.2f}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
