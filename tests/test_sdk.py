"""The SDK on its own: headers, the trajectory types, gather's semantics, and what ``import flywheel`` loads.

Everything here runs without a gateway; tests/test_sdk_gateway.py drives the same API through one.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from typing import Any

import pytest
from openai.types.chat.chat_completion import Choice

import flywheel
from flywheel.trajectories import PendingGroup


def test_headers_names_only_what_is_given() -> None:
    assert flywheel.headers() == {}
    assert flywheel.headers(trajectory_id="run-1", group_id="g", task="t", capture=False, fork=3) == {
        "X-Flywheel-Trajectory-Id": "run-1", "X-Flywheel-Group-Id": "g", "X-Flywheel-Task": "t",
        "X-Flywheel-Capture": "off", "X-Flywheel-Fork": "3"}
    assert flywheel.headers(capture=True) == {"X-Flywheel-Capture": "on"}


def test_importing_flywheel_loads_no_server_or_ml_package() -> None:
    heavy = ["torch", "transformers", "fastapi", "uvicorn", "duckdb", "sqlmodel", "litellm", "gateway", "capture",
             "judge", "trainer", "tqdm"]
    code = ("import sys, flywheel, flywheel.rewards, flywheel.local; "
            f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({heavy!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def choice(text: str, *, tool_call: dict[str, Any] | None = None) -> Choice:
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if tool_call is not None:
        message["tool_calls"] = [{"id": "call_1", "type": "function", "function": tool_call}]
    return Choice.model_validate({"index": 0, "finish_reason": "stop", "message": message})


def test_a_trajectory_keeps_choices_and_shows_them_as_messages() -> None:
    call = {"name": "move", "arguments": '{"square": 4}'}
    trajectory = flywheel.Trajectory(messages_and_choices=[{"role": "user", "content": "Your move."},
                                                           choice("", tool_call=call)], reward=0.5)
    assert isinstance(trajectory.messages_and_choices[1], Choice)
    assert trajectory.messages() == [
        {"role": "user", "content": "Your move."},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": call}]}]
    again = flywheel.Trajectory.model_validate_json(trajectory.model_dump_json())
    assert isinstance(again.messages_and_choices[1], Choice) and again.messages() == trajectory.messages()


def test_a_pydantic_message_in_the_list_becomes_a_plain_message() -> None:
    trajectory = flywheel.Trajectory(messages_and_choices=[choice("hi").message], reward=0)
    assert trajectory.messages_and_choices == [{"role": "assistant", "content": "hi"}]


def test_a_group_of_trajectories_and_exceptions() -> None:
    first = flywheel.Trajectory(messages_and_choices=[], reward=1.0)
    group = flywheel.TrajectoryGroup(t for t in [first, ValueError("lost the game")])
    assert isinstance(group, flywheel.TrajectoryGroup)
    assert list(group) == [first] and len(group) == 1
    assert [(e.type, e.message) for e in group.exceptions] == [("ValueError", "lost the game")]
    again = flywheel.TrajectoryGroup.model_validate_json(group.model_dump_json())
    assert len(again) == 1 and again.exceptions[0].message == "lost the game"


async def rollout(reward: float, *, fail: bool = False) -> flywheel.Trajectory:
    await asyncio.sleep(0)
    if fail:
        raise RuntimeError(f"rollout {reward} failed")
    return flywheel.Trajectory(messages_and_choices=[{"role": "user", "content": "hi"}], reward=reward,
                               metrics={"turns": 1})


async def test_a_group_of_awaitables_is_awaitable_and_keeps_input_order() -> None:
    pending = flywheel.TrajectoryGroup(rollout(r) for r in (0.1, 0.2, 0.3))
    assert isinstance(pending, PendingGroup)
    group = await pending
    assert [t.reward for t in group] == [0.1, 0.2, 0.3]
    assert group.id == pending.group_id
    assert all(t.id is None for t in group)  # no call was made: no gateway trajectory to name


async def test_outside_a_gather_a_failed_rollout_raises() -> None:
    with pytest.raises(RuntimeError, match=r"rollout 0\.2 failed"):
        await flywheel.TrajectoryGroup([rollout(0.1), rollout(0.2, fail=True)])


async def test_gather_keeps_failed_rollouts_in_the_group_within_the_budget() -> None:
    groups = await flywheel.gather_trajectory_groups(
        [flywheel.TrajectoryGroup([rollout(0.0), rollout(1.0, fail=True), rollout(1.0)]),
         flywheel.TrajectoryGroup([rollout(0.5), rollout(0.5)])], pbar_desc="test", max_exceptions=1)
    assert [[t.reward for t in g] for g in groups] == [[0.0, 1.0], [0.5, 0.5]]
    assert [e.message for e in groups[0].exceptions] == ["rollout 1.0 failed"]


async def test_gather_raises_past_the_budget_as_a_count_and_as_a_fraction() -> None:
    with pytest.raises(RuntimeError):
        await flywheel.gather_trajectory_groups(
            [flywheel.TrajectoryGroup([rollout(0, fail=True), rollout(1, fail=True), rollout(2)])], max_exceptions=1)
    groups = await flywheel.gather_trajectory_groups(  # 1 failure in 4 rollouts is within 0.25
        [flywheel.TrajectoryGroup([rollout(0, fail=True), rollout(1), rollout(2), rollout(3)])], max_exceptions=0.25)
    assert [t.reward for t in groups[0]] == [1, 2, 3]
    with pytest.raises(RuntimeError):  # 2 in 4 is not
        await flywheel.gather_trajectory_groups(
            [flywheel.TrajectoryGroup([rollout(0, fail=True), rollout(1, fail=True), rollout(2), rollout(3)])],
            max_exceptions=0.25)


async def test_a_group_that_raises_as_a_whole_is_dropped_within_the_budget() -> None:
    async def broken() -> flywheel.TrajectoryGroup:
        raise RuntimeError("no scenario")

    groups = await flywheel.gather_trajectory_groups([broken(), flywheel.TrajectoryGroup([rollout(1)])],
                                                     max_exceptions=1)
    assert [len(g) for g in groups] == [1]


async def test_after_each_may_keep_replace_drop_or_split_a_group() -> None:
    async def after_each(group: flywheel.TrajectoryGroup) -> Any:
        rewards = [t.reward for t in group]
        if rewards == [1.0]:
            return None
        if rewards == [2.0, 3.0]:
            return [flywheel.TrajectoryGroup([t]) for t in group]
        return group.model_copy(update={"metadata": {"seen": True}})

    groups = await flywheel.gather_trajectory_groups(
        [flywheel.TrajectoryGroup([rollout(1.0)]), flywheel.TrajectoryGroup([rollout(2.0), rollout(3.0)]),
         flywheel.TrajectoryGroup([rollout(4.0)])], after_each=after_each)
    assert [([t.reward for t in g], g.metadata) for g in groups] == [([2.0], {}), ([3.0], {}), ([4.0], {"seen": True})]


def test_train_config_sends_only_what_was_set() -> None:
    assert flywheel.TrainConfig().model_fields_set == set()
    assert flywheel.TrainConfig(learning_rate=1e-5).model_fields_set == {"learning_rate"}


async def test_a_model_used_before_register_says_so() -> None:
    model = flywheel.TrainableModel(name="agent", project="p", base_model="tiny")
    with pytest.raises(flywheel.NotRegisteredError, match="register"):
        await model.get_step()
    with pytest.raises(ValueError, match="register"):
        model.openai_client()
