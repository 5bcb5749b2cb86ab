"""ART code runs with ``import flywheel as art``: a rollout written against ART's documented API, unchanged.

The rollout below follows ART's documentation (the client from ``model.openai_client()``, the
Choice appended to ``messages_and_choices``, ``trajectory.messages()`` sent as the request,
``gather_trajectory_groups`` over ``TrajectoryGroup(rollout(...) for _ in range(n))``, RULER from
``art.rewards`` in ``after_each``). Only the import lines differ from ART. The judge is a scripted
OpenAI-compatible server on loopback that scores each trajectory by how often it says "good".
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import flywheel as art
import pytest
from flywheel.rewards import ruler_score_group

from judge import JudgeCallError
from tests.conftest import ADMIN_KEY
from tests.gateway_process import GatewayProcess
from tests.scripted_judge import ScriptedJudge


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


@pytest.fixture(scope="module")
def gateway(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    process = GatewayProcess(tmp_path_factory.mktemp("art"), f"""
[engines.local]
model = "{tiny_model}"
default_max_tokens = 4
[aliases.agent-001]
engine = "local"
[auth]
admin_key = "{ADMIN_KEY}"
""", name="art").start()
    yield process
    process.stop()


@pytest.fixture
def judge() -> Iterator[ScriptedJudge]:
    with ScriptedJudge() as server:
        yield server


async def test_an_art_rollout_runs_unchanged(gateway: GatewayProcess, judge: ScriptedJudge) -> None:
    backend = art.Gateway(gateway.url, admin_key=ADMIN_KEY)
    model = art.TrainableModel(name="agent-001", project="art-compat", base_model="tiny")
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
            goods = verdict.count("good")
            assert trajectory.metrics["ruler_score"] == trajectory.reward == pytest.approx(goods / (goods + 1),
                                                                                       abs=1e-4)
            assert trajectory.metrics["independent_reward"] == (1.0 if goods else 0.0)
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
    backend = art.Gateway(gateway.url, admin_key=ADMIN_KEY)
    model = art.TrainableModel(name="agent-001", project="art-compat", base_model="tiny")
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
