"""The SDK's helpers and admin client through a real gateway (tiny model, local engine, keys on).

Tagging scopes (sync and async, concurrent on one client), feedback, the admin client and its
errors, and the groups route: captured members found by their last choice, hand-built ones stored
as ``sdk`` turns (redacted), client rewards, refusals with the parameter named.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import flywheel
import httpx
import openai
import pytest

from tests.conftest import ADMIN_KEY, CLIENT_KEY
from tests.gateway_process import GatewayProcess
from tests.scripted_openai import free_port

QUESTION = [{"role": "user", "content": "Pick a number."}]


@pytest.fixture(scope="module")
def gateway(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    process = GatewayProcess(tmp_path_factory.mktemp("sdk"), f"""
[engines.local]
model = "{tiny_model}"
default_max_tokens = 4
[aliases.agent]
engine = "local"
[auth]
api_keys = ["{CLIENT_KEY}"]
admin_key = "{ADMIN_KEY}"
""", name="sdk").start()
    yield process
    process.stop()


@pytest.fixture
def admin(gateway: GatewayProcess) -> Iterator[flywheel.Gateway]:
    with flywheel.Gateway(gateway.url, admin_key=ADMIN_KEY, api_key=CLIENT_KEY) as client:
        yield client


def client_of(gateway: GatewayProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=CLIENT_KEY, max_retries=0)


def async_client_of(gateway: GatewayProcess) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=CLIENT_KEY, max_retries=0)


def test_a_scope_tags_every_call_and_closes_the_trajectory_at_exit(gateway: GatewayProcess,
                                                                   admin: flywheel.Gateway) -> None:
    client = client_of(gateway)
    with flywheel.trajectory(client, group_id="g-sync", task="numbers") as scope:
        first = client.chat.completions.create(model="agent", messages=QUESTION, max_tokens=3)
        follow_up = [*QUESTION, {"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "Another one."}]
        client.chat.completions.create(model="agent", messages=follow_up, max_tokens=3)
    assert scope.closed and scope.requests == 2
    detail = admin.trajectory(scope.id)
    assert (detail["status"], detail["close_reason"], detail["group_key"]) == ("closed", "client", "g-sync")
    assert [t["request_messages"][-1]["content"] for t in detail["turns"]] == ["Pick a number.", "Another one."]
    assert all(t["task_key"] == "numbers" for t in detail["turns"])
    untagged = client.chat.completions.create(model="agent", messages=QUESTION, max_tokens=3)  # after the scope
    assert admin.trajectory(scope.id)["turn_count"] == 2 and untagged.id != first.id


def test_a_reward_set_in_the_scope_is_reported_as_feedback(gateway: GatewayProcess, admin: flywheel.Gateway) -> None:
    client = client_of(gateway)
    with flywheel.trajectory(client) as scope:
        client.chat.completions.create(model="agent", messages=QUESTION, max_tokens=2)
        scope.reward, scope.comment = 0.25, "close, but no"
    detail = admin.trajectory(scope.id)
    assert [(f["reward"], f["comment"]) for f in detail["feedback"]] == [(0.25, "close, but no")]
    assert detail["status"] == "closed"


def test_a_scope_that_raised_closes_with_its_reason_and_the_error_goes_on(gateway: GatewayProcess,
                                                                          admin: flywheel.Gateway) -> None:
    client = client_of(gateway)
    with pytest.raises(KeyError), flywheel.trajectory(client) as scope:
        client.chat.completions.create(model="agent", messages=QUESTION, max_tokens=2)
        raise KeyError("the tool broke")
    assert admin.trajectory(scope.id)["close_reason"] == "exception"


def test_a_scope_without_calls_reports_nothing(gateway: GatewayProcess, admin: flywheel.Gateway) -> None:
    with flywheel.trajectory(client_of(gateway)) as scope:
        scope.reward = 1.0
    assert not scope.closed
    with pytest.raises(flywheel.NotFoundError):
        admin.trajectory(scope.id)


async def test_concurrent_async_scopes_on_one_client_tag_their_own_calls(gateway: GatewayProcess,
                                                                         admin: flywheel.Gateway) -> None:
    client = async_client_of(gateway)

    async def conversation(n: int) -> str:
        async with flywheel.trajectory(client, group_id="g-async") as scope:
            for turn in range(n):
                await client.chat.completions.create(model="agent", max_tokens=2,
                                                     messages=[{"role": "user", "content": f"turn {turn} of {n}"}])
                await asyncio.sleep(0)  # let the other conversation's call interleave
        return scope.id

    ids = await asyncio.gather(conversation(2), conversation(3))
    counts = [(await asyncio.to_thread(admin.trajectory, tid))["turn_count"] for tid in ids]
    assert counts == [2, 3]


async def test_feedback_by_completion_id_sync_and_async(gateway: GatewayProcess, admin: flywheel.Gateway) -> None:
    client = client_of(gateway)
    reply = client.chat.completions.create(model="agent", messages=[{"role": "user", "content": "rate me"}],
                                           max_tokens=2)
    answer = flywheel.feedback(client, completion_id=reply.id, label="good")
    assert answer["reward"] == 1.0
    again = await flywheel.feedback(async_client_of(gateway), trajectory_id=answer["trajectory_id"], reward=0.5)
    assert again["trajectory_id"] == answer["trajectory_id"]
    rewards = [f["reward"] for f in admin.trajectory(answer["trajectory_id"])["feedback"]]
    assert rewards == [None, 0.5]  # the label alone was stored as given; the gateway maps it at scoring time
    with pytest.raises(flywheel.NotFoundError, match="completion_id"):
        flywheel.feedback(client, completion_id="chatcmpl-nothing", reward=1.0)
    with pytest.raises(ValueError, match="reward, a label"):
        flywheel.feedback(client, completion_id=reply.id)


def test_admin_client_reads_aliases_pages_and_exports(gateway: GatewayProcess, admin: flywheel.Gateway) -> None:
    assert [a["alias"] for a in admin.aliases()] == ["agent"]
    client = client_of(gateway)
    with flywheel.trajectory(client) as scope:
        client.chat.completions.create(model="agent", messages=QUESTION, max_tokens=2)
    page = admin.trajectories(alias="agent", status="closed", limit=1)
    assert page["data"][0]["id"] == scope.id and page["has_more"] is True
    (record,) = admin.export(scope.id, format="art")
    assert record["metadata"]["trajectory_id"] == scope.id
    assert flywheel.Trajectory.model_validate(record).messages()[0] == QUESTION[0]


def test_admin_errors_are_typed(gateway: GatewayProcess) -> None:
    with flywheel.Gateway(gateway.url, admin_key="wrong") as wrong, pytest.raises(flywheel.AuthenticationError):
        wrong.aliases()
    with flywheel.Gateway(gateway.url, admin_key=ADMIN_KEY) as admin, pytest.raises(flywheel.NotFoundError) as info:
        admin.trajectory("traj_missing")
    assert info.value.status_code == 404 and info.value.code == "not_found"
    with flywheel.Gateway(f"http://127.0.0.1:{free_port()}", admin_key=None) as nowhere, \
            pytest.raises(flywheel.GatewayConnectionError):
        nowhere.aliases()
    closed = flywheel.Gateway(gateway.url, admin_key=ADMIN_KEY)
    closed.close()
    with pytest.raises(flywheel.FlywheelError, match="closed"):
        closed.aliases()


def captured_group(gateway: GatewayProcess, key: str, rewards: list[float]) -> flywheel.TrajectoryGroup:
    """Rollouts made with a plain client (no tags): the gateway must find them by their last choice."""
    client = client_of(gateway)
    trajectories = []
    for i, reward in enumerate(rewards):
        messages: list[Any] = [{"role": "user", "content": f"{key}: attempt {i}"}]
        reply = client.chat.completions.create(model="agent", messages=messages, max_tokens=3)
        trajectories.append(flywheel.Trajectory(messages_and_choices=[*messages, reply.choices[0]], reward=reward))
    return flywheel.TrajectoryGroup(trajectories, id=key)


def test_a_captured_group_is_stored_with_the_client_rewards(gateway: GatewayProcess, admin: flywheel.Gateway) -> None:
    stored = admin.record_group("agent", captured_group(gateway, "g-captured", [0.0, 1.0]))
    assert (stored["status"], stored["size"], stored["key"]) == ("scored", 2, "g-captured")
    assert [m["captured"] for m in stored["members"]] == [True, True]
    for member, reward in zip(stored["members"], [0.0, 1.0], strict=True):
        detail = admin.trajectory(member["trajectory_id"])
        assert detail["status"] == "closed"
        assert detail["turns"][-1]["id"] == member["leaf_turn_id"]
        assert detail["turns"][-1]["completion_token_ids"]  # the engine's own tokens will be trained
        assert sorted((s["source"], s["value"]) for s in detail["scores"]) == [("client", reward), ("reward", reward)]


def test_sending_a_group_again_moves_its_members_to_the_new_group(gateway: GatewayProcess,
                                                                  admin: flywheel.Gateway) -> None:
    group = captured_group(gateway, "g-twice", [0.2, 0.8])
    first = admin.record_group("agent", group)
    second = admin.record_group("agent", group)
    assert [m["trajectory_id"] for m in second["members"]] == [m["trajectory_id"] for m in first["members"]]
    groups = {s["group_id"] for m in second["members"] for s in admin.trajectory(m["trajectory_id"])["scores"]}
    assert groups == {first["id"], second["id"]}  # both audits stay; membership is the new group's alone


def test_a_hand_built_group_is_stored_as_redacted_sdk_turns(gateway: GatewayProcess, admin: flywheel.Gateway) -> None:
    def built(answer: str, reward: float) -> flywheel.Trajectory:
        reply = {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": answer}}
        return flywheel.Trajectory(messages_and_choices=[
            {"role": "system", "content": "Reply to ada@example.com."}, {"role": "user", "content": "hello"}, reply],
            reward=reward)

    stored = admin.record_group("agent", flywheel.TrajectoryGroup([built("Hi Ada!", 1.0), built("Go away.", 0.0)]))
    assert [m["captured"] for m in stored["members"]] == [False, False]
    detail = admin.trajectory(stored["members"][0]["trajectory_id"])
    (turn,) = detail["turns"]
    assert turn["source"] == "sdk" and turn["response_message"]["content"] == "Hi Ada!"
    assert turn["request_messages"][0]["content"] == "Reply to [REDACTED:EMAIL]."
    assert turn["completion_token_ids"] is None  # the trainer renders it with the chat template


def test_the_groups_route_names_what_is_wrong(gateway: GatewayProcess) -> None:
    def post(body: dict[str, Any]) -> httpx.Response:
        return httpx.post(f"{gateway.url}/flywheel/v1/groups", json=body,
                          headers={"authorization": f"Bearer {ADMIN_KEY}"})

    messages = [{"role": "user", "content": "never answered"}]
    unknown = post({"alias": "nobody", "trajectories": [{"messages": messages, "reward": 1}]})
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "alias"
    silent = post({"alias": "agent", "trajectories": [{"messages": messages, "reward": 1}]})
    assert silent.status_code == 400 and silent.json()["error"]["param"] == "trajectories[0].messages"
    wrong = post({"alias": "agent", "trajectories": [{"messages": messages, "choices": [0], "reward": 1}]})
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "trajectories[0].choices"
    not_sampled = post({"alias": "agent", "trajectories": [
        {"messages": [*messages, {"role": "assistant", "content": "a reply nobody sampled"}], "reward": 1}]})
    assert not_sampled.status_code == 400 and "not captured" in not_sampled.json()["error"]["message"]
    infinite = post({"alias": "agent", "trajectories": [{"messages": messages, "reward": "Infinity"}]})
    assert infinite.status_code == 400 and infinite.json()["error"]["param"] == "trajectories[0].reward"


async def test_model_log_stores_metrics_for_the_serving_version(gateway: GatewayProcess,
                                                                admin: flywheel.Gateway) -> None:
    model = flywheel.TrainableModel(name="agent", project="sdk-tests", base_model="tiny")
    await model.register(admin)
    assert model.inference_base_url == f"{gateway.url}/v1" and await model.get_step() == 0
    evaluated = [flywheel.Trajectory(messages_and_choices=[], reward=r, metrics={"moves": m})
                 for r, m in ((1.0, 3), (0.0, 5))]
    await model.log([flywheel.TrajectoryGroup(evaluated, exceptions=[RuntimeError("timeout")])], split="val")
    rows = {row["metric"]: row for row in admin.eval_metrics("agent", split="val")}
    assert {name: (row["value"], row["n"], row["version"]) for name, row in rows.items()} == {
        "reward": (0.5, 2, 0), "moves": (4.0, 2, 0), "exceptions": (1.0, 3, 0)}


async def test_registering_a_model_the_gateway_does_not_serve_says_which_it_does(admin: flywheel.Gateway) -> None:
    model = flywheel.TrainableModel(name="gpt-4o", project="sdk-tests", base_model="tiny")
    with pytest.raises(flywheel.NotFoundError, match="aliases: agent"):
        await model.register(admin)
