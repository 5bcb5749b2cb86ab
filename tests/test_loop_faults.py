"""The loop under faults: a judge that is down, a gateway restart mid-canary, a training child that dies,
a gateway stopped mid-round. Serving goes on through all of them; the next tick recovers from what the
store says; no group is trained twice or lost.
"""

from __future__ import annotations

import itertools
import signal
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import pytest

from flywheel.gateway.core.processes import free_port
from tests.colour_task import ANSWERS, PROMPT
from tests.gateway_process import GatewayProcess
from tests.scripted_judge import ScriptedJudge
from tests.scripted_openai import Reply, ScriptedOpenAI
from tests.test_loop_versions import CANARY, admin, converse, fake_adapter, start, status
from tests.vllm_standin import VllmStandIn
from tests.waiting import wait_for


def test_scoring_survives_a_judge_that_is_down_and_recovers_when_it_is_back(tmp_path: Path) -> None:
    judge_port = free_port()  # nothing listens there yet
    with ScriptedOpenAI(reply=lambda body: Reply(content="an answer")) as upstream:
        gateway = GatewayProcess(tmp_path, f"""
[engines.up]
base_url = "{upstream.base_url}"
[aliases.agent]
engine = "up"
base_model = "scripted"
[capture]
idle_close_s = 1
[groups]
form_every_s = 0.5
min_size = 2
[judge]
model = "openai/judge"
api_base = "http://127.0.0.1:{judge_port}/v1"
api_key = "unused"
max_retries = 0
timeout_s = 5
[loop]
score_every_s = 0.5
min_groups = 1000
[loop.gate]
holdout_fraction = 0.0  # both conversations must form the group
""").start()
        client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
        for _ in range(2):  # the same task twice, no feedback: only the judge can score it
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "same task"}])
        failed = wait_for(lambda: ((status(gateway)["jobs"].get("score") or {}).get("counts") or {}).get("failed"),
                          timeout_s=240, what="a scoring run that failed on the judge")
        assert failed >= 1
        reply = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "still serving"}])
        assert reply.choices[0].message.content == "an answer"
        with ScriptedJudge(port=judge_port) as judge:
            # Two equal answers score equally: the judged group is settled as untrainable (judge/scoring.py).
            wait_for(lambda: status(gateway)["pending"]["groups"].get("untrainable"), what="the group scored")
            assert judge.requests
        gateway.stop()


def test_a_restart_mid_canary_resumes_it(tmp_path: Path) -> None:
    with VllmStandIn() as vllm:
        gateway = start(tmp_path, vllm, CANARY)
        admin(gateway, "POST", "/aliases/agent/candidates", json={"path": fake_adapter(tmp_path, "cand")})
        started = wait_for(lambda: status(gateway)["canary"], what="the canary")["started_at"]
        client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
        for _ in range(5):
            converse(client, gateway, 1, lambda m: 1.0 if m == "agent@1" else 0.2)
        gateway.stop()
        gateway.start()
        resumed = status(gateway)["canary"]
        assert resumed is not None and resumed["version"] == 1 and resumed["started_at"] == started
        client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
        for _ in range(120):
            converse(client, gateway, 1, lambda m: 1.0 if m == "agent@1" else 0.2)
            if status(gateway)["serving"]["version"] == 1:
                break
        assert status(gateway)["serving"]["version"] == 1  # the rewards from before the restart still count
        gateway.stop()


def training_children(gateway: GatewayProcess) -> list[psutil.Process]:
    """The gateway's own training children: not their descendants, which share their command line between
    a fork and its exec."""
    assert gateway.proc is not None
    return [p for p in psutil.Process(gateway.proc.pid).children()
            if "train" in p.cmdline() and "gateway" in " ".join(p.cmdline())]


def versions(gateway: GatewayProcess) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = httpx.get(f"{gateway.url}/flywheel/v1/aliases/agent/versions",
                                           timeout=60).json()["data"]
    return rows


@pytest.mark.slow
def test_a_dead_training_child_and_a_stop_mid_round_lose_no_group_and_train_none_twice(tmp_path: Path) -> None:
    from flywheel.trainer.tiny_model import build_tiny_model
    from tests.support import tiny_loop_config, warm_start

    model = warm_start(build_tiny_model(tmp_path / "tiny"), tmp_path / "colours", PROMPT, ANSWERS, steps=40)
    gateway = GatewayProcess(tmp_path, tiny_loop_config(model, """
[groups]
form_every_s = 1
min_size = 4
max_size = 4
[judge]
enabled = false
[loop]
tick_s = 0.5
score_every_s = 1
min_groups = 2
[loop.gate]
offline = false
[loop.canary]
enabled = false
""")).start()
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
    # Rewards 1, 0, 1, 0, ... whatever the model said: every group of four has both, so no round is untrainable
    rewards = itertools.cycle([1.0, 0.0])

    def traffic(n: int) -> None:
        for _ in range(n):
            reply = client.chat.completions.create(model="m", messages=PROMPT, max_tokens=8, temperature=1.0)
            httpx.post(f"{gateway.url}/flywheel/v1/feedback", timeout=30,
                       json={"completion_id": reply.id, "reward": next(rewards)})

    try:
        traffic(8)  # two groups of four: a round starts
        child = wait_for(lambda: training_children(gateway), what="a training child")[0]
        wait_for(lambda: [v for v in versions(gateway) if v["status"] == "training"], timeout_s=300,
                 what="the child to reserve its version")
        child.send_signal(signal.SIGKILL)  # the child dies without a word, mid-round
        dead = wait_for(lambda: [v for v in versions(gateway) if v["status"] == "failed"], what="the failed round")
        assert "exited with -9" in dead[0]["reason"]
        traffic(2)  # serving goes on meanwhile
        wait_for(lambda: [v for v in versions(gateway) if v["status"] == "training"], timeout_s=300,
                 what="the next round to reserve its version")
        gateway.stop()  # mid-round: the child is stopped with the gateway
        gateway.start()
        client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
        promoted = wait_for(lambda: [v for v in versions(gateway) if v["status"] == "promoted"], timeout_s=300,
                            what="a round that finishes and is promoted")[0]
        rows = versions(gateway)
        assert [v["status"] for v in rows[:-1]] == ["failed"] * (len(rows) - 1), rows
        assert "gateway stopped" in rows[1]["reason"]
        groups = status(gateway)["pending"]["groups"]
        # Both groups settled once, and trained (each had rewards 1 and 0); none left behind.
        assert groups.get("trained", 0) == 2 and "scored" not in groups, groups
        assert promoted["metrics"]["samples/groups_trained"] == groups["trained"]
        traffic(1)
    finally:
        gateway.stop()
