"""The linker across batches, on a real file: stored trajectories are continued, counted and branched.

Each test runs on DuckDB (the default store) and on SQLite, which takes the same generic
write path as PostgreSQL (executemany instead of DuckDB's Arrow inserts and updates).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import duckdb
import pytest
from sqlalchemy import text
from sqlmodel import col, select

from flywheel.capture.models import Trajectory, Turn
from flywheel.capture.store import Store
from flywheel.capture.turns import CapturedExchange, prepare_turns

T0 = datetime(2026, 11, 1, tzinfo=UTC)


def exchange(i: int, messages: list[dict[str, Any]], answer: str) -> CapturedExchange:
    response = {"id": f"chatcmpl-{i}", "choices": [{"index": 0, "finish_reason": "stop",
                                                    "message": {"role": "assistant", "content": answer}}]}
    return CapturedExchange(completion_id=f"chatcmpl-{i}", endpoint="chat.completions", requested_model="m",
                            alias="a", engine_model="m", adapter_version=0, client_key_id=None,
                            request={"model": "m", "messages": messages}, response=response,
                            created_at=T0 + timedelta(seconds=i), latency_ms=1.0)


def write(store: Store, *exchanges: CapturedExchange) -> None:
    store.write_turns([turn for e in exchanges for turn in prepare_turns(e, None)])


def test_a_conversation_over_three_batches_is_one_trajectory_with_a_rewind_as_a_branch(store: Store) -> None:
    q1 = [{"role": "user", "content": "plan a trip"}]
    write(store, exchange(1, q1, "where to?"), exchange(2, [{"role": "user", "content": "other"}], "hi"))
    q2 = [*q1, {"role": "assistant", "content": "where to?"}, {"role": "user", "content": "Lisbon"}]
    write(store, exchange(3, q2, "booked"))
    q3 = [*q2, {"role": "assistant", "content": "booked"}, {"role": "user", "content": "thanks"}]
    rewound = [*q1, {"role": "assistant", "content": "where to?"}, {"role": "user", "content": "Porto"}]
    write(store, exchange(4, q3, "bye"), exchange(5, rewound, "booked Porto"))
    with store.session() as session:
        trajectories = session.exec(select(Trajectory).order_by(col(Trajectory.created_at))).all()
        turns = session.exec(select(Turn).order_by(col(Turn.created_at))).all()
    trip, other = trajectories
    assert (other.turn_count, other.branch_count) == (1, 1)
    assert (trip.turn_count, trip.branch_count, trip.status) == (4, 2, "open")
    assert trip.latest_turn_id == turns[-1].id
    assert trip.updated_at.replace(tzinfo=None) == datetime(2026, 11, 1, 0, 0, 5)  # SQLite drops the zone
    by_answer = {t.response_message["content"]: t for t in turns}
    assert by_answer["bye"].parent_turn_id == by_answer["booked"].id
    assert by_answer["booked Porto"].parent_turn_id == by_answer["where to?"].id  # the branch point
    assert {t.trajectory_id for t in turns if t.id != by_answer["hi"].id} == {trip.id}


def test_a_closed_trajectory_is_not_continued(store: Store) -> None:
    q1 = [{"role": "user", "content": "hello"}]
    write(store, exchange(1, q1, "hi"))
    with store.session() as session:
        first = session.exec(select(Trajectory)).one()
    store.close_trajectory(first.id)
    write(store, exchange(2, [*q1, {"role": "assistant", "content": "hi"}, {"role": "user", "content": "again"}],
                          "hi again"))
    with store.session() as session:
        trajectories = {t.id: t for t in session.exec(select(Trajectory)).all()}
        latest = session.exec(select(Turn).where(Turn.completion_id == "chatcmpl-2")).one()
    assert len(trajectories) == 2 and trajectories[first.id].status == "closed"
    assert trajectories[first.id].turn_count == 1
    assert latest.trajectory_id != first.id and latest.parent_turn_id is not None  # history kept by parent


def test_turns_land_in_their_columns_when_the_file_orders_columns_differently(tmp_path: Path) -> None:
    """DuckDB inserts by position (``insert_into``): a file whose ``turns`` table has its columns in
    another order than the model (as after a migration that appended one) still gets every value in
    its own column."""
    path = tmp_path / "s.duckdb"
    Store(path).close()
    with duckdb.connect(str(path)) as connection:
        names = [row[0] for row in connection.execute("SELECT name FROM pragma_table_info('turns')").fetchall()]
        reversed_columns = ", ".join(f'"{name}"' for name in reversed(names))
        connection.execute(f"CREATE TABLE turns_reordered AS SELECT {reversed_columns} FROM turns")
        connection.execute("DROP TABLE turns")
        connection.execute("ALTER TABLE turns_reordered RENAME TO turns")
    store = Store(path)
    try:
        question = [{"role": "user", "content": "plan a trip"}]
        write(store, exchange(1, question, "where to?"))
        with store.session() as session:
            turn = session.exec(select(Turn)).one()
        assert (turn.completion_id, turn.endpoint, turn.alias, turn.choice_index) == ("chatcmpl-1", "chat.completions",
                                                                                     "a", 0)
        assert turn.request_messages == question
        assert turn.response_message == {"role": "assistant", "content": "where to?"}
        assert turn.created_at.replace(tzinfo=None) == T0.replace(tzinfo=None) + timedelta(seconds=1)
        assert turn.trajectory_id.startswith("traj_") and turn.depth == 0 and turn.parent_turn_id is None
    finally:
        store.close()


def test_a_popular_answer_links_by_what_it_replied_to_and_is_refused_alone_without_reading_its_turns(
        store: Store) -> None:
    """"OK" given by more stored turns than TAIL_CANDIDATES: a conversation whose system prompt changed still
    continues the one turn that said "OK" to the same message; "OK" after a message no such turn replied to is
    ambiguous, refused, and the lookup reads none of the turns that said it."""
    from flywheel.capture.linker import TAIL_CANDIDATES, TrajectoryLinker

    many = TAIL_CANDIDATES + 8
    write(store, *(exchange(i, [{"role": "system", "content": "at 10:00"}, {"role": "user", "content": f"task {i}"}],
                            "OK") for i in range(many)))
    later = [{"role": "system", "content": "at 10:05"}, {"role": "user", "content": "task 7"},
             {"role": "assistant", "content": "OK"}, {"role": "user", "content": "go on"}]
    elsewhere = [{"role": "system", "content": "at 10:05"}, {"role": "user", "content": "a task nobody gave"},
                 {"role": "assistant", "content": "OK"}, {"role": "user", "content": "go on"}]
    with store.session() as session:
        linker = TrajectoryLinker(session)
        linker.prefetch(prepare_turns(exchange(many + 1, elsewhere, "done"), None))
        assert len(linker._candidates) == 0  # refused from a bounded read: no turn that said "OK" was loaded
    write(store, exchange(many, later, "done"), exchange(many + 1, elsewhere, "done too"))
    with store.session() as session:
        turns = {t.response_message["content"]: t for t in session.exec(select(Turn))
                 if t.response_message["content"] != "OK"}
        seventh = session.exec(select(Turn).where(Turn.completion_id == "chatcmpl-7")).one()
    assert (turns["done"].link_rule, turns["done"].parent_turn_id) == ("tail", seventh.id)
    assert (turns["done too"].link_rule, turns["done too"].parent_turn_id) == ("new", None)


def test_a_batch_that_conflicts_with_a_job_holding_its_trajectory_is_written_once_the_job_commits(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """DuckDB: a batch continuing a trajectory that another transaction (a loop job) is updating loses the
    write conflict, waits and runs again; it is neither failed nor spooled. (The Arrow UPDATE's clean-up once
    replaced the conflict with "transaction is aborted", which no retry recognised.)"""
    store = Store(tmp_path / "flywheel.duckdb")
    q1 = [{"role": "user", "content": "hello"}]
    write(store, exchange(1, q1, "hi"))
    caplog.set_level(logging.INFO, logger="flywheel.store")
    with store.session() as job, ThreadPoolExecutor(1) as pool:
        job.execute(text("UPDATE trajectories SET group_key = 'g1'"))  # as forming groups does; not committed yet
        batch = pool.submit(write, store, exchange(2, [*q1, {"role": "assistant", "content": "hi"},
                                                       {"role": "user", "content": "again"}], "hi again"))
        deadline = time.monotonic() + 10
        while "write conflict" not in caplog.text and not batch.done() and time.monotonic() < deadline:
            time.sleep(0.001)
        assert "write conflict (attempt 1)" in caplog.text
        job.commit()
        batch.result(timeout=10)
    with store.session() as session:
        trajectory = session.exec(select(Trajectory)).one()
    assert (trajectory.turn_count, trajectory.group_key) == (2, "g1")
    store.close()
