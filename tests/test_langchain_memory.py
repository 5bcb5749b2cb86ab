"""LangChain's chat memory through a real gateway: conversations whose history LangChain trims or summarizes
are linked one trajectory each where the requests carry evidence, and never merged with another.

The agents keep their history as LangChain messages and send what LangChain's own functions make of it
(``trim_messages``; a summary the model wrote, LangGraph's summarizing memory), converted with
``convert_to_openai_messages``, through the plain ``openai`` client. Three conversations run at once
with the same system prompt and first question; the scripted upstream answers like a sampling model
(fresh text each time, a fresh summary when asked for one), except where a system prompt asks for
``[summary:fixed]`` (every summary the same text, as two conversations alike could get).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import openai
import pytest
from langchain_core.messages import (
    AIMessage,
    BaseMessage,
    HumanMessage,
    SystemMessage,
    convert_to_openai_messages,
    trim_messages,
)
from langchain_core.messages.utils import count_tokens_approximately

from flywheel.capture.history import branch_conversation
from flywheel.capture.models import Turn
from tests.gateway_process import GatewayProcess
from tests.scripted_gateway import scripted_gateway_fixtures
from tests.scripted_openai import Reply
from tests.test_tail_linking import Stored, capture_counts, delta, stored

KEYS = [f"sk-langchain-{i:02d}" for i in range(24)]
OPENING = "Plan a weekend trip for two."
SUMMARIZE = "Create a summary of the conversation above:"


def reply(body: dict[str, Any]) -> Reply:
    """A sampling model that also writes summaries when asked; ``[summary:fixed]``: always the same summary."""
    messages = body["messages"]
    last = str(messages[-1]["content"])
    if last.startswith((SUMMARIZE, "This is the summary")):
        if "[summary:fixed]" in str(messages[0]["content"]):
            return Reply(content="The user is planning a weekend trip for two and is choosing a city.")
        return Reply(content=f"The user plans a trip and has asked {len(messages)} things so far; "
                             f"summary {uuid.uuid4().hex[:12]}.")
    return Reply(content=f"Here is a thought about that, number {uuid.uuid4().hex[:12]}.")


gateway, key = scripted_gateway_fixtures(reply, KEYS, "langchain")


# -- a LangChain agent --------------------------------------------------------------------------------------

Ask = Callable[[list[BaseMessage]], Awaitable[AIMessage]]


@dataclass
class Conversation:
    """One conversation: everything said (the system prompt aside), as LangChain messages, and what its
    memory made of it; ``completion_ids`` holds every request it made, its memory's summaries included."""

    system: str
    questions: list[str]
    memory: Memory
    history: list[BaseMessage] = field(default_factory=list)
    summary: str | None = None
    summarized: int = 0  # how many messages of history the summary stands for
    completion_ids: list[str] = field(default_factory=list)
    trajectory_id: str | None = None  # sent as X-Flywheel-Trajectory-Id when set

    def __post_init__(self) -> None:
        self.history.append(HumanMessage(self.questions.pop(0)))

    async def step(self, client: openai.AsyncOpenAI, *, stream: bool) -> None:
        headers = {"X-Flywheel-Trajectory-Id": self.trajectory_id} if self.trajectory_id else None

        async def ask(messages: list[BaseMessage]) -> AIMessage:
            sent: Any = convert_to_openai_messages(messages)
            if stream:
                chunks = [c async for c in await client.chat.completions.create(
                    model="gpt-4o", messages=sent, stream=True, extra_headers=headers)]
                self.completion_ids.append(chunks[0].id)
                return AIMessage("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
            answer = await client.chat.completions.create(model="gpt-4o", messages=sent, extra_headers=headers)
            self.completion_ids.append(answer.id)
            return AIMessage(answer.choices[0].message.content or "")

        self.history.append(await ask(await self.memory(self, ask)))
        if self.questions:
            self.history.append(HumanMessage(self.questions.pop(0)))


Memory = Callable[[Conversation, Ask], Awaitable[list[BaseMessage]]]


def trimmed(max_tokens: int, token_counter: Callable[[list[BaseMessage]], int]) -> Memory:
    """LangChain's chat-memory recipe: the last messages within a token budget, starting on a human message,
    the system prompt kept."""
    async def messages(conversation: Conversation, ask: Ask) -> list[BaseMessage]:
        return trim_messages([SystemMessage(conversation.system), *conversation.history], strategy="last",
                             token_counter=token_counter, max_tokens=max_tokens, start_on="human",
                             include_system=True)
    return messages


def summarized(keep: int, role: type[SystemMessage] | type[HumanMessage] = SystemMessage) -> Memory:
    """LangGraph's summarizing memory: once four messages are unsummarized, the model summarizes
    them (extending its last summary), and the request sends the summary in their place, then the last
    ``keep`` messages before the new question."""
    async def messages(conversation: Conversation, ask: Ask) -> list[BaseMessage]:
        pending = conversation.history[conversation.summarized:-1]
        if len(pending) >= 4:
            prompt = SUMMARIZE if conversation.summary is None else \
                f"This is the summary of the conversation to date: {conversation.summary}\n\n" \
                "Extend the summary by taking into account the new messages above:"
            conversation.summary = str((await ask([SystemMessage(conversation.system), *pending,
                                                   HumanMessage(prompt)])).content)
            conversation.summarized = len(conversation.history) - 1 - keep
        recent = conversation.history[conversation.summarized:]
        if conversation.summary is None:
            return [SystemMessage(conversation.system), *recent]
        return [SystemMessage(conversation.system), role(f"Summary of the conversation so far: {conversation.summary}"),
                *recent]
    return messages


def conversations(memory: Memory, system: str = "You are a travel agent.", count: int = 3) -> list[Conversation]:
    return [Conversation(system, [OPENING, f"I pick city number {i}.", f"Book a hotel in city number {i}.",
                                  f"And a table for dinner in city number {i}.",
                                  f"Which museum should we see in city number {i}?",
                                  f"And a day trip from city number {i}?"], memory)
            for i in range(count)]


async def converse(gateway: GatewayProcess, key: str, crowd: list[Conversation], *, stream: bool) -> None:
    """Every question of every conversation, all conversations concurrently, turn by turn."""
    client = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0)
    while any(c.questions or c.history[-1].type == "human" for c in crowd):
        await asyncio.gather(*(c.step(client, stream=stream) for c in crowd if c.history[-1].type == "human"))
    await client.close()


# -- reading back -------------------------------------------------------------------------------------------

def owners(result: Stored, crowd: list[Conversation]) -> list[set[int]]:
    """For each stored trajectory, the conversations whose turns it holds (-1: a request of none of them)."""
    owner = {cid: i for i, c in enumerate(crowd) for cid in c.completion_ids}
    return [{owner.get(turn["completion_id"], -1) for turn in t["turns"]} for t in result.trajectories]


def of(result: Stored, conversation: Conversation) -> list[dict[str, Any]]:
    """The trajectories holding this conversation's turns."""
    ids = set(conversation.completion_ids)
    return [t for t in result.trajectories if ids & {turn["completion_id"] for turn in t["turns"]}]


def assert_never_merged(result: Stored, crowd: list[Conversation]) -> None:
    assert all(len(held - {-1}) == 1 for held in owners(result, crowd)), owners(result, crowd)


def chain(result: Stored, conversation: Conversation) -> list[dict[str, Any]]:
    """The conversation's one trajectory: one chain of turns, every request it made in the order it made them."""
    (trajectory,) = of(result, conversation)
    turns = sorted(trajectory["turns"], key=lambda t: t["depth"])
    assert [t["completion_id"] for t in turns] == conversation.completion_ids
    assert [t["depth"] for t in turns] == list(range(len(turns)))
    assert trajectory["branch_count"] == 1
    return turns


def rules(turns: list[dict[str, Any]]) -> list[str]:
    return [t["link_rule"] for t in turns]


def read_back(turns: list[dict[str, Any]]) -> list[tuple[str, str]]:
    conversation, _ = branch_conversation([Turn.model_validate(t) for t in turns])
    return [(m["role"], str(m["content"])) for m in conversation]


def said(conversation: Conversation) -> list[tuple[str, str]]:
    roles = {"human": "user", "ai": "assistant"}
    return [(roles[m.type], str(m.content)) for m in conversation.history]


def is_in_order(part: list[Any], whole: list[Any]) -> bool:
    rest = iter(whole)
    return all(item in rest for item in part)


STREAMS = pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])


# -- trim_messages ----------------------------------------------------------------------------------------

@pytest.mark.parametrize(("memory", "linked"), [
    (trimmed(4, len), ["new", "prefix", "tail", "tail", "tail", "tail"]),  # [system, h, a, h]
    (trimmed(6, len), ["new", "prefix", "prefix", "tail", "tail", "tail"]),  # [system, h, a, h, a, h]
    (trimmed(60, count_tokens_approximately), ["new", "prefix", "tail", "tail", "tail", "tail"]),
], ids=["4-messages", "6-messages", "60-tokens"])
@STREAMS
def test_a_trimmed_window_that_keeps_an_answer_links_by_tail(gateway: GatewayProcess, key: str, stream: bool,
                                                             memory: Memory, linked: list[str]) -> None:
    crowd = conversations(memory)
    asyncio.run(converse(gateway, key, crowd, stream=stream))
    result = stored(gateway, key)
    assert_never_merged(result, crowd)
    for conversation in crowd:
        turns = chain(result, conversation)
        assert rules(turns) == linked
        assert read_back(turns)[1:] == said(conversation)  # nothing the window dropped is lost


@STREAMS
def test_a_window_that_keeps_no_answer_starts_over_unless_the_client_names_the_trajectory(
        gateway: GatewayProcess, key: str, stream: bool) -> None:
    crowd = conversations(trimmed(3, len))  # [system, the new question]: nothing of the conversation before
    asyncio.run(converse(gateway, key, crowd, stream=stream))
    result = stored(gateway, key)
    assert_never_merged(result, crowd)
    assert len(result.trajectories) == sum(len(c.completion_ids) for c in crowd)  # every request on its own

    tagged = conversations(trimmed(3, len))
    for i, conversation in enumerate(tagged):
        conversation.trajectory_id = f"trip-{uuid.uuid4().hex[:8]}-{i}"
    asyncio.run(converse(gateway, key, tagged, stream=stream))
    result = stored(gateway, key)
    for conversation in tagged:
        turns = chain(result, conversation)
        assert rules(turns) == ["explicit"] * 6


# -- a summary the model wrote ----------------------------------------------------------------------------

@pytest.mark.parametrize("role", [SystemMessage, HumanMessage], ids=["system", "user"])
@STREAMS
def test_a_summary_in_place_of_the_history_links_by_summary(gateway: GatewayProcess, key: str, stream: bool,
                                                             role: type[SystemMessage] | type[HumanMessage]) -> None:
    crowd = conversations(summarized(0, role))  # [system, "Summary of the conversation so far: ...", question]
    before = capture_counts(gateway)
    asyncio.run(converse(gateway, key, crowd, stream=stream))
    result = stored(gateway, key)
    assert_never_merged(result, crowd)
    for conversation in crowd:
        turns = chain(result, conversation)
        # h1; h2; the summary of h1..a2 (verbatim); [summary, h3]; [summary, h3, a3, h4]; the summary extended by
        # h3..a4 (its last answer); [summary, h5]; [summary, h5, a5, h6]
        assert rules(turns) == ["new", "prefix", "prefix", "summary", "prefix", "tail", "summary", "prefix"]
        quoting = turns[3]
        assert quoting["parent_turn_id"] == turns[2]["id"]
        assert turns[2]["response_message"]["content"] in \
            quoting["request_messages"][quoting["parent_message_index"]]["content"]
        assert is_in_order(said(conversation), read_back(turns))  # the whole conversation, summaries between
    assert delta(before, result.counts, "flywheel_capture_links:summary") == 6
    assert delta(before, result.counts, "flywheel_capture_tail_ambiguous") == 0


@STREAMS
def test_a_summary_that_keeps_the_last_exchange_links_by_tail(gateway: GatewayProcess, key: str,
                                                              stream: bool) -> None:
    crowd = conversations(summarized(2))  # [system, summary, h, a, question]
    asyncio.run(converse(gateway, key, crowd, stream=stream))
    result = stored(gateway, key)
    assert_never_merged(result, crowd)
    for conversation in crowd:
        (trajectory,) = of(result, conversation)
        turns = sorted(trajectory["turns"], key=lambda t: t["depth"])
        assert len(turns) == len(conversation.completion_ids)
        assert rules(turns)[1:] == ["prefix", "prefix"] + ["tail"] * (len(turns) - 3)
        # each summary request continues the conversation, and the request after it continues the answer it
        # kept, beside the summary: a branch per summary
        summaries = [t for t in turns if t["request_messages"][-1]["content"].startswith((SUMMARIZE, "This is"))]
        assert len(summaries) == 4 and trajectory["branch_count"] == 1 + len(summaries)


@STREAMS
def test_a_summary_two_conversations_share_links_neither(gateway: GatewayProcess, key: str, stream: bool) -> None:
    crowd = conversations(summarized(0), "You are a travel agent. [summary:fixed]")
    before = capture_counts(gateway)
    for conversation in crowd:  # one after the other: the first one's summaries are the only ones yet
        asyncio.run(converse(gateway, key, [conversation], stream=stream))
    result = stored(gateway, key)
    assert_never_merged(result, crowd)
    chain(result, crowd[0])
    for conversation in crowd[1:]:  # split where only the summary, said in another conversation too, could tell
        assert len(of(result, conversation)) == 3
    assert delta(before, result.counts, "flywheel_capture_links:summary") == 2
    assert delta(before, result.counts, "flywheel_capture_tail_ambiguous") == 4


@STREAMS
def test_a_summary_pasted_into_several_new_conversations_links_at_most_one(gateway: GatewayProcess, key: str,
                                                                            stream: bool) -> None:
    """A document summarized once, then given to every new conversation: never the link between them."""
    document = Conversation("You summarize documents.", [f"{SUMMARIZE} (the hotel's brochure)"],
                            trimmed(100, len))

    async def summarize() -> None:
        async with openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0) as client:
            await document.step(client, stream=stream)

    asyncio.run(summarize())
    summary = str(document.history[-1].content)
    crowd = conversations(trimmed(100, len), f"You are a travel agent. The brochure:\n{summary}")
    for conversation in crowd:  # the summary before the question, in a message of its own
        conversation.history.insert(0, HumanMessage(f"Brochure summary: {summary}"))
    before = capture_counts(gateway)
    asyncio.run(converse(gateway, key, crowd, stream=stream))
    result = stored(gateway, key)
    assert_never_merged(result, crowd)
    assert [len(of(result, c)) for c in crowd] == [1, 1, 1]
    # the first to arrive continues the summary's turn; the others find it continued, and start their own
    (held,) = [held_by for held_by in owners(result, crowd) if -1 in held_by]
    assert len(held) == 2  # the summary's turn and one conversation
    assert delta(before, result.counts, "flywheel_capture_links:summary") == 1
    assert delta(before, result.counts, "flywheel_capture_tail_ambiguous") == 2


@STREAMS
def test_an_answer_handed_on_whole_as_a_prompt_is_not_a_summary(gateway: GatewayProcess, key: str,
                                                                 stream: bool) -> None:
    """An orchestrator's answer given verbatim as a worker's task (a sub-agent without tags): two conversations."""
    planner = Conversation("You plan trips.", ["Write the task for the booking agent."], trimmed(100, len))

    async def plan() -> None:
        async with openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0) as client:
            await planner.step(client, stream=stream)

    asyncio.run(plan())
    task = str(planner.history[-1].content)
    (worker,) = conversations(trimmed(100, len), "You book trips.", count=1)
    worker.history.insert(0, HumanMessage(task))  # the planner's answer, whole, as the worker's first message
    before = capture_counts(gateway)
    asyncio.run(converse(gateway, key, [worker], stream=stream))
    result = stored(gateway, key)
    (mine,) = of(result, worker)
    assert {turn["completion_id"] for turn in mine["turns"]} == set(worker.completion_ids)  # none of the planner's
    assert delta(before, result.counts, "flywheel_capture_links:summary") == 0
