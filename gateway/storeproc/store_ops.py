"""What the loop does where the store is: the functions behind :class:`~flywheel.gateway.core.store_api.StoreApi`.

Each takes the open :class:`Store`, the :class:`Settings` and the method's arguments, and returns the
Protocol's model. The store process runs them for the gateway (``store_api_local.LocalStore``, on a worker
thread; ``score`` is a coroutine); the CLI and ``flywheel train`` call them on the store file when no
gateway runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
import weakref
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Connection,
    Float,
    String,
    and_,
    cast,
    func,
    insert,
    literal,
    null,
    or_,
    text,
    union_all,
)
from sqlalchemy import select as sa_select  # sqlmodel's select types at most four columns
from sqlmodel import Session, col, delete, select

from flywheel.capture.batches import TrainingGroup
from flywheel.capture.groups import Changed, GroupingRules, Waiting, form_groups, held_out
from flywheel.capture.models import (
    Feedback,
    Group,
    GroupMember,
    JobRun,
    Score,
    Trajectory,
    Turn,
    epoch,
    utcnow,
)
from flywheel.capture.store import Store
from flywheel.capture.write_stamps import CLOSED, FORKED, REWARDED, Fact, Followed, FollowedFacts
from flywheel.gateway.core.config import Settings
from flywheel.gateway.core.store_api import (
    QUIET_STATUSES,
    AliasVersions,
    CanaryReward,
    FormedGroup,
    HeldoutContext,
    JobRunRecord,
    Pending,
    Promoted,
    Recovered,
    RewardByVersion,
    RewardRow,
    Rewards,
    ScoreCounts,
    Version,
    VersionSummary,
)
from flywheel.gateway.storeproc import versions
from flywheel.gateway.storeproc.reward_facts import RewardFacts
from flywheel.gateway.storeproc.training_records import record_failed_round, record_training, training_batch
from flywheel.judge.rewards import InvalidFeedbackError, feedback_reward


def adapter_dir(settings: Settings, alias: str, version: int) -> Path:
    from flywheel.trainer.adapters import alias_dir

    return alias_dir(settings.data_dir, alias) / str(version)


# -- the pipeline's store jobs ------------------------------------------------------------------------------


def holdout_fraction(settings: Settings) -> float:
    gate = settings.loop.gate
    return gate.holdout_fraction if settings.loop.enabled and gate.offline else 0.0


def grouping_rules(settings: Settings) -> GroupingRules:
    config = settings.groups
    return GroupingRules(min_size=config.min_size, max_size=config.max_size, task_window_s=config.task_window_s,
                         cohorts=config.cohorts, holdout_fraction=holdout_fraction(settings))


@dataclass
class IdleWatch:
    """Where this process is the store's one writer: a time no open trajectory was last written before, kept from
    what the writes since the last close said (docs/loop.md, "Incremental jobs")."""

    facts: FollowedFacts
    oldest_open: float = -math.inf  # epoch seconds; inf: none open, -inf: not known

    def lower(self, facts: list[Fact] | None) -> None:
        """Take in the trajectories written since: one that may be open may have been written that long ago."""
        if facts is None:
            self.oldest_open = -math.inf
            return
        for table, _, _, values in facts:
            if table == "trajectories" and values.get("status") != "closed":
                at = values.get("updated_at")
                self.oldest_open = min(self.oldest_open, -math.inf if at is None else epoch(at))


IDLE_WATCHES: weakref.WeakKeyDictionary[Store, IdleWatch] = weakref.WeakKeyDictionary()


def close_idle(store: Store, settings: Settings) -> int:
    """Close the open trajectories idle for ``capture.idle_close_s``. On DuckDB only once one can be: until then
    the ``UPDATE`` would find nothing."""
    idle_s = settings.capture.idle_close_s
    if store.shared:
        return store.close_idle(idle_s)
    watch = IDLE_WATCHES.get(store)
    if watch is None:
        watch = IDLE_WATCHES[store] = IdleWatch(store.stamps.follow_facts())
    watch.lower(watch.facts.take())
    now = utcnow()
    if now.timestamp() - idle_s <= watch.oldest_open:
        return 0
    closed = store.close_idle(idle_s, now=now)
    with store.engine.connect() as connection:  # after the take: a write committed since is read here or taken next
        oldest = connection.execute(sa_select(func.min(Trajectory.updated_at))
                                    .where(col(Trajectory.status) == "open")).scalar()
    watch.oldest_open = math.inf if oldest is None else epoch(oldest)
    return closed


SHORT_LAG_S = 5.0  # a run looks back this far past the last run's start: a write that committed a little late
MARK_LAG_S = 60.0  # every LONG_LOOK_S a run looks back this far past the last such run's start: one much later
LONG_LOOK_S = 30.0
FULL_PASS_S = 600.0  # every key is looked at this often: what no watermark shows (a replayed spool, a deleted group)


@dataclass(frozen=True)
class Look:
    """What one run of an incremental job reads: rows since ``since`` (None: everything); ``long``: a look far
    enough back for writes that committed up to ``MARK_LAG_S`` late."""

    since: datetime | None
    long: bool


@dataclass
class Watermark:
    """Where the last runs of an incremental job started, and when it last looked at everything (docs/loop.md)."""

    started: datetime | None = None  # the last run's start
    long_started: datetime | None = None  # the last long (or full) run's start
    long_at: float = -math.inf
    full_at: float = -math.inf

    def look(self) -> Look:
        """What this run reads: everything (the first run, or a full pass is due), a long look every
        ``LONG_LOOK_S``, else a short one."""
        now = time.monotonic()
        if self.started is None or self.long_started is None or now - self.full_at >= FULL_PASS_S:
            return Look(None, long=True)
        if now - self.long_at >= LONG_LOOK_S:
            return Look(self.long_started - timedelta(seconds=MARK_LAG_S), long=True)
        return Look(self.started - timedelta(seconds=SHORT_LAG_S), long=False)

    def ran(self, started: datetime, look: Look) -> None:
        self.started = started
        if look.long:
            self.long_started, self.long_at = started, time.monotonic()
        if look.since is None:
            self.full_at = time.monotonic()


FORMATION_MARKS: weakref.WeakKeyDictionary[Store, Watermark] = weakref.WeakKeyDictionary()


@dataclass
class Changes:
    """What the store process's own writes changed since a job last looked (``capture/write_stamps.py``)."""

    closed: Followed
    forked: Followed

    def take(self) -> Changed | None:
        """The trajectories closed and completions forked since the last take; None: look at everything."""
        closed, forked = self.closed.take(), self.forked.take()
        if closed is None or forked is None:
            return None
        return Changed(frozenset(closed), frozenset(forked))

    def give_back(self, changed: Changed | None) -> None:
        """A run that failed: what it took is looked at by the next one."""
        self.closed.give_back(None if changed is None else changed.closed)
        self.forked.give_back(None if changed is None else changed.forked)


@dataclass
class Formation:
    """Group formation where this process is the store's one writer: what its writes changed, and what waits."""

    changes: Changes
    waiting: Waiting = field(default_factory=Waiting)


FORMATIONS: weakref.WeakKeyDictionary[Store, Formation] = weakref.WeakKeyDictionary()


def run_group_formation(store: Store, settings: Settings) -> list[FormedGroup]:
    """Form the groups the store allows now; the new groups. Incremental: where this process is the store's one
    writer, from the trajectories its own writes closed and the turns they forked since the last run, beside those
    still waiting for their group (nothing to read when nothing changed); on a shared store, what changed since a
    little before the last run (``Watermark``), and everything every ``FULL_PASS_S``. The first run looks at
    everything."""
    rules = grouping_rules(settings)
    if store.shared or rules.cohorts:
        return _formation_from_watermark(store, settings)
    formation = FORMATIONS.get(store)
    if formation is None:  # follow from now on, then look at everything once
        formation = FORMATIONS[store] = Formation(Changes(store.stamps.follow(CLOSED), store.stamps.follow(FORKED)))
        changed = None
    else:
        changed = formation.changes.take()
        if changed is not None and not changed.closed and not changed.forked:
            return []
    try:
        with Session(store.engine, expire_on_commit=False) as session:
            groups = formation.waiting.form(session, rules, changed)
            session.commit()
    except BaseException:
        formation.changes.give_back(None)  # what waits may be off by what this run took: the next run reads it all
        raise
    return [FormedGroup(id=g.id, source=g.source, key=g.key, alias=g.alias, size=g.size) for g in groups]


def _formation_from_watermark(store: Store, settings: Settings) -> list[FormedGroup]:
    mark = FORMATION_MARKS.setdefault(store, Watermark())
    started, look = utcnow(), mark.look()
    with Session(store.engine, expire_on_commit=False) as session:
        groups = form_groups(session, grouping_rules(settings), since=look.since)
        session.commit()
    mark.ran(started, look)
    return [FormedGroup(id=g.id, source=g.source, key=g.key, alias=g.alias, size=g.size) for g in groups]


SCORING: weakref.WeakKeyDictionary[Store, asyncio.Lock] = weakref.WeakKeyDictionary()


async def score(store: Store, settings: Settings, alias: str | None = None) -> ScoreCounts:
    """Score the pending groups; one run at a time (the loop's and ``POST /jobs/score``): two would judge the same
    groups twice and conflict when they mark them scored."""
    from flywheel.judge.scoring import score_pending

    async with SCORING.setdefault(store, asyncio.Lock()):
        summary = await score_pending(store.engine, settings.judge, settings.rewards, alias=alias)
    return ScoreCounts(**asdict(summary))


# One statement (each costs more than the rows it reads): the last round (first: its column's type), open
# trajectories, groups by status.
_PENDING = text("""
    SELECT '#trained', 0, max(created_at) FROM adapter_versions WHERE alias = :alias AND source = 'trained'
    UNION ALL SELECT '#open', count(*), NULL FROM trajectories WHERE status = 'open' AND alias = :alias
    UNION ALL SELECT status, count(*), NULL FROM groups WHERE alias = :alias GROUP BY status
""")


def pending(store: Store, settings: Settings, alias: str) -> Pending:
    """What waits for the loop: open trajectories, groups by status, and when the alias last trained."""
    with store.engine.connect() as connection:
        rows = connection.execute(_PENDING, {"alias": alias}).all()
    by_status = {str(status): int(count) for status, count, _ in rows if not str(status).startswith("#")}
    found = {status: (count, at) for status, count, at in rows if str(status).startswith("#")}
    return Pending(open_trajectories=int(found["#open"][0]), groups=by_status,
                   scored_groups=by_status.get("scored", 0), last_trained_at=found["#trained"][1])


# -- training rounds ----------------------------------------------------------------------------------------


def batch(store: Store, settings: Settings, alias: str, max_groups: int,
          group_ids: list[str] | None = None) -> list[TrainingGroup]:
    return training_batch(store, alias, max_groups, group_ids, order=settings.train.batch_order)


def reserve_version(store: Store, settings: Settings, alias: str, base_model: str, source: str = "trained",
                    status: str = "training", path: str | None = None,
                    parent_version: int | None = None, alone: bool = False, one_round: bool = False) -> Version:
    """The next version number, reserved. ``one_round``: only while no other round of the alias trains (no
    version ``training``); ``alone``: only while no other version of it is in flight (trainer workers). Either
    is checked and reserved as one step across every replica."""
    refuse = versions.IN_FLIGHT if alone else ("training",) if one_round else ()
    with store.session() as session, \
            store.exclusive(session, f"reserve:{alias}") if refuse else contextlib.nullcontext():
        row = versions.reserve(session, alias, path_of=lambda n: adapter_dir(settings, alias, n),
                               base_model=base_model, source=source, status=status, path=path,
                               parent_version=parent_version, refuse=refuse)
        return Version.model_validate(row)


def record_round(store: Store, settings: Settings, alias: str, version: int, parent_version: int | None,
                 promote: bool, result: dict[str, Any], batch_group_ids: list[str] | None = None) -> Version | None:
    from flywheel.trainer.grpo_args import RoundResult

    adapter = record_training(store, alias, RoundResult.from_json(result), version=version,
                              parent_version=parent_version, promote=promote, batch_group_ids=batch_group_ids or [])
    return Version.model_validate(adapter) if adapter is not None else None


def failed_round(store: Store, settings: Settings, alias: str, version: int, error: str,
                 group_ids: list[str] | None = None) -> Version:
    return Version.model_validate(record_failed_round(store, alias, version, error, group_ids or []))


# -- versions -----------------------------------------------------------------------------------------------


def list_versions(store: Store, settings: Settings, alias: str) -> list[Version]:
    with store.session() as session:
        return [Version.model_validate(row) for row in versions.listing(session, alias)]


def serving(store: Store, settings: Settings) -> dict[str, AliasVersions]:
    """Per alias: the version serving it, the oldest in flight (training, candidate or canary), the one
    training now and the newest waiting for its gate, each or None. A round may train while an older
    version is on canary (docs/loop.md)."""
    with store.session() as session:
        found = versions.at_a_glance(session, list(settings.aliases))
    return {alias: AliasVersions(**{key: Version.model_validate(row) if row else None for key, row in rows.items()})
            for alias, rows in found.items()}


def training_head(store: Store, settings: Settings, alias: str) -> Version | None:
    """The version the next round of ``alias`` continues from (versions.training_head), None: the base model."""
    with store.session() as session:
        row = versions.training_head(session, alias)
        return Version.model_validate(row) if row is not None else None


def promote(store: Store, settings: Settings, alias: str, version: int, reason: str,
            replaced_status: str = "retired") -> Promoted:
    with store.session() as session:
        target, previous = versions.promote(session, alias, version, reason=reason, replaced_status=replaced_status)
        return Promoted(serving=Version.model_validate(target) if target else None,
                        previous=Version.model_validate(previous) if previous else None)


def rollback_target(store: Store, settings: Settings, alias: str) -> int:
    with store.session() as session:
        return versions.rollback_target(session, alias)


def decide(store: Store, settings: Settings, alias: str, version: int, status: str, reason: str,
           gate: dict[str, Any] | None = None) -> Version:
    with store.session() as session:
        return Version.model_validate(versions.decide(session, alias, version, status, reason=reason, gate=gate))


def record_gate(store: Store, settings: Settings, alias: str, version: int, gate: dict[str, Any]) -> Version:
    with store.session() as session:
        return Version.model_validate(versions.record_gate(session, alias, version, gate))


def recover(store: Store, settings: Settings, rounds: bool = True) -> Recovered:
    """When a gateway starts leading the loop: rounds (with ``rounds``; trainer workers' are not the gateway's)
    that were in progress when the last leader stopped are recorded failed."""
    if not rounds:
        return Recovered(rounds_failed=0)
    with store.session() as session:
        return Recovered(rounds_failed=versions.fail_stale(session))


# -- job runs -----------------------------------------------------------------------------------------------


def record_runs(store: Store, settings: Settings, runs: list[JobRunRecord]) -> None:
    """Record finished runs, in order, in one transaction; a quiet one (``idle``, ``waiting``) replaces its job's
    previous quiet runs.

    The table keeps every run that acted or failed and the latest quiet one of each job; the loop records a quiet
    run only when its job turns quiet, and sends its runs every few seconds (docs/loop.md)."""
    kept: list[JobRunRecord] = []
    quieted: set[tuple[str, str | None]] = set()
    for run in runs:
        if run.status in QUIET_STATUSES:
            quieted.add((run.job, run.alias))
            kept = [k for k in kept if not (k.status in QUIET_STATUSES and (k.job, k.alias) == (run.job, run.alias))]
        kept.append(run)
    if not kept:
        return
    with store.session() as session:
        for job, alias in sorted(quieted, key=str):
            session.execute(delete(JobRun).where(col(JobRun.job) == job, col(JobRun.alias).is_not_distinct_from(alias),
                                                 col(JobRun.status).in_(QUIET_STATUSES))
                            .execution_options(synchronize_session=False))
        session.execute(insert(JobRun).values([run.model_dump() for run in kept]))  # one statement, not one a row
        session.commit()


def last_runs(store: Store, settings: Settings, alias: str, jobs: list[str]) -> dict[str, JobRunRecord]:
    """The latest run of each of ``jobs`` (for ``alias``, or alias-wide): a busy job cannot hide a quiet one."""
    found: dict[str, JobRunRecord] = {}
    with store.session() as session:
        for job in jobs:
            query = (select(JobRun).where(col(JobRun.job) == job,
                                          or_(col(JobRun.alias) == alias, col(JobRun.alias).is_(None)))
                     .order_by(col(JobRun.started_at).desc()).limit(1))
            run = session.exec(query).first()
            if run is not None:
                found[job] = JobRunRecord.model_validate(run)
    return found


# -- rewards per version (the A/B test, the monitor, status) ------------------------------------------------

Reader = Session | Connection  # a read needs no ORM session: a connection costs less per statement


def trajectory_rewards(session: Reader, alias: str, *, since: datetime | None = None,
                       until: datetime | None = None, versions_in: list[int] | None = None,
                       judge_only: bool = False, ids: list[str] | None = None) -> tuple[list[dict[str, Any]], int]:
    """Closed trajectories of ``alias`` with a reward, in the order they closed, and how many were mixed.

    A trajectory's version is the adapter version of its first turn (the canary keeps a conversation
    on one version; one that changed version midway is counted as mixed and left out). Its reward is
    the final reward of the scoring job when there is one, else its latest feedback (unless the
    reward policy is ``judge_only``). ``ids``: only these trajectories.
    """
    out, mixed = _rewarded(session, alias, since=since, until=until, versions_in=versions_in, judge_only=judge_only,
                           ids=ids)
    return out, len(mixed)


def _rewarded(session: Reader, alias: str, *, since: datetime | None = None, until: datetime | None = None,
              versions_in: list[int] | None = None, judge_only: bool = False,
              ids: list[str] | None = None) -> tuple[list[dict[str, Any]], set[str]]:
    """``trajectory_rewards``, with the ids of the mixed trajectories rather than their count."""
    if ids is None:
        versions, told, final = _reward_inputs(session, alias, since, until, judge_only)
    else:
        assert since is None and until is None, "ids are chosen already"
        versions, told, final = _reward_inputs_of(session, alias, ids, judge_only)
    mixed: set[str] = set()
    by_id: dict[str, dict[str, Any]] = {}
    for trajectory_id, closed_at, low, high in versions:
        if low != high:
            mixed.add(trajectory_id)
            continue
        if versions_in is None or low in versions_in:
            by_id[trajectory_id] = {"trajectory_id": trajectory_id, "closed_at": closed_at, "version": int(low)}
    rewards: dict[str, float] = {}
    for trajectory_id, reward, label in told:  # oldest first: the latest feedback wins
        if trajectory_id in by_id:
            with contextlib.suppress(InvalidFeedbackError):
                rewards[trajectory_id] = feedback_reward(reward, label)
    for trajectory_id, value in final:
        if trajectory_id in by_id:
            rewards[trajectory_id] = value  # the scoring job's final word wins
    out = [{**row, "reward": rewards[i]} for i, row in by_id.items() if i in rewards and math.isfinite(rewards[i])]
    out.sort(key=lambda r: (r["closed_at"], r["trajectory_id"]))
    for row in out:
        row["closed_at"] = row["closed_at"].isoformat() if row["closed_at"] else None
    return out, mixed


RewardInputs = tuple[list[tuple[str, datetime | None, int, int]], list[tuple[str, float | None, str | None]],
                     list[tuple[str, float]]]


def _reward_inputs(session: Reader, alias: str, since: datetime | None, until: datetime | None,
                   judge_only: bool) -> RewardInputs:
    """Every closed trajectory of ``alias`` (created in ``[since, until)``): its versions (first and last turn's
    adapter version), feedback and final rewards, oldest first. One join per table, read as tuples."""
    chosen_ones: list[ColumnElement[bool]] = [col(Trajectory.alias) == alias, col(Trajectory.status) == "closed",
                                              col(Trajectory.close_reason) != "fork"]
    if since is not None:
        chosen_ones.append(col(Trajectory.created_at) >= since)
    if until is not None:
        chosen_ones.append(col(Trajectory.created_at) < until)
    query = (select(Trajectory.id, Trajectory.closed_at, func.min(Turn.adapter_version), func.max(Turn.adapter_version))
             .join(Turn, and_(col(Turn.trajectory_id) == col(Trajectory.id)))
             .where(*chosen_ones, col(Turn.source) != "fork").group_by(col(Trajectory.id), col(Trajectory.closed_at)))
    versions = [(i, closed_at, int(low), int(high)) for i, closed_at, low, high in session.execute(query).all()]
    told = [] if judge_only else [tuple(row) for row in session.execute(
        sa_select(col(Feedback.trajectory_id), col(Feedback.reward), col(Feedback.label))
        .join(Trajectory, col(Trajectory.id) == col(Feedback.trajectory_id)).where(*chosen_ones)
        .order_by(col(Feedback.created_at)))]
    final = [tuple(row) for row in session.execute(
        sa_select(col(Score.trajectory_id), col(Score.value))
        .join(Trajectory, col(Trajectory.id) == col(Score.trajectory_id))
        .where(*chosen_ones, col(Score.source) == "reward").order_by(col(Score.created_at)))]
    return versions, told, final


def _reward_inputs_of(session: Reader, alias: str, ids: list[str], judge_only: bool) -> RewardInputs:
    """``_reward_inputs`` of the trajectories ``ids``, in one statement: each table read by its indexed trajectory
    id alone (with another predicate DuckDB scans the table instead of using the index), every other condition
    checked here."""
    text_null, number_null = cast(null(), String), cast(null(), Float)
    rows = session.execute(union_all(
        sa_select(literal("trajectory"), col(Trajectory.id), number_null, col(Trajectory.alias), col(Trajectory.status),
                  col(Trajectory.close_reason), col(Trajectory.closed_at)).where(col(Trajectory.id).in_(ids)),
        sa_select(literal("turn"), col(Turn.trajectory_id), cast(col(Turn.adapter_version), Float), col(Turn.source),
                  text_null, text_null, col(Turn.created_at)).where(col(Turn.trajectory_id).in_(ids)),
        sa_select(literal("feedback"), col(Feedback.trajectory_id), cast(col(Feedback.reward), Float),
                  col(Feedback.label), text_null, text_null, col(Feedback.created_at))
        .where(col(Feedback.trajectory_id).in_(ids)),
        sa_select(literal("score"), col(Score.trajectory_id), col(Score.value), col(Score.source), text_null, text_null,
                  col(Score.created_at)).where(col(Score.trajectory_id).in_(ids)))).all()
    closed = {i: at for kind, i, _, owner, status, reason, at in rows
              if kind == "trajectory" and owner == alias and status == "closed" and reason != "fork"}
    spans: dict[str, tuple[int, int]] = {}
    told: list[tuple[str, float | None, str | None]] = []
    final: list[tuple[str, float]] = []
    for kind, trajectory_id, number, word, _, _, _ in sorted((r for r in rows if r[1] in closed),
                                                             key=lambda r: (r[6] is None, r[6] or 0)):
        if kind == "turn" and word != "fork":
            version = int(number)
            low, high = spans.get(trajectory_id, (version, version))
            spans[trajectory_id] = (min(low, version), max(high, version))
        elif kind == "feedback" and not judge_only:
            told.append((trajectory_id, number, word))  # oldest first: the latest feedback wins
        elif kind == "score" and word == "reward":
            final.append((trajectory_id, number))
    versions = [(i, closed[i], low, high) for i, (low, high) in spans.items()]
    return versions, [t for t in told if t[0] in spans], [f for f in final if f[0] in spans]


def rewards(store: Store, settings: Settings, alias: str, since: datetime | None = None,
            until: datetime | None = None, versions_in: list[int] | None = None) -> Rewards:
    with store.session() as session:
        rows, mixed = trajectory_rewards(session, alias, since=since, until=until, versions_in=versions_in,
                                         judge_only=settings.rewards.policy == "judge_only")
    return Rewards(rewards=[RewardRow(**row) for row in rows], mixed=mixed)


def canary_rewards(store: Store, settings: Settings, alias: str, since: datetime,
                   versions_in: list[int]) -> list[CanaryReward]:
    """What the canary pairs (``abtest.pair_finished``): every reward of ``versions_in`` since ``since``, with its
    context and the time it became known, oldest first."""
    with store.session() as session:
        rows = conversation_units(session, alias, since, versions_in,
                                  judge_only=settings.rewards.policy == "judge_only")
        rows += fork_units(session, alias, since, versions_in)
    rows.sort(key=lambda r: (r["at"], r["context"] or "", r["order"]))
    return [CanaryReward(**{**row, "at": epoch(row["at"])}) for row in rows]


def conversation_units(session: Session, alias: str, since: datetime | None, versions_in: list[int], *,
                       judge_only: bool) -> list[dict[str, Any]]:
    """Closed conversations on one version, none of whose turns was forked (those count through their fork
    groups: one reward, one pair), with the first reward recorded for each (a pair, once formed, never changes):
    context = task key, at = when it was both closed and rewarded."""
    forked = select(Turn.completion_id).where(Turn.source == "fork", col(Turn.created_at) >= since)
    query = (sa_select(col(Trajectory.id), col(Trajectory.closed_at), col(Trajectory.task_key),
                       func.min(Turn.adapter_version), func.max(Turn.adapter_version))
             .join(Turn, col(Turn.trajectory_id) == col(Trajectory.id))
             .where(col(Trajectory.alias) == alias, col(Trajectory.status) == "closed",
                    col(Trajectory.close_reason) != "fork", col(Trajectory.created_at) >= since,
                    col(Turn.source) != "fork",
                    col(Trajectory.id).not_in(select(Turn.trajectory_id).where(col(Turn.completion_id).in_(forked))))
             .group_by(col(Trajectory.id), col(Trajectory.closed_at), col(Trajectory.task_key)))
    found = {tid: (closed_at, key, int(low)) for tid, closed_at, key, low, high in session.execute(query).all()
             if low == high and low in versions_in}
    first: dict[str, tuple[datetime, float]] = {}
    ids = list(found)
    for start in range(0, len(ids), 500):
        chunk = ids[start:start + 500]
        rewards: list[tuple[str, datetime, float]] = [
            (row.trajectory_id, row.created_at, row.value) for row in session.exec(
                select(Score).where(col(Score.trajectory_id).in_(chunk), Score.source == "reward"))]
        if not judge_only:
            for feedback in session.exec(select(Feedback).where(col(Feedback.trajectory_id).in_(chunk))):
                with contextlib.suppress(InvalidFeedbackError):
                    rewards.append((feedback.trajectory_id, feedback.created_at,
                                    feedback_reward(feedback.reward, feedback.label)))
        for trajectory_id, at, value in rewards:
            if math.isfinite(value) and (trajectory_id not in first or at < first[trajectory_id][0]):
                first[trajectory_id] = (at, value)
    return [{"at": max(at, found[tid][0] or at), "version": found[tid][2], "context": found[tid][1],
             "reward": value, "order": tid} for tid, (at, value) in first.items()]


def fork_units(session: Session, alias: str, since: datetime | None, versions_in: list[int]) -> list[dict[str, Any]]:
    """Every judged answer of a fork group (the client's and its siblings, one turn each) that is a sample of its
    version: context = the group, reward = the judge's (or the reward hook's) own score, the same call for every
    member, at = when it was judged. A sibling drawn without replacement is not: the draw keeps it apart from
    the answers drawn before it, so it would measure its version by its less likely answers."""
    query = (sa_select(col(Group.key), col(Turn.choice_index), col(Turn.adapter_version), col(Score.created_at),
                       col(Score.value))
             .join(GroupMember, col(GroupMember.group_id) == col(Group.id))
             .join(Turn, col(Turn.id) == col(GroupMember.leaf_turn_id))
             .join(Score, and_(col(Score.group_id) == col(Group.id),
                               col(Score.trajectory_id) == col(GroupMember.trajectory_id)))
             .where(col(Group.alias) == alias, col(Group.source) == "fork", col(Turn.created_at) >= since,
                    col(Score.source).in_(["ruler", "hook"]), col(Turn.adapter_version).in_(versions_in),
                    col(Turn.inclusion_logprob).is_(None))
             .order_by(col(Score.created_at)))
    first: dict[tuple[str, int], dict[str, Any]] = {}
    for key, choice, version, at, value in session.execute(query).all():
        if (key, choice) not in first and math.isfinite(value):  # a group judged again keeps its first word
            first[(key, choice)] = {"at": at, "version": int(version), "context": f"fork:{key}",
                                    "reward": value, "order": f"{choice:04d}"}
    return list(first.values())


@dataclass
class VersionRewards:
    """Per-version reward sums of one alias, kept up to date from what changed (docs/loop.md, "Incremental jobs")."""

    mark: Watermark = field(default_factory=Watermark)  # a shared store's
    followed: tuple[Followed, Followed] | None = None  # the trajectories this process's writes closed, rewarded
    facts: FollowedFacts | None = None  # and what their rewards are made of
    known: RewardFacts | None = None  # those parts, per trajectory
    reward_of: dict[str, tuple[int, float]] = field(default_factory=dict)  # trajectory -> (version, reward)
    mixed: set[str] = field(default_factory=set)
    sums: dict[int, list[float]] = field(default_factory=dict)  # version -> [n, sum, sum of squares]

    def drop(self, trajectory_id: str) -> None:
        self.mixed.discard(trajectory_id)
        if (old := self.reward_of.pop(trajectory_id, None)) is not None:
            version, reward = old
            n_sum_sq = self.sums[version]
            n_sum_sq[0] -= 1
            n_sum_sq[1] -= reward
            n_sum_sq[2] -= reward * reward
            if n_sum_sq[0] == 0:
                del self.sums[version]

    def add(self, trajectory_id: str, version: int, reward: float) -> None:
        self.reward_of[trajectory_id] = (version, reward)
        n_sum_sq = self.sums.setdefault(version, [0, 0.0, 0.0])
        n_sum_sq[0] += 1
        n_sum_sq[1] += reward
        n_sum_sq[2] += reward * reward


VERSION_REWARDS: weakref.WeakKeyDictionary[Store, dict[tuple[str, bool], VersionRewards]] = \
    weakref.WeakKeyDictionary()


def forget_rewards(store: Store) -> None:
    """After a deletion: the next ``reward_by_version`` recomputes, and group formation looks at everything (a
    deleted trajectory leaves no watermark, nor a change to follow)."""
    for kept in VERSION_REWARDS.pop(store, {}).values():
        for followed in (*(kept.followed or ()), *([kept.facts] if kept.facts else [])):
            store.stamps.unfollow(followed)
    store.stamps.forget()


def changed_trajectories(session: Reader, alias: str, since: datetime, judge_only: bool) -> list[str]:
    """Trajectories of ``alias`` closed, given feedback or scored since ``since``: whose reward may have changed."""
    ids = set(session.execute(select(Trajectory.id).where(Trajectory.alias == alias,
                                                          col(Trajectory.closed_at) >= since)).scalars())
    if not judge_only:
        ids.update(session.execute(select(Feedback.trajectory_id).where(col(Feedback.created_at) >= since)).scalars())
    ids.update(session.execute(select(Score.trajectory_id).where(Score.source == "reward",
                                                                 col(Score.created_at) >= since)).scalars())
    return sorted(ids)


def reward_by_version(store: Store, settings: Settings, alias: str) -> RewardByVersion:
    """Mean reward, n and a 95% interval (normal approximation) per version, over every rewarded trajectory.

    Incremental: sums per version kept in the store process, updated from the trajectories whose reward may have
    changed: where this process is the store's one writer, those its own writes closed, rewarded or otherwise
    touched, answered from what those writes said (:mod:`reward_facts`) and read from the store only when
    written before this process began following them; on a shared store, those changed since a little before
    the last call, and everything every ``FULL_PASS_S``. The first call reads everything."""
    judge_only = settings.rewards.policy == "judge_only"
    kept = VERSION_REWARDS.setdefault(store, {}).setdefault((alias, judge_only), VersionRewards())
    if store.shared:
        started, look = utcnow(), kept.mark.look()
        with store.engine.connect() as session:
            changed = None if look.since is None else changed_trajectories(session, alias, look.since, judge_only)
            _update_rewards(kept, session, alias, judge_only, changed)
        kept.mark.ran(started, look)
    else:
        _follow_rewards(kept, store, alias, judge_only)
    return RewardByVersion(versions={str(v): summarize_sums(*kept.sums[v]) for v in sorted(kept.sums)},
                           mixed=len(kept.mixed))


def _follow_rewards(kept: VersionRewards, store: Store, alias: str, judge_only: bool) -> None:
    """``reward_by_version``'s update where this process is the store's one writer."""
    if kept.followed is None or kept.facts is None or kept.known is None:  # follow from now on, read all once
        kept.followed = (store.stamps.follow(CLOSED), store.stamps.follow(REWARDED))
        kept.facts, taken = store.stamps.follow_facts(), None
        kept.known = RewardFacts(single_precision=store.engine.dialect.name == "duckdb")  # FLOAT is 4 bytes there
    else:
        closed, rewarded = (followed.take() for followed in kept.followed)
        facts = kept.facts.take()
        if facts is None:  # too many to keep: what else changed is not known, so read everything once
            kept.known.clear()
        touched = kept.known.apply(facts or [])
        taken = None if closed is None or rewarded is None or facts is None else closed | rewarded | touched
    from_facts = [] if taken is None else [i for i in taken if i in kept.known.known]
    unknown = None if taken is None else sorted(taken.difference(from_facts))
    if unknown is None or unknown:
        try:
            with store.engine.connect() as session:
                _update_rewards(kept, session, alias, judge_only, unknown)
        except BaseException:
            kept.followed[0].give_back(taken)
            raise
    for trajectory_id in from_facts:
        kept.drop(trajectory_id)
        answer = kept.known.answer(trajectory_id, alias, judge_only)
        if answer == "mixed":
            kept.mixed.add(trajectory_id)
        elif isinstance(answer, tuple):
            kept.add(trajectory_id, *answer)


def _update_rewards(kept: VersionRewards, session: Reader, alias: str, judge_only: bool,
                    changed: list[str] | None) -> None:
    """Recompute the rewards of the ``changed`` trajectories in ``kept`` (None: of every trajectory)."""
    if changed is None:
        rows, mixed = _rewarded(session, alias, judge_only=judge_only)
        kept.reward_of.clear()
        kept.sums.clear()
        kept.mixed = mixed
    else:
        rows, mixed = [], set()
        for start in range(0, len(changed), 500):
            chunk_rows, chunk_mixed = _rewarded(session, alias, judge_only=judge_only, ids=changed[start:start + 500])
            rows += chunk_rows
            mixed |= chunk_mixed
        for trajectory_id in changed:
            kept.drop(trajectory_id)
        kept.mixed |= mixed
    for row in rows:
        kept.add(row["trajectory_id"], row["version"], row["reward"])


def summarize_sums(n: float, total: float, squares: float) -> VersionSummary:
    """Mean, n and a 95% interval (normal approximation) from a count, a sum and a sum of squares."""
    count = int(n)
    mean = total / count if count else math.nan
    variance = max(0.0, (squares - total * total / count) / (count - 1)) if count > 1 else math.inf
    half = 1.96 * math.sqrt(variance / count) if count > 1 else math.inf
    if math.isfinite(half):
        return VersionSummary(n=count, mean=mean, low=mean - half, high=mean + half)
    return VersionSummary(n=count, mean=mean)



# -- the offline gate's contexts ----------------------------------------------------------------------------


def heldout_contexts(store: Store, settings: Settings, alias: str, count: int) -> list[HeldoutContext]:
    """The first request of the ``count`` most recent held-out conversations (never in a group, so never trained on).

    Sub-agent trajectories are left out: they are scored (and may be trained) with their parent's group.
    """
    fraction = holdout_fraction(settings)
    grouped = select(GroupMember.trajectory_id)
    with store.session() as session:
        recent = session.exec(select(Trajectory.id).where(Trajectory.alias == alias, Trajectory.status == "closed",
                                                          col(Trajectory.close_reason) != "fork",
                                                          col(Trajectory.parent_trajectory_id).is_(None),
                                                          col(Trajectory.id).not_in(grouped))
                              .order_by(col(Trajectory.closed_at).desc()).limit(max(count * 50, 1000))).all()
        chosen = [t for t in recent if held_out(t, fraction)][:count]
        contexts = []
        for trajectory_id in chosen:
            first = session.exec(select(Turn).where(Turn.trajectory_id == trajectory_id, Turn.depth == 0,
                                                    Turn.source != "fork")
                                 .order_by(col(Turn.created_at)).limit(1)).first()
            if first is not None and first.endpoint == "chat.completions" and first.request_messages:
                contexts.append(HeldoutContext(trajectory_id=trajectory_id, messages=first.request_messages,
                                               tools=first.tools))
    return contexts

