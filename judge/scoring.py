"""The scoring job: every closed, unscored group gets judge scores and final rewards.

For each group (in parallel up to ``max_concurrency`` judge calls): its members become
trajectories (one branch each), RULER scores them relative to each other (cached in the
store) — or, with ``[judge] reward_hook``, the task's own check scores each member's last
answer (one ``source = "hook"`` row per member) — the latest client feedback of each member is
combined with that score under the reward policy, and one ``scores`` row with ``source =
"reward"`` per member records the final reward the trainer uses (``explanation`` starts with
where it came from). The group's status becomes ``scored`` (``untrainable`` when its final rewards
are all equal, a canary's pair sibling aside: nothing for GRPO to learn). A group whose judge or hook call
fails after its retries stays ``closed`` and is tried again by the next run.

A fork group's members are turns, not conversations: they are scored by the judge or hook
alone. A conversation's feedback rewards the whole conversation (its task group, the canary),
and the siblings, which no client saw, could never have any.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from sqlalchemy import Engine, update
from sqlmodel import Session, col, select

from flywheel.capture.groups import branch_messages, branches, member_messages, with_sub_agents
from flywheel.capture.linker import chunks
from flywheel.capture.models import Feedback, Group, Score, utcnow
from flywheel.capture.models import GroupMember as GroupMemberRow
from flywheel.capture.store import bulk_insert
from flywheel.capture.trajectory import Trajectory, TrajectoryGroup
from flywheel.capture.turns import new_id, turn_position
from flywheel.judge.cache import JudgeCache
from flywheel.judge.hook import RewardHook, RewardHookError, load_reward_hook, split_answer
from flywheel.judge.rewards import InvalidFeedbackError, RewardPolicy, apply_rewards, feedback_reward
from flywheel.judge.rubric import PROMPT_VERSION, resolve_rubric, rubric_hash
from flywheel.judge.ruler import JudgeConfig, group_cache_key, ruler_score_group

log = logging.getLogger("flywheel.scoring")


@dataclass
class ScoringSummary:
    groups: int = 0
    scored: int = 0
    failed: int = 0
    trajectories: int = 0
    seconds: float = 0.0
    failed_group_ids: list[str] = field(default_factory=list)
    fork_taught: list[tuple[str, int, bool]] = field(default_factory=list)  # (alias, position, did not tie) per fork


def pending_groups(engine: Engine, alias: str | None = None, limit: int | None = None) -> list[Group]:
    """Closed groups with no final rewards yet, oldest first."""
    with Session(engine) as session:
        return _pending(session, alias, limit)


def _pending(session: Session, alias: str | None, limit: int | None) -> list[Group]:
    query = select(Group).where(Group.status == "closed").order_by(col(Group.created_at))
    if alias is not None:
        query = query.where(Group.alias == alias)
    if limit is not None:
        query = query.limit(limit)
    return list(session.exec(query))


def _pending_inputs(engine: Engine, alias: str | None, limit: int | None, *,
                    judged: bool) -> tuple[list[Group], dict[str, JudgeInput]]:
    """``pending_groups`` and their ``groups_for_judge``, in one session."""
    with Session(engine) as session:
        groups = _pending(session, alias, limit)
        return groups, _inputs(session, groups, judged)


class JudgeInput(NamedTuple):
    """A group as the judge reads it: its members, their feedback rewards, the task key (for the rubric)."""

    trajectories: TrajectoryGroup
    feedback: dict[str, float]
    task: str | None
    canary_pairs: frozenset[str] = frozenset()  # members judged with the group but never trained on
    position: int | None = None  # a fork group's turn: the assistant messages before it


INPUT_CHUNK = 200  # groups read together: a few queries per chunk, not a few per group
WRITE_EVERY = 100  # judged groups written together


def groups_for_judge(engine: Engine, groups: list[Group], *, judged: bool = True) -> dict[str, JudgeInput]:
    """Each group (by id) as trajectories, the members' latest feedback rewards, and the task key (for the
    rubric); read for many groups at once, one query per table. ``judged``: a judge or hook reads the members'
    conversations; else (feedback alone decides) they are left unread."""
    with Session(engine) as session:
        return _inputs(session, groups, judged)


def _inputs(session: Session, groups: list[Group], judged: bool) -> dict[str, JudgeInput]:
    out: dict[str, JudgeInput] = {}
    for chunk in chunks(groups, INPUT_CHUNK):
        out.update(_groups_for_judge(session, chunk, judged))
    return out


def _groups_for_judge(session: Session, groups: list[Group], judged: bool) -> dict[str, JudgeInput]:
    members_of: dict[str, list[GroupMemberRow]] = {g.id: [] for g in groups}
    for member in session.exec(select(GroupMemberRow).where(col(GroupMemberRow.group_id).in_(list(members_of)))):
        members_of[member.group_id].append(member)
    forks = [m for g in groups if g.source == "fork" for m in members_of[g.id]]
    others = [m for g in groups if g.source != "fork" for m in members_of[g.id]]
    # Kept apart: a fork group's leaf (its turn alone) may also end a task group's member (its whole branch).
    fork_paths = branches(session, forks, single_turn=True) if forks and judged else {}
    other_paths = branches(session, others) if others and judged else {}
    parents = with_sub_agents(session, [m.trajectory_id for m in others]) if others and judged else set()
    feedback: dict[str, float] = {}
    for trajectory_id, reward, label in session.execute(
            select(Feedback.trajectory_id, Feedback.reward, Feedback.label)
            .where(col(Feedback.trajectory_id).in_(list({m.trajectory_id for m in forks + others})))
            .order_by(col(Feedback.created_at))):
        with contextlib.suppress(InvalidFeedbackError):  # validated on the way in: an old bad row is skipped
            feedback[trajectory_id] = feedback_reward(reward, label)
    out: dict[str, JudgeInput] = {}
    for group in groups:
        trajectories = []
        task = None
        pairs: set[str] = set()
        position = None  # a fork group's members share one context: its assistant messages say which turn it is
        paths = fork_paths if group.source == "fork" else other_paths
        for member in members_of[group.id]:
            if member.leaf_turn_id is None:
                continue
            if not judged:  # feedback alone decides: the member's id is all it needs
                trajectories.append(Trajectory(messages_and_choices=[], id=member.trajectory_id,
                                               leaf_turn_id=member.leaf_turn_id))
                continue
            turns = paths[member.leaf_turn_id]
            task = task or turns[0].task_key
            if turns[-1].canary_pair:
                pairs.add(member.trajectory_id)
            if group.source == "fork" and position is None:
                position = turn_position(turns[-1].request_messages or [])
            messages = member_messages(session, member.trajectory_id, turns) \
                if member.trajectory_id in parents else branch_messages(turns)
            trajectories.append(Trajectory(messages_and_choices=messages, tools=turns[-1].tools,
                                           id=member.trajectory_id, leaf_turn_id=member.leaf_turn_id))
        ids = {m.trajectory_id for m in members_of[group.id]}
        if group.source == "fork":
            ids = set()  # a conversation's feedback is not its forked turn's reward (module docstring)
        out[group.id] = JudgeInput(TrajectoryGroup(trajectories=trajectories, id=group.id),
                                   {tid: reward for tid, reward in feedback.items() if tid in ids}, task,
                                   frozenset(pairs), position)
    return out


async def hook_score_group(group: TrajectoryGroup, hook: RewardHook, semaphore: asyncio.Semaphore,
                           retries: int = 0) -> TrajectoryGroup | None:
    """A copy of ``group`` with each member's last answer scored by the reward hook (``metrics["hook_score"]``),
    or None when the hook failed (after ``retries`` more tries) or a member has no answer."""
    async def one(trajectory: Trajectory) -> float | None:
        parts = split_answer(trajectory.messages())
        if parts is None:
            return None
        for attempt in range(retries + 1):
            try:
                async with semaphore:
                    return await hook(parts[0], trajectory.tools, parts[1])
            except RewardHookError as exc:
                if attempt == retries:
                    log.warning("group %s: %s", group.id, exc)
        return None

    scores = await asyncio.gather(*(one(t) for t in group.trajectories))
    trajectories = []
    for trajectory, score in zip(group.trajectories, scores, strict=True):
        if score is None:
            return None
        copy = trajectory.model_copy(deep=True)
        copy.reward = copy.metrics["hook_score"] = score
        trajectories.append(copy)
    return TrajectoryGroup(trajectories=trajectories, id=group.id, metadata=dict(group.metadata))


def hook_rows(group_id: str, group: TrajectoryGroup) -> list[dict[str, Any]]:
    """The hook's own score of each member (``source = "hook"``): what the canary pairs for a fork group."""
    return [Score(id=new_id("score"), trajectory_id=t.id, group_id=group_id, source="hook",
                  value=float(t.metrics["hook_score"]), explanation="reward hook", prompt_version=PROMPT_VERSION)
            .model_dump() for t in group.trajectories if t.id is not None]


async def judge_group(group: Group, judge_input: JudgeInput, config: JudgeConfig, policy: RewardPolicy,
                      semaphore: asyncio.Semaphore, cache: JudgeCache,
                      hook: RewardHook | None = None) -> list[dict[str, Any]] | None:
    """Judge one group (read by ``groups_for_judge``): its score rows, or None when the judge or hook failed."""
    trajectories, feedback, task = judge_input.trajectories, judge_input.feedback, judge_input.task
    rubric = resolve_rubric(config.rubrics, group.alias, task)
    judge_model: str | None = config.model
    scored: TrajectoryGroup | None = None
    own_rows: list[dict[str, Any]] = []  # the hook's scores (RULER's go through the judge cache)
    if hook is not None:
        scored, judge_model = await hook_score_group(trajectories, hook, semaphore, config.max_retries), None
        own_rows = hook_rows(group.id, scored) if scored is not None else []
    elif config.enabled:
        scored = await ruler_score_group(trajectories, config.model, rubric=rubric, swallow_exceptions=True,
                                         cache=cache, semaphore=semaphore, **config.call_kwargs())
    if scored is None and feedback_decides(policy, trajectories, feedback):
        scored, judge_model = trajectories, None  # no judge (off or failing), but every member has its reward
        log.info("group %s scored from client feedback alone (judge %s)", group.id,
                 "off" if not config.enabled else "failed")
    if scored is None:
        return None
    return own_rows + reward_rows(group.id, apply_rewards(scored, feedback, policy), judge_model,
                                  rubric_hash(rubric))


def judge_cache_key(group: Group, judge_input: JudgeInput, config: JudgeConfig) -> str:
    """The judge cache's key of ``group`` as :func:`judge_group` asks the judge about it."""
    trajectories, task = judge_input.trajectories, judge_input.task
    return group_cache_key(trajectories, config.model, resolve_rubric(config.rubrics, group.alias, task),
                           extra_litellm_params=config.extra_litellm_params)


def feedback_decides(policy: RewardPolicy, group: TrajectoryGroup, feedback: dict[str, float]) -> bool:
    """Under ``feedback_overrides``, a group whose every member has feedback can be scored without a judge."""
    return policy.policy == "feedback_overrides" and all(t.id in feedback for t in group.trajectories)


def reward_rows(group_id: str, group: TrajectoryGroup, judge_model: str | None, rubric: str) -> list[dict[str, Any]]:
    rows = []
    for trajectory in group.trajectories:
        source = trajectory.metadata.get("reward_source")
        if source is None or trajectory.id is None:
            continue
        explanation = (trajectory.metadata.get("ruler") or {}).get("explanation", "")
        rows.append(Score(id=new_id("score"), trajectory_id=trajectory.id, group_id=group_id, source="reward",
                          value=trajectory.reward, explanation=f"{source}: {explanation}", judge_model=judge_model,
                          rubric_hash=rubric, prompt_version=PROMPT_VERSION).model_dump())
    return rows


def teaches_nothing(rows: list[dict[str, Any]], left_out: frozenset[str] = frozenset()) -> bool:
    """Whether a group's final rewards are all equal, ``left_out`` (a canary's pair, never trained on) aside: GRPO's
    advantages are then all zero."""
    return len({row["value"] for row in rows
                if row["source"] == "reward" and row["trajectory_id"] not in left_out}) < 2


def _store_rewards(engine: Engine, judged: list[tuple[str, list[dict[str, Any]], bool]],
                   answers: list[dict[str, Any]]) -> None:
    """The judge's new answers (the cache's rows), the judged groups' final rewards and their status (each judged
    group's third item: whether it teaches nothing), in one transaction: ``scored``, or ``untrainable`` when the
    rewards are all equal, so that a round's ``max_groups`` and the loop's ``min_groups`` count only groups a round
    can learn from."""
    with Session(engine) as session:
        bulk_insert(session, Score, answers)
        bulk_insert(session, Score, [row for _, rows, _ in judged for row in rows])  # the ORM writes row by row
        for status in ("scored", "untrainable"):
            ids = [group_id for group_id, _, nothing in judged if nothing == (status == "untrainable")]
            for chunk in chunks(ids, 500):
                session.execute(update(Group).where(col(Group.id).in_(chunk)).values(status=status))
        session.commit()


async def score_pending(engine: Engine, config: JudgeConfig, policy: RewardPolicy, *, alias: str | None = None,
                        limit: int | None = None,
                        on_group_done: Callable[[Group, bool], None] | None = None) -> ScoringSummary:
    """Score every closed, unscored group (optionally of one alias), ``max_concurrency`` calls at a time."""
    started = time.perf_counter()
    groups, inputs = await asyncio.to_thread(_pending_inputs, engine, alias, limit,
                                             judged=config.enabled)
    summary = ScoringSummary(groups=len(groups))
    semaphore = asyncio.Semaphore(config.max_concurrency)
    cache = JudgeCache(engine, deferred=True)
    hook: RewardHook | None = None
    if config.enabled and config.reward_hook:
        try:
            hook = load_reward_hook(config.reward_hook, config.timeout_s)
        except RewardHookError as exc:
            log.error("scoring: %s; %d groups stay closed", exc, len(groups))
            summary.failed, summary.failed_group_ids = len(groups), [g.id for g in groups]
            return summary
    elif config.enabled:  # every group's stored answer in one read, not one read per group
        await asyncio.to_thread(cache.prefetch, [judge_cache_key(g, inputs[g.id], config) for g in groups])

    judged: list[tuple[str, list[dict[str, Any]], bool]] = []  # written together: a transaction per run, not per group

    async def one(group: Group) -> None:
        rows = await judge_group(group, inputs[group.id], config, policy, semaphore, cache, hook)
        ok = rows is not None
        if rows is not None:
            nothing = teaches_nothing(rows, inputs[group.id].canary_pairs)
            judged.append((group.id, rows, nothing))
            if (position := inputs[group.id].position) is not None:
                summary.fork_taught.append((group.alias, position, not nothing))
            if len(judged) >= WRITE_EVERY:  # a long run (a backlog) keeps what it judged as it goes
                batch = judged[:]
                judged.clear()
                await asyncio.to_thread(_store_rewards, engine, batch, cache.take_unwritten())
        if ok:
            summary.scored += 1
            summary.trajectories += group.size
        else:
            summary.failed += 1
            summary.failed_group_ids.append(group.id)
        if on_group_done is not None:
            on_group_done(group, ok)

    await asyncio.gather(*(one(g) for g in groups))
    answers = cache.take_unwritten()
    if judged or answers:
        await asyncio.to_thread(_store_rewards, engine, judged, answers)
    summary.seconds = time.perf_counter() - started
    log.info("scored %d/%d groups (%d failed) in %.1f s at %s", summary.scored, summary.groups, summary.failed,
             summary.seconds, utcnow().isoformat(timespec="seconds"))
    return summary
