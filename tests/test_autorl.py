"""``flywheel autorl``: inputs from a generator model, rollouts through the gateway, RULER, groups stored.

The input generator and the judge are small OpenAI-compatible servers on loopback; the agent is the
tiny model behind a real gateway with client keys on. The command runs as the operator runs it (a
subprocess).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import flywheel
from tests.conftest import ADMIN_KEY, CLIENT_KEY
from tests.gateway_process import GatewayProcess
from tests.scripted_judge import ScriptedJudge
from tests.scripted_openai import Reply, ScriptedOpenAI

TASK = "Answer questions about the opening hours of a small bakery."
INPUTS = ["When do you open on Sunday?", "Are you open on public holidays?", "Until when can I pick up bread?"]


@pytest.fixture(scope="module")
def gateway(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    process = GatewayProcess(tmp_path_factory.mktemp("autorl"), f"""
[engines.local]
model = "{tiny_model}"
default_max_tokens = 4
[aliases.baker]
engine = "local"
[auth]
api_keys = ["{CLIENT_KEY}"]
admin_key = "{ADMIN_KEY}"
""", name="autorl").start()
    yield process
    process.stop()


def autorl(gateway: GatewayProcess, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "flywheel.gateway", "autorl", "--task", TASK, "--alias", "baker",
                           "--config", str(gateway.config_file), "--gateway", gateway.url, "--admin-key", ADMIN_KEY,
                           "--api-key", CLIENT_KEY, "--max-tokens", "4", *args], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "OPENAI_API_KEY": "unused"})


def generator_reply(body: dict[str, Any]) -> Reply:
    return Reply(content="```json\n" + json.dumps({"inputs": [*INPUTS, INPUTS[0]]}) + "\n```")  # a repeat, fenced


def test_autorl_judges_groups_of_rollouts_on_generated_inputs(gateway: GatewayProcess) -> None:
    with ScriptedOpenAI(reply=generator_reply) as generator, ScriptedJudge() as judge:
        done = autorl(gateway, "--inputs", "3", "--rollouts", "2", "--input-model", "openai/writer",
                      "--input-api-base", generator.base_url, "--judge-model", "openai/judge",
                      "--judge-api-base", judge.base_url, "--no-train")
        assert done.returncode == 0, done.stderr[-2000:]
        assert "3 inputs written" in done.stdout and "step 0: 3 of 3 groups gathered and judged" in done.stdout
        (request,) = generator.requests
        assert TASK in request["messages"][0]["content"]
        assert len(judge.requests) == 3
    with flywheel.Gateway(gateway.url, admin_key=ADMIN_KEY) as admin:
        captured = admin.trajectories(alias="baker", limit=100)["data"]
        firsts = {admin.trajectory(t["id"])["turns"][0]["request_messages"][-1]["content"] for t in captured}
        assert firsts == set(INPUTS)
        assert len({t["group_key"] for t in captured}) == 3 and len(captured) == 6


def test_autorl_says_what_is_wrong_in_one_line(gateway: GatewayProcess) -> None:
    with ScriptedOpenAI(reply=lambda body: Reply(content="I cannot think of any.")) as generator:
        silent = autorl(gateway, "--input-model", "openai/writer", "--input-api-base", generator.base_url)
    assert silent.returncode == 2 and silent.stderr.count("\n") == 1
    assert "gave 0 usable inputs" in silent.stderr
    missing = autorl(gateway, "--agent", "examples.nothing_here:rollout")
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1
    assert missing.stderr.startswith("error: --agent: cannot import 'examples.nothing_here'")
