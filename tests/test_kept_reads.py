"""Kept reads: the loop's answers given again until a table they read is written, on a real store.

The store interface is called as the store process calls it (``LocalStore``), on a DuckDB file and on
the session's PostgreSQL server; the writes are the store's own (a version reserved, turns written by
the store's write path, feedback riding a batch, a job run recorded). The serving process's own kept
version reads are checked through a gateway, with versions written while another client reads them.
"""

from __future__ import annotations

import asyncio
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import insert

from flywheel.capture.feedback import FeedbackBatch, FeedbackItem
from flywheel.capture.models import JobRun, utcnow
from flywheel.capture.store import Store
from flywheel.capture.turns import CapturedExchange, prepare_lines
from flywheel.gateway.core.config import Settings
from flywheel.gateway.core.store_api import JobRunRecord
from flywheel.gateway.storeproc.store_api_local import LocalStore
from tests.test_loop_versions import admin, start
from tests.vllm_standin import VllmStandIn


def settings(tmp_path: Path) -> Settings:
    return Settings.model_validate({"data_dir": str(tmp_path), "aliases": {"agent": {"engine": "up"}},
                                    "loop": {"enabled": False},  # no held-out share: every trajectory groups
                                    "engines": {"up": {"kind": "openai", "base_url": "http://127.0.0.1:9/v1"}}})


def exchange(i: int) -> bytes:
    return CapturedExchange(
        completion_id=f"chatcmpl-{i}", endpoint="chat.completions", requested_model="agent", alias="agent",
        engine_model="agent", adapter_version=0, client_key_id=None,
        request={"model": "agent", "messages": [{"role": "user", "content": f"question {i}"}]},
        response={"id": f"chatcmpl-{i}", "object": "chat.completion", "created": 0, "model": "agent",
                  "choices": [{"index": 0, "message": {"role": "assistant", "content": f"answer {i}"},
                               "finish_reason": "stop"}]},
        created_at=utcnow(), latency_ms=1.0).to_line()


def test_a_kept_answer_holds_until_its_table_is_written(store: Store, tmp_path: Path) -> None:
    local = LocalStore(store, settings(tmp_path))
    first = asyncio.run(local.serving())
    again = asyncio.run(local.serving())
    if store.shared:  # other replicas write a shared store: every read runs
        assert again is not first and again == first
    else:
        assert again is first  # given again, not read again
    asyncio.run(local.reserve_version("agent", "base"))
    after = asyncio.run(local.serving())
    assert after is not first and after["agent"].training is not None and first["agent"].training is None

    pending = asyncio.run(local.pending("agent"))
    store.write_turns(prepare_lines([exchange(1)], None, None))  # a batch of turns: trajectories written
    assert pending.open_trajectories == 0 and asyncio.run(local.pending("agent")).open_trajectories == 1

    rewards = asyncio.run(local.reward_by_version("agent"))
    carried = FeedbackBatch([FeedbackItem(trajectory_id=None, completion_id="chatcmpl-2", reward=1.0)])
    store.write_turns(prepare_lines([exchange(2)], None, None), feedback=carried)  # feedback riding its batch
    assert rewards.versions == {} and asyncio.run(local.reward_by_version("agent")).versions["0"].n == 1

    runs = asyncio.run(local.last_runs("agent", ["train"]))
    asyncio.run(local.record_runs([JobRunRecord(id="job_1", job="train", alias="agent", status="ok",
                                                started_at=utcnow(), finished_at=utcnow())]))
    assert runs == {} and asyncio.run(local.last_runs("agent", ["train"]))["train"].id == "job_1"


def test_a_commit_counts_once_it_is_visible_and_a_quiet_job_waits_for_a_write(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.duckdb")
    try:
        tables = ("job_runs",)
        before = store.stamps.stamp(tables)
        with store.engine.connect() as connection:
            connection.execute(insert(JobRun).values(id="job_x", job="train", status="ok", started_at=utcnow()))
            connection.commit()
            assert store.stamps.stamp(tables) is None  # committed, connection not back yet: nothing kept meanwhile
        assert before is not None and store.stamps.stamp(tables) == (before[0] + 1,)

        local = LocalStore(store, settings(tmp_path))
        assert asyncio.run(local.form_groups()) == []
        stamp = store.stamps.stamp(("turns", "trajectories"))
        assert asyncio.run(local.form_groups()) == []  # kept: nothing it reads was written
        assert store.stamps.stamp(("turns", "trajectories")) == stamp
        for _ in range(4):  # four closed attempts at one task form a group once they are written
            store.write_turns(prepare_lines([exchange(9)], None, None))
        store.close_idle(0.0, now=utcnow() + timedelta(seconds=1))  # all four, however fine the clock
        formed = asyncio.run(local.form_groups())
        assert [group.size for group in formed] == [4]
    finally:
        store.close()


def test_a_version_written_while_a_kept_read_runs_is_never_hidden(tmp_path: Path, vllm: VllmStandIn) -> None:
    """The gateway keeps its version reads; versions written while another request reads them must show next."""
    gateway = start(tmp_path, vllm)

    def versions() -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = admin(gateway, "GET", "/aliases/agent/versions")["data"]
        return rows

    reading = threading.Event()
    reads: list[int] = []

    def read_all_along() -> None:
        while not reading.is_set():
            reads.append(len(versions()))

    reader = threading.Thread(target=read_all_along)
    reader.start()
    try:
        for _ in range(40):  # each round writes versions twice: reserved, then failed
            reserved = admin(gateway, "POST", "/training/versions", json={"alias": "agent"})
            admin(gateway, "POST", "/training/failures", json={"alias": "agent", "version": reserved["version"],
                                                               "error": "a round that raised"})
            rows = versions()
            assert (len(rows), rows[-1]["status"]) == (reserved["version"], "failed"), rows
    finally:
        reading.set()
        reader.join(timeout=60)
    assert len(reads) > 40  # the reader ran all along
