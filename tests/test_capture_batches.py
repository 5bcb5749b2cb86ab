"""What a write transaction of the store process carries: a batch of turns, and the feedback that rides it.

A real gateway on loopback in front of a scripted upstream, the plain ``openai`` client and ``httpx`` for
feedback; the store's write transactions are read from ``/metrics`` (``flywheel_capture_batches_total``) and
the rows from the DuckDB file once the gateway stopped.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
from sqlalchemy import event
from sqlmodel import col, select

from flywheel.capture.feedback import FeedbackBatch, FeedbackItem
from flywheel.capture.models import Feedback, Trajectory, Turn, utcnow
from flywheel.capture.recorder import Recorder, Spool
from flywheel.capture.store import Store
from flywheel.capture.turns import CapturedExchange, prepare_lines
from flywheel.capture.write_stamps import CLOSED
from tests.gateway_process import GatewayProcess
from tests.scripted_openai import ScriptedOpenAI
from tests.test_capture import start_gateway
from tests.test_kept_reads import exchange


def metric(gateway: GatewayProcess, name: str) -> float:
    for line in httpx.get(f"{gateway.url}/metrics", timeout=10).text.splitlines():
        if line.startswith(f"{name} "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_feedback_rides_the_batch_that_writes_its_turn(tmp_path: Path) -> None:
    with ScriptedOpenAI() as upstream:
        gateway = start_gateway(tmp_path, upstream, "[capture]\nbatch_wait_s = 3.0\n")
        client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
        batches = metric(gateway, "flywheel_capture_batches_total")

        def episode(i: int) -> httpx.Response:
            reply = client.chat.completions.create(model="agent", messages=[{"role": "user", "content": f"q{i}"}])
            return httpx.post(f"{gateway.url}/flywheel/v1/feedback", json={"completion_id": reply.id, "reward": i / 4},
                              timeout=30)

        def unknown() -> httpx.Response:
            return httpx.post(f"{gateway.url}/flywheel/v1/feedback", json={"completion_id": "chatcmpl-nope",
                                                                           "reward": 1.0}, timeout=30)

        with ThreadPoolExecutor(5) as pool:
            episodes, unknown_one = [pool.submit(episode, i) for i in range(4)], pool.submit(unknown)
            answered, missing = [e.result() for e in episodes], unknown_one.result()

        assert [r.status_code for r in answered] == [200] * 4
        assert [r.json()["reward"] for r in answered] == [0.0, 0.25, 0.5, 0.75]
        assert missing.status_code == 404 and missing.json()["error"]["param"] == "completion_id"
        # Four turns and four feedbacks inside one batch window: one write transaction for all of them.
        assert metric(gateway, "flywheel_capture_batches_total") - batches == 1
        assert metric(gateway, "flywheel_capture_feedback_total") == 4
        trajectory_ids = {r.json()["trajectory_id"] for r in answered}
        gateway.stop()

    store = Store(gateway.dir / "data" / "flywheel.duckdb")
    try:
        with store.session() as session:
            closed = {t.id: t.close_reason for t in session.exec(select(Trajectory))}
            rewards = sorted(f.reward for f in session.exec(select(Feedback)) if f.reward is not None)
    finally:
        store.close()
    assert closed == dict.fromkeys(trajectory_ids, "feedback")
    assert rewards == [0.0, 0.25, 0.5, 0.75]


def test_feedback_finds_its_completion_in_its_own_batch_or_in_the_store(store: Store) -> None:
    """A completion named by feedback is its first choice's trajectory, for the client key that asked, whether the
    batch carrying the feedback wrote its turns (matched from the batch's rows) or an earlier batch did (read)."""
    two = CapturedExchange(
        completion_id="chatcmpl-two", endpoint="chat.completions", requested_model="agent", alias="agent",
        engine_model="agent", adapter_version=0, client_key_id="key_a",
        request={"model": "agent", "messages": [{"role": "user", "content": "pick one"}], "n": 2},
        response={"id": "chatcmpl-two", "object": "chat.completion", "created": 0, "model": "agent",
                  "choices": [{"index": i, "message": {"role": "assistant", "content": f"choice {i}"},
                               "finish_reason": "stop"} for i in (1, 0)]},  # the store orders them, not the list
        created_at=utcnow(), latency_ms=1.0).to_line()
    store.write_turns(prepare_lines([exchange(7)], None, None))
    carried = FeedbackBatch([FeedbackItem(trajectory_id=None, completion_id="chatcmpl-two", reward=1.0,
                                          client_key_id="key_a"),
                             FeedbackItem(trajectory_id=None, completion_id="chatcmpl-two", reward=0.5,
                                          client_key_id="key_b"),  # another client's completion: not found
                             FeedbackItem(trajectory_id=None, completion_id="chatcmpl-7", reward=0.25)])
    store.write_turns(prepare_lines([two], None, None), feedback=carried)
    with store.session() as session:
        owner = {(t.completion_id, t.choice_index): t.trajectory_id for t in session.exec(select(Turn))}
        closed = {t.id for t in session.exec(select(Trajectory).where(col(Trajectory.status) == "closed"))}
    assert [r.trajectory_id if r else None for r in carried.recorded] == \
        [owner["chatcmpl-two", 0], None, owner["chatcmpl-7", 0]]
    assert closed == {owner["chatcmpl-two", 0], owner["chatcmpl-7", 0]}


def test_feedback_on_a_trajectory_its_batch_writes_closes_it_in_the_rows_written(store: Store) -> None:
    """Feedback closes the trajectory a batch starts or continues in the row the batch writes (no ``UPDATE`` after
    it), one the batch did not touch by an ``UPDATE``; each is followed as closed (what group formation reads)."""
    closes: list[str] = []

    def count(conn: Any, cursor: Any, statement: str, parameters: Any, *args: Any) -> None:
        if statement.startswith("UPDATE trajectories") and "trajectories.id IN" in statement:
            closes.append(str(parameters))

    followed = store.stamps.follow(CLOSED)
    store.write_turns(prepare_lines([exchange(1), exchange(3), exchange(4)], None, None))
    continued = CapturedExchange.from_line(exchange(11))
    continued.request["messages"] = [{"role": "user", "content": "question 1"},
                                     {"role": "assistant", "content": "answer 1"},
                                     {"role": "user", "content": "and then?"}]
    event.listen(store.engine, "before_cursor_execute", count)
    carried = FeedbackBatch([FeedbackItem(trajectory_id=None, completion_id=f"chatcmpl-{i}", reward=1.0)
                             for i in (11, 2, 3)])
    store.write_turns(prepare_lines([continued.to_line(), exchange(2)], None, None), feedback=carried)
    event.remove(store.engine, "before_cursor_execute", count)
    with store.session() as session:
        by_completion = {t.completion_id: t.trajectory_id for t in session.exec(select(Turn))}
        trajectories = {t.id: t for t in session.exec(select(Trajectory))}
    continued_id, new_id, untouched_id = (by_completion[f"chatcmpl-{i}"] for i in (11, 2, 3))
    assert continued_id == by_completion["chatcmpl-1"] and trajectories[continued_id].turn_count == 2
    assert [r.trajectory_id if r else None for r in carried.recorded] == [continued_id, new_id, untouched_id]
    closed = {t.id: t.close_reason for t in trajectories.values() if t.status == "closed"}
    assert closed == dict.fromkeys((continued_id, new_id, untouched_id), "feedback")
    assert all(trajectories[i].closed_at is not None for i in closed)
    assert len(closes) == 1 and untouched_id in closes[0]  # the untouched one's, naming none of the others
    assert continued_id not in closes[0] and new_id not in closes[0]
    assert followed.take() == set(closed)


def test_closing_looks_for_sub_agents_once_a_store_holds_one_and_after_it_is_opened_again(store: Store) -> None:
    """Feedback closes a trajectory and its open sub-agents. A DuckDB store that never held a sub-agent skips
    their UPDATE; one that holds one, written by this store or found when it is opened, closes them."""
    updates: list[str] = []

    def count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if statement.startswith("UPDATE trajectories SET status"):
            updates.append(statement)

    def close(target: Store, completion_id: str) -> None:
        carried = FeedbackBatch([FeedbackItem(trajectory_id=None, completion_id=completion_id, reward=1.0)])
        target.write_turns([], feedback=carried)
        assert carried.recorded[0] is not None

    def trajectory_of(target: Store, completion_id: str) -> Trajectory:
        with target.session() as session:
            turn = session.exec(select(Turn).where(col(Turn.completion_id) == completion_id)).one()
            return session.exec(select(Trajectory).where(col(Trajectory.id) == turn.trajectory_id)).one()

    event.listen(store.engine, "before_cursor_execute", count)
    store.write_turns(prepare_lines([exchange(1), exchange(2)], None, None))
    close(store, "chatcmpl-1")
    assert len(updates) == (2 if store.shared else 1)  # no sub-agent anywhere: no search for one
    parent = trajectory_of(store, "chatcmpl-2")
    sub_agent = CapturedExchange.from_line(exchange(3))
    sub_agent.parent_trajectory_id = parent.id
    store.write_turns(prepare_lines([sub_agent.to_line()], None, None))
    assert store.sub_agents and trajectory_of(store, "chatcmpl-3").parent_trajectory_id == parent.id
    store.close()
    again = Store(store.url)  # what the file holds decides, not what the last process saw
    try:
        assert again.sub_agents
        close(again, "chatcmpl-2")
        child = trajectory_of(again, "chatcmpl-3")
        assert (child.status, child.close_reason) == ("closed", "parent")
    finally:
        again.close()


def test_the_loop_jobs_and_a_polled_status_do_not_cut_batches_short(tmp_path: Path) -> None:
    """Group formation and the idle close run every 0.2 s, the status is polled as often and a trainer asks for its
    batch: none of them makes the store process write the turns of the moment early (each did, one transaction
    per look)."""
    (tmp_path / "config.json").write_text("{}")  # the base weights a round would train: never read here
    with ScriptedOpenAI() as upstream:
        gateway = start_gateway(tmp_path, upstream, f'train_model = "{tmp_path}"\n'  # aliases.agent's
                                                    "[capture]\nbatch_wait_s = 1.0\nidle_close_s = 0.8\n"
                                                    "[groups]\nform_every_s = 0.2\n")
        client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
        batches = metric(gateway, "flywheel_capture_batches_total")
        started = time.monotonic()
        for i in range(30):  # a request every 0.1 s for 3 s, the status read after each
            client.chat.completions.create(model="agent", messages=[{"role": "user", "content": f"t{i}"}])
            assert httpx.get(f"{gateway.url}/flywheel/v1/status", timeout=10).status_code == 200
            batch = httpx.get(f"{gateway.url}/flywheel/v1/training/batch", params={"alias": "agent"}, timeout=10)
            assert batch.status_code == 200 and batch.json()["groups"] == [], batch.text
            time.sleep(max(0.0, started + (i + 1) * 0.1 - time.monotonic()))
        written = metric(gateway, "flywheel_capture_batches_total") - batches
        elapsed = time.monotonic() - started
        gateway.stop()
    assert written <= elapsed / 1.0 + 2, f"{written} write transactions in {elapsed:.1f} s of 1 s batches"


async def test_feedback_that_wakes_an_idle_recorder_waits_for_the_lines_that_follow(tmp_path: Path) -> None:
    """A feedback on an idle recorder opens a batch window; the lines that arrive in it (the first one taken by the
    read the feedback woke) and the feedback on them are written together, each feedback finding its turn."""
    store = Store(tmp_path / "s.duckdb")
    recorder = Recorder(store, Spool(tmp_path / "spool.jsonl"), redactor=None, queue_size=100, batch_size=100,
                        batch_wait_s=0.3, retry_s=60.0)
    recorder.start()
    try:
        unknown = recorder.record_feedback(FeedbackItem(trajectory_id=None, completion_id="chatcmpl-none"))
        await asyncio.sleep(0.05)  # the writer is woken, its window open, a read pending on the empty queue
        answered = []
        for i in range(2):
            recorder.submit(exchange(i))
            answered.append(recorder.record_feedback(FeedbackItem(trajectory_id=None, completion_id=f"chatcmpl-{i}",
                                                                  reward=1.0)))
        found = await asyncio.wait_for(asyncio.gather(unknown, *answered), timeout=10)
        assert found[0] is None and all(recorded is not None for recorded in found[1:])
        assert recorder.stats["batches"] == 1 and recorder.stats["feedback"] == 2
    finally:
        await recorder.drain()
        store.close()
