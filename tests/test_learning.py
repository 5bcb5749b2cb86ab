"""End to end through the real gateway: capture -> groups -> RULER rewards -> GRPO -> hot-load, repeated.

The toy task: asked to pick a colour, the agent is rewarded for one particular answer
among three. The tiny model gets a short supervised warm start so that "red", "green"
and "blue" are about equally likely (a random model never says any of them: its groups
would carry no signal). Every round the agent sends plain requests; the gateway forks
each into 8 samples (the client sees one), groups and scores them (the judge is a
scripted OpenAI-compatible server that gives 1 to an answer of "blue", 0 otherwise), and
``flywheel train --promote`` trains a round on them and hot-loads the adapter.

Statistic: the share of "blue" among 48 fresh samples (temperature 1, capture off),
before training and after the last round. Threshold: it rises by at least 0.20
(from about 1/3).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.gateway_process import GatewayProcess
from tests.scripted_judge import ScriptedJudge

pytestmark = pytest.mark.slow

ROUNDS = 4
PROMPT = [{"role": "user", "content": "Pick a colour."}]
ANSWERS = ["red", "green", "blue"]
ADMIN = {"authorization": "Bearer admin"}


def reward_of(text: str) -> float:
    return 1.0 if text.strip().startswith("blue") else 0.0


def judge_reward(block: str) -> float:
    """What the scripted judge gives a trajectory block: the reward of its last answer."""
    messages = json.loads(block)
    answer = next((m.get("content") or "" for m in reversed(messages) if m.get("role") == "assistant"), "")
    return reward_of(answer)


@pytest.fixture
def judge() -> Iterator[ScriptedJudge]:
    with ScriptedJudge(scorer=judge_reward) as server:
        yield server


def mean_reward(client: openai.OpenAI) -> float:
    texts = []
    for seed in range(3):
        reply = client.chat.completions.create(model="agent", messages=PROMPT, max_tokens=8, n=16, seed=1000 + seed,
                                               temperature=1.0, extra_headers={"X-Flywheel-Capture": "off"})
        texts += [c.message.content or "" for c in reply.choices]
    return statistics.fmean(reward_of(t) for t in texts)


def test_rounds_of_capture_score_train_raise_the_reward(tmp_path: Path, judge: ScriptedJudge) -> None:
    from flywheel.trainer.tiny_model import build_tiny_model
    from tests.support import tiny_loop_config, warm_start

    model = warm_start(build_tiny_model(tmp_path / "tiny"), tmp_path / "colours", PROMPT, ANSWERS, steps=40)
    gateway = GatewayProcess(tmp_path, tiny_loop_config(model, f"""
[auth]
admin_key = "admin"
{judge.config_toml}[groups]
form_every_s = 3600
[loop]
score_every_s = 3600  # the test scores by hand, each round's groups once
[loop.gate]
holdout_fraction = 0.0  # each forked request must form its group
""")).start()
    try:
        client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
        before = mean_reward(client)
        history = [before]
        for round_ in range(ROUNDS):
            for i in range(4):  # the agent's traffic; each request is forked into a group of 8
                client.chat.completions.create(model="agent", messages=PROMPT, max_tokens=8, temperature=1.0,
                                               seed=round_ * 10 + i, extra_headers={"X-Flywheel-Fork": "7"})
            formed = httpx.post(f"{gateway.url}/flywheel/v1/jobs/groups", headers=ADMIN, timeout=60).json()
            assert len(formed["formed"]) == 4
            scored = httpx.post(f"{gateway.url}/flywheel/v1/jobs/score", headers=ADMIN, timeout=120).json()
            assert scored["scored"] == 4, scored
            trained = subprocess.run(
                [sys.executable, "-m", "flywheel.gateway",
                 "train", "--alias", "agent", "--config", str(gateway.config_file),
                 "--gateway", gateway.url, "--admin-key", "admin", "--promote"],
                capture_output=True, text=True, timeout=600,
                env={**os.environ, "PYTHONFAULTHANDLER": "1"})  # a crash shows its stack
            assert trained.returncode == 0, trained.stderr[-3000:]
            assert f"version {round_ + 1} written" in trained.stdout and "promoted" in trained.stdout
            served = httpx.get(f"{gateway.url}/flywheel/v1/aliases", headers=ADMIN).json()["data"][0]
            assert served["adapter"] == f"agent@{round_ + 1}"
            history.append(mean_reward(client))
        after = history[-1]
        print("share of 'blue' per round:", [round(h, 3) for h in history])
        assert after >= before + 0.20, history
    finally:
        gateway.stop()
