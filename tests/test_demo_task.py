"""The demo task (examples/demo/task.py) and the format-only warm start (trainer/warm_start.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from examples.demo import task
from examples.demo.agent import Args, feedback_url, schedule

REQUEST = task.Request("Hi. Where is my order for the lamp? Thanks.", "order")


def call(name: str, arguments: str = "{}") -> dict[str, Any]:
    return {"role": "assistant", "content": None,
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": name, "arguments": arguments}}]}


ANSWER = {"role": "assistant", "content": "Here you go."}


@pytest.mark.parametrize(("first", "final", "truncated", "reward"), [
    (call("order"), ANSWER, False, 1.0),  # right tool, then an answer
    (call("order"), None, False, 0.5),  # right tool, no final answer
    (call("order"), {"role": "assistant", "content": ""}, False, 0.5),  # an empty answer is none
    (call("order"), call("price"), False, 0.5),  # a second call is no final answer
    (call("price"), ANSWER, False, 0.1),  # a well-formed call to another tool
    (call("email"), None, False, 0.05),
    (call("refund"), ANSWER, False, 0.0),  # no such tool
    (call("order", '{"id": '), ANSWER, False, 0.0),  # arguments that are not JSON
    (call("order", '"x"'), ANSWER, False, 0.0),  # arguments that are not an object
    ({"role": "assistant", "content": "Your order is on its way."}, None, False, 0.0),  # no call at all
    ({**call("order"), "content": "Let me look."}, ANSWER, False, 0.0),  # text beside the call
    ({"role": "assistant", "content": None, "tool_calls": call("order")["tool_calls"] * 2}, ANSWER, False, 0.0),
    (call("order"), ANSWER, True, 0.0),  # the first turn ran into max_tokens: no end of turn
])
def test_episode_reward(first: dict[str, Any], final: dict[str, Any] | None, truncated: bool, reward: float) -> None:
    assert task.episode_reward(REQUEST, first, final, first_truncated=truncated) == pytest.approx(reward)


def test_an_endless_final_answer_halves_the_reward() -> None:
    assert task.episode_reward(REQUEST, call("order"), ANSWER, final_truncated=True) == pytest.approx(0.5)


def test_turn_reward_scores_a_first_turn_by_its_tool() -> None:
    messages = task.first_messages(task.Request("Can I get a meeting to fix my bike?", "calendar"))
    assert task.turn_reward(messages, task.TOOLS, call("calendar")) == 1.0
    assert task.turn_reward(messages, task.TOOLS, call("order")) == pytest.approx(0.1)
    assert task.turn_reward(messages, task.TOOLS, {"role": "assistant", "content": "Sure."}) == 0.0
    assert task.turn_reward(messages, task.TOOLS, call("calendar"), truncated=True) == 0.0
    assert task.turn_reward(messages, task.TOOLS[:1], call("calendar")) == 0.0  # a tool the context did not offer
    # a bare {"name", "arguments"} call is read too, arguments as a dict
    bare = {"role": "assistant", "tool_calls": [{"name": "calendar", "arguments": {}}]}
    assert task.turn_reward(messages, task.TOOLS, bare) == 1.0


def test_turn_reward_scores_the_turn_after_the_result_by_its_answer() -> None:
    messages = [*task.first_messages(task.Request("Please book a bike meeting.", "calendar")), call("order"),
                {"role": "tool", "tool_call_id": "call_0", "content": task.tool_result("order")}]
    assert task.turn_reward(messages, task.TOOLS, ANSWER) == 1.0  # the turn's own job: an answer
    assert task.turn_reward(messages, task.TOOLS, ANSWER, truncated=True) == 0.0
    assert task.turn_reward(messages, task.TOOLS, call("calendar")) == 0.0  # a second call is no answer


def test_every_request_carries_the_cue_of_exactly_its_tool() -> None:
    requests = task.all_requests()
    assert len({r.text for r in requests}) == len(requests)
    assert {r.tool for r in requests} == set(task.TOOL_NAMES)
    assert all(task.cue_tool(r.text) == r.tool for r in requests)
    for tool, templates in task.TEMPLATES.items():  # ... and no other tool's cue, whatever fills the template
        for template in templates:
            assert task.cue_tool(template.format(item="lamp")) == tool, template
    assert task.cue_tool("Where is my order? And email me the receipt.") is None  # two cues: no single right tool


def test_request_pools_are_balanced_and_the_held_out_split_is_disjoint() -> None:
    train = task.request_pool(64, seed=0)
    held_out = task.request_pool(64, seed=0, held_out=True)
    assert len(set(train)) == 64 and not {r.text for r in train} & {r.text for r in held_out}
    assert all(sum(r.tool == t for r in train) == 16 for t in task.TOOL_NAMES)
    assert task.request_pool(64, seed=0) == train  # deterministic
    with pytest.raises(ValueError):
        task.request_pool(10, seed=0)


def test_the_agent_runs_each_request_in_a_block_of_group_size_episodes() -> None:
    episodes = list(schedule(Args(episodes=24, group_size=4, pool=8)))
    assert [i for i, _ in episodes] == list(range(24))
    blocks = [episodes[i:i + 4] for i in range(0, 24, 4)]
    assert all(len({r for _, r in block}) == 1 for block in blocks)
    assert len({block[0][1] for block in blocks}) == 6  # a pass over the pool before any request recurs
    assert feedback_url("http://127.0.0.1:8000/v1/") == "http://127.0.0.1:8000/flywheel/v1/feedback"


def test_warm_start_examples_have_the_format_with_tools_at_random() -> None:
    examples = task.warm_start_examples(400, seed=0)
    called = [messages[2]["tool_calls"][0]["function"]["name"] for messages, _ in examples]
    assert set(called) == set(task.TOOL_NAMES)
    right = sum(name == task.cue_tool(messages[1]["content"])
                for name, (messages, _) in zip(called, examples, strict=True))
    assert 0.15 < right / len(examples) < 0.35  # about chance (1/4): the warm start teaches no tool choice
    assert all(task.episode_reward(task.Request(m[1]["content"], n), m[2], m[4]) == 1.0
               for n, (m, _) in zip(called, examples, strict=True))


def test_warm_start_writes_a_loadable_model_and_reuses_it(tiny_model: Path, tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from flywheel.trainer.warm_start import IGNORE, RECORD_FILE, encode_conversation, warm_start

    examples = task.warm_start_examples(16, seed=0)
    out = warm_start(tiny_model, tmp_path / "warm", examples, steps=3, batch_size=4, progress=False)
    record = json.loads((out / RECORD_FILE).read_text())
    assert record["steps"] == 3 and record["loss_last"] < record["loss_first"]
    tokenizer = AutoTokenizer.from_pretrained(out)
    weights = dict(AutoModelForCausalLM.from_pretrained(out).named_parameters())
    before = dict(AutoModelForCausalLM.from_pretrained(tiny_model).named_parameters())
    assert weights.keys() == before.keys() and not all(torch.equal(weights[k], before[k]) for k in weights)
    ids, labels = encode_conversation(tokenizer, *examples[0])
    trained = str(tokenizer.decode([i for i, label in zip(ids, labels, strict=True) if label != IGNORE]))
    assert trained.startswith("<tool_call>\n{") and trained.count("<|im_end|>") == 2  # both assistant turns
    assert str(tokenizer.decode(ids)).startswith("<|im_start|>system\n" + task.SYSTEM_PROMPT)
    # the same examples and settings again: the model already there, not trained again
    assert warm_start(tiny_model, out, examples, steps=3, batch_size=4, progress=False) == out
    assert json.loads((out / RECORD_FILE).read_text()) == record  # its seconds would differ had it trained
