"""Two gateway replicas on one PostgreSQL store: conversations whose turns alternate between them are rebuilt
whole, never split, never cross-linked, and every turn sent is stored (docs/storage.md, "Several writers (PostgreSQL)").

The engine is a scripted OpenAI-compatible server; the store is a database on the session's real
PostgreSQL server (tests/postgres.py). Two writers on the store level race for the same stored turns.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import openai
import orjson
import pytest
from sqlmodel import col, select

from flywheel.capture.models import Trajectory, Turn
from flywheel.capture.store import Store
from flywheel.capture.turns import CapturedExchange, prepare_turns
from tests.gateway_process import GatewayProcess
from tests.scripted_openai import Reply, ScriptedOpenAI

SYSTEM = {"role": "system", "content": "You are a helpful travel agent."}


def echo(body: dict[str, Any]) -> Reply:
    return Reply(content=f"echo {body['messages'][-1]['content']}")


@pytest.fixture
def upstream() -> Iterator[ScriptedOpenAI]:
    with ScriptedOpenAI(reply=echo) as server:
        yield server


def replica_config(upstream: ScriptedOpenAI, database: str, capture: str = "") -> str:
    return f"""
[engines.up]
base_url = "{upstream.base_url}"
[aliases.agent]
engine = "up"
base_model = "scripted"
[capture]
database = "{database}"
{capture}"""


def start_replicas(tmp: Path, upstream: ScriptedOpenAI, database: str, capture: str = "") -> list[GatewayProcess]:
    """Two replicas started together: the schema is created once, under the migration lock."""
    replicas = [GatewayProcess(tmp, replica_config(upstream, database, capture), name=f"replica-{i}")
                for i in range(2)]
    threads = [threading.Thread(target=replica.start) for replica in replicas]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for replica in replicas:
        assert replica.proc is not None and replica.proc.poll() is None, replica.log_file.read_text()
    return replicas


def stored(database: str) -> tuple[list[Trajectory], list[Turn]]:
    store = Store(database)
    try:
        with store.session() as session:
            trajectories = list(session.exec(select(Trajectory).order_by(col(Trajectory.created_at))))
            turns = list(session.exec(select(Turn).order_by(col(Turn.created_at), col(Turn.depth))))
        return trajectories, turns
    finally:
        store.close()


async def test_conversations_alternating_between_replicas_are_rebuilt_whole(tmp_path: Path, upstream: ScriptedOpenAI,
                                                                          postgres_url: str) -> None:
    replicas = await asyncio.to_thread(start_replicas, tmp_path, upstream, postgres_url)
    # A request unanswered for a minute fails the test with the replicas' logs (a CI run once hung here).
    clients = [openai.AsyncOpenAI(base_url=f"{r.url}/v1", api_key="x", max_retries=0, timeout=60.0) for r in replicas]
    conversations, turns_each = 40, 4

    async def conversation(index: int) -> list[str]:
        # Half the conversations open with word-for-word the same question (and get the same reply): their first
        # turns are claimed one each. Every turn goes to the other replica than the turn before it.
        opening = "Hello there" if index % 2 else f"Hello from traveller {index}"
        messages: list[Any] = [SYSTEM, {"role": "user", "content": opening}]
        ids = []
        for turn in range(turns_each):
            reply = await clients[(index + turn) % 2].chat.completions.create(model="gpt-4o", messages=messages)
            ids.append(reply.id)
            messages += [reply.choices[0].message.model_dump(exclude_none=True),
                         {"role": "user", "content": f"traveller {index} turn {turn}"}]
        return ids

    try:
        seen = await asyncio.gather(*(conversation(i) for i in range(conversations)))
    except openai.APITimeoutError:
        for replica in replicas:
            await asyncio.to_thread(replica.stop)
        logs = "\n".join(f"--- {r.log_file}:\n{r.log_file.read_text()[-6000:]}" for r in replicas)
        raise AssertionError(f"a request went unanswered for 60 s; the replicas' logs:\n{logs}") from None
    for replica in replicas:
        await asyncio.to_thread(replica.stop)  # SIGTERM: each store process writes what it holds
    trajectories, turns = await asyncio.to_thread(stored, postgres_url)

    assert len(turns) == conversations * turns_each  # count in = count stored
    assert sorted(t.completion_id for t in turns) == sorted(i for ids in seen for i in ids)
    assert len(trajectories) == conversations  # none split
    assert [(t.turn_count, t.branch_count) for t in trajectories] == [(turns_each, 1)] * conversations
    for trajectory in trajectories:
        mine = sorted((t for t in turns if t.trajectory_id == trajectory.id), key=lambda t: t.depth)
        assert [t.depth for t in mine] == list(range(turns_each))
        assert all(child.parent_turn_id == parent.id for parent, child in itertools.pairwise(mine))
        owners = {m["content"].split(" turn ")[0] for t in mine[1:]  # type: ignore[union-attr]
                  for m in t.request_messages[2:] if m["role"] == "user"}  # type: ignore[index]
        assert len(owners) == 1  # none cross-linked: every later turn comes from the same traveller
        if mine[0].request_messages[-1]["content"] != "Hello there":  # type: ignore[index]  (one of a kind)
            assert {t.completion_id for t in mine} <= next(set(ids) for ids in seen if mine[0].completion_id in ids)


def agent(body: dict[str, Any]) -> Reply:
    """A tool-using agent's model: a question gets a ``search`` call (a fresh call id), a tool result an answer."""
    last = body["messages"][-1]
    if last["role"] == "user":
        call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": "search", "arguments": orjson.dumps({"q": last["content"]}).decode()}}
        return Reply(content=None, tool_calls=[call], finish_reason="tool_calls")
    return Reply(content=f"found {last['content']}")


async def test_fast_tool_using_conversations_alternating_between_replicas_are_chains(tmp_path: Path,
                                                                                   postgres_url: str) -> None:
    """Agents that send their next request as soon as the answer comes, 16 at a time, each request to the other
    replica: turn k waits on one replica for turn k-1 on the other, itself held there for turn k-2, one batch per
    link, longer than ``link_wait_s`` from the first request. Each conversation must still be one trajectory
    whose every turn continues the one before it (no split, no branch). Batches of 3 s make each link slower
    than a request, on a busy machine too, so the chain outgrows the 8-s wait before its sixteenth turn."""
    with ScriptedOpenAI(reply=agent) as upstream:
        replicas = await asyncio.to_thread(start_replicas, tmp_path, upstream, postgres_url,
                                           "batch_wait_s = 3.0\nlink_wait_s = 8.0\n")
        clients = [openai.AsyncOpenAI(base_url=f"{r.url}/v1", api_key="x", max_retries=0) for r in replicas]
        conversations, questions, slots = 32, 8, asyncio.Semaphore(16)
        tools: list[Any] = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]

        async def conversation(index: int) -> list[str]:
            messages: list[Any] = [SYSTEM]
            ids = []
            async with slots:
                for request in range(2 * questions):
                    if request % 2 == 0:
                        messages.append({"role": "user", "content": f"traveller {index} question {request}"})
                    reply = await clients[(index + request) % 2].chat.completions.create(
                        model="agent", messages=messages, tools=tools)
                    ids.append(reply.id)
                    answer = reply.choices[0].message.model_dump(exclude_none=True)
                    messages.append(answer)
                    messages += [{"role": "tool", "tool_call_id": call["id"], "content": f"guide {index}"}
                                 for call in answer.get("tool_calls", ())]
            return ids

        seen = await asyncio.gather(*(conversation(i) for i in range(conversations)))
        for replica in replicas:
            await asyncio.to_thread(replica.stop)  # SIGTERM: each store process writes what it holds
    trajectories, turns = await asyncio.to_thread(stored, postgres_url)

    assert len(turns) == conversations * 2 * questions
    by_completion = {t.completion_id: t for t in turns}
    for ids in seen:
        mine = [by_completion[i] for i in ids]
        assert len({t.trajectory_id for t in mine}) == 1, [(t.depth, t.link_rule) for t in mine]  # not split
        assert [t.depth for t in mine] == list(range(2 * questions)), [(t.depth, t.link_rule) for t in mine]
        assert all(child.parent_turn_id == parent.id for parent, child in itertools.pairwise(mine))
    assert len(trajectories) == conversations
    assert {(t.turn_count, t.branch_count) for t in trajectories} == {(2 * questions, 1)}


T0 = datetime(2026, 11, 1, tzinfo=UTC)


def _exchange(name: str, messages: list[dict[str, Any]], answer: str, at: int) -> CapturedExchange:
    response = {"id": name, "choices": [{"index": 0, "finish_reason": "stop",
                                         "message": {"role": "assistant", "content": answer}}]}
    return CapturedExchange(completion_id=name, endpoint="chat.completions", requested_model="m", alias="a",
                            engine_model="m", adapter_version=0, client_key_id=None,
                            request={"model": "m", "messages": messages}, response=response,
                            created_at=T0 + timedelta(seconds=at), latency_ms=1.0)


def test_two_writers_claim_identical_conversations_one_each(postgres_url: str) -> None:
    """Ten identical first turns; two store processes (two engines) each write the second turns of five of the
    conversations at the same time. Each first turn is continued exactly once: no branch, no trajectory left."""
    stores = [Store(postgres_url), Store(postgres_url)]
    try:
        question = [{"role": "user", "content": "plan a trip"}]
        stores[0].write_turns([t for i in range(10) for t in prepare_turns(
            _exchange(f"first-{i}", question, "where to?", i), None)])
        follow_up = [*question, {"role": "assistant", "content": "where to?"}]
        batches = [[t for i in range(w, 10, 2) for t in prepare_turns(
            _exchange(f"second-{i}", [*follow_up, {"role": "user", "content": f"city {i}"}], "booked", 20 + i),
            None)] for w in range(2)]
        barrier = threading.Barrier(2)

        def write(index: int) -> None:
            barrier.wait()
            stores[index].write_turns(batches[index])

        threads = [threading.Thread(target=write, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        with stores[0].session() as session:
            trajectories = session.exec(select(Trajectory)).all()
            seconds = session.exec(select(Turn).where(col(Turn.completion_id).startswith("second-"))).all()
        assert len(seconds) == 10
        assert len({t.parent_turn_id for t in seconds}) == 10  # each first turn claimed once
        assert sorted((t.turn_count, t.branch_count) for t in trajectories) == [(2, 1)] * 10
    finally:
        for store in stores:
            store.close()
