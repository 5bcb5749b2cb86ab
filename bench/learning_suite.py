"""The learning suite: does the loop lift agents it was not tuned for, on both shapes of traffic?

    python -m bench.learning_suite                                    # six tasks x two shapes, 15 min each
    python -m bench.learning_suite --tasks argument length --shapes unique --minutes 5 --out runs.json
    python -m bench.learning_suite --tasks letters --shapes repeated --minutes 8 --until-declared  # CI

For each task of bench/learning_tasks.py and each traffic shape, hands-off, through the real parts:

1. the tiny model gets the task's format-only warm start (once, cached): a random model never ends a
   turn, so it could not even be scored;
2. a gateway starts on ``deploy/flywheel.small-model.toml`` (the same file for every task; the layer on
   top says only what it serves, where the judge is, and for ``unique`` traffic, that every turn forks);
3. the agent (bench/learning_agent.py, a separate process on the plain ``openai`` client) runs for
   ``--minutes``; ``repeated``: a pool of requests in blocks of four, rewards posted as feedback;
   ``unique``: a ticket number in every request, no feedback, the gateway's forks scored by the judge
   stand-in (bench/learning_judge.py, a loopback server reading RULER's prompt);
4. the loop groups, scores, trains, gates, runs its canary and promotes or rejects by itself.

Printed and written per run: the warm start's reward, the reward of the version serving at the end
(rewards as the loop recorded them), the final comparison (Welch z-test and the loop's own sequential
test, as ``flywheel demo`` reports), minutes to the first promotion the canary's test decided, episodes,
what the loop decided for each version; a plot per run (``<data-dir>/<task>-<shape>/reward.png``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console

from bench.learning_tasks import TASKS
from flywheel.gateway.cli.demo import SMALL_MODEL_CONFIG, canary_decision, final_comparison, plot_rewards
from flywheel.gateway.core.processes import free_port, stop, wait_until_answering
from flywheel.gateway.serving.loop.abtest import TEST_DECISIONS

ROOT = Path(__file__).resolve().parent.parent
SHAPES = ("repeated", "unique")
WARM_START_STEPS = 80
ALIAS = "agent"


@dataclass
class Run:
    """One task on one shape of traffic, as the agent and the gateway saw it."""

    task: str
    shape: str
    episodes: list[dict[str, Any]] = field(default_factory=list)


def warm_model(data_dir: Path, task: str) -> Path:
    from flywheel.trainer.tiny_model import ensure_tiny_model
    from flywheel.trainer.warm_start import warm_start

    tiny = ensure_tiny_model(data_dir / "models" / "tiny")
    examples = TASKS[task].warm_start_examples(512, seed=0)
    return Path(warm_start(tiny, data_dir / "models" / f"warm-{task}", examples, steps=WARM_START_STEPS, seed=0))


def layer_config(run_dir: Path, model: Path, shape: str, judge_url: str) -> str:
    """What this run adds to the small-model configuration: what it serves, the judge, the traffic's forks."""
    forks = "fork_fraction = 1.0\n" if shape == "unique" else ""
    return f"""data_dir = "{run_dir}"
log_level = "warning"

[engines.local]
model = "{model}"
default_max_tokens = 32

[aliases.{ALIAS}]
engine = "local"

[capture]
idle_close_s = 5

[groups]
{forks}
[judge]
model = "openai/judge"
api_base = "{judge_url}"
api_key = "unused"
"""


def start_judge(log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    judge = subprocess.Popen([sys.executable, "-m", "bench.learning_judge", "--port", str(port)], cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=log.open("wb"))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            httpx.post(f"{url}/v1/chat/completions", json={"messages": []}, timeout=5)
            return judge, f"{url}/v1"
        except httpx.HTTPError:
            if time.monotonic() > deadline or judge.poll() is not None:
                raise SystemExit(f"the judge stand-in did not start (log {log})") from None
            time.sleep(0.2)


def read_agent(agent: subprocess.Popen[str], run: Run) -> None:
    assert agent.stdout is not None
    for line in agent.stdout:
        with_reward = json.loads(line)
        run.episodes.append(with_reward)


def test_promotions(versions: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The promotions the canary's test decided ("better"), first first: version, when, and the canary's numbers."""
    decided = [v for v in versions if v.get("promoted_at") and "canary: better" in (v.get("reason") or "")]
    return sorted(({"version": v["version"], "promoted_at": v["promoted_at"], **{
        key: ((v.get("gate") or {}).get("online") or {}).get(key)
        for key in ("baseline_version", "pairs", "p_better", "mean_difference", "standard_error")}}
        for v in decided), key=lambda one: one["promoted_at"])


def first_test_promotion(versions: list[dict[str, Any]], started: datetime) -> float | None:
    """Minutes from the agent's start to the first promotion the canary's test decided ("better")."""
    decided = test_promotions(versions)
    if not decided:
        return None
    first = datetime.fromisoformat(decided[0]["promoted_at"])
    first = first if first.tzinfo else first.replace(tzinfo=UTC)
    return round((first - started).total_seconds() / 60, 2)


def run_one(task: str, shape: str, args: argparse.Namespace, console: Console) -> dict[str, Any]:
    data_dir: Path = args.data_dir
    model = warm_model(data_dir, task)
    run_dir = data_dir / f"{task}-{shape}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    judge, judge_url = start_judge(run_dir / "judge.log")
    layer = run_dir / "flywheel.toml"
    layer.write_text(layer_config(run_dir, model, shape, judge_url))
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    gateway = subprocess.Popen(
        [sys.executable, "-m", "flywheel.gateway", "serve", "-c", str(SMALL_MODEL_CONFIG), "-c", str(layer),
         "--port", str(port)], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
        stderr=(run_dir / "gateway.log").open("wb"))
    url = f"http://127.0.0.1:{port}"
    run = Run(task, shape)
    try:
        wait_until_answering(url, gateway, timeout_s=300.0, require_ok=True)
        started_at = datetime.now(UTC)
        agent = subprocess.Popen([sys.executable, "-m", "bench.learning_agent", "--task", task, "--shape", shape,
                                  "--base-url", f"{url}/v1", "--seed", str(args.seed)],
                                 cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE,
                                 stderr=(run_dir / "agent.log").open("wb"))
        threading.Thread(target=read_agent, args=(agent, run), daemon=True).start()
        began = time.monotonic()
        while time.monotonic() - began < args.minutes * 60 and agent.poll() is None:
            time.sleep(5)
            recent = [e.get("reward", 0.0) for e in run.episodes[-64:]]
            console.log(f"{task}/{shape}: {time.monotonic() - began:4.0f} s, {len(run.episodes)} episodes, "
                        f"reward (last {len(recent)}) {sum(recent) / max(1, len(recent)):.3f}")
            if args.until_declared and first_test_promotion(
                    httpx.get(f"{url}/flywheel/v1/aliases/{ALIAS}/versions", timeout=30).json()["data"],
                    started_at) is not None:
                break
        minutes = (time.monotonic() - began) / 60
        agent.terminate()
        agent.wait(timeout=30)
        status = httpx.get(f"{url}/flywheel/v1/status", timeout=30).json()["aliases"][0]
        versions = httpx.get(f"{url}/flywheel/v1/aliases/{ALIAS}/versions", timeout=30).json()["data"]
        rewards = httpx.get(f"{url}/flywheel/v1/aliases/{ALIAS}/rewards", timeout=60).json()["rewards"]
    finally:
        stop(gateway)
        judge.terminate()  # after the gateway: a scoring run in progress still reaches it
    serving = status["serving"]["version"]
    plot_rewards(rewards, versions, run_dir / "reward.png", title=f"{task}, {shape} traffic")
    by_version = status["reward_by_version"]["versions"]
    result = {
        "task": task, "shape": shape, "minutes": round(minutes, 2), "episodes": len(run.episodes),
        "agent_errors": sum("error" in e for e in run.episodes),
        "warm_start_reward": (by_version.get("0") or {}).get("mean"),
        "serving_version": serving, "serving_reward": (by_version.get(str(serving)) or {}).get("mean"),
        "final_comparison": final_comparison(rewards, serving),
        "minutes_to_first_test_promotion": first_test_promotion(versions, started_at),
        "test_promotions": test_promotions(versions),
        "decisions": [{"version": v["version"], "status": v["status"], "reason": v.get("reason")} for v in versions
                      if v["version"] > 0],
        "canary_ends": canary_ends(versions),
        "agent_reward_first_100": mean([e.get("reward", 0.0) for e in run.episodes[:100]]),
        "agent_reward_last_100": mean([e.get("reward", 0.0) for e in run.episodes[-100:]]),
    }
    (run_dir / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def canary_ends(versions: list[dict[str, Any]]) -> dict[str, Any]:
    """How each finished canary ended, and the share its own test decided (better, worse, not better)."""
    ends: dict[str, int] = {}
    for version in versions:
        decision = canary_decision(version)
        if decision is not None and version["status"] != "canary":
            ends[decision] = ends.get(decision, 0) + 1
    finished = sum(ends.values())
    by_test = sum(ends.get(decision, 0) for decision in TEST_DECISIONS)
    return {**ends, "finished": finished, "decided_by_test": by_test / finished if finished else None}


def mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def report_line(result: dict[str, Any]) -> str:
    comparison = result["final_comparison"] or {}
    sequential = comparison.get("sequential") or {}
    return (f"{result['task']:>11} {result['shape']:>8}: {result['episodes']:5d} episodes, warm start "
            f"{result['warm_start_reward'] or 0:.3f} -> version {result['serving_version']} "
            f"{result['serving_reward'] or 0:.3f}; p(better, sequential) {sequential.get('p_better', 1):.3g}; "
            f"first test-decided promotion at {result['minutes_to_first_test_promotion']} min; canaries "
            f"{result['canary_ends']}; decisions "
            + ", ".join(f"v{d['version']} {d['status']}" for d in result["decisions"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="+", choices=sorted(TASKS), default=list(TASKS))
    parser.add_argument("--shapes", nargs="+", choices=SHAPES, default=list(SHAPES))
    parser.add_argument("--minutes", type=float, default=15.0, help="agent time per task and shape")
    parser.add_argument("--data-dir", type=Path, default=Path("flywheel-data") / "learning")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="also write every result to this JSON file")
    parser.add_argument("--until-declared", action="store_true",
                        help="end a run at its first promotion the canary's test decided (--minutes at most)")
    args = parser.parse_args()
    args.data_dir = args.data_dir.resolve()
    console = Console(stderr=True, highlight=False)
    results = []
    for task in args.tasks:
        for shape in args.shapes:
            results.append(run_one(task, shape, args, console))
            console.print(report_line(results[-1]))
            if args.out:
                args.out.write_text(json.dumps(results, indent=2) + "\n")
    for result in results:
        print(report_line(result))


if __name__ == "__main__":
    main()
