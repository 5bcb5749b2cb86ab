"""Sub-agents through a real gateway: tagged calls form trajectories of their own, linked to the parent's,
shown with it, kept out of grouping and of training, and judged inside the parent's conversation.

Two runs of one task (the same system prompt and question, so they form a task group) each
delegate research to a sub-agent between their turns; one sub-agent's work is good, the
other's is not, and the parents' own answers are the same. The scripted judge scores by how
often "good" appears in a trajectory, so only a judge that read the sub-agents' work can
rank the two parents apart.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from sqlmodel import select

from flywheel.capture.groups import training_group
from flywheel.capture.models import Group, GroupMember, Score
from flywheel.capture.store import Store
from tests.gateway_process import GatewayProcess
from tests.scripted_judge import ScriptedJudge
from tests.scripted_openai import Reply, ScriptedOpenAI
from tests.test_stored_completions import gateway_config

KEY_A, KEY_B = "sk-sub-a", "sk-sub-b"
ADMIN = {"authorization": "Bearer admin"}
PLANNER = {"role": "system", "content": "You plan trips. Delegate research to your researcher."}
QUESTION = {"role": "user", "content": "Plan a weekend in Lisbon."}


def answer(body: dict[str, Any]) -> Reply:
    """The planner's answers are always the same; a researcher's follow its brief (good or poor work)."""
    system = body["messages"][0]["content"]
    if system.startswith("You research"):
        return Reply(content="good good findings" if "thorough" in system else "poor findings")
    return Reply(content=f"Plan step {len(body['messages'])}.")


@pytest.fixture
def servers() -> Iterator[tuple[ScriptedOpenAI, ScriptedJudge]]:
    with ScriptedOpenAI(reply=answer) as upstream, ScriptedJudge() as judge:
        yield upstream, judge


def start(tmp: Path, upstream: ScriptedOpenAI, judge: ScriptedJudge) -> GatewayProcess:
    return GatewayProcess(tmp, gateway_config(upstream, KEY_A, KEY_B, admin="admin") + f"""
{judge.config_toml}[groups]
form_every_s = 3600
""").start()


def run(client: openai.OpenAI, run_id: str, researcher: str, *, tag_in_body: bool) -> None:
    """A planner (explicit trajectory ``run_id``) that asks a researcher sub-agent between its two turns."""
    planner = {"X-Flywheel-Trajectory-Id": run_id}
    first = client.chat.completions.create(model="gpt-4o", messages=[PLANNER, QUESTION], extra_headers=planner)
    brief = [{"role": "system", "content": f"You research. {researcher}"},
             {"role": "user", "content": "Find museums in Lisbon."}]
    tag: dict[str, Any] = ({"extra_body": {"metadata": {"parent_trajectory_id": run_id}}} if tag_in_body else
                           {"extra_headers": {"X-Flywheel-Parent-Trajectory-Id": run_id}})
    found = client.chat.completions.create(model="gpt-4o", messages=brief, **tag)
    more = [*brief, {"role": "assistant", "content": found.choices[0].message.content},
            {"role": "user", "content": "And opening hours?"}]
    client.chat.completions.create(model="gpt-4o", messages=more, **tag)
    history = [PLANNER, QUESTION, {"role": "assistant", "content": first.choices[0].message.content},
               {"role": "user", "content": f"Research says: {found.choices[0].message.content}"}]
    client.chat.completions.create(model="gpt-4o", messages=history, extra_headers=planner)


def test_sub_agents_are_shown_and_scored_with_their_parent(
        tmp_path: Path, servers: tuple[ScriptedOpenAI, ScriptedJudge]) -> None:
    upstream, judge = servers
    gateway = start(tmp_path, upstream, judge)
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=KEY_A, max_retries=0)
    run(client, "run-good", "Be thorough.", tag_in_body=False)
    run(client, "run-poor", "Be quick.", tag_in_body=True)
    admin = httpx.Client(base_url=f"{gateway.url}/flywheel/v1", headers=ADMIN, timeout=60)
    listed = {t["id"]: t for t in admin.get("/trajectories").json()["data"]}
    assert len(listed) == 4
    for run_id in ("run-good", "run-poor"):
        detail = admin.get(f"/trajectories/{run_id}").json()
        assert detail["turn_count"] == 2 and detail["parent_trajectory_id"] is None
        (sub_agent,) = detail["sub_agents"]
        assert sub_agent["parent_trajectory_id"] == run_id and sub_agent["turn_count"] == 2
        assert listed[sub_agent["id"]]["parent_trajectory_id"] == run_id
        closed = httpx.post(f"{gateway.url}/flywheel/v1/trajectories/{run_id}/close",
                            headers={"authorization": f"Bearer {KEY_A}"}, timeout=30)
        assert closed.status_code == 200
        assert admin.get(f"/trajectories/{sub_agent['id']}").json()["close_reason"] == "parent"
    formed = admin.post("/jobs/groups").json()["formed"]
    assert [(g["source"], g["size"]) for g in formed] == [("task", 2)]  # the parents; the sub-agents join none
    assert admin.post("/jobs/score").json()["scored"] == 1
    (judged,) = judge.requests
    assert judged["messages"][-1]["content"].count('"role": "sub_agent"') == 2
    admin.close()

    gateway.stop()
    store = Store(gateway.dir / "data" / "flywheel.duckdb")
    try:
        with store.session() as session:
            rewards = {s.trajectory_id: s.value for s in session.exec(select(Score).where(Score.source == "reward"))}
            members = {m.trajectory_id for m in session.exec(select(GroupMember))}
            group = session.exec(select(Group)).one()
            trained = training_group(session, group)
        assert members == {"run-good", "run-poor"}
        assert rewards["run-good"] > rewards["run-poor"]  # only the sub-agents' work tells them apart
        for member in trained.members:  # the parent's two turns only: sub-agents are not trained on yet
            assert [t.request_messages[0]["content"].split(".")[0] for t in member.turns] == ["You plan trips"] * 2
    finally:
        store.close()


def test_a_parent_tag_binds_only_an_existing_trajectory_of_the_same_key(
        tmp_path: Path, servers: tuple[ScriptedOpenAI, ScriptedJudge]) -> None:
    upstream, judge = servers
    gateway = start(tmp_path, upstream, judge)
    a = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=KEY_A, max_retries=0)
    b = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=KEY_B, max_retries=0)
    a.chat.completions.create(model="gpt-4o", messages=[PLANNER, QUESTION],
                              extra_headers={"X-Flywheel-Trajectory-Id": "run-a"})
    brief = [{"role": "system", "content": "You research."}, {"role": "user", "content": "Anything."}]
    b.chat.completions.create(model="gpt-4o", messages=brief,
                              extra_headers={"X-Flywheel-Parent-Trajectory-Id": "run-a"})  # another key's
    a.chat.completions.create(model="gpt-4o", messages=brief,
                              extra_headers={"X-Flywheel-Parent-Trajectory-Id": "run-nobody-made"})
    # a sub-agent repeating its parent's conversation still gets a trajectory of its own
    copied = [PLANNER, QUESTION, {"role": "assistant", "content": "Plan step 2."},
              {"role": "user", "content": "Research this."}]
    a.chat.completions.create(model="gpt-4o", messages=copied,
                              extra_headers={"X-Flywheel-Parent-Trajectory-Id": "run-a"})
    with httpx.Client(base_url=f"{gateway.url}/flywheel/v1", headers=ADMIN, timeout=60) as admin:
        listed = admin.get("/trajectories", params={"order": "asc"}).json()["data"]
        parent = admin.get("/trajectories/run-a").json()
    assert [(t["id"] == "run-a", t["parent_trajectory_id"], t["turn_count"]) for t in listed] == [
        (True, None, 1), (False, None, 1), (False, None, 1), (False, "run-a", 1)]
    (copy,) = parent["sub_agents"]
    copy_turn = httpx.get(f"{gateway.url}/flywheel/v1/trajectories/{copy['id']}", headers=ADMIN).json()["turns"][0]
    assert copy_turn["parent_turn_id"] == parent["turns"][0]["id"]  # the history it repeated is kept
    assert copy_turn["link_rule"] == "prefix"
    gateway.stop()


def test_feedback_closes_the_trajectory_and_its_open_sub_agents_for_its_own_key_only(
        tmp_path: Path, servers: tuple[ScriptedOpenAI, ScriptedJudge]) -> None:
    upstream, judge = servers
    gateway = start(tmp_path, upstream, judge)
    run(openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=KEY_A, max_retries=0), "run-a", "Be thorough.",
        tag_in_body=False)
    feedback = f"{gateway.url}/flywheel/v1/feedback"
    foreign = httpx.post(feedback, json={"trajectory_id": "run-a", "reward": 0.0},
                         headers={"authorization": f"Bearer {KEY_B}"})
    assert foreign.status_code == 404 and foreign.json()["error"]["param"] == "trajectory_id"
    own = httpx.post(feedback, json={"trajectory_id": "run-a", "reward": 0.75},
                     headers={"authorization": f"Bearer {KEY_A}"})
    assert own.status_code == 200 and own.json()["trajectory_id"] == "run-a" and own.json()["reward"] == 0.75
    with httpx.Client(base_url=f"{gateway.url}/flywheel/v1", headers=ADMIN, timeout=60) as admin:
        parent = admin.get("/trajectories/run-a").json()
    assert (parent["status"], parent["close_reason"]) == ("closed", "feedback")
    assert [(s["status"], s["close_reason"]) for s in parent["sub_agents"]] == [("closed", "parent")]
    assert [f["reward"] for f in parent["feedback"]] == [0.75]  # the refused one left nothing behind
    gateway.stop()
