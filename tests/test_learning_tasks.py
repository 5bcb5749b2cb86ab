"""The learning suite's tasks and its judge stand-in: the judge reads RULER's own prompt to the tasks' rewards."""

from __future__ import annotations

import pytest

from bench.learning_judge import judge_scores
from bench.learning_tasks import TASKS, Request, call_message, gate_reward, task_of
from flywheel.judge.ruler import Candidate, build_judge_messages


@pytest.mark.parametrize("name", sorted(TASKS))
def test_the_judge_stand_in_scores_each_trajectory_of_a_ruler_prompt_by_its_task(name: str) -> None:
    task = TASKS[name]
    examples = task.warm_start_examples(16, seed=3)
    rewards = [task.score(messages) for messages, _ in examples]
    assert all(0.0 <= r <= 1.0 for r in rewards) and len(set(rewards)) > 1, rewards  # random choices differ
    prompt = build_judge_messages([Candidate(messages=m, tools=t) for m, t in examples])[1]["content"]
    assert [s["score"] for s in judge_scores(prompt)] == pytest.approx(rewards, abs=1e-4)
    assert task_of(examples[0][0]) is task


def test_a_right_and_a_wrong_answer_score_as_the_table_says() -> None:
    task = TASKS["argument"]
    context = task.first_messages(Request("One small coffee now.", "small"), ticket=12345)
    assert gate_reward(context, task.tools, call_message("order", {"size": "small"})) == 1.0
    assert gate_reward(context, task.tools, call_message("order", {"size": "large"})) == 0.3
    assert gate_reward(context, task.tools, {"role": "assistant", "content": "small"}) == 0.0
    assert gate_reward(context, task.tools, call_message("order", {"size": "small"}), truncated=True) == 0.0
