"""The whole loop on the tiny model, through HTTP, with no manual step.

An agent that only knows the OpenAI API asks "Pick a colour." again and again and reports each
answer's reward (1 for "blue") through the feedback endpoint. The scheduler closes, groups and
scores the trajectories, trains a round in a child process, passes the candidate through the
offline gate (the task's reward hook on held-out contexts) and the canary (a sequential test on
live rewards), and promotes it. The test only sends traffic and watches ``/flywheel/v1/status``
and ``flywheel status``; it asserts what the loop recorded: the version serving, the gate's
numbers, each job's last run, and reward per version.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.colour_task import ANSWERS, PROMPT, reward_of
from tests.gateway_process import GatewayProcess

pytestmark = pytest.mark.slow


def status(gateway: GatewayProcess) -> dict[str, Any]:
    entry: dict[str, Any] = httpx.get(f"{gateway.url}/flywheel/v1/status", timeout=60).json()["aliases"][0]
    return entry


def test_traffic_with_feedback_is_trained_gated_and_promoted_by_the_loop(tmp_path: Path) -> None:
    from flywheel.trainer.tiny_model import build_tiny_model
    from tests.support import tiny_loop_config, warm_start

    model = warm_start(build_tiny_model(tmp_path / "tiny"), tmp_path / "colours", PROMPT, ANSWERS, steps=40)
    gateway = GatewayProcess(tmp_path, tiny_loop_config(model, """
[groups]
form_every_s = 1
min_size = 8
max_size = 8
[judge]
enabled = false
[loop]
tick_s = 0.5
score_every_s = 1
min_groups = 4
[loop.gate]
contexts = 6
min_contexts = 3
holdout_fraction = 0.15
reward_hook = "tests.colour_task:gate_reward"
max_tokens = 8
[loop.canary]
fraction = 0.5
max_pairs = 400
""")).start()  # no admin key: the admin API answers loopback callers, the CLI finds the gateway by itself
    try:
        client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
        deadline = time.monotonic() + 540
        sent = 0
        while status(gateway)["serving"]["version"] == 0:
            assert time.monotonic() < deadline, json.dumps(status(gateway), indent=1)[-4000:]
            for _ in range(8):
                reply = client.chat.completions.create(model="gpt-4o", messages=PROMPT, max_tokens=8,
                                                       temperature=1.0)
                reward = reward_of(reply.choices[0].message.content or "")
                httpx.post(f"{gateway.url}/flywheel/v1/feedback", json={"completion_id": reply.id, "reward": reward},
                           timeout=30).raise_for_status()
                sent += 1
        final = status(gateway)
        version = final["serving"]["row"]
        gate = version["gate"]
        n = version["version"]  # an earlier candidate may have failed a gate: the loop then trains another
        assert n >= 1 and version["status"] == "promoted" and version["source"] == "trained"
        earlier = httpx.get(f"{gateway.url}/flywheel/v1/aliases/agent/versions", timeout=30).json()["data"]
        assert all(v["status"] == "rejected" for v in earlier if 0 < v["version"] < n), earlier
        # the offline gate passed it, or saw only ties and left it to the canary; never a promotion it failed
        assert gate["offline"]["decision"] in ("passed", "inconclusive") and gate["offline"]["contexts"] >= 3
        assert gate["online"]["decision"] == "better" and gate["online"]["p_better"] <= 0.05
        assert gate["online"]["mean_candidate"] > gate["online"]["mean_baseline"]
        for job in ("close_idle", "form_groups", "score", "train", "gate", "ab"):
            assert job in final["jobs"], (job, final["jobs"].keys())
        rewards = final["reward_by_version"]["versions"]
        assert rewards[str(n)]["mean"] > rewards["0"]["mean"], rewards
        shown = subprocess.run([sys.executable, "-m", "flywheel.gateway",
                                "status", "--data-dir", str(gateway.dir / "data")],
                               capture_output=True, text=True, timeout=120)  # found through gateway.json
        assert shown.returncode == 0, shown.stderr
        assert f"agent serves version {n}" in shown.stdout and "reward per version" in shown.stdout
        print(f"promoted after {sent} requests; reward by version {rewards}")
    finally:
        gateway.stop()
