"""The learning suite, shortened: hands-off, the loop lifts a task and its own sequential test says so.

Runs ``python -m bench.learning_suite --tasks T --shapes S --until-declared`` as a user would, for two tasks
(``letters``, a dense share; ``length``, a distance) in both shapes: repeated requests whose rewards the agent
posts as feedback, and unique requests with no feedback, every turn forked and the fork groups scored by the
judge stand-in. Each
run: the task's warm start, a gateway on deploy/flywheel.small-model.toml, the agent a separate process on
the plain ``openai`` client; it ends at its first promotion the canary's test decided, or after MINUTES.

Statistic: the first promotion the test decided, over the warm start (version 0). Threshold: there is one, its
anytime-valid p(better) is at most the test's alpha (0.05), and the mean paired gain it measured is above 0.
Measured: docs/learning.md ("In CI").
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
MINUTES = 8.0
ALPHA = 0.05
RUN_S = (MINUTES + 4) * 60  # the agent's time, plus the warm start, the gateway's start and its report


@pytest.mark.timeout(RUN_S + 60)
@pytest.mark.parametrize(("task", "shape"), [(task, shape) for task in ("letters", "length")
                                             for shape in ("repeated", "unique")])
def test_the_loop_lifts_a_task_by_its_own_test(tmp_path: Path, task: str, shape: str) -> None:
    out = tmp_path / "runs.json"
    done = subprocess.run(
        [sys.executable, "-m", "bench.learning_suite", "--tasks", task, "--shapes", shape,
         "--minutes", str(MINUTES), "--until-declared", "--data-dir", str(tmp_path / "suite"), "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=RUN_S)
    assert done.returncode == 0, done.stderr[-3000:]
    print(done.stdout)
    runs = json.loads(out.read_text())
    [run] = runs
    assert (run["task"], run["shape"], run["agent_errors"]) == (task, shape, 0), run
    assert run["test_promotions"], run  # promoted by the test itself, not by the time running out
    first = run["test_promotions"][0]
    assert first["baseline_version"] == 0 and first["p_better"] <= ALPHA, run
    assert first["mean_difference"] > 0, run
