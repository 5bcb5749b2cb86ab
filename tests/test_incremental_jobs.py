"""The loop's incremental jobs: group formation and reward per version from a watermark never lose a trajectory,
and find what a full pass finds; the idle close; and the record of the jobs' runs, where an idle run replaces the last
idle one."""

from __future__ import annotations

from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlmodel import select

from flywheel.capture.models import Feedback, Group, GroupMember, JobRun, Score, Trajectory, Turn, utcnow
from flywheel.capture.store import Store
from flywheel.capture.turns import new_id
from flywheel.gateway.core.config import Settings
from flywheel.gateway.core.store_api import JobRunRecord
from flywheel.gateway.storeproc import store_ops

SETTINGS = Settings(groups={"min_size": 2, "max_size": 4})


def closed(store: Store, trajectory_id: str, task: str, closed_at: datetime) -> None:
    """A closed one-turn trajectory of ``task`` that closed at ``closed_at`` (committed now, whatever that says)."""
    with store.session() as session:
        session.add(Trajectory(id=trajectory_id, alias="a", status="closed", task_key=task, created_at=closed_at,
                               updated_at=closed_at, closed_at=closed_at, close_reason="idle", turn_count=1,
                               latest_turn_id=f"turn_{trajectory_id}"))
        session.add(Turn(id=f"turn_{trajectory_id}", trajectory_id=trajectory_id, completion_id=f"c_{trajectory_id}",
                         requested_model="a", alias="a", engine_model="m", h_ctx="x", h_out=f"o_{trajectory_id}",
                         task_key=task, created_at=closed_at))
        session.commit()


def groups_of(store: Store) -> dict[str, set[str]]:
    with store.session() as session:
        rows = session.exec(select(Group.key, GroupMember.trajectory_id)
                            .join(GroupMember, GroupMember.group_id == Group.id)).all()
    out: dict[str, set[str]] = {}
    for key, trajectory_id in rows:
        out.setdefault(key, set()).add(trajectory_id)
    return out


def test_a_trajectory_committed_after_a_run_that_closed_before_it_is_grouped(store: Store) -> None:
    closed(store, "t1", "task-x", utcnow())
    assert store_ops.run_group_formation(store, SETTINGS) == []  # the first run: a full pass
    mark = store_ops.FORMATION_MARKS[store]
    assert mark.started is not None and mark.look().since is not None  # the next run is incremental
    # Written concurrently with that run: it closed before the run started, its transaction committed after.
    closed(store, "t2", "task-x", mark.started - timedelta(seconds=1))
    formed = store_ops.run_group_formation(store, SETTINGS)
    assert [g.key for g in formed] == ["task-x"]
    assert groups_of(store) == {"task-x": {"t1", "t2"}}


def test_a_write_that_committed_much_later_is_grouped_by_the_next_long_look(store: Store) -> None:
    closed(store, "t1", "task-z", utcnow() - timedelta(hours=1))
    assert store_ops.run_group_formation(store, SETTINGS) == []  # a full pass: one member, no group yet
    mark = store_ops.FORMATION_MARKS[store]
    late = mark.started - timedelta(seconds=store_ops.SHORT_LAG_S + 15)  # beyond a short look, within a long one
    closed(store, "t2", "task-z", late)
    assert store_ops.run_group_formation(store, SETTINGS) == []  # a short look: not seen yet
    assert not mark.look().long
    mark.long_at -= store_ops.LONG_LOOK_S  # a long look is due
    look = mark.look()
    assert look.long and look.since is not None and look.since <= late
    assert [g.key for g in store_ops.run_group_formation(store, SETTINGS)] == ["task-z"]
    assert groups_of(store) == {"task-z": {"t1", "t2"}}


def test_what_the_watermark_cannot_see_the_full_pass_finds(store: Store) -> None:
    assert store_ops.run_group_formation(store, SETTINGS) == []
    long_ago = utcnow() - timedelta(hours=2)  # older than any watermark's look back (a replayed spool)
    closed(store, "t1", "task-y", long_ago)
    closed(store, "t2", "task-y", long_ago + timedelta(seconds=1))
    assert store_ops.run_group_formation(store, SETTINGS) == []  # incremental: not seen
    store_ops.FORMATION_MARKS[store].full_at -= store_ops.FULL_PASS_S  # a full pass is due
    assert [g.key for g in store_ops.run_group_formation(store, SETTINGS)] == ["task-y"]
    assert store_ops.FORMATION_MARKS[store].look().since is not None


def test_incremental_runs_form_what_full_passes_form(store: Store, tmp_path: Path) -> None:
    """A mixed sequence of trajectories and runs, on two stores: one run by run from its watermark, the other
    with a full pass every run; the same groups."""
    incremental, full = store, Store(tmp_path / "full.duckdb")
    try:
        now = utcnow()
        written = [(f"t{i}", f"task-{i % 5}", now + timedelta(milliseconds=i)) for i in range(23)]
        for start in range(0, len(written), 3):
            for store in (incremental, full):
                for trajectory_id, task, at in written[start:start + 3]:
                    closed(store, trajectory_id, task, at)
                if store is full and store in store_ops.FORMATION_MARKS:
                    store_ops.FORMATION_MARKS[store].full_at -= store_ops.FULL_PASS_S
                store_ops.run_group_formation(store, SETTINGS)
        assert store_ops.FORMATION_MARKS[incremental].look().since is not None
        by_runs, by_full = ({key: sorted(members) for key, members in groups_of(s).items()}
                            for s in (incremental, full))
        assert by_runs == by_full
        assert sum(len(m) for m in by_runs.values()) >= 20
    finally:
        full.close()


def rewarded(store: Store, trajectory_id: str, version: int, *, feedback: float | None = None,
             score: float | None = None) -> None:
    """A closed one-turn trajectory served by ``version``, with a client's feedback and/or a scoring job's reward."""
    now = utcnow()
    with store.session() as session:
        if session.get(Trajectory, trajectory_id) is None:
            session.add(Trajectory(id=trajectory_id, alias="a", status="closed", task_key="t", created_at=now,
                                   updated_at=now, closed_at=now, close_reason="idle", turn_count=1,
                                   latest_turn_id=f"turn_{trajectory_id}"))
            session.add(Turn(id=f"turn_{trajectory_id}", trajectory_id=trajectory_id,
                             completion_id=f"c_{trajectory_id}", requested_model="a", alias="a", engine_model="m",
                             h_ctx="x", h_out="o", task_key="t", adapter_version=version, created_at=now))
        if feedback is not None:
            session.add(Feedback(id=f"f_{trajectory_id}_{feedback}", trajectory_id=trajectory_id, reward=feedback,
                                 created_at=now))
        if score is not None:
            session.add(Score(id=f"s_{trajectory_id}_{score}", trajectory_id=trajectory_id, source="reward",
                              value=score, created_at=now))
        session.commit()


def from_scratch(store: Store) -> dict[str, Any]:
    """What ``reward_by_version`` answers after a full pass."""
    store_ops.VERSION_REWARDS.pop(store, None)
    return store_ops.reward_by_version(store, SETTINGS, "a").model_dump(exclude_none=True)


def test_rewards_per_version_kept_from_changes_equal_a_recomputation(store: Store) -> None:
    """Feedback, a later judge's score overriding it, a second feedback, new trajectories: after each write the
    running sums answer what a recomputation from every stored trajectory answers."""
    writes = [("t1", 0, 0.2, None), ("t2", 0, 0.6, None), ("t3", 1, None, 0.9), ("t1", 0, None, 1.0),
              ("t4", 1, 0.1, None), ("t4", 1, 0.5, None), ("t5", 2, 0.3, 0.7), ("t2", 0, None, 0.0)]
    kept = None
    for trajectory_id, version, feedback, score in writes:
        rewarded(store, trajectory_id, version, feedback=feedback, score=score)
        if kept is not None:
            store_ops.VERSION_REWARDS[store] = kept
        answer = store_ops.reward_by_version(store, SETTINGS, "a").model_dump(exclude_none=True)
        kept = store_ops.VERSION_REWARDS[store]
        assert kept[("a", False)].mark.look().since is not None  # answered from the watermark after the first
        expected = from_scratch(store)
        assert answer["mixed"] == expected["mixed"]
        assert answer["versions"].keys() == expected["versions"].keys()
        for version, cell in expected["versions"].items():
            assert answer["versions"][version] == pytest.approx(cell), version
    final = from_scratch(store)["versions"]
    assert {v: c["n"] for v, c in final.items()} == {"0": 2, "1": 2, "2": 1}
    assert final["0"]["mean"] == pytest.approx(0.5) and final["1"]["mean"] == pytest.approx(0.7)


def test_a_quiet_run_replaces_the_previous_quiet_runs_of_its_job_and_alias_only(store: Store) -> None:
    def run(job: str, alias: str | None, status: str) -> str:
        record = JobRunRecord(id=new_id("job"), job=job, alias=alias, status=status, started_at=utcnow(),
                              finished_at=utcnow(), counts={"n": 1}, detail=f"{job} {status}")
        store_ops.record_run(store, SETTINGS, record)
        return record.id

    kept = [run("score", None, "ok"), run("score", "a", "idle"), run("form_groups", None, "waiting"),
            run("score", None, "failed")]
    run("score", None, "idle")
    run("score", None, "waiting")
    latest = run("score", None, "idle")
    with store.session() as session:
        rows = {r.id: r for r in session.exec(select(JobRun))}
    assert set(rows) == {*kept, latest}  # only the earlier quiet runs of score (alias-wide) are gone
    assert (rows[latest].status, rows[latest].counts, rows[latest].detail) == ("idle", {"n": 1}, "score idle")
    assert rows[latest].finished_at is not None


def test_the_idle_close_closes_only_open_trajectories_quiet_for_idle_s(store: Store) -> None:
    now = utcnow()
    closed(store, "done", "t", now - timedelta(hours=1))
    with store.session() as session:
        for trajectory_id, quiet_s in (("quiet", 120), ("busy", 5)):
            session.add(Trajectory(id=trajectory_id, alias="a", updated_at=now - timedelta(seconds=quiet_s)))
        session.commit()
    assert store.close_idle(60, now) == 1
    assert store.close_idle(60, now) == 0
    with store.session() as session:
        rows = {t.id: (t.status, t.close_reason) for t in session.exec(select(Trajectory))}
    assert rows == {"done": ("closed", "idle"), "quiet": ("closed", "idle"), "busy": ("open", None)}
