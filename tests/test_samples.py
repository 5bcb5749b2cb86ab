"""Captured groups -> training samples: masks, concatenation, retokenization, skipping, advantages.

Token ids are computed with the tiny model's real tokenizer and chat template, the way the
engine would have produced them, so every mask position can be checked against the ids
the model "sampled".
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from flywheel.capture.batches import BranchTurn, GroupMember, TrainingGroup
from flywheel.trainer.sample_plan import plan_groups
from flywheel.trainer.samples import (
    ADVANTAGE_EPS,
    build_samples,
    centred_rewards,
    group_advantages,
    offpolicy_params,
)
from tests.conftest import WEATHER_ANSWER, WEATHER_QUESTION, WEATHER_TOOL, weather_followup

CALL_ARGS = '{"city": "Paris"}'
TOOL_CALL_MESSAGE: dict[str, Any] = {
    "role": "assistant", "content": None,
    "tool_calls": [{"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": CALL_ARGS}}]}
CALL_TEXT = f'<tool_call>\n{{"name": "get_weather", "arguments": {CALL_ARGS}}}\n</tool_call>'
LIMITS = {"max_prompt_tokens": 1024, "max_completion_tokens": 256}


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def prompt_ids(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
    return encode(tokenizer, tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                                           tokenize=False))


def answer_ids(tokenizer: Any, text: str) -> list[int]:
    """What the engine reports as sampled: the answer's tokens and the eos it stopped on."""
    return [*encode(tokenizer, text), tokenizer.eos_token_id]


def fake_logprobs(ids: list[int], start: float) -> list[float]:
    return [start - 0.01 * i for i in range(len(ids))]


def tool_trajectory(tokenizer: Any, *, exact: bool = True, answer: str = WEATHER_ANSWER) -> list[BranchTurn]:
    """Two turns: a tool call, then (after the tool's result) an answer."""
    first, second = WEATHER_QUESTION, weather_followup("call_0")
    turns = [BranchTurn(request_messages=first, response_message=TOOL_CALL_MESSAGE, tools=[WEATHER_TOOL],
                        finish_reason="stop"),
             BranchTurn(request_messages=second, response_message={"role": "assistant", "content": answer},
                        tools=[WEATHER_TOOL], finish_reason="stop")]
    if exact:
        for turn, text, start in zip(turns, [CALL_TEXT, answer], [-0.5, -1.5], strict=True):
            turn.prompt_token_ids = prompt_ids(tokenizer, turn.request_messages, turn.tools)
            turn.completion_token_ids = answer_ids(tokenizer, text)
            turn.completion_logprobs = fake_logprobs(turn.completion_token_ids, start)
    return turns


def group_of(members: list[tuple[list[BranchTurn], float]], group_id: str = "g1") -> TrainingGroup:
    return TrainingGroup(group_id=group_id, source="explicit", alias="agent",
                         members=[GroupMember(trajectory_id=f"{group_id}-t{i}", turns=turns, reward=reward)
                                  for i, (turns, reward) in enumerate(members)])


def single_turn(tokenizer: Any, answer: str) -> list[BranchTurn]:
    ids = answer_ids(tokenizer, answer)
    return [BranchTurn(request_messages=WEATHER_QUESTION, response_message={"role": "assistant", "content": answer},
                       prompt_token_ids=prompt_ids(tokenizer, WEATHER_QUESTION), completion_token_ids=ids,
                       completion_logprobs=fake_logprobs(ids, -1.0), finish_reason="stop")]


def test_env_mask_is_one_exactly_on_the_sampled_tokens_of_a_tool_trajectory(tokenizer: Any) -> None:
    turns = tool_trajectory(tokenizer)
    batch = build_samples([group_of([(turns, 1.0), (tool_trajectory(tokenizer, answer="No idea."), 0.0)])],
                          tokenizer, **LIMITS)
    sample = batch.samples[0]
    call, answer = turns[0].completion_token_ids, turns[1].completion_token_ids
    assert call is not None and answer is not None and turns[1].prompt_token_ids is not None
    # The second prompt extends the first prompt + tool call: one sequence, env tokens in between.
    env = turns[1].prompt_token_ids[len(sample.prompt_ids) + len(call):]
    assert sample.prompt_ids == turns[0].prompt_token_ids
    assert sample.completion_ids == call + env + answer
    assert sample.env_mask == [1] * len(call) + [0] * len(env) + [1] * len(answer)
    assert [t for t, m in zip(sample.completion_ids, sample.env_mask, strict=True) if m] == call + answer
    # env tokens are the template's turn markers and the tool's result, nothing the model sampled
    env_text = tokenizer.decode(env)
    assert "<tool_response>" in env_text and '{"sky": "sunny"}' in env_text and env_text.endswith("assistant\n")
    assert turns[0].completion_logprobs is not None and turns[1].completion_logprobs is not None
    assert sample.logprobs == turns[0].completion_logprobs + [None] * len(env) + turns[1].completion_logprobs
    assert (sample.turns, sample.part, sample.retokenized, sample.truncated) == (2, 0, False, False)
    assert len(batch.samples) == 2 and batch.stats()["samples/split"] == 0


def test_retokenized_trajectory_renders_the_same_tokens_and_is_flagged(tokenizer: Any) -> None:
    exact = build_samples([group_of([(tool_trajectory(tokenizer), 1.0), (single_turn(tokenizer, "No."), 0.0)])],
                          tokenizer, **LIMITS).samples[0]
    rendered = build_samples([group_of([(tool_trajectory(tokenizer, exact=False), 1.0),
                                        (single_turn(tokenizer, "No."), 0.0)])], tokenizer, **LIMITS).samples[0]
    assert rendered.retokenized and not exact.retokenized
    assert rendered.logprobs is None  # no behaviour logprobs for tokens we rendered ourselves
    # With canonical tokenization the chat template reproduces the engine's ids exactly.
    assert (rendered.prompt_ids, rendered.completion_ids, rendered.env_mask) == (
        exact.prompt_ids, exact.completion_ids, exact.env_mask)
    sampled = [t for t, m in zip(rendered.completion_ids, rendered.env_mask, strict=True) if m]
    assert tokenizer.decode(sampled) == f"{CALL_TEXT}<|im_end|>{WEATHER_ANSWER}<|im_end|>"


def test_a_turn_cut_by_the_token_limit_has_no_sampled_eos(tokenizer: Any) -> None:
    turn = BranchTurn(request_messages=WEATHER_QUESTION, response_message={"role": "assistant", "content": "It is"},
                      finish_reason="length")
    batch = build_samples([group_of([([turn], 0.0), (single_turn(tokenizer, "Sunny."), 1.0)])], tokenizer, **LIMITS)
    assert batch.samples[0].completion_ids == encode(tokenizer, "It is")


def test_turns_that_do_not_extend_the_sequence_are_split_and_keep_the_member_reward(tokenizer: Any) -> None:
    turns = tool_trajectory(tokenizer)
    # The client rewrote history: the second request's question differs from the first.
    rewritten = [{"role": "user", "content": "Weather in Paris, please."}, *weather_followup("call_0")[1:]]
    turns[1].request_messages = rewritten
    turns[1].prompt_token_ids = prompt_ids(tokenizer, rewritten, [WEATHER_TOOL])
    batch = build_samples([group_of([(turns, 1.0), (single_turn(tokenizer, "No."), 0.0)])], tokenizer, **LIMITS)
    first, second, other = batch.samples
    assert (first.part, second.part, first.trajectory_id) == (0, 1, second.trajectory_id)
    assert first.completion_ids == turns[0].completion_token_ids and first.env_mask == [1] * len(first.completion_ids)
    assert second.prompt_ids == turns[1].prompt_token_ids and second.completion_ids == turns[1].completion_token_ids
    assert first.reward == second.reward == 1.0 and first.advantage == second.advantage > 0 > other.advantage
    assert batch.stats()["samples/split"] == 1
    # Advantages are per member, not per sequence: the split member counts once.
    assert first.advantage == pytest.approx(0.5 / (_std([1.0, 0.0]) + ADVANTAGE_EPS))


def test_a_long_multi_turn_member_splits_at_the_completion_limit(tokenizer: Any) -> None:
    turns = tool_trajectory(tokenizer)
    assert turns[0].completion_token_ids is not None
    limit = len(turns[0].completion_token_ids) + 3  # room for the tool call, not for the rest
    batch = build_samples([group_of([(turns, 1.0), (single_turn(tokenizer, "No."), 0.0)])], tokenizer,
                          max_prompt_tokens=1024, max_completion_tokens=limit)
    assert [s.part for s in batch.samples if s.trajectory_id == "g1-t0"] == [0, 1]
    assert all(len(s.completion_ids) <= limit for s in batch.samples)


def test_truncation_left_cuts_prompts_and_drop_skips(tokenizer: Any) -> None:
    long_answer = "It is sunny in Paris today."
    group = group_of([(single_turn(tokenizer, long_answer), 1.0), (single_turn(tokenizer, "It rains."), 0.0)])
    full = group.members[0].turns[0].prompt_token_ids
    assert full is not None
    left = build_samples([group], tokenizer, max_prompt_tokens=10, max_completion_tokens=3)
    sample = left.samples[0]
    assert sample.prompt_ids == full[-10:] and sample.truncated
    assert len(sample.completion_ids) == 3 and sample.completion_ids == encode(tokenizer, long_answer)[:3]
    assert sample.logprobs is None  # captured under the full prompt: not comparable any more
    dropped = build_samples([group], tokenizer, max_prompt_tokens=10, max_completion_tokens=64, truncation="drop")
    assert dropped.samples == [] and dropped.skip_counts() == {"too_long": {"groups": 0, "members": 2},
                                                               "too_small": {"groups": 1, "members": 0}}


def test_zero_variance_and_small_groups_are_skipped_and_counted(tokenizer: Any) -> None:
    def answers(*rewards: float) -> list[tuple[list[BranchTurn], float]]:
        return [(single_turn(tokenizer, f"Answer {i}."), r) for i, r in enumerate(rewards)]

    groups = [group_of(answers(1.0, 1.0, 1.0), "same"), group_of(answers(0.3), "alone"),
              group_of(answers(0.0, 0.0), "zeros"), group_of(answers(1.0, 0.0, 0.5), "good")]
    batch = build_samples(groups, tokenizer, **LIMITS)
    assert batch.group_ids == ["good"] and len(batch.samples) == 3
    assert batch.skip_counts() == {"zero_variance": {"groups": 2, "members": 5},
                                   "too_small": {"groups": 1, "members": 1}}
    stats = batch.stats()
    assert stats["samples/skipped_groups/zero_variance"] == 2 and stats["samples/groups_in"] == 4
    # Json-friendly: the lead stores these in training_runs.metrics
    json.dumps(stats)


def _std(xs: list[float]) -> float:
    mean = sum(xs) / len(xs)
    return float((sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)) ** 0.5)


def test_advantages_per_scale(tokenizer: Any) -> None:
    rewards = [[1.0, 0.0, 0.0, 0.0], [0.2, 0.6]]
    group = group_advantages(rewards, "group")
    assert group[0] == pytest.approx([0.75 / (0.5 + ADVANTAGE_EPS), *[-0.25 / (0.5 + ADVANTAGE_EPS)] * 3])
    small_std = _std([0.2, 0.6])
    assert group[1] == pytest.approx([-0.2 / (small_std + ADVANTAGE_EPS), 0.2 / (small_std + ADVANTAGE_EPS)])
    batch_std = _std([1.0, 0.0, 0.0, 0.0, 0.2, 0.6])
    batch = group_advantages(rewards, "batch")
    assert batch[1] == pytest.approx([-0.2 / (batch_std + ADVANTAGE_EPS), 0.2 / (batch_std + ADVANTAGE_EPS)])
    flat = [a for adv in group_advantages(rewards, "none") for a in adv]
    assert flat == pytest.approx([0.75, -0.25, -0.25, -0.25, -0.2, 0.2])
    # Through build_samples: every sample carries its member's advantage, groups are centred.
    groups = [group_of([(single_turn(tokenizer, f"A{i}."), r) for i, r in enumerate(rs)], f"g{j}")
              for j, rs in enumerate(rewards)]
    for scale, expected in (("group", group), ("batch", batch)):
        samples = build_samples(groups, tokenizer, advantage_scale=scale, **LIMITS).samples
        assert [s.advantage for s in samples] == pytest.approx([a for adv in expected for a in adv])


def test_members_drawn_without_replacement_are_weighted_by_p_over_q(tokenizer: Any) -> None:
    """The self-normalized estimator for a sample without replacement: w = (p/q) / sum(p/q), B = sum w r."""
    import math

    rewards, log_weights = [1.0, 0.0, 0.0, 0.0], [-3.0, -0.5, -1.2, -2.5]
    w = [math.exp(lw) / sum(math.exp(x) for x in log_weights) for lw in log_weights]
    baseline = sum(wi * r for wi, r in zip(w, rewards, strict=True))
    centred = centred_rewards(rewards, [*log_weights])
    assert centred == pytest.approx([4 * wi * (r - baseline) for wi, r in zip(w, rewards, strict=True)])
    assert sum(centred) == pytest.approx(0.0)  # all drawn: the weighted deviations cancel
    assert centred[0] < 0.75  # the rare right answer counts for less than an equal share would give it
    # Equal weights give the plain mean; the client's independent answer is centred on the drawn ones' baseline.
    assert centred_rewards(rewards, [-1.0] * 4) == pytest.approx([0.75, -0.25, -0.25, -0.25])
    mixed = centred_rewards([0.5, 1.0, 0.0, 0.0], [None, -1.0, -1.0, -1.0])
    assert mixed == pytest.approx([0.5 - 1 / 3, 3 * (1 / 3) * (1 - 1 / 3), -1 / 3, -1 / 3])
    assert centred_rewards(rewards, [None, -1.0, None, None]) == centred_rewards(rewards)  # one drawn: no draw

    # Through build_samples: a fork group whose siblings recorded log q; its advantages are ours, not TRL's.
    def sibling(answer: str, log_q: float | None) -> list[BranchTurn]:
        turns = single_turn(tokenizer, answer)
        turns[0].inclusion_logprob = log_q
        return turns

    drawn = group_of([(sibling("A0.", None), 1.0), (sibling("A1.", -0.1), 0.0), (sibling("A2.", -2.0), 1.0),
                      (sibling("A3.", -4.0), 0.0)], "fork")
    plain = group_of([(single_turn(tokenizer, f"B{i}."), r) for i, r in enumerate([1.0, 0.0, 0.0, 0.0])], "plain")
    batch = build_samples([drawn, plain], tokenizer, **LIMITS)
    assert batch.weighted == {"fork"}
    turns = [m.turns[0] for m in drawn.members]
    logs = [None, *(sum(t.completion_logprobs or []) - (t.inclusion_logprob or 0.0) for t in turns[1:])]
    expected = centred_rewards([1.0, 0.0, 1.0, 0.0], logs)
    std = math.sqrt(sum((c - sum(expected) / 4) ** 2 for c in expected) / 3)
    assert [s.advantage for s in batch.samples[:4]] == pytest.approx([c / (std + ADVANTAGE_EPS) for c in expected])
    assert plan_groups(batch).native == [False, True]  # TRL cannot see the weights: not compared with its own


# --------------------------------------------------------------------------- sampling parameters


def test_offpolicy_params_names_what_reshapes_the_sampling_distribution() -> None:
    neutral = {"temperature": 1, "top_p": 1.0, "top_k": -1, "min_p": 0, "presence_penalty": 0.0, "max_tokens": 5,
               "seed": 3, "n": 2, "stop": ["\n"], "logit_bias": {}, "response_format": {"type": "text"},
               "tool_choice": "auto", "logprobs": True}
    assert offpolicy_params(neutral, 1.0) == [] and offpolicy_params(None, 1.0) == []  # unset: OpenAI's defaults
    assert offpolicy_params(None, 0.7) == ["temperature"] and offpolicy_params({"temperature": 0.7}, 0.7) == []
    assert offpolicy_params({"temperature": 0}, 1.0) == ["temperature"]  # greedy
    reshaped = {"top_p": 0.9, "top_k": 20, "frequency_penalty": 0.5, "logit_bias": {"7": 5},
                "response_format": {"type": "json_object"}, "tool_choice": "required"}
    assert offpolicy_params(reshaped, 1.0) == list(reshaped)


def test_turns_sampled_with_other_parameters_lose_their_behaviour_logprobs_and_are_counted(tokenizer: Any) -> None:
    default, cooler = single_turn(tokenizer, "Sunny."), single_turn(tokenizer, "Rain.")
    tool = tool_trajectory(tokenizer)
    cooler[0].params = {"temperature": 0.7, "max_tokens": 16}
    tool[1].params = {"top_p": 0.9}  # only the answer after the tool result was nucleus-sampled
    group = group_of([(default, 1.0), (cooler, 0.0), (tool, 0.5)])

    at_1 = build_samples([group], tokenizer, **LIMITS)  # the trainer's temperature: 1 (GRPOArgs' default)
    plain, cool, tooled = at_1.samples
    assert plain.logprobs == default[0].completion_logprobs and not plain.offpolicy_params
    assert cool.logprobs is None and cool.offpolicy_params
    call = tool[0].completion_token_ids
    assert call is not None and tool[0].completion_logprobs is not None and tooled.logprobs is not None
    assert tooled.logprobs[:len(call)] == tool[0].completion_logprobs  # the tool call was sampled as trained
    assert tooled.logprobs[len(call):] == [None] * (len(tooled.completion_ids) - len(call))
    assert tooled.offpolicy_params and at_1.stats()["samples/offpolicy_params_sequences"] == 2
    assert [s.advantage for s in at_1.samples] == [s.advantage for s in
                                                  build_samples([group], tokenizer, **LIMITS, temperature=0.7).samples]

    at_07 = build_samples([group], tokenizer, **LIMITS, temperature=0.7)  # now the default turns are the odd ones
    assert at_07.samples[0].logprobs is None and at_07.samples[1].logprobs == cooler[0].completion_logprobs
    assert at_07.stats()["samples/offpolicy_params_sequences"] == 2


def test_the_stored_sampling_parameters_reach_the_trainer(tmp_path: Path) -> None:
    from flywheel.capture.groups import training_group
    from flywheel.capture.models import Group, GroupMember, Score, Trajectory, Turn
    from flywheel.capture.store import Store

    store = Store(tmp_path / "store.duckdb")
    try:
        with store.session() as session:
            session.add(Group(id="grp", source="explicit", key="k", alias="agent", status="scored", size=2))
            for i, params in enumerate([{"temperature": 0.3, "top_p": 0.5}, None]):
                session.add(Trajectory(id=f"traj{i}", alias="agent"))
                session.add(Turn(id=f"turn{i}", trajectory_id=f"traj{i}", completion_id=f"c{i}", requested_model="m",
                                 alias="agent", engine_model="m", request_messages=WEATHER_QUESTION,
                                 response_message={"role": "assistant", "content": "Sunny."}, params=params,
                                 h_ctx="ctx", h_out=f"out{i}"))
                session.add(GroupMember(group_id="grp", trajectory_id=f"traj{i}", leaf_turn_id=f"turn{i}"))
                session.add(Score(id=f"s{i}", trajectory_id=f"traj{i}", group_id="grp", source="reward", value=i))
            session.commit()
        with store.session() as session:
            stored = session.get(Group, "grp")
            assert stored is not None
            batch = training_group(session, stored)
    finally:
        store.close()
    assert [m.turns[0].params for m in batch.members] == [{"temperature": 0.3, "top_p": 0.5}, None]
    assert TrainingGroup.from_json(json.loads(json.dumps(batch.to_json()))) == batch  # through the admin API
