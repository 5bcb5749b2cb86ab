"""Production-shaped traffic through the loop: every request unique, every turn forked, no feedback.

The agent asks the tiny model about a different ticket each time through the plain ``openai``
client and never reports a reward. The gateway forks every turn (``fork_fraction = 1``); the fork
groups are scored by a judge stand-in (RULER over HTTP) or by the task's reward hook (``[judge]
reward_hook``), the loop trains a candidate, and the offline gate judges it on held-out
conversations — which exist only because a held-out conversation's turns form no fork group. The
test asserts that the gate decided the candidate (promoted or rejected, with its numbers) and that
the loop trained again after it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from itertools import count
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.gateway_process import GatewayProcess
from tests.scripted_judge import ScriptedJudge
from tests.support import tiny_loop_config
from tests.variety_task import variety
from tests.waiting import wait_for

pytestmark = pytest.mark.slow


HOOK = "tests.variety_task:reward"


def judged_variety(block: str) -> float:
    """The judge's reward for a trajectory block: the variety of its last answer."""
    messages = json.loads(block)
    return variety(next((m.get("content") or "" for m in reversed(messages) if m.get("role") == "assistant"), ""))


@pytest.fixture
def judge() -> Iterator[ScriptedJudge]:
    with ScriptedJudge(scorer=judged_variety) as server:
        yield server


def versions(gateway: GatewayProcess) -> dict[int, dict[str, Any]]:
    rows = httpx.get(f"{gateway.url}/flywheel/v1/aliases/agent/versions", timeout=60).json()["data"]
    return {row["version"]: row for row in rows}


def needs_traffic(gateway: GatewayProcess) -> bool:
    """Whether the loop waits for more conversations: too few scored groups for a round, or held-out contexts."""
    entry = httpx.get(f"{gateway.url}/flywheel/v1/status", timeout=60).json()["aliases"][0]
    gate = entry["jobs"].get("gate") or {}
    return bool(entry["pending"]["scored_groups"] < 4 or gate.get("detail") == "not enough held-out contexts yet")


def gated_and_trained_again(rows: dict[int, dict[str, Any]]) -> bool:
    """Version 1 decided (not left a candidate) and version 2 reserved by a later round."""
    return 1 in rows and rows[1]["status"] in ("promoted", "rejected") and 2 in rows


@pytest.mark.timeout(600)
@pytest.mark.parametrize("scorer", ["judge", "hook"])
def test_unique_forked_traffic_without_feedback_is_gated_and_trained_again(tmp_path: Path, judge: ScriptedJudge,
                                                                           scorer: str) -> None:
    from flywheel.trainer.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "tiny")
    scoring = judge.config_toml if scorer == "judge" else f'[judge]\nreward_hook = "{HOOK}"\n'
    gateway = GatewayProcess(tmp_path, tiny_loop_config(model, f"""
[capture]
idle_close_s = 1
[groups]
form_every_s = 1
fork_fraction = 1.0
fork_k = 3
{scoring}[loop]
tick_s = 0.5
score_every_s = 1
min_groups = 4
[loop.gate]
contexts = 4
min_contexts = 2
holdout_fraction = 0.3
max_tokens = 8
[loop.canary]
enabled = false
[loop.monitor]
enabled = false
""")).start()
    try:
        client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
        tickets = count(1000)
        deadline = time.monotonic() + 480  # two training rounds of the tiny model on a busy 2-core machine
        rows = versions(gateway)
        while not gated_and_trained_again(rows):
            assert time.monotonic() < deadline, json.dumps(rows, indent=1)[-4000:]
            for _ in range(4):
                client.chat.completions.create(model="agent", temperature=1.0, messages=[
                    {"role": "user", "content": f"Ticket #{next(tickets)}: my order has not arrived."}])
            wait_for(lambda: gated_and_trained_again(versions(gateway)) or needs_traffic(gateway),
                     what="the loop to go on or ask for traffic", timeout_s=max(deadline - time.monotonic(), 1))
            rows = versions(gateway)
        first = rows[1]
        offline = first["gate"]["offline"]
        assert first["status"] in ("promoted", "rejected") and first["source"] == "trained", first
        assert offline["contexts"] >= 2 and offline["scorer"] == ("ruler" if scorer == "judge" else HOOK), offline
        assert offline["wins"] + offline["ties"] + offline["losses"] == offline["contexts"]
        assert offline["decision"] in ("passed", "failed", "inconclusive")
        assert (first["status"] == "promoted") == (offline["decision"] == "passed"), first
        assert first["reason"] == "passed the offline gate" or first["reason"].startswith("offline gate"), first
        print(f"{next(tickets) - 1000} requests; version 1 {first['status']}: {first['reason']}")
    finally:
        gateway.stop()
    if scorer == "hook":
        assert_scored_by_the_hook(gateway.dir / "data" / "flywheel.duckdb")


def assert_scored_by_the_hook(path: Path) -> None:
    """Every member of every scored fork group has the hook's own score and a final reward taken from it."""
    from sqlmodel import select

    from flywheel.capture.models import Group, Score
    from flywheel.capture.store import Store

    store = Store(path)
    try:
        with store.session() as session:
            # scored, then perhaps trained: with rounds this quick a round can take every group scored so far
            groups = [g for g in session.exec(select(Group).where(Group.status.in_(["scored", "trained"])))]
            scores = list(session.exec(select(Score).where(Score.source.in_(["hook", "reward", "ruler"]))))
    finally:
        store.close()
    assert groups and all(g.source == "fork" for g in groups)
    assert not [s for s in scores if s.source == "ruler"]  # no judge call
    for group in groups:
        hook = {s.trajectory_id: s.value for s in scores if s.group_id == group.id and s.source == "hook"}
        final = {s.trajectory_id: (s.value, s.explanation) for s in scores
                 if s.group_id == group.id and s.source == "reward"}
        assert len(hook) == group.size and hook.keys() == final.keys(), group.id
        assert all(final[t] == (value, "hook: ") for t, value in hook.items()), (hook, final)
