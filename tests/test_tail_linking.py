"""Real agents through a real gateway: conversations whose history changes between requests are still
rebuilt one trajectory each, and never merged with another.

One gateway (upstream engine on a scripted server) serves the module; each test talks with its
own client key, so its trajectories are the ones listed for that key. Every test runs three
conversations at once with the plain ``openai`` client, turn by turn, streaming or not; they
share their openings (the same system prompt and first question). The scripted upstream
answers like a sampling model (a fresh random text each time, fresh tool-call ids), except
where a test needs the same answer twice: then its system prompt asks for ``[reply:echo]``
(the answer depends on the last user message only) or ``[reply:ok]`` (always "OK").

The history policies are what production agents do to the history they send back:
verbatim, a system prompt carrying the current time, a sliding window, a summary replacing
older messages, tool results shortened once answered.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import pytest

from flywheel.capture.history import branch_conversation
from flywheel.capture.models import Turn
from tests.gateway_process import GatewayProcess
from tests.scripted_gateway import scripted_gateway_fixtures
from tests.scripted_openai import Reply

KEYS = [f"sk-tail-{i:02d}" for i in range(32)]
OPENING = "Plan a weekend trip for two."
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


def reply(body: dict[str, Any]) -> Reply:
    """A sampling model: fresh text and tool-call ids each call; ``[reply:echo]``/``[reply:ok]`` repeat themselves."""
    system = body["messages"][0]["content"] if body["messages"][0]["role"] == "system" else ""
    last = body["messages"][-1]
    if "[reply:ok]" in system:
        return Reply(content="OK")
    if "[reply:echo]" in system:
        return Reply(content=f"Noted, and here is my considered answer to: {last['content']}")
    if "[reply:tools]" in system and last["role"] == "user":
        call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps({"city": last["content"][-6:]})}}
        return Reply(content=None, tool_calls=[call], finish_reason="tool_calls")
    return Reply(content=f"Here is a thought about that, number {uuid.uuid4().hex[:12]}.")


gateway, key = scripted_gateway_fixtures(reply, KEYS, "tail")


# -- what agents do to their history -------------------------------------------------------------------

Policy = Callable[[str, list[dict[str, Any]], int], list[dict[str, Any]]]


def verbatim(system: str, history: list[dict[str, Any]], call: int) -> list[dict[str, Any]]:
    return [{"role": "system", "content": system}, *history]


def dynamic_system(system: str, history: list[dict[str, Any]], call: int) -> list[dict[str, Any]]:
    """The system prompt carries the current time: it differs on every request."""
    return [{"role": "system", "content": f"{system} Now: 2026-11-01T10:{call:02d}:{uuid.uuid4().int % 60:02d}Z."},
            *history]


def sliding_window(system: str, history: list[dict[str, Any]], call: int) -> list[dict[str, Any]]:
    """The system prompt and the last three messages."""
    return [{"role": "system", "content": system}, *history[-3:]]


def summary(system: str, history: list[dict[str, Any]], call: int) -> list[dict[str, Any]]:
    """The messages before the last three become one summary message."""
    older, recent = history[:-3], history[-3:]
    digest = [{"role": "user", "content": "Summary so far: " + " / ".join(str(m.get("content"))[:20] for m in older)}]
    return [{"role": "system", "content": system}, *(digest if older else []), *recent]


def short_tool_results(system: str, history: list[dict[str, Any]], call: int) -> list[dict[str, Any]]:
    """Tool results the model already answered after are shortened."""
    out = []
    for i, message in enumerate(history):
        answered = any(m["role"] == "assistant" for m in history[i + 1:])
        if message["role"] == "tool" and answered:
            message = {**message, "content": json.dumps({"sky": "sunny", "details": "[shortened]"})}
        out.append(message)
    return [{"role": "system", "content": system}, *out]


# -- agents ---------------------------------------------------------------------------------------------

@dataclass
class Agent:
    """One conversation: the true history (without the system prompt), what it sends, what it got."""

    system: str
    questions: list[str]
    policy: Policy
    history: list[dict[str, Any]] = field(default_factory=list)
    completion_ids: list[str] = field(default_factory=list)
    calls: int = 0

    def __post_init__(self) -> None:
        self.history.append({"role": "user", "content": self.questions.pop(0)})

    async def step(self, client: openai.AsyncOpenAI, *, stream: bool, retry: bool = False) -> None:
        """One request; ``retry``: send it, then send the same history again and continue from that answer."""
        messages = self.policy(self.system, self.history, self.calls)
        self.calls += 1
        tools = TOOLS if "[reply:tools]" in self.system else openai.omit
        if stream:
            chunks = [c async for c in await client.chat.completions.create(
                model="gpt-4o", messages=messages, tools=tools, stream=True)]  # type: ignore[arg-type]
            completion_id = chunks[0].id
            content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
            message: dict[str, Any] = {"role": "assistant", "content": content or None}
            if calls:
                message["tool_calls"] = [{"id": tc.id, "type": "function", "function": {
                    "name": tc.function.name, "arguments": tc.function.arguments}} for tc in calls]  # type: ignore[union-attr]
        else:
            answer = await client.chat.completions.create(model="gpt-4o", messages=messages,  # type: ignore[arg-type]
                                                          tools=tools)
            completion_id = answer.id
            message = answer.choices[0].message.model_dump(exclude_none=True)
        self.completion_ids.append(completion_id)
        if retry:
            return await self.step(client, stream=stream)
        self.history.append(message)
        if message.get("tool_calls"):
            call = message["tool_calls"][0]
            details = "A long weather report. " * 20
            self.history.append({"role": "tool", "tool_call_id": call["id"],
                                 "content": json.dumps({"sky": "sunny", "details": details})})
        elif self.questions:
            self.history.append({"role": "user", "content": self.questions.pop(0)})


def agents(policy: Policy, system: str = "You are a travel agent.", *, shared_opening: bool = True,
           count: int = 3) -> list[Agent]:
    """``count`` conversations with the same system prompt; the same first question unless told otherwise."""
    return [Agent(system, [OPENING if shared_opening else f"Plan a trip to place {i}.",
                           f"I pick city number {i}.", f"Book a hotel in city number {i}.",
                           f"And a table for dinner in city number {i}."], policy) for i in range(count)]


async def converse(gateway: GatewayProcess, key: str, crowd: list[Agent], calls: int, *, stream: bool,
                   retry_at: int | None = None) -> None:
    """``calls`` requests per agent, all agents concurrently, turn by turn (a retry repeats one request)."""
    client = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0)
    for call in range(calls):
        await asyncio.gather(*(agent.step(client, stream=stream, retry=call == retry_at) for agent in crowd))
    await client.close()


# -- reading back ---------------------------------------------------------------------------------------

@dataclass
class Stored:
    trajectories: list[dict[str, Any]]  # details, oldest first
    counts: dict[str, float]  # capture counters after the test's turns were written

    def of(self, agent: Agent) -> list[dict[str, Any]]:
        """The trajectories holding this agent's turns."""
        ids = set(agent.completion_ids)
        return [t for t in self.trajectories if ids & {turn["completion_id"] for turn in t["turns"]}]


def stored(gateway: GatewayProcess, key: str) -> Stored:
    key_id = "key_" + hashlib.sha256(key.encode()).hexdigest()[:12]
    with httpx.Client(base_url=f"{gateway.url}/flywheel/v1", headers={"authorization": "Bearer adm"},
                      timeout=30) as admin:
        listed = admin.get("/trajectories", params={"client_key_id": key_id, "order": "asc", "limit": 1000}).json()
        details = [admin.get(f"/trajectories/{t['id']}").json() for t in listed["data"]]
    return Stored(details, capture_counts(gateway))


def capture_counts(gateway: GatewayProcess) -> dict[str, float]:
    text = httpx.get(f"{gateway.url}/metrics", timeout=30).text
    out = {}
    for name, label, value in re.findall(r'^(flywheel_capture_\w+?)_total(?:\{\w+="(\w+)"\})? ([0-9.e+]+)$', text,
                                         re.MULTILINE):
        out[f"{name}:{label}" if label else name] = float(value)
    return out


def assert_never_merged(result: Stored, crowd: list[Agent]) -> None:
    """No trajectory holds turns of two conversations."""
    owner = {cid: i for i, agent in enumerate(crowd) for cid in agent.completion_ids}
    for trajectory in result.trajectories:
        owners = {owner[turn["completion_id"]] for turn in trajectory["turns"]}
        assert len(owners) == 1, f"trajectory {trajectory['id']} mixes conversations {owners}"


def assert_one_trajectory_each(result: Stored, crowd: list[Agent], rules: list[str]) -> None:
    """Each conversation is one trajectory: one chain of turns in call order, linked by ``rules``, whose
    branch read back as one conversation is the agent's true history (the first system prompt kept)."""
    assert_never_merged(result, crowd)
    for agent in crowd:
        (trajectory,) = result.of(agent)
        turns = sorted(trajectory["turns"], key=lambda t: t["depth"])
        assert [t["completion_id"] for t in turns] == agent.completion_ids
        assert [t["depth"] for t in turns] == list(range(len(turns)))
        assert [t["link_rule"] for t in turns] == rules
        assert trajectory["branch_count"] == 1 and trajectory["turn_count"] == len(rules)
        conversation, _ = branch_conversation([Turn.model_validate(t) for t in turns])
        assert [_text(m) for m in conversation[1:]] == [_text(m) for m in agent.history[:len(conversation) - 1]]
        assert conversation[0] == turns[0]["request_messages"][0]


def _text(message: dict[str, Any]) -> tuple[str, str]:
    return message["role"], str(message.get("content") or message.get("tool_calls", [{}])[0].get("id"))


def delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


# -- the cases ------------------------------------------------------------------------------------------

STREAMS = pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])


@STREAMS
def test_verbatim_history_links_by_prefix(gateway: GatewayProcess, key: str, stream: bool) -> None:
    crowd = agents(verbatim)
    before = capture_counts(gateway)
    asyncio.run(converse(gateway, key, crowd, 4, stream=stream))
    result = stored(gateway, key)
    assert_one_trajectory_each(result, crowd, ["new", "prefix", "prefix", "prefix"])
    assert all(t["history_edits"] is None for tr in result.trajectories for t in tr["turns"])
    assert delta(before, result.counts, "flywheel_capture_links:prefix") == 9
    assert delta(before, result.counts, "flywheel_capture_links:tail") == 0


@STREAMS
def test_a_system_prompt_that_changes_every_turn_links_by_tail(gateway: GatewayProcess, key: str,
                                                                 stream: bool) -> None:
    crowd = agents(dynamic_system)
    before = capture_counts(gateway)
    asyncio.run(converse(gateway, key, crowd, 4, stream=stream))
    result = stored(gateway, key)
    assert_one_trajectory_each(result, crowd, ["new", "tail", "tail", "tail"])
    for trajectory in result.trajectories:
        for turn in trajectory["turns"][1:]:
            assert turn["history_edits"] == {"system_changed": True, "dropped": 0, "rewritten": 0, "added": 0}
            assert turn["request_messages"][0]["content"].endswith("Z.")  # the history as it was sent
    assert delta(before, result.counts, "flywheel_capture_links:tail") == 9
    assert delta(before, result.counts, "flywheel_capture_tail_ambiguous") == 0


def edits(dropped: int, rewritten: int) -> dict[str, Any]:
    return {"system_changed": False, "dropped": dropped, "rewritten": rewritten, "added": 0}


@pytest.mark.parametrize(("policy", "third", "fourth"), [
    (sliding_window, edits(2, 0), edits(2, 0)),  # [system, u2, a2, u3]: u1 and a1 dropped
    (summary, edits(1, 1), edits(2, 1)),  # [system, summary of u1 a1, u2, a2, u3], then of u1..a2
], ids=["sliding-window", "summary"])
@STREAMS
def test_a_window_or_a_summary_links_by_tail(gateway: GatewayProcess, key: str, stream: bool, policy: Policy,
                                             third: dict[str, Any], fourth: dict[str, Any]) -> None:
    crowd = agents(policy)
    asyncio.run(converse(gateway, key, crowd, 4, stream=stream))
    result = stored(gateway, key)
    assert_one_trajectory_each(result, crowd, ["new", "prefix", "tail", "tail"])
    for trajectory in result.trajectories:
        turns = sorted(trajectory["turns"], key=lambda t: t["depth"])
        assert [turns[2]["history_edits"], turns[3]["history_edits"]] == [third, fourth]
        assert turns[2]["request_messages"][turns[2]["parent_message_index"]]["content"] == \
            turns[1]["response_message"]["content"]  # where the parent's answer sits in what was sent


@STREAMS
def test_a_shortened_tool_result_links_by_tail(gateway: GatewayProcess, key: str, stream: bool) -> None:
    crowd = agents(short_tool_results, "You are a travel agent with tools. [reply:tools]")
    asyncio.run(converse(gateway, key, crowd, 4, stream=stream))
    result = stored(gateway, key)
    # call 1 asks for a tool, call 2 answers its result, call 3 (result shortened) asks again, call 4 answers
    assert_one_trajectory_each(result, crowd, ["new", "prefix", "tail", "prefix"])
    for agent in crowd:
        (trajectory,) = result.of(agent)
        third = sorted(trajectory["turns"], key=lambda t: t["depth"])[2]
        assert third["history_edits"] == edits(0, 1)
        assert "[shortened]" in third["request_messages"][3]["content"]  # stored as sent


@pytest.mark.parametrize("policy", [verbatim, dynamic_system], ids=["verbatim", "dynamic"])
@STREAMS
def test_a_retried_turn_is_a_branch(gateway: GatewayProcess, key: str, stream: bool, policy: Policy) -> None:
    crowd = agents(policy)
    asyncio.run(converse(gateway, key, crowd, 3, stream=stream, retry_at=1))
    result = stored(gateway, key)
    assert_never_merged(result, crowd)
    for agent in crowd:
        (trajectory,) = result.of(agent)
        by_id = {t["completion_id"]: t for t in trajectory["turns"]}
        first, tried, retried, last = (by_id[c] for c in agent.completion_ids)
        assert (trajectory["turn_count"], trajectory["branch_count"]) == (4, 2)
        assert tried["parent_turn_id"] == retried["parent_turn_id"] == first["id"]
        assert last["parent_turn_id"] == retried["id"]
        rule = "prefix" if policy is verbatim else "tail"
        assert [tried["link_rule"], retried["link_rule"], last["link_rule"]] == [rule] * 3


@STREAMS
def test_identical_conversations_are_never_merged(gateway: GatewayProcess, key: str, stream: bool) -> None:
    crowd = agents(verbatim, "You repeat yourself. [reply:echo]")
    for agent in crowd:  # word for word the same conversation three times
        agent.questions = [f"Question {i}." for i in range(2, 5)]
    asyncio.run(converse(gateway, key, crowd, 4, stream=stream))
    result = stored(gateway, key)
    assert [(t["turn_count"], t["branch_count"]) for t in result.trajectories] == [(4, 1)] * 3


@STREAMS
def test_identical_conversations_with_a_changing_system_prompt_split_rather_than_merge(
        gateway: GatewayProcess, key: str, stream: bool) -> None:
    crowd = agents(dynamic_system, "You repeat yourself. [reply:echo]")
    for agent in crowd:
        agent.questions = [f"Question {i}." for i in range(2, 5)]
    before = capture_counts(gateway)
    asyncio.run(converse(gateway, key, crowd, 4, stream=stream))
    result = stored(gateway, key)
    assert len(result.trajectories) == 12  # no evidence tells them apart: every turn on its own, none merged
    assert all(t["turn_count"] == 1 and t["turns"][0]["link_rule"] == "new" for t in result.trajectories)
    assert delta(before, result.counts, "flywheel_capture_tail_ambiguous") == 9
    assert delta(before, result.counts, "flywheel_capture_links:tail") == 0


@STREAMS
def test_the_same_short_answer_in_two_conversations_is_never_cross_linked(
        gateway: GatewayProcess, key: str, stream: bool) -> None:
    crowd = agents(dynamic_system, "You agree. [reply:ok]", shared_opening=False)
    asyncio.run(converse(gateway, key, crowd, 4, stream=stream))
    result = stored(gateway, key)
    # "OK" everywhere, but the question before each "OK" tells the conversations apart
    assert_one_trajectory_each(result, crowd, ["new", "tail", "tail", "tail"])


@STREAMS
def test_the_same_short_answer_to_the_same_opening_is_refused_not_guessed(
        gateway: GatewayProcess, key: str, stream: bool) -> None:
    crowd = agents(dynamic_system, "You agree. [reply:ok]")
    before = capture_counts(gateway)
    asyncio.run(converse(gateway, key, crowd, 4, stream=stream))
    result = stored(gateway, key)
    assert_never_merged(result, crowd)
    for agent in crowd:  # "OK" to the same question in all three: a split there, linked again after it
        first, rest = result.of(agent)
        assert [t["completion_id"] for t in first["turns"]] == agent.completion_ids[:1]
        assert sorted(t["completion_id"] for t in rest["turns"]) == sorted(agent.completion_ids[1:])
        assert [t["link_rule"] for t in sorted(rest["turns"], key=lambda t: t["depth"])] == ["new", "tail", "tail"]
    assert delta(before, result.counts, "flywheel_capture_tail_ambiguous") == 3
    assert delta(before, result.counts, "flywheel_capture_links:tail") == 6


def test_metrics_name_the_link_rules(gateway: GatewayProcess) -> None:
    text = httpx.get(f"{gateway.url}/metrics", timeout=30).text
    for rule in ("prefix", "tail", "explicit", "new"):
        assert f'flywheel_capture_links_total{{rule="{rule}"}}' in text
    assert "flywheel_capture_tail_ambiguous_total" in text

