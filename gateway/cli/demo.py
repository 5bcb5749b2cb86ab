"""``flywheel demo``: watch an agent that was not modified at all get better, on a laptop's CPU.

    flywheel demo                        # tiny model: warm start (once), then ~13 minutes of the loop
    flywheel demo --minutes 5            # shorter
    flywheel demo --model ~/models/Qwen2.5-0.5B-Instruct   # a real local model, no warm start

What happens:

1. The tiny model is built into ``<data_dir>/models/tiny`` if missing and given a short supervised
   warm start that teaches only the *format* of the task — a valid tool call, then a final answer,
   with tools chosen at random (``trainer/warm_start.py``). It exists only because the tiny model
   starts from random weights; it is cached, so a second run skips it.
2. A gateway starts with the local engine and the loop (``<data_dir>/demo/``, fresh each run).
3. The bundled agent (``examples/demo/agent.py``) runs: a support agent that must call the right one
   of four tools for each customer request, gets the tool's result and answers. It uses only the
   ``openai`` client with its ``base_url`` pointed at the gateway, and reports each episode's reward
   through the feedback endpoint — the only thing it knows about Flywheel.
4. The loop groups the episodes and the forks of every turn (scored by the task's reward hook), trains
   LoRA rounds in a child process, gates each candidate
   offline (held-out requests, the task's reward hook) and on a canary (a sequential test on live
   rewards), promotes or rejects it, and watches each promotion for a drop — by itself, while the
   agent keeps running. The screen shows episodes, versions, reward per version, gate decisions.
5. At the end: reward per version with n and a 95% interval, the test used and its p-value, and a
   plot of reward over episodes coloured by serving version (``<data_dir>/demo/reward.png``).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
import tomllib
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.panel import Panel
from rich.table import Table

from flywheel.gateway.cli.common import fail
from flywheel.gateway.core.processes import NotAnswering, free_port, stop, wait_until_answering
from flywheel.gateway.serving.loop.abtest import TEST_DECISIONS, SequentialTest

REPO = Path(__file__).resolve().parents[2]  # examples/ lives beside the packages
ALIAS = "flywheel"

# The loop's settings for small models, which the demo runs on unchanged (docs/learning.md).
SMALL_MODEL_CONFIG = REPO / "deploy" / "flywheel.small-model.toml"
GROUP_SIZE = 4  # attempts per request: the agent repeats each request this many times in a row
WARM_START_STEPS = 80


CANARY_ENDS = (*TEST_DECISIONS, "max_pairs")  # how a canary's own test ends (not a hand-over)


def canary_decision(version: dict[str, Any]) -> str | None:
    """How the canary of a version (a ``versions`` row) ended or stands, None without one."""
    decision = ((version.get("gate") or {}).get("online") or {}).get("decision")
    return str(decision) if decision is not None else None


@dataclass
class Episode:
    index: int
    reward: float
    right_tool: bool
    finished_at: float


@dataclass
class Board:
    """What the live display shows, updated by the agent's output and by polling the gateway."""

    started: float = field(default_factory=time.monotonic)
    episodes: list[Episode] = field(default_factory=list)
    errors: int = 0
    status: dict[str, Any] = field(default_factory=dict)
    versions: list[dict[str, Any]] = field(default_factory=list)
    events: deque[str] = field(default_factory=lambda: deque(maxlen=8))
    _seen: dict[int, str] = field(default_factory=dict)

    def promoted(self, enough: int) -> bool:
        return enough > 0 and sum(1 for row in self.versions if row.get("promoted_at")) >= enough

    def decided_by_canary(self, enough: int) -> bool:
        decided = sum(1 for row in self.versions if canary_decision(row) in CANARY_ENDS)
        return enough > 0 and decided >= enough

    def note_versions(self, rows: list[dict[str, Any]]) -> None:
        """Turn status changes of versions into lines for the event log."""
        for row in rows:
            previous = self._seen.get(row["version"])
            if previous != row["status"]:
                self._seen[row["version"]] = row["status"]
                elapsed = time.monotonic() - self.started
                reason = f" — {row['reason']}" if row.get("reason") else ""
                self.events.append(f"{elapsed:6.0f}s  version {row['version']}: {row['status']}{reason}")
        self.versions = rows


def demo(data_dir: Annotated[Path, typer.Option(help="Where models, the demo's store and its plot go.")] = Path(
             "flywheel-data"),
         minutes: Annotated[float, typer.Option(help="How long the agent runs (the warm start is extra).")] = 13.0,
         episodes: Annotated[int | None, typer.Option(help="Stop after this many episodes instead.")] = None,
         concurrency: Annotated[int, typer.Option(help="Episodes the agent runs at once.")] = 4,
         model: Annotated[Path | None, typer.Option(
             help="A local model directory (e.g. Qwen2.5-0.5B-Instruct) instead of the tiny one; no warm start.")
                          ] = None,
         seed: Annotated[int, typer.Option(help="The agent's seed.")] = 0,
         min_groups: Annotated[int | None, typer.Option(
             help="Scored groups per training round (default: the small-model configuration's).")] = None,
         canary_pairs: Annotated[int | None, typer.Option(
             help="Canary pairs per version before the A/B test must decide (default: the configuration's).")
                                 ] = None,
         promotions: Annotated[int, typer.Option(
             help="Stop once this many versions were promoted (0: run the whole time).")] = 0,
         decisions: Annotated[int, typer.Option(
             help="Stop once the canary's test decided this many versions (0: run the whole time).")] = 0,
         ) -> None:
    """Watch an unmodified agent improve: warm start (tiny model), gateway + loop, agent, live progress, plot.

    Example: flywheel demo --minutes 10   (CI runs: --minutes 8 --min-groups 4 --canary-pairs 20 --decisions 1)
    """
    data_dir = data_dir.resolve()
    console = Console(stderr=True, highlight=False)
    served_model = _model(data_dir, model, console)
    demo_dir = data_dir / "demo"
    shutil.rmtree(demo_dir, ignore_errors=True)  # every run starts from the warm start, with a fresh store
    demo_dir.mkdir(parents=True)
    config = demo_dir / "flywheel.toml"
    config.write_text(demo_config(demo_dir, served_model, tiny=model is None, min_groups=min_groups,
                                   canary_pairs=canary_pairs))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(
        os.pathsep)}
    port = free_port()
    serve = [sys.executable, "-m", "flywheel.gateway", "serve", "--config", str(SMALL_MODEL_CONFIG),
             "--config", str(config), "--port", str(port)]
    gateway = subprocess.Popen(serve, stdout=subprocess.DEVNULL, stderr=(demo_dir / "gateway.log").open("wb"),
                               env=env, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    board = Board()
    try:
        _wait_ready(gateway, url, demo_dir / "gateway.log")
        console.print(f"gateway ready at {url} (log {demo_dir / 'gateway.log'}); starting the agent")
        agent = subprocess.Popen(
            [sys.executable, "-m", "examples.demo.agent", "--base-url", f"{url}/v1", "--episodes",
             str(episodes or 1_000_000), "--concurrency", str(concurrency), "--seed", str(seed),
             "--group-size", str(GROUP_SIZE)],
            stdout=subprocess.PIPE, stderr=(demo_dir / "agent.log").open("wb"), env=env, cwd=REPO, text=True)
        reader = threading.Thread(target=_read_agent, args=(agent, board), daemon=True)
        reader.start()
        deadline = time.monotonic() + minutes * 60
        with Live(_render(board), console=console, refresh_per_second=2) as live:
            while agent.poll() is None and time.monotonic() < deadline and not board.promoted(promotions) \
                    and not board.decided_by_canary(decisions):
                _poll(url, board)
                live.update(_render(board))
                time.sleep(1.0)
            agent.terminate()
            agent.wait(timeout=30)
            _poll(url, board)
            live.update(_render(board))
        summary = _finish(url, board, demo_dir)
    finally:
        stop(gateway)
    _report(Console(highlight=False), summary, demo_dir)


def _model(data_dir: Path, model: Path | None, console: Console) -> Path:
    """The model the gateway serves: the given directory, or the tiny model after its (cached) warm start."""
    if model is not None:
        if not (model / "config.json").is_file():
            fail(f"--model: {model} is not a model directory (config.json missing)")
        return model.resolve()
    sys.path.insert(0, str(REPO))  # examples/ is not an installed package
    from examples.demo import task
    from flywheel.trainer.tiny_model import ensure_tiny_model
    from flywheel.trainer.warm_start import warm_start

    tiny = ensure_tiny_model(data_dir / "models" / "tiny")
    out = data_dir / "models" / "demo-warm-start"
    if not (out / "config.json").is_file():
        console.print("warm start: teaching the tiny model the task's format (tool call, then an answer; "
                      "tools at random) — once, cached in " + str(out))
    return Path(warm_start(tiny, out, task.warm_start_examples(512, seed=0), steps=WARM_START_STEPS, seed=0))


def demo_config(demo_dir: Path, model: Path, *, tiny: bool, min_groups: int | None = None,
                canary_pairs: int | None = None) -> str:
    """The demo's own layer over ``deploy/flywheel.small-model.toml``: what it serves and how rewards arrive.

    Every ``[train]`` and ``[loop]`` value comes from that file (the one configuration docs/learning.md
    measures on every task) except the two the command line shortens: ``min_groups`` and the canary's
    ``max_pairs``. A real model (``--model``) trains at a real model's learning rate in its own precision.
    """
    real_model = "" if tiny else '[train.args]\nlearning_rate = 2e-5\nprecision = "auto"\n'
    rounds = "" if min_groups is None else f"max_groups = {min_groups}\n"
    return f"""# written by flywheel demo, layered over {SMALL_MODEL_CONFIG.name}
data_dir = "{demo_dir}"
log_level = "warning"

[engines.local]
model = "{model}"
default_max_tokens = 64

[aliases.{ALIAS}]
engine = "local"

[capture]
idle_close_s = 60

[groups]
fork_fraction = 1.0  # every turn also answered by the training head: a group at every context

[judge]
reward_hook = "examples.demo.task:turn_reward"  # the task's own check scores groups and the gate: no judge model

[train]
{rounds}{real_model}
[loop]
{rounds.replace("max_groups", "min_groups")}

[loop.canary]
{"" if canary_pairs is None else f"max_pairs = {canary_pairs}"}
"""


def small_model_train_args() -> dict[str, Any]:
    """``[train.args]`` of the small-model configuration (what every round of the demo trains with)."""
    return dict(tomllib.loads(SMALL_MODEL_CONFIG.read_text())["train"]["args"])


def _wait_ready(gateway: subprocess.Popen[bytes], url: str, log: Path) -> None:
    """Wait until the gateway serves; if it does not, a one-line CLI error with the log's last line."""
    try:
        wait_until_answering(url, gateway, timeout_s=300.0, require_ok=True)
    except NotAnswering as exc:
        lines = log.read_text(errors="replace").strip().splitlines()
        fail(f"the gateway did not start: {exc}: {lines[-1] if lines else '(empty log)'} (log {log})")


def _read_agent(agent: subprocess.Popen[str], board: Board) -> None:
    assert agent.stdout is not None
    for line in agent.stdout:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if "episode" not in record:
            continue
        if record.get("error"):
            board.errors += 1
        board.episodes.append(Episode(record["episode"], float(record.get("reward") or 0.0),
                                      bool(record.get("right_tool")), time.monotonic()))


def _poll(url: str, board: Board) -> None:
    try:
        board.status = httpx.get(f"{url}/flywheel/v1/status", timeout=10).json()["aliases"][0]
        board.note_versions(httpx.get(f"{url}/flywheel/v1/aliases/{ALIAS}/versions", timeout=10).json()["data"])
    except (httpx.HTTPError, ValueError, KeyError):
        pass  # the next poll will do


def _render(board: Board) -> Panel:
    elapsed = time.monotonic() - board.started
    recent = board.episodes[-64:]
    rate = len(board.episodes) / elapsed if elapsed > 0 else 0.0
    head = Table.grid(padding=(0, 2))
    serving = (board.status.get("serving") or {}).get("version", 0)
    candidate = board.status.get("candidate")
    head.add_row(f"[bold]{elapsed:5.0f} s[/bold]", f"{len(board.episodes)} episodes ({rate:.1f}/s)",
                 f"serving version [bold]{serving}[/bold]",
                 f"candidate: version {candidate['version']} {candidate['status']}" if candidate else "no candidate",
                 f"reward (last {len(recent)}): {sum(e.reward for e in recent) / max(1, len(recent)):.3f}")
    rewards = Table(title="reward per version (finished episodes)", title_justify="left", expand=False)
    for column in ("version", "n", "mean", "95% interval"):
        rewards.add_column(column)
    for version, cell in ((board.status.get("reward_by_version") or {}).get("versions") or {}).items():
        interval = f"[{cell['low']:.3f}, {cell['high']:.3f}]" if "low" in cell else "-"
        rewards.add_row(version, str(cell["n"]), f"{cell['mean']:.3f}", interval)
    canary = board.status.get("canary") or {}
    ab = canary.get("ab") or {}
    lines: list[RenderableType] = [head, rewards]
    if ab:
        lines.append(f"canary: version {canary['version']} vs {ab.get('baseline_version')}: {ab.get('pairs')} pairs, "
                     f"p(better)={ab.get('p_better', 1):.4f}, p(worse)={ab.get('p_worse', 1):.4f}")
    lines += list(board.events)
    return Panel(Group(*lines), title="flywheel demo: an unmodified agent, learning")


def _finish(url: str, board: Board, demo_dir: Path) -> dict[str, Any]:
    """Collect the numbers, write the plot and ``summary.json``."""
    status = httpx.get(f"{url}/flywheel/v1/status", timeout=30).json()["aliases"][0]
    versions = httpx.get(f"{url}/flywheel/v1/aliases/{ALIAS}/versions", timeout=30).json()["data"]
    rewards = httpx.get(f"{url}/flywheel/v1/aliases/{ALIAS}/rewards", timeout=60).json()["rewards"]
    summary = {"episodes": len(board.episodes), "agent_errors": board.errors,
               "seconds": time.monotonic() - board.started, "reward_by_version": status["reward_by_version"],
               "serving_version": status["serving"]["version"], "versions": versions,
               "promoted": [v["version"] for v in versions if v.get("promoted_at")],
               "final_comparison": final_comparison(rewards, status["serving"]["version"])}
    (demo_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot_rewards(rewards, versions, demo_dir / "reward.png")
    return summary


def final_comparison(rewards: list[dict[str, Any]], serving: int) -> dict[str, Any] | None:
    """The serving version against the warm start (version 0), measured once, at the end.

    Two numbers: a Welch z-test on every episode of each (one look, so a fixed-sample test is valid:
    the difference, its 95% interval, the one-sided p-value of "no better"), and the loop's own
    anytime-valid sequential test on the same episodes paired in order (more conservative).
    """
    ours = [r["reward"] for r in rewards if r["version"] == serving]
    theirs = [r["reward"] for r in rewards if r["version"] == 0]
    if serving == 0 or len(ours) < 2 or len(theirs) < 2:
        return None
    difference = statistics.fmean(ours) - statistics.fmean(theirs)
    se = math.sqrt(statistics.variance(ours) / len(ours) + statistics.variance(theirs) / len(theirs))
    z = difference / se if se > 0 else math.inf * (1 if difference > 0 else -1)
    sequential = SequentialTest(alpha=0.05, max_pairs=min(len(ours), len(theirs)))
    sequential.add_all(ours, theirs)
    return {"version": serving, "n": len(ours), "n_warm_start": len(theirs), "difference": difference,
            "low": difference - 1.96 * se, "high": difference + 1.96 * se,
            "p_value": 0.5 * math.erfc(z / math.sqrt(2)), "test": "Welch z-test, one-sided (candidate > warm start)",
            "sequential": sequential.summary()}


def plot_rewards(rewards: list[dict[str, Any]], versions: list[dict[str, Any]], out: Path, window: int = 25,
                 title: str = "flywheel demo") -> None:
    """Reward over finished episodes (each version's moving average), coloured by the version that served them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(11, 4.8), dpi=110)
    by_version: dict[int, list[tuple[int, float]]] = {}
    own: dict[int, list[float]] = {}  # each version's moving average runs over its own episodes only
    for index, row in enumerate(rewards):
        values = own.setdefault(row["version"], [])
        values.append(row["reward"])
        recent = values[-window:]
        by_version.setdefault(row["version"], []).append((index, sum(recent) / len(recent)))
    latest = max(by_version, default=0)
    colours = plt.get_cmap("viridis")  # later versions lighter: the progression reads at a glance
    for version, points in sorted(by_version.items()):
        xs, ys = zip(*points, strict=True)
        label = "warm start (version 0)" if version == 0 else f"version {version}"
        axes.scatter(xs, ys, s=6, color=colours(0.9 * version / max(1, latest)), label=label)
    axes.set_xlabel("finished episodes (in the order they closed)")
    axes.set_ylabel(f"reward, moving average of the version's last {window}")
    axes.set_ylim(-0.02, 1.02)
    decided: dict[str, int] = {}
    for row in versions:
        decided[row["status"]] = decided.get(row["status"], 0) + 1
    axes.set_title(f"{title}: reward by serving version — " + ", ".join(
        f"{count} {status}" for status, count in sorted(decided.items())), fontsize=10)
    axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, markerscale=2)
    figure.tight_layout()
    figure.savefig(out)
    plt.close(figure)


def _report(console: Console, summary: dict[str, Any], demo_dir: Path) -> None:
    table = Table(title="reward per version", title_justify="left")
    for column in ("version", "status", "n", "mean reward", "95% interval", "gate"):
        table.add_column(column)
    rows = {str(v["version"]): v for v in summary["versions"]}
    for version, cell in summary["reward_by_version"]["versions"].items():
        row = rows.get(version, {})
        gate = row.get("gate") or {}
        online = gate.get("online") or {}
        said = (f"offline win rate {gate['offline']['win_rate']:.2f}" if gate.get("offline") else "")
        if online:
            decision = online.get("decision")
            p = online.get({"worse": "p_worse", "not_better": "p_not_better"}.get(str(decision), "p_better"), 1)
            said += f"; canary {decision}, p={p:.4f}"
        interval = f"[{cell['low']:.3f}, {cell['high']:.3f}]" if "low" in cell else "-"
        table.add_row(version, row.get("status", "base model"), str(cell["n"]), f"{cell['mean']:.3f}", interval,
                      said.strip("; "))
    console.print(table)
    final = summary.get("final_comparison")
    if final:
        sequential = final["sequential"]
        console.print(f"version {final['version']} ({final['n']} episodes) vs the warm start "
                      f"({final['n_warm_start']}): "
                      f"reward {final['difference']:+.3f}, 95% interval [{final['low']:+.3f}, {final['high']:+.3f}]; "
                      f"{final['test']}: p = {final['p_value']:.2g}; the loop's sequential test on "
                      f"{sequential['pairs']} pairs: p(better) = {sequential['p_better']:.2g}")
    else:
        console.print("no version was promoted in this run: the warm start still serves")
    console.print(f"{summary['episodes']} episodes in {summary['seconds'] / 60:.1f} min; "
                  f"plot: {demo_dir / 'reward.png'}; numbers: {demo_dir / 'summary.json'}")
