"""The SDK through one real gateway (tiny model, local engine, keys on): helpers, admin client, ART's API.

- Tagging scopes (sync and async, concurrent on one client), feedback, the admin client and its errors.
- The groups route: captured members found by their last choice, hand-built ones stored as ``sdk``
  turns (redacted), client rewards, refusals with the parameter named.
- ART code runs with ``import flywheel as art``: a rollout written against ART's documented API
  (the client from ``model.openai_client()``, the Choice appended to ``messages_and_choices``,
  ``trajectory.messages()`` as the request, ``gather_trajectory_groups`` over
  ``TrajectoryGroup(rollout(...) for _ in range(n))``, RULER from ``art.rewards`` in ``after_each``),
  unchanged but for the import lines; the judge is a scripted server on loopback.
- ART's loop: two training steps on the tiny model serve versions 1 and 2 (``model.train`` with a
  ``TrainConfig``, then ``backend.train`` with ART's newer keyword arguments); ``model.log`` per
  version; ``delete_checkpoints`` keeps the best and the latest; the serving version is never deleted.
"""

from __future__ import annotations

import asyncio
import io
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

import flywheel
import flywheel as art
from flywheel.admin_client import AdminClient, AdminError, AdminUnreachable
from flywheel.gateway.core.processes import free_port
from flywheel.judge import JudgeCallError
from flywheel.rewards import ruler_score_group
from tests.conftest import ADMIN_KEY, CLIENT_KEY
from tests.gateway_process import GatewayProcess
from tests.scripted_judge import ScriptedJudge

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
[train.args]
lora_r = 8
lora_alpha = 16
precision = "fp32"
gradient_accumulation_steps = 1
max_prompt_tokens = 128
max_completion_tokens = 16
seed = 0
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


def test_the_admin_client_turns_an_error_answer_into_one_typed_exception(gateway: GatewayProcess) -> None:
    """The client the SDK, the CLI and training rounds share: an error answer is an AdminError carrying what the
    OpenAI-shaped body says; no answer is AdminUnreachable."""
    body = {"alias": "agent", "trajectories": [{"messages": QUESTION, "reward": "Infinity"}]}
    raw = httpx.post(f"{gateway.url}/flywheel/v1/groups", json=body,
                     headers={"authorization": f"Bearer {ADMIN_KEY}"}).json()["error"]
    with AdminClient(gateway.url, ADMIN_KEY) as admin:
        with pytest.raises(AdminError) as refused:
            admin.call("POST", "/flywheel/v1/groups", json=body)
        error = refused.value
        assert (error.status, error.code, error.message, error.param) == (
            400, raw["code"], raw["message"], "trajectories[0].reward")
        assert (error.method, error.path, str(error)) == ("POST", "/flywheel/v1/groups",
                                                          f"gateway answered 400: {raw['message']}")
        with pytest.raises(AdminError) as missing:  # a download streams only a 2xx body into the file
            admin.download("/flywheel/v1/trajectories/traj_missing/export", archive := io.BytesIO())
        assert (missing.value.status, missing.value.code, archive.getvalue()) == (404, "not_found", b"")
    with AdminClient(gateway.url, "wrong") as wrong, pytest.raises(AdminError) as denied:
        wrong.call("GET", "/flywheel/v1/aliases")
    assert denied.value.status == 401
    nowhere = f"http://127.0.0.1:{free_port()}"
    with AdminClient(nowhere, None) as down, pytest.raises(AdminUnreachable) as unreachable:
        down.call("GET", "/flywheel/v1/aliases")
    assert str(unreachable.value).startswith(f"gateway at {nowhere} failed: ConnectError")


def test_the_gateway_calls_through_the_transport_it_is_given(gateway: GatewayProcess) -> None:
    paths: list[str] = []

    class Recording(httpx.HTTPTransport):
        def handle_request(self, request: httpx.Request) -> httpx.Response:
            paths.append(request.url.path)
            return super().handle_request(request)

    with flywheel.Gateway(gateway.url, admin_key=ADMIN_KEY, transport=Recording()) as through:
        assert through.alias("agent")["alias"] == "agent"
    assert paths == ["/flywheel/v1/aliases"]


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
    assert model.inference_base_url == f"{gateway.url}/v1"
    step = await model.get_step()
    evaluated = [flywheel.Trajectory(messages_and_choices=[], reward=r, metrics={"moves": m})
                 for r, m in ((1.0, 3), (0.0, 5))]
    await model.log([flywheel.TrajectoryGroup(evaluated, exceptions=[RuntimeError("timeout")])], split="test")
    rows = {row["metric"]: row for row in admin.eval_metrics("agent", split="test")}
    assert {name: (row["value"], row["n"], row["version"]) for name, row in rows.items()} == {
        "reward": (0.5, 2, step), "moves": (4.0, 2, step), "exceptions": (1.0, 3, step)}


async def test_registering_a_model_the_gateway_does_not_serve_says_which_it_does(admin: flywheel.Gateway) -> None:
    model = flywheel.TrainableModel(name="gpt-4o", project="sdk-tests", base_model="tiny")
    with pytest.raises(flywheel.NotFoundError, match="aliases: agent"):
        await model.register(admin)


# -- ART code, unchanged but for its imports


@dataclass
class Scenario:
    id: int
    question: str


async def rollout(model: art.Model, scenario: Scenario) -> art.Trajectory:
    """A one-turn rollout the way ART's documentation writes one."""
    client = model.openai_client()
    trajectory = art.Trajectory(
        messages_and_choices=[{"role": "system", "content": "Answer in one word."}],
        metadata={"scenario_id": scenario.id},
        reward=0,
    )
    trajectory.messages_and_choices.append({"role": "user", "content": scenario.question})
    chat_completion = await client.chat.completions.create(
        model=model.name, messages=trajectory.messages(), max_completion_tokens=4)
    choice = chat_completion.choices[0]
    trajectory.messages_and_choices.append(choice)
    # The environment's verdict (here: made up, so the judge has something to rank).
    verdict = "good " * (len(choice.message.content or "") % 3)
    trajectory.messages_and_choices.append({"role": "user", "content": f"Verdict: {verdict}".strip()})
    trajectory.reward = 1.0 if verdict else 0.0
    trajectory.metrics["answer_chars"] = len(choice.message.content or "")
    return trajectory


@pytest.fixture
def judge() -> Iterator[ScriptedJudge]:
    with ScriptedJudge() as server:
        yield server


async def test_an_art_rollout_runs_unchanged(gateway: GatewayProcess, judge: ScriptedJudge) -> None:
    backend = art.Gateway(gateway.url, admin_key=ADMIN_KEY, api_key=CLIENT_KEY)
    model = art.TrainableModel(name="agent", project="art-compat", base_model="tiny")
    await model.register(backend)
    scenarios = [Scenario(1, "Colour of the sky?"), Scenario(2, "Opposite of up?")]
    judge_params = {"api_base": judge.base_url, "api_key": "unused"}

    groups = await art.gather_trajectory_groups(
        (art.TrajectoryGroup(rollout(model, scenario) for _ in range(3)) for scenario in scenarios),
        pbar_desc="gather",
        max_exceptions=0,
        after_each=lambda group: ruler_score_group(group, "openai/judge", extra_litellm_params=judge_params,
                                                   swallow_exceptions=True),
    )

    assert [len(group) for group in groups] == [3, 3]
    for group in groups:
        for trajectory in group:
            verdict = trajectory.messages()[-1]["content"]
            # The judge counts the word in all the trajectory shows it: the tiny model may say it too.
            shown = " ".join(m["content"] or "" for m in trajectory.messages()[2:])
            goods = len(re.findall(r"\bgood\b", shown, re.IGNORECASE))
            assert trajectory.metrics["ruler_score"] == trajectory.reward == pytest.approx(goods / (goods + 1),
                                                                                       abs=1e-4)
            assert trajectory.metrics["independent_reward"] == (1.0 if "good" in verdict else 0.0)
            assert trajectory.logs and trajectory.logs[-1].startswith("RULER explanation:")
            assert trajectory.id is not None  # each rollout's calls carried its own trajectory id
    assert len(judge.requests) == 2

    stored = [backend.record_group(model.name, group) for group in groups]
    for group, answer in zip(groups, stored, strict=True):
        assert [m["trajectory_id"] for m in answer["members"]] == [t.id for t in group]
        assert answer["key"] == group.id
        for member in answer["members"]:
            assert backend.trajectory(member["trajectory_id"])["group_key"] == group.id
    backend.close()


async def test_a_failed_judging_drops_the_group_or_raises(gateway: GatewayProcess) -> None:
    backend = art.Gateway(gateway.url, admin_key=ADMIN_KEY, api_key=CLIENT_KEY)
    model = art.TrainableModel(name="agent", project="art-compat", base_model="tiny")
    await model.register(backend)
    with ScriptedJudge(faults=["http400", "http400"]) as judge:
        params = {"api_base": judge.base_url, "api_key": "unused"}
        groups = await art.gather_trajectory_groups(
            [art.TrajectoryGroup(rollout(model, Scenario(3, "Two plus two?")) for _ in range(2))],
            after_each=lambda g: ruler_score_group(g, "openai/judge", extra_litellm_params=params,
                                                   swallow_exceptions=True))
        assert groups == []
        group = await art.TrajectoryGroup(rollout(model, Scenario(3, "Two plus two?")) for _ in range(2))
        with pytest.raises(JudgeCallError):
            await ruler_score_group(group, "openai/judge", extra_litellm_params=params)
    await backend.close()


# -- ART's training loop


QUESTIONS = ["Name a fruit.", "Name a colour."]


async def answer(model: flywheel.Model, question: str) -> flywheel.Trajectory:
    trajectory = flywheel.Trajectory(messages_and_choices=[{"role": "user", "content": question}], reward=0)
    completion = await model.openai_client().chat.completions.create(
        model=model.name, messages=trajectory.messages(), max_tokens=6, temperature=1.0)
    trajectory.messages_and_choices.append(completion.choices[0])
    return trajectory


async def ranked(group: flywheel.TrajectoryGroup) -> flywheel.TrajectoryGroup:
    """Rewards by rank of answer length (ties by position): distinct in every group, so GRPO has a signal."""
    order = sorted(range(len(group)), key=lambda i: (len(group.trajectories[i].messages()[-1]["content"] or ""), i))
    for rank, index in enumerate(order):
        group.trajectories[index].reward = rank / (len(group) - 1)
    return group


async def gather(model: flywheel.TrainableModel) -> list[flywheel.TrajectoryGroup]:
    return await flywheel.gather_trajectory_groups(
        (flywheel.TrajectoryGroup(answer(model, q) for _ in range(3)) for q in QUESTIONS), after_each=ranked)


def evaluated(reward: float) -> flywheel.TrajectoryGroup:
    return flywheel.TrajectoryGroup([flywheel.Trajectory(messages_and_choices=[], reward=reward)])


async def test_two_art_steps_serve_two_versions(gateway: GatewayProcess) -> None:
    backend = flywheel.Gateway(gateway.url, admin_key=ADMIN_KEY, api_key=CLIENT_KEY)
    model = flywheel.TrainableModel(name="agent", project="sdk-train", base_model="tiny")
    await model.register(backend)
    assert await model.get_step() == 0  # the tests above trained nothing

    first = await model.train(await gather(model), config=flywheel.TrainConfig(learning_rate=1e-3))
    assert (first.status, first.step, first.promoted) == ("finished", 1, True)
    assert first.checkpoint_path is not None and (Path(first.checkpoint_path) / "adapter_config.json").is_file()
    assert "losses/loss" in first.metrics
    await model.log([evaluated(0.2)], split="val")

    second = await backend.train(model, await gather(model), learning_rate=1e-3, epsilon_high=0.28,
                                 scale_rewards=False)
    assert (second.status, second.step) == ("finished", 2)
    assert await model.get_step() == 2
    assert backend.alias("agent")["adapter"] == "agent@2"
    assert second.checkpoint_path is not None
    resolved = json.loads((Path(second.checkpoint_path) / "flywheel_round.json").read_text())["config"]["args"]
    assert (resolved["epsilon_high"], resolved["advantage_scale"], resolved["learning_rate"]) == (0.28, "none", 1e-3)
    await model.log([evaluated(0.8)], split="val")

    statuses = {v["version"]: v["status"] for v in backend.versions("agent")}
    assert statuses == {1: "retired", 2: "promoted"}
    assert backend.rollback("agent")["version"] == 1 and await model.get_step() == 1
    assert backend.promote("agent", 2)["version"] == 2 and await model.get_step() == 2
    (status,) = backend.status()["aliases"]
    assert (status["alias"], status["serving"]["version"]) == ("agent", 2)
    await model.delete_checkpoints("val/reward")  # the best is the latest: version 1 goes
    statuses = {v["version"]: v["status"] for v in backend.versions("agent")}
    assert statuses == {1: "deleted", 2: "promoted"}
    assert not Path(first.checkpoint_path).exists() and Path(second.checkpoint_path).exists()
    with pytest.raises(flywheel.GatewayError) as refused:
        backend.delete_version("agent", 2)
    assert (refused.value.status_code, refused.value.code) == (409, "version_in_use")
    with pytest.raises(flywheel.NotFoundError):
        backend.delete_version("agent", 9)
    reply = await model.openai_client().chat.completions.create(model="agent", max_tokens=2,
                                                                messages=[{"role": "user", "content": "hi"}])
    assert reply.choices[0].message.content is not None  # version 2 still serves
    await backend.close()
