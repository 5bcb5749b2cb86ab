"""Groups: which trajectories GRPO and RULER compare with each other (architecture §5).

Production traffic has one attempt per request, so groups come from four places, each
labelled with its source in ``groups.source``:

- ``explicit``: closed trajectories carrying the same ``X-Flywheel-Group-Id``;
- ``task``: closed trajectories with the same task key (system prompt + tools + first
  user message, or ``X-Flywheel-Task``) created within ``task_window_s`` of each other;
- ``fork``: the client's turn and the k extra samples the gateway drew for the same
  context (``X-Flywheel-Fork: k`` or ``fork_fraction``): a single-turn group;
- ``cohort`` (off by default): same system prompt and tools, different inputs.

A trajectory joins at most one group. Groups smaller than ``min_size`` wait for more
members (explicit and task) or are dropped (fork); larger ones are cut at ``max_size``,
oldest first — never padded. A stable ``holdout_fraction`` of the trajectories that are not
explicitly grouped never joins a task, cohort or fork group (the siblings sampled for its turns
are left ungrouped): the promotion gate's contexts come from them, so it never evaluates on what
was trained.

A sub-agent's trajectory (``parent_trajectory_id`` set) joins no group of its own: it is
scored with its parent, whose conversation the judge reads with it (:func:`member_messages`);
its turns are not trained on yet (docs/capture.md, "Sub-agents").
"""

from __future__ import annotations

import hashlib
import json
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, NamedTuple, Protocol, TypeVar

from sqlalchemy import ColumnElement, or_
from sqlalchemy import select as sa_select  # sqlmodel's select types at most four columns
from sqlalchemy.orm import aliased
from sqlmodel import Session, col, select

from flywheel.capture.batches import BranchTurn, GroupMember, TrainingGroup
from flywheel.capture.canonical import content_text
from flywheel.capture.history import branch_conversation
from flywheel.capture.linker import chunks
from flywheel.capture.models import Group, Score, Trajectory, Turn, utcnow
from flywheel.capture.models import GroupMember as GroupMemberRow
from flywheel.capture.store import bulk_insert
from flywheel.capture.turns import new_id

CLOCK_MARGIN_S = 60.0


@dataclass(frozen=True)
class GroupingRules:
    min_size: int = 2
    max_size: int = 8
    task_window_s: float = 3600.0
    cohorts: bool = False
    holdout_fraction: float = 0.0  # task, cohort and forked trajectories kept out of training, for the promotion gate


def held_out(trajectory_id: str, fraction: float) -> bool:
    """Whether a trajectory is in the held-out share: a stable hash of its id, so every caller agrees."""
    if fraction <= 0:
        return False
    bucket = int.from_bytes(hashlib.sha256(trajectory_id.encode()).digest()[:4], "big") / 2**32
    return bucket < fraction


@dataclass(frozen=True)
class Changed:
    """What committed since a run looked last, as the store's one writer noted it (``capture/write_stamps.py``):
    trajectories closed (or given feedback or a final reward), and completions forked."""

    closed: frozenset[str] = frozenset()
    forked: frozenset[str] = frozenset()


def form_groups(session: Session, rules: GroupingRules, now: datetime | None = None, *,
                since: datetime | None = None) -> list[Group]:
    """Form every group the store allows now; returns the new groups (committed by the caller).

    ``since`` (None: every key): only the keys a trajectory closed at or after it, and the turns forked at or
    after it, can form a group: what a run that formed nothing before ``since`` left is unchanged, so it would
    form nothing again (docs/loop.md, "Incremental jobs"). Cohorts always look at every trajectory.
    """
    now = now or utcnow()
    since = None if rules.cohorts else since
    forked = _fork_groups(session, rules, now, _forks_since(session, since))
    closed, still_open = _closed_since(session, since)
    explicit = [t for t in closed if t.group_key and t.group_key not in still_open]  # wait for every rollout
    rows: list[GroupMemberRow] = []
    formed = _keyed_groups(rows, "explicit", explicit, lambda t: t.group_key, rules, now, window_s=None)
    remaining = [t for t in closed if not t.group_key and not held_out(t.id, rules.holdout_fraction)]
    formed += _keyed_groups(rows, "task", remaining, lambda t: t.task_key, rules, now, window_s=rules.task_window_s)
    _insert(session, formed, rows)
    if rules.cohorts:  # after the others: a trajectory in any group (forks too) joins no cohort
        taken = set(session.exec(select(GroupMemberRow.trajectory_id)))
        rows = []
        formed += (cohorts := _keyed_groups(rows, "cohort", [t for t in remaining if t.id not in taken],
                                            lambda t: _cohort_key(session, t), rules, now,
                                            window_s=rules.task_window_s))
        _insert(session, cohorts, rows)
    return forked + formed


def _closed_since(session: Session, since: datetime | None) -> tuple[list[Trajectory], set[str]]:
    """Closed trajectories in no group but a fork group (of the keys a trajectory closed since ``since``), oldest
    first, and the group keys with a trajectory still open."""
    grouped = select(GroupMemberRow.trajectory_id).join(Group, col(Group.id) == col(GroupMemberRow.group_id)) \
        .where(Group.source != "fork")
    not_a_fork = or_(col(Trajectory.close_reason).is_(None), col(Trajectory.close_reason) != "fork")
    query = select(Trajectory).where(Trajectory.status == "closed", col(Trajectory.id).not_in(grouped), not_a_fork,
                                     col(Trajectory.parent_trajectory_id).is_(None))  # scored with their parent
    if since is not None:
        changed = aliased(Trajectory)
        query = query.where(or_(
            col(Trajectory.task_key).in_(select(changed.task_key).where(col(changed.closed_at) >= since)),
            col(Trajectory.group_key).in_(select(changed.group_key).where(col(changed.closed_at) >= since))))
    closed = list(session.exec(query.order_by(col(Trajectory.created_at), col(Trajectory.id))))
    still_open = {key for key in session.exec(select(Trajectory.group_key).where(
        Trajectory.status == "open", col(Trajectory.group_key).is_not(None))) if key}
    return closed, still_open


def _in_a_group(session: Session, trajectory_ids: list[str]) -> set[str]:
    """Which of ``trajectory_ids`` are in a group other than a fork group."""
    memberships: list[tuple[str, str]] = []
    for chunk in chunks(trajectory_ids, 500):
        memberships += [tuple(row) for row in session.execute(
            sa_select(col(GroupMemberRow.trajectory_id), col(GroupMemberRow.group_id))
            .where(col(GroupMemberRow.trajectory_id).in_(chunk)))]
    sources: dict[str, str] = {}
    for chunk in chunks(sorted({group_id for _, group_id in memberships}), 500):
        sources.update(tuple(row) for row in session.execute(sa_select(col(Group.id), col(Group.source))
                                                              .where(col(Group.id).in_(chunk))))
    return {trajectory_id for trajectory_id, group_id in memberships if sources.get(group_id) != "fork"}


class Candidate(NamedTuple):
    """A closed trajectory in no group yet: what forming its group needs of it."""

    id: str
    alias: str
    task_key: str | None
    group_key: str | None
    created_at: datetime
    latest_turn_id: str | None


_CANDIDATE_COLUMNS = (col(Trajectory.id), col(Trajectory.alias), col(Trajectory.task_key), col(Trajectory.group_key),
                      col(Trajectory.created_at), col(Trajectory.latest_turn_id), col(Trajectory.status),
                      col(Trajectory.close_reason), col(Trajectory.parent_trajectory_id))
MAX_WAITING = 200_000  # candidates kept; beyond, the oldest are let go (a full pass finds them again)


class Waiting:
    """The closed trajectories in no group yet, by the key they wait on (an explicit group key, or a task key), kept
    by the store's one writer between runs: a run reads only the trajectories its own writes closed since the last
    one, by id, and forms groups where a key has enough (docs/loop.md, "Incremental jobs")."""

    def __init__(self) -> None:
        self.keys: dict[tuple[str, str, str], dict[str, Candidate]] = {}  # (source, alias, key) -> id -> candidate

    def form(self, session: Session, rules: GroupingRules, changed: Changed | None,
             now: datetime | None = None) -> list[Group]:
        """The groups ``changed`` lets form (None: read every closed trajectory in no group, as a first run)."""
        now = now or utcnow()
        if changed is None:
            self.keys.clear()
            forks = _forks_since(session, None)
            closed, still_open = _closed_since(session, None)
            touched = self._add(rules, [_candidate(t) for t in closed])
        else:
            forks = _forks_of(session, sorted(changed.forked))
            touched = self._add(rules, self._read(session, sorted(changed.closed)))
            still_open = _still_open(session, sorted({key for source, _, key in touched if source == "explicit"}))
        forked = _fork_groups(session, rules, now, forks)
        formable = [k for k in touched if not (k[0] == "explicit" and k[2] in still_open)]  # every rollout closed
        formable = [key for key in formable if self._formable(rules, key)]
        if changed is not None:  # a candidate a group took since (an SDK's explicit group, one formed before)
            for trajectory_id in _in_a_group(session, [i for key in formable for i in self.keys[key]]):
                for key in formable:
                    self.keys[key].pop(trajectory_id, None)
        rows: list[GroupMemberRow] = []
        formed = []
        for key in formable:
            for members in self._formable(rules, key):
                formed.append(_new_group(rows, key[0], key[2], key[1], members, now))
                for member in members:
                    del self.keys[key][member.id]
            if not self.keys[key]:
                del self.keys[key]
        _insert(session, formed, rows)
        return forked + formed

    def _read(self, session: Session, ids: list[str]) -> list[Candidate]:
        """The closed trajectories among ``ids`` that may join a group, read by id."""
        found = []
        for chunk in chunks(ids, 500):
            for (trajectory_id, alias, task_key, group_key, created_at, latest, status, reason,
                 parent) in session.execute(sa_select(*_CANDIDATE_COLUMNS).where(col(Trajectory.id).in_(chunk))):
                if status == "closed" and reason != "fork" and parent is None:  # sub-agents: scored with their parent
                    found.append(Candidate(trajectory_id, alias, task_key, group_key, created_at, latest))
        return found

    def _add(self, rules: GroupingRules, candidates: list[Candidate]) -> list[tuple[str, str, str]]:
        """Add ``candidates`` under their keys (an explicit group's, else a task's, held-out ones left out); the keys
        that got one."""
        touched: dict[tuple[str, str, str], None] = {}
        for candidate in candidates:
            if candidate.group_key:
                key = ("explicit", candidate.alias, candidate.group_key)
            elif candidate.task_key and not held_out(candidate.id, rules.holdout_fraction):
                key = ("task", candidate.alias, candidate.task_key)
            else:
                continue
            self.keys.setdefault(key, {})[candidate.id] = candidate
            touched[key] = None
        if sum(len(members) for members in self.keys.values()) > MAX_WAITING:
            self._let_go(MAX_WAITING * 9 // 10)
        return [key for key in touched if key in self.keys]

    def _formable(self, rules: GroupingRules, key: tuple[str, str, str]) -> list[list[Candidate]]:
        """The groups ``key``'s candidates form now."""
        waiting = sorted(self.keys.get(key, {}).values(), key=lambda c: (c.created_at, c.id))
        return _formable(waiting, rules, None if key[0] == "explicit" else rules.task_window_s)

    def _let_go(self, keep: int) -> None:
        """Keep the ``keep`` newest candidates."""
        newest = sorted(((c.created_at, c.id, key) for key, members in self.keys.items() for c in members.values()),
                        reverse=True)
        for _, trajectory_id, key in newest[keep:]:
            del self.keys[key][trajectory_id]
            if not self.keys[key]:
                del self.keys[key]


def _candidate(trajectory: Trajectory) -> Candidate:
    return Candidate(trajectory.id, trajectory.alias, trajectory.task_key, trajectory.group_key,
                     trajectory.created_at, trajectory.latest_turn_id)


def _still_open(session: Session, group_keys: list[str]) -> set[str]:
    """Which of ``group_keys`` have a trajectory still open (read by the group key's index alone)."""
    found: set[str] = set()
    for chunk in chunks(group_keys, 500):
        found |= {key for key, status in session.execute(sa_select(col(Trajectory.group_key), col(Trajectory.status))
                                                         .where(col(Trajectory.group_key).in_(chunk)))
                  if status == "open"}
    return found


def _insert(session: Session, groups: list[Group], members: list[GroupMemberRow]) -> None:
    """New groups and their members, one multi-row insert per table (the ORM writes row by row)."""
    bulk_insert(session, Group, [g.model_dump() for g in groups])
    bulk_insert(session, GroupMemberRow, [m.model_dump() for m in members])


def _keyed_groups(rows: list[GroupMemberRow], source: str, trajectories: list[Trajectory], key_of: object,
                  rules: GroupingRules, now: datetime, *, window_s: float | None) -> list[Group]:
    buckets: dict[tuple[str, str], list[Trajectory]] = defaultdict(list)
    for trajectory in trajectories:
        key = key_of(trajectory)  # type: ignore[operator]
        if key:
            buckets[(trajectory.alias, key)].append(trajectory)
    return [_new_group(rows, source, key, alias, members, now)
            for (alias, key), waiting in buckets.items() for members in _formable(waiting, rules, window_s)]


def _formable(waiting: list[Member], rules: GroupingRules, window_s: float | None) -> list[list[Member]]:
    """The groups ``waiting`` (oldest first) forms now: the first ``max_size`` of each window holding at least
    ``min_size``, then again over what is left, until no window does."""
    groups: list[list[Member]] = []
    while taken := [w[: rules.max_size] for w in _windows(waiting, window_s) if len(w) >= rules.min_size]:
        groups += taken
        gone = {member.id for members in taken for member in members}
        waiting = [member for member in waiting if member.id not in gone]
    return groups


Member = TypeVar("Member", Trajectory, Candidate)


def _windows(members: list[Member], window_s: float | None) -> Iterable[list[Member]]:
    """Split time-ordered trajectories into runs whose first and last are within ``window_s``."""
    if window_s is None:
        yield members
        return
    current: list[Member] = []
    for trajectory in members:
        if current and trajectory.created_at - current[0].created_at > timedelta(seconds=window_s):
            yield current
            current = []
        current.append(trajectory)
    if current:
        yield current


def _forks_since(session: Session, since: datetime | None) -> dict[str, list[Turn]]:
    """The turns of each forked completion (the client's and its siblings') with no fork group yet, forked since
    ``since``."""
    sibling = aliased(Turn)
    forked = select(sibling.completion_id).where(sibling.source == "fork")
    grouped = select(Group.key).where(Group.source == "fork")
    if since is not None:
        forked = forked.where(col(sibling.created_at) >= since)
        # A fork group is formed after its turns were written: one for a turn forked since ``since`` is no older
        # (a minute's margin for the clocks of several replicas), so older groups need no look (nor older turns).
        grouped = grouped.where(col(Group.created_at) >= since - timedelta(seconds=CLOCK_MARGIN_S))
    asked = select(Turn.completion_id).where(
        Turn.source != "fork", col(Turn.completion_id).in_(forked), col(Turn.completion_id).not_in(grouped))
    if since is not None:  # the client's turn was answered with its siblings, in the same exchange
        asked = asked.where(col(Turn.created_at) >= since - timedelta(seconds=CLOCK_MARGIN_S))
    return _turns_of(session, sorted(set(session.exec(asked))))


def _forks_of(session: Session, completion_ids: list[str]) -> dict[str, list[Turn]]:
    """``_forks_since`` for ``completion_ids``: their turns and their fork groups, each read by its index alone."""
    grouped: set[str] = set()
    for chunk in chunks(completion_ids, 500):
        grouped |= {key for key, source in session.execute(sa_select(col(Group.key), col(Group.source))
                                                           .where(col(Group.key).in_(chunk))) if source == "fork"}
    turns = _turns_of(session, [c for c in completion_ids if c not in grouped])
    return {completion_id: found for completion_id, found in turns.items()
            if any(turn.source != "fork" for turn in found)}  # the client's turn is stored too


def _turns_of(session: Session, completion_ids: list[str]) -> dict[str, list[Turn]]:
    by_completion: dict[str, list[Turn]] = defaultdict(list)
    for chunk in chunks(completion_ids, 500):
        for turn in session.exec(select(Turn).where(col(Turn.completion_id).in_(chunk))
                                 .order_by(col(Turn.completion_id), col(Turn.choice_index))):
            by_completion[turn.completion_id].append(turn)
    return by_completion


def _fork_groups(session: Session, rules: GroupingRules, now: datetime,
                 by_completion: dict[str, list[Turn]]) -> list[Group]:
    """One group per forked completion: the client's choice(s) plus the gateway's siblings; none for a turn of a
    held-out conversation, so that its first request stays a context the promotion gate can use. ``min_size`` and
    ``max_size`` count the members a round trains on; a canary's pair sibling joins beyond them."""
    formed: list[Group] = []
    rows: list[GroupMemberRow] = []
    for completion_id in sorted(by_completion):
        turns = by_completion[completion_id]
        if all(held_out(t.trajectory_id, rules.holdout_fraction) for t in turns if t.source != "fork"):
            continue
        trained = [turn for turn in turns if not turn.canary_pair]
        pairs = [turn for turn in turns if turn.canary_pair]  # judged with it, not trained
        if len(trained) >= rules.min_size:
            formed.append(_new_group(rows, "fork", completion_id, trained[0].alias,
                                     trained[: rules.max_size] + pairs, now))
    _insert(session, formed, rows)
    return formed


def _new_group(rows: list[GroupMemberRow], source: str, key: str, alias: str,
               members: Sequence[Trajectory | Candidate] | list[Turn], now: datetime) -> Group:
    """A closed group of ``members`` (their rows appended to ``rows``; both added to the session by the caller)."""
    group = Group(id=new_id("grp"), source=source, key=key, alias=alias, status="closed", size=len(members),
                  created_at=now, closed_at=now)
    for member in members:
        if isinstance(member, Turn):  # fork: a single turn, possibly inside a longer trajectory
            rows.append(GroupMemberRow(group_id=group.id, trajectory_id=member.trajectory_id,
                                       leaf_turn_id=member.id, added_at=now))
        else:
            rows.append(GroupMemberRow(group_id=group.id, trajectory_id=member.id,
                                       leaf_turn_id=member.latest_turn_id, added_at=now))
    return group


def _cohort_key(session: Session, trajectory: Trajectory) -> str | None:
    first = session.exec(select(Turn).where(Turn.trajectory_id == trajectory.id, Turn.depth == 0)).first()
    if first is None:
        return None
    messages = first.request_messages or []
    system = next((content_text(m.get("content")) for m in messages if m.get("role") in ("system", "developer")), "")
    payload = json.dumps([system, first.tools or []], sort_keys=True)
    return "cohort_" + hashlib.sha256(payload.encode()).hexdigest()[:24]


# -- reading groups for the judge and the trainer ----------------------------------------------------------


def branch_turns(session: Session, leaf_turn_id: str, *, single_turn: bool = False,
                 within: str | None = None) -> list[Turn]:
    """The root-to-leaf path ending at ``leaf_turn_id`` (just the leaf for a single-turn member; only the
    turns of trajectory ``within`` when given)."""
    path: list[Turn] = []
    current = session.get(Turn, leaf_turn_id)
    while current is not None and (within is None or current.trajectory_id == within):
        path.append(current)
        if single_turn or current.parent_turn_id is None:
            break
        current = session.get(Turn, current.parent_turn_id)
    return list(reversed(path))


def branches(session: Session, members: list[GroupMemberRow], *, single_turn: bool = False) -> dict[str, list[Turn]]:
    """``branch_turns`` of many members at once (by leaf turn id): their trajectories' turns in one query, a parent
    outside them looked up by itself."""
    leaves, wanted = _branch_turns(members, single_turn)
    if not leaves:
        return {}
    known = {turn.id: turn for turn in session.exec(select(Turn).where(wanted))}
    return _paths(known, leaves, lambda turn_id: session.get(Turn, turn_id), single_turn)


def _branch_turns(members: Sequence[Any], single_turn: bool) -> tuple[list[str], ColumnElement[bool]]:
    """The members' leaf turn ids, and which turns their branches are read from: the leaves themselves (a
    single-turn branch) or every turn of their trajectories."""
    leaves = [m.leaf_turn_id for m in members if m.leaf_turn_id is not None]
    wanted = col(Turn.id).in_(leaves) if single_turn else \
        col(Turn.trajectory_id).in_([m.trajectory_id for m in members])
    return leaves, wanted


class _HasParent(Protocol):
    id: str
    parent_turn_id: str | None


Node = TypeVar("Node", bound=_HasParent)


def _paths(known: dict[str, Node], leaves: list[str], lookup: Callable[[str], Node | None],
           single_turn: bool) -> dict[str, list[Node]]:
    """Each leaf's root-to-leaf path through ``known`` turns, a turn outside them fetched with ``lookup``."""
    out: dict[str, list[Node]] = {}
    for leaf in leaves:
        path: list[Node] = []
        current = known.get(leaf) or lookup(leaf)
        while current is not None:
            path.append(current)
            if single_turn or current.parent_turn_id is None:
                break
            current = known.get(current.parent_turn_id) or lookup(current.parent_turn_id)
        out[leaf] = list(reversed(path))
    return out


def with_sub_agents(session: Session, trajectory_ids: list[str]) -> set[str]:
    """Which of ``trajectory_ids`` a sub-agent worked for."""
    return set(session.exec(select(Trajectory.parent_trajectory_id)
                            .where(col(Trajectory.parent_trajectory_id).in_(trajectory_ids))))  # type: ignore[arg-type]


def branch_messages(turns: list[Turn]) -> list[dict[str, Any]]:
    """A branch as one OpenAI message list: the conversation as it happened, each answer in place
    (``flywheel.capture.history.branch_conversation``: a request that rewrote its history loses nothing before it)."""
    return branch_conversation(turns)[0]


def sub_agent_branches(session: Session, trajectory_id: str) -> list[tuple[Trajectory, list[Turn]]]:
    """The sub-agents that worked for ``trajectory_id``, oldest first, each with its latest branch (its own turns)."""
    children = session.exec(select(Trajectory).where(Trajectory.parent_trajectory_id == trajectory_id)
                            .order_by(col(Trajectory.created_at), col(Trajectory.id)))
    return [(child, branch_turns(session, child.latest_turn_id, within=child.id))
            for child in children if child.latest_turn_id]


def member_messages(session: Session, trajectory_id: str, turns: list[Turn],
                    seen: frozenset[str] = frozenset()) -> list[dict[str, Any]]:
    """What the judge reads of a member: its branch's conversation with, after the answer each sub-agent
    followed, a ``{"role": "sub_agent", "messages": [...]}`` entry holding that sub-agent's own (and, nested,
    its sub-agents')."""
    messages, answers = branch_conversation(turns)
    seen = seen | {trajectory_id}
    inserts: list[tuple[int, dict[str, Any]]] = []
    for child, child_turns in sub_agent_branches(session, trajectory_id):
        if child.id in seen or not child_turns:
            continue  # a parent chain can only loop through a deleted and re-made explicit id
        before = [answers[i] for i, turn in enumerate(turns) if turn.created_at <= child.created_at]
        inserts.append((before[-1] + 1 if before else 0,
                        {"role": "sub_agent", "messages": member_messages(session, child.id, child_turns, seen)}))
    for position, entry in reversed(inserts):  # from the back, so earlier positions stay valid
        messages.insert(position, entry)
    return messages


def training_group(session: Session, group: Group) -> TrainingGroup:
    """A scored group as the trainer's input: one branch per member, with its reward."""
    return training_groups(session, [group])[0]


# What a trained turn needs, read as plain rows: a Turn entity hydrates and decodes ~40 columns (a batch's main cost).
_TRAINED = tuple(col(column) for column in (
    Turn.id, Turn.parent_turn_id, Turn.request_messages, Turn.response_message, Turn.tools, Turn.prompt_token_ids,
    Turn.completion_token_ids, Turn.completion_logprobs, Turn.finish_reason, Turn.params, Turn.inclusion_logprob,
    Turn.canary_pair))


class GroupKey(Protocol):
    """What ``training_groups`` reads of a group: a :class:`Group`, or a row of these columns."""

    id: str
    source: str
    alias: str


def training_groups(session: Session, groups: Sequence[GroupKey]) -> list[TrainingGroup]:
    """``training_group`` of each of ``groups``, read together: members, final rewards and branches in a fixed
    few queries for the whole batch, not a few per group and one per turn (about 40 ms a group on DuckDB)."""
    if not groups:
        return []
    ids = [group.id for group in groups]
    members: dict[str, list[Any]] = {group_id: [] for group_id in ids}
    for member in session.execute(sa_select(col(GroupMemberRow.group_id), col(GroupMemberRow.trajectory_id),
                                            col(GroupMemberRow.leaf_turn_id))
                                  .where(col(GroupMemberRow.group_id).in_(ids))):
        members[member.group_id].append(member)  # each group's in the order the store gives, as one group alone
    rewards: dict[str, dict[str, float]] = defaultdict(dict)
    for score in session.execute(sa_select(col(Score.group_id), col(Score.trajectory_id), col(Score.value))
                                 .where(col(Score.group_id).in_(ids), col(Score.source) == "reward")
                                 .order_by(col(Score.created_at))):
        rewards[score.group_id or ""][score.trajectory_id] = score.value  # the latest wins
    paths = {fork: _trained_paths(session, [m for g in groups if (g.source == "fork") == fork for m in members[g.id]],
                                  single_turn=fork)
             for fork in (False, True)}  # apart: a forked turn's path is itself, the same leaf's elsewhere is not
    out: list[TrainingGroup] = []
    for group in groups:
        path_of = paths[group.source == "fork"]
        kept = [(member, path_of[member.leaf_turn_id]) for member in members[group.id] if member.leaf_turn_id]
        out.append(TrainingGroup(group_id=group.id, source=group.source, alias=group.alias, members=[
            _training_member(member, path, rewards[group.id]) for member, path in kept
            if not path[-1].canary_pair]))  # a canary's pair sibling is its evidence, not a sample to learn from
    return out


def _trained_paths(session: Session, members: list[Any], *, single_turn: bool) -> dict[str, list[Any]]:
    """``branches`` as rows of the ``_TRAINED`` columns."""
    leaves, wanted = _branch_turns(members, single_turn)
    if not leaves:
        return {}
    known = {turn.id: turn for turn in session.execute(sa_select(*_TRAINED).where(wanted))}
    return _paths(known, leaves, lambda turn_id: session.execute(
        sa_select(*_TRAINED).where(col(Turn.id) == turn_id)).first(), single_turn)


def _training_member(member: Any, turns: list[Any], rewards: dict[str, float]) -> GroupMember:
    return GroupMember(
        trajectory_id=member.trajectory_id, leaf_turn_id=member.leaf_turn_id,
        reward=rewards.get(member.trajectory_id, 0.0),
        turns=[BranchTurn(request_messages=t.request_messages or [], response_message=t.response_message or {},
                          tools=t.tools, prompt_token_ids=t.prompt_token_ids,
                          completion_token_ids=t.completion_token_ids,
                          completion_logprobs=t.completion_logprobs, finish_reason=t.finish_reason,
                          turn_id=t.id, params=t.params, inclusion_logprob=t.inclusion_logprob) for t in turns])
