"""The loop's incremental jobs: group formation and reward per version, from what the store process's own writes
changed (DuckDB, its one writer) or from a watermark (a shared PostgreSQL store), never lose a trajectory and find
what a full pass finds; the idle close; and the record of the jobs' runs, where an idle run replaces the last idle
one."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path
from random import Random
from typing import Any

import pytest
from sqlalchemy import event
from sqlmodel import Session, select

from flywheel.capture.feedback import FeedbackItem, close_trajectories, write_feedback
from flywheel.capture.groups import GroupingRules, Waiting, form_groups
from flywheel.capture.linker import TOUCHED_COLUMNS
from flywheel.capture.models import Feedback, Group, GroupMember, JobRun, Score, Trajectory, Turn, utcnow
from flywheel.capture.store import Store, bulk_insert, bulk_update
from flywheel.capture.turns import new_id
from flywheel.capture.write_stamps import CLOSED, FORKED, REWARDED
from flywheel.gateway.core.config import Settings
from flywheel.gateway.core.store_api import JobRunRecord
from flywheel.gateway.storeproc import store_ops

SETTINGS = Settings(groups={"min_size": 2, "max_size": 4})
SHARED = pytest.mark.parametrize("database", ["postgresql"], indirect=True)  # watermarks: other replicas write too
ONE_WRITER = pytest.mark.parametrize("database", ["duckdb"], indirect=True)  # its own writes tell what changed


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


def look_at_everything(store: Store) -> None:
    """The next run of the incremental jobs reads every row, as the first one does."""
    if store.shared:
        if store in store_ops.FORMATION_MARKS:
            store_ops.FORMATION_MARKS[store].full_at -= store_ops.FULL_PASS_S
    else:
        store.stamps.forget()


def incremental_next(store: Store) -> bool:
    """Whether the next formation run reads only what changed."""
    if store.shared:
        return store_ops.FORMATION_MARKS[store].look().since is not None
    return store in store_ops.FORMATIONS


def each_group(store: Store) -> list[tuple[str, list[str]]]:
    """Every group's key and members."""
    members: dict[str, list[str]] = {}
    with store.session() as session:
        for group_id, key, trajectory_id in session.exec(select(Group.id, Group.key, GroupMember.trajectory_id)
                                                         .join(GroupMember, GroupMember.group_id == Group.id)):
            members.setdefault(f"{key}\0{group_id}", []).append(trajectory_id)
    return sorted((name.split("\0")[0], sorted(ids)) for name, ids in members.items())


def groups_of(store: Store) -> dict[str, set[str]]:
    with store.session() as session:
        rows = session.exec(select(Group.key, GroupMember.trajectory_id)
                            .join(GroupMember, GroupMember.group_id == Group.id)).all()
    out: dict[str, set[str]] = {}
    for key, trajectory_id in rows:
        out.setdefault(key, set()).add(trajectory_id)
    return out


@SHARED
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


@SHARED
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


@SHARED
def test_what_the_watermark_cannot_see_the_full_pass_finds(store: Store) -> None:
    assert store_ops.run_group_formation(store, SETTINGS) == []
    long_ago = utcnow() - timedelta(hours=2)  # older than any watermark's look back (a replayed spool)
    closed(store, "t1", "task-y", long_ago)
    closed(store, "t2", "task-y", long_ago + timedelta(seconds=1))
    assert store_ops.run_group_formation(store, SETTINGS) == []  # incremental: not seen
    store_ops.FORMATION_MARKS[store].full_at -= store_ops.FULL_PASS_S  # a full pass is due
    assert [g.key for g in store_ops.run_group_formation(store, SETTINGS)] == ["task-y"]
    assert store_ops.FORMATION_MARKS[store].look().since is not None


@ONE_WRITER
def test_what_this_process_wrote_is_grouped_however_old_and_a_run_after_no_write_reads_nothing(store: Store) -> None:
    statements: list[str] = []
    event.listen(store.engine, "before_cursor_execute", lambda *args: statements.append(args[2]))
    assert store_ops.run_group_formation(store, SETTINGS) == []  # the first run reads everything
    long_ago = utcnow() - timedelta(hours=2)  # older than any watermark's look back (a replayed spool)
    closed(store, "t1", "task-y", long_ago)
    closed(store, "t2", "task-y", long_ago + timedelta(seconds=1))
    assert [g.key for g in store_ops.run_group_formation(store, SETTINGS)] == ["task-y"]
    statements.clear()
    assert store_ops.run_group_formation(store, SETTINGS) == []
    assert statements == []  # nothing was written since: nothing to read


@ONE_WRITER
def test_the_store_s_own_closes_feedback_and_rewards_are_followed_and_a_rolled_back_write_is_not(store: Store) -> None:
    now = utcnow()
    closed_ones, rewarded_ones = store.stamps.follow(CLOSED), store.stamps.follow(REWARDED)
    with store.session() as session:
        for trajectory_id in ("t1", "t2", "t3"):
            session.add(Trajectory(id=trajectory_id, alias="a", task_key="task-q", created_at=now, updated_at=now,
                                   turn_count=1, latest_turn_id=f"turn_{trajectory_id}"))
            session.add(Turn(id=f"turn_{trajectory_id}", trajectory_id=trajectory_id,
                             completion_id=f"c_{trajectory_id}", requested_model="a", alias="a", engine_model="m",
                             h_ctx="x", h_out=f"o_{trajectory_id}", task_key="task-q", adapter_version=3,
                             created_at=now))
        session.commit()
    assert closed_ones.take() == rewarded_ones.take() == set()  # open trajectories: nothing a job follows
    assert store_ops.run_group_formation(store, SETTINGS) == []
    assert store_ops.reward_by_version(store, SETTINGS, "a").versions == {}
    with store.session() as session:  # feedback as a batch writes it: the trajectory closes
        write_feedback(session, [FeedbackItem(trajectory_id="t1", completion_id=None, reward=0.25)])
        session.rollback()
    assert closed_ones.take() == rewarded_ones.take() == set()
    with store.session() as session:
        write_feedback(session, [FeedbackItem(trajectory_id="t1", completion_id=None, reward=0.25)])
        session.commit()
    assert store.close_idle(0.0, now=utcnow() + timedelta(seconds=1)) == 2  # t2, t3
    assert closed_ones.take() == {"t1", "t2", "t3"} and rewarded_ones.take() == {"t1"}
    assert [g.key for g in store_ops.run_group_formation(store, SETTINGS)] == ["task-q"]
    assert store_ops.reward_by_version(store, SETTINGS, "a").versions["3"].n == 1
    with store.session() as session:  # a final reward as scoring writes it (bulk)
        bulk_insert(session, Score, [Score(id="s_t2", trajectory_id="t2", source="reward", value=0.75).model_dump()])
        session.commit()
    assert closed_ones.take() == set() and rewarded_ones.take() == {"t2"}
    summary = store_ops.reward_by_version(store, SETTINGS, "a").versions["3"]
    assert (summary.n, summary.mean) == (2, pytest.approx(0.5))
    assert summary.model_dump(exclude_none=True) == pytest.approx(from_scratch(store)["versions"]["3"])


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
                if store is full:
                    look_at_everything(store)
                store_ops.run_group_formation(store, SETTINGS)
        assert incremental_next(incremental)
        by_runs, by_full = ({key: sorted(members) for key, members in groups_of(s).items()}
                            for s in (incremental, full))
        assert by_runs == by_full
        assert sum(len(m) for m in by_runs.values()) >= 20
    finally:
        full.close()


@ONE_WRITER
def test_what_waits_forms_what_a_full_pass_forms_through_closes_explicit_keys_windows_and_taken_members(
        store: Store, tmp_path: Path) -> None:
    """A random sequence on two stores: trajectories closed and left open (task keys, explicit group keys, created
    hours apart), open ones closed later, closed ones taken by a group an SDK posted; after each step one store forms
    from what waits and what its writes closed, the other by a full pass; the same groups."""
    rules = GroupingRules(min_size=2, max_size=3, task_window_s=3600, holdout_fraction=0.25)
    waiting, full = Waiting(), Store(tmp_path / "full.duckdb")
    changes = store_ops.Changes(store.stamps.follow(CLOSED), store.stamps.follow(FORKED))
    random = Random(7)
    now, opened, closed_ids = utcnow(), [], []
    try:
        for step in range(150):
            write: Callable[[Session], Any] | None = None
            if random.random() < 0.6:
                row = {"id": f"t{step}", "alias": "a", "status": random.choice(["open", "closed", "closed"]),
                       "task_key": f"task-{random.randrange(4)}", "turn_count": 1, "latest_turn_id": f"turn{step}",
                       "group_key": random.choice([None, None, None, "g1", "g2"]), "updated_at": now,
                       "created_at": now - timedelta(seconds=random.randrange(3 * 3600))}
                (opened if row["status"] == "open" else closed_ids).append(row["id"])
                write = lambda session, row=row: session.add(  # noqa: E731
                    Trajectory(**row, closed_at=now if row["status"] == "closed" else None))
            elif random.random() < 0.5 and opened:
                closed_ids.append(trajectory_id := opened.pop(0))
                write = lambda session, ids=[trajectory_id]: close_trajectories(session, ids, "client")  # noqa: E731
            elif len(closed_ids) >= 2:  # an SDK posts a group of two closed trajectories
                taken = random.sample(closed_ids, 2)
                write = lambda session, taken=taken, key=f"sdk{step}": session.add_all([  # noqa: E731
                    Group(id=key, source="explicit", key=key, alias="a", status="scored", size=2),
                    *(GroupMember(group_id=key, trajectory_id=t) for t in taken)])
            for target in (store, full):
                with target.session() as session:
                    if write is not None:
                        write(session)
                    if target is store:
                        session.commit()
                        waiting.form(session, rules, changes.take())
                    else:
                        form_groups(session, rules)
                    session.commit()
            assert each_group(store) == each_group(full), step
        assert sum(key.startswith("task") for key in groups_of(store)) >= 3
        assert {"g1", "g2"} & set(groups_of(store))
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
    """What ``reward_by_version`` answers from every stored trajectory: the first call of a store opened afresh."""
    fresh = Store(store.url)
    try:
        return store_ops.reward_by_version(fresh, SETTINGS, "a").model_dump(exclude_none=True)
    finally:
        fresh.close()


def test_rewards_per_version_kept_from_changes_equal_a_recomputation(store: Store) -> None:
    """Feedback, a later judge's score overriding it, a second feedback, new trajectories: after each write the
    running sums answer what a recomputation from every stored trajectory answers."""
    writes = [("t1", 0, 0.2, None), ("t2", 0, 0.6, None), ("t3", 1, None, 0.9), ("t1", 0, None, 1.0),
              ("t4", 1, 0.1, None), ("t4", 1, 0.5, None), ("t5", 2, 0.3, 0.7), ("t2", 0, None, 0.0)]
    for trajectory_id, version, feedback, score in writes:
        rewarded(store, trajectory_id, version, feedback=feedback, score=score)
        answer = store_ops.reward_by_version(store, SETTINGS, "a").model_dump(exclude_none=True)
        kept = store_ops.VERSION_REWARDS[store]
        sums = kept[("a", False)]
        assert sums.mark.look().since is not None if store.shared else sums.followed is not None  # after the first
        expected = from_scratch(store)
        assert answer["mixed"] == expected["mixed"]
        assert answer["versions"].keys() == expected["versions"].keys()
        for version, cell in expected["versions"].items():
            assert answer["versions"][version] == pytest.approx(cell), version
    final = from_scratch(store)["versions"]
    assert {v: c["n"] for v, c in final.items()} == {"0": 2, "1": 2, "2": 1}
    assert final["0"]["mean"] == pytest.approx(0.5) and final["1"]["mean"] == pytest.approx(0.7)


def test_a_quiet_run_replaces_the_previous_quiet_runs_of_its_job_and_alias_only(store: Store) -> None:
    """Across the loop's sends of its runs, and within one send."""
    def run(job: str, alias: str | None, status: str) -> JobRunRecord:
        return JobRunRecord(id=new_id("job"), job=job, alias=alias, status=status, started_at=utcnow(),
                            finished_at=utcnow(), counts={"n": 1}, detail=f"{job} {status}")

    kept = [run("score", None, "ok"), run("score", "a", "idle"), run("form_groups", None, "waiting"),
            run("score", None, "failed")]
    store_ops.record_runs(store, SETTINGS, [*kept, run("score", None, "idle")])
    store_ops.record_runs(store, SETTINGS, [run("score", None, "waiting"), latest := run("score", None, "idle")])
    with store.session() as session:
        rows = {r.id: r for r in session.exec(select(JobRun))}
    assert set(rows) == {r.id for r in [*kept, latest]}  # only the earlier quiet runs of score (alias-wide) are gone
    row = rows[latest.id]
    assert (row.status, row.counts, row.detail) == ("idle", {"n": 1}, "score idle") and row.finished_at is not None


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


def trajectory(store: Store, trajectory_id: str, alias: str, versions: list[int], *, closed_by: str | None,
               forked_versions: tuple[int, ...] = (), at: datetime | None = None) -> None:
    """A trajectory of ``alias`` as capture writes it (bulk rows, turns before their trajectory): a turn per
    version, forked turns beside them, all ``at`` (default now: a replayed spool writes older ones); open, or
    closed for ``closed_by``."""
    now = at or utcnow()
    turns = [Turn(id=f"turn_{trajectory_id}_{n}", trajectory_id=trajectory_id, completion_id=f"c_{trajectory_id}_{n}",
                  requested_model=alias, alias=alias, engine_model="m", h_ctx="x", h_out=f"o{n}", task_key="t",
                  adapter_version=version, source="fork" if n >= len(versions) else "client", created_at=now)
             for n, version in enumerate([*versions, *forked_versions])]
    with store.session() as session:
        bulk_insert(session, Turn, [turn.model_dump() for turn in turns])
        bulk_insert(session, Trajectory, [Trajectory(
            id=trajectory_id, alias=alias, status="open" if closed_by is None else "closed", task_key="t",
            created_at=now, updated_at=now, closed_at=None if closed_by is None else now, close_reason=closed_by,
            turn_count=len(turns), latest_turn_id=turns[-1].id).model_dump()])
        session.commit()


@ONE_WRITER
def test_rewards_per_version_from_what_writes_said_equal_a_recomputation_through_every_write(store: Store) -> None:
    """Random writes through the store's own write paths (capture's bulk rows, feedback that closes, the idle
    close, final rewards written late with earlier times, a continued trajectory reopened, an ORM update of a
    score, another alias, forks, mixed versions): after each one the sums kept from what the writes said answer
    what a recomputation from every stored trajectory answers; trajectories written after the first call are
    answered without reading the store."""
    rng = Random(23)
    trajectory(store, "old_closed", "a", [1], closed_by="client")
    trajectory(store, "old_open", "a", [1], closed_by=None)
    statements: list[str] = []
    event.listen(store.engine, "before_cursor_execute", lambda *args: statements.append(args[2]))
    store_ops.reward_by_version(store, SETTINGS, "a")  # the first call reads everything: older ones are unknown
    ids = ["old_closed", "old_open"]
    score_time = utcnow() - timedelta(hours=1)

    def a_score(trajectory_id: str) -> None:
        at = score_time + timedelta(seconds=rng.randrange(3600))  # written now, dated any time: the latest wins
        with store.session() as session:
            bulk_insert(session, Score, [Score(id=new_id("s"), trajectory_id=trajectory_id,
                                               source=rng.choice(["reward", "reward", "ruler"]),
                                               value=rng.choice([rng.random(), float("nan")]), created_at=at)
                                         .model_dump()])
            session.commit()

    def feedback(trajectory_id: str) -> None:
        item = rng.choice([FeedbackItem(trajectory_id, None, reward=rng.random() * 3),
                           FeedbackItem(trajectory_id, None, label=rng.choice(["good", "bad", "meh"]))])
        with store.session() as session:
            write_feedback(session, [item])
            session.commit()

    def reopen(trajectory_id: str) -> None:  # a client continued a closed trajectory by its id
        with store.session() as session:
            row = session.get(Trajectory, trajectory_id)
            assert row is not None
            row_values = {**row.model_dump(), "status": "open", "closed_at": None, "close_reason": None}
            bulk_update(session, Trajectory, [row_values], TOUCHED_COLUMNS)
            session.commit()

    def rescore(trajectory_id: str) -> None:  # an ORM update of a stored score: which one changed is not said
        with store.session() as session:
            for score in session.exec(select(Score).where(Score.trajectory_id == trajectory_id)):
                score.value = rng.random()
            session.commit()

    for step in range(160):
        choice = rng.random()
        created = choice < 0.3 or len(ids) < 4
        if created:
            trajectory_id = f"t{step}"
            versions = [rng.choice([0, 1, 2])] * rng.randint(1, 3)
            if rng.random() < 0.15:
                versions.append(rng.choice([0, 1, 2]))  # mixed, perhaps
            trajectory(store, trajectory_id, rng.choice(["a", "a", "a", "b"]), versions,
                       closed_by=rng.choice([None, None, "client", "fork"]),
                       forked_versions=(rng.choice([0, 5]),) if rng.random() < 0.3 else ())
            ids.append(trajectory_id)
        elif choice < 0.55:
            feedback(rng.choice(ids))
        elif choice < 0.75:
            a_score(rng.choice(ids))
        elif choice < 0.82:
            store.close_idle(0.0, now=utcnow() + timedelta(seconds=1))
        elif choice < 0.9:
            reopen(rng.choice(ids))
        else:
            rescore(rng.choice(ids))
        statements.clear()
        answer = store_ops.reward_by_version(store, SETTINGS, "a").model_dump(exclude_none=True)
        if created:
            assert statements == [], step  # a new trajectory's parts were all said by its writes
        expected = from_scratch(store)
        assert answer["mixed"] == expected["mixed"], step
        assert answer["versions"].keys() == expected["versions"].keys(), step
        for version, cell in expected["versions"].items():
            assert answer["versions"][version] == pytest.approx(cell, nan_ok=True), (step, version)
    kept = store_ops.VERSION_REWARDS[store][("a", False)]
    assert len(kept.known.known) > 20 and sum(c["n"] for c in expected["versions"].values()) > 5


@ONE_WRITER
def test_a_trajectory_written_after_the_first_call_is_answered_without_a_read(store: Store) -> None:
    statements: list[str] = []
    store_ops.reward_by_version(store, SETTINGS, "a")
    event.listen(store.engine, "before_cursor_execute", lambda *args: statements.append(args[2]))
    trajectory(store, "t1", "a", [4, 4], closed_by=None)
    with store.session() as session:
        write_feedback(session, [FeedbackItem(trajectory_id="t1", completion_id=None, reward=0.5)])
        session.commit()
    statements.clear()
    summary = store_ops.reward_by_version(store, SETTINGS, "a").versions["4"]
    assert statements == [] and (summary.n, summary.mean) == (1, 0.5)


@ONE_WRITER
def test_the_idle_close_reads_nothing_until_a_trajectory_can_be_idle_and_then_closes_what_a_full_update_closes(
        store: Store) -> None:
    """Random writes (new open trajectories, some replayed from long ago, closes by feedback, reopened ones
    dated back): after each call every trajectory idle when it began is closed, and a call that could find
    nothing idle runs no statement."""
    rng = Random(7)
    idle_s = 60.0
    settings = Settings(capture={"idle_close_s": idle_s})
    statements: list[str] = []
    event.listen(store.engine, "before_cursor_execute", lambda *args: statements.append(args[2]))
    ids: list[str] = []
    skipped = 0
    for step in range(80):
        choice = rng.random()
        now = utcnow()
        if choice < 0.5 or not ids:
            ago = rng.choice([0.0, 0.0, 0.0, rng.uniform(0, 3 * idle_s)])  # now, or replayed from a while ago
            trajectory(store, f"t{step}", "a", [0], closed_by=None, at=now - timedelta(seconds=ago))
            ids.append(f"t{step}")
        elif choice < 0.75:
            with store.session() as session:
                write_feedback(session, [FeedbackItem(trajectory_id=rng.choice(ids), completion_id=None, reward=1.0)])
                session.commit()
        else:  # a client continued a closed trajectory by its id, with a turn dated back
            with store.session() as session:
                row = session.get(Trajectory, rng.choice(ids))
                assert row is not None
                bulk_update(session, Trajectory, [{**row.model_dump(), "status": "open", "closed_at": None,
                                                   "close_reason": None,
                                                   "updated_at": now - timedelta(seconds=rng.uniform(0, 2 * idle_s))}],
                            TOUCHED_COLUMNS)
                session.commit()
        began = utcnow()
        statements.clear()
        store_ops.close_idle(store, settings)
        skipped += statements == []
        with store.session() as session:
            idle = session.exec(select(Trajectory.id).where(Trajectory.status == "open", Trajectory.updated_at
                                                            < began - timedelta(seconds=idle_s))).all()
        assert idle == [], step
    assert 20 < skipped < 80  # most calls find nothing can be idle; the replayed ones are closed at once
