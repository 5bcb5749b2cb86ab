"""``[train] workers``: the gateway's loop never trains itself; a trainer worker (``flywheel train --gateway``, a
real GRPO round on the tiny model in its own process) gets a batch only when the loop would train, and the
loop's gate takes what it reports. The engine is the vLLM stand-in, which loads the new version."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.gateway_process import GatewayProcess
from tests.test_loop_versions import ADMIN, admin, status
from tests.vllm_standin import BASE, VllmStandIn
from tests.waiting import wait_for


@pytest.fixture
def vllm() -> Iterator[VllmStandIn]:
    with VllmStandIn() as server:
        yield server


def worker(gateway: GatewayProcess) -> dict[str, Any]:
    """One ``flywheel train`` run as a worker on another machine would: the admin API only, its last line JSON."""
    done = subprocess.run([sys.executable, "-m", "gateway", "train", "--alias", "agent", "--gateway", gateway.url,
                           "--json"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "FLYWHEEL_ADMIN_KEY": "admin"}, cwd=gateway.dir)
    assert done.returncode == 0, done.stdout + done.stderr
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_a_worker_trains_only_when_the_loop_would_and_the_gate_takes_its_round(tmp_path: Path, vllm: VllmStandIn,
                                                                                 tiny_model: Path) -> None:
    gateway = GatewayProcess(tmp_path, f"""
[engines.vllm]
base_url = "{vllm.base_url}"
[aliases.agent]
engine = "vllm"
base_model = "{BASE}"
train_model = "{tiny_model}"
[auth]
admin_key = "admin"
[judge]
enabled = false
[groups]
form_every_s = 0.5
[train]
workers = true
[train.args]
precision = "fp32"
max_steps = 1
gradient_accumulation_steps = 1
max_prompt_tokens = 128
max_completion_tokens = 32
[loop]
tick_s = 0.5
score_every_s = 0.5
min_groups = 2
[loop.gate]
offline = false
[loop.canary]
enabled = false
""").start()
    try:
        assert worker(gateway)["status"] == "nothing"  # no scored group yet: nothing handed out
        client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
        for index in range(4):  # two explicit groups of two; feedback closes each conversation
            reply = client.chat.completions.create(
                model="agent", messages=[{"role": "user", "content": "name a colour"}],
                extra_headers={"X-Flywheel-Group-Id": f"colours-{index // 2}"})
            feedback = httpx.post(f"{gateway.url}/flywheel/v1/feedback", headers=ADMIN, timeout=30,
                                  json={"completion_id": reply.id, "reward": float(index % 2)})
            assert feedback.status_code == 200, feedback.text
        wait_for(lambda: status(gateway)["pending"]["scored_groups"] == 2, "the loop to score both groups")
        # Due now, but the gateway does not train itself: its train job says so.
        wait_for(lambda: "wait for a trainer worker" in ((status(gateway)["jobs"].get("train") or {}).get("detail")
                                                         or ""), "the loop's train job to see a round due")
        assert [row["status"] for row in admin(gateway, "GET", "/aliases/agent/versions")["data"]] == []

        round_ = worker(gateway)
        assert (round_["status"], round_["version"], round_["groups"]) == ("finished", 1, 2), round_
        assert (Path(round_["adapter_path"]) / "adapter_config.json").is_file()
        # The loop's gate (offline and canary off here) promotes what the worker reported; the engine loads it.
        wait_for(lambda: status(gateway)["serving"]["version"] == 1, "the loop to promote the worker's round")
        assert "agent@1" in vllm.loras
        assert worker(gateway)["status"] == "nothing"  # the groups are trained: nothing handed out twice
        # Two workers never train one alias at once: a reservation while a version is in flight is refused.
        assert admin(gateway, "POST", "/training/versions", json={"alias": "agent"})["version"] == 2
        second = httpx.post(f"{gateway.url}/flywheel/v1/training/versions", headers=ADMIN, timeout=30,
                            json={"alias": "agent"})
        assert second.status_code == 400 and "one round at a time" in second.text, second.text
    finally:
        gateway.stop()
