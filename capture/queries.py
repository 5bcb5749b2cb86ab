"""Reads, updates and deletes over the store, shared by the HTTP APIs and the CLI.

Two families, both plain SQLModel/SQLAlchemy (no DuckDB-only SQL, so they run on
PostgreSQL too; JSON lookups compile per dialect):

- **Trajectories** (admin API, ``flywheel trajectories``): :func:`list_trajectories`
  with a :class:`TrajectoryFilter` and a cursor, :func:`trajectory_detail` (turns in
  order, branches as root-to-leaf turn ids, scores, feedback), :func:`delete_trajectory`
  and :func:`delete_client_data`.
- **Stored completions** (OpenAI's ``/v1/chat/completions`` reads): a completion is the
  set of turns sharing a ``completion_id`` (one per choice). :func:`list_completions`,
  :func:`get_completion`, :func:`update_completion_metadata`, :func:`delete_completion`,
  :func:`completion_messages`. ``owner`` is the caller's client key id, or
  :data:`EVERY_KEY` when the gateway has no client keys (then nobody is a tenant).

Everything returned is JSON-ready (``dict``/``list``, timestamps as ISO 8601 UTC strings
in the admin shapes, unix seconds in OpenAI's). Functions are blocking: the gateway calls
them through ``asyncio.to_thread``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Final, Literal

from sqlalchemy import ColumnElement, and_, exists, func, or_
from sqlmodel import Session, col, delete, select

from flywheel.capture.models import Feedback, GroupMember, Score, Trajectory, Turn
from flywheel.capture.models import Group as GroupRow
from flywheel.capture.store import Store

Order = Literal["asc", "desc"]
CHAT_ENDPOINT: Final = "chat.completions"


class QueryError(ValueError):
    """A filter or cursor that cannot be used; ``param`` names it (the API turns it into a 400)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class _EveryKey:
    """Sentinel owner: no client keys are configured, so every stored completion is visible."""

    def __repr__(self) -> str:
        return "EVERY_KEY"


EVERY_KEY: Final = _EveryKey()
Owner = str | None | _EveryKey  # a client key id, None (rows stored without a key), or EVERY_KEY


@dataclass
class Page:
    """One page of a cursor-paginated list, in OpenAI's list shape."""

    data: list[dict[str, Any]]
    has_more: bool

    def to_json(self) -> dict[str, Any]:
        return {"object": "list", "data": self.data,
                "first_id": self.data[0]["id"] if self.data else None,
                "last_id": self.data[-1]["id"] if self.data else None,
                "has_more": self.has_more}


@dataclass
class DeleteCounts:
    """What a delete removed, row counts per table."""

    trajectories: int = 0
    turns: int = 0
    scores: int = 0
    feedback: int = 0
    group_members: int = 0

    def to_json(self) -> dict[str, int]:
        return {"trajectories": self.trajectories, "turns": self.turns, "scores": self.scores,
                "feedback": self.feedback, "group_members": self.group_members}


# -- time and filter parsing ------------------------------------------------------------------------------

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)\s*([smhdw])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_time(text: str, param: str, now: datetime | None = None) -> datetime:
    """ISO 8601 (naive means UTC), unix seconds, or a duration ago (``30m``, ``2h``, ``7d``)."""
    text = text.strip()
    duration = _DURATION.match(text)
    try:
        if duration:
            seconds = float(duration.group(1)) * _UNIT_S[duration.group(2)]
            return (now or datetime.now(UTC)) - timedelta(seconds=seconds)
        return datetime.fromtimestamp(float(text), tz=UTC)
    except (OverflowError, OSError):  # a number no datetime holds (1e20, 99999999999d)
        raise QueryError(f"Invalid value for '{param}': {text!r} is out of range", param) from None
    except ValueError:
        pass
    try:
        parsed = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise QueryError(f"Invalid value for '{param}': {text!r} is not an ISO 8601 time, unix seconds "
                         "or a duration like 30m, 2h, 7d", param) from None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def parse_bool(text: str, param: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("true", "1", "yes", "on"):
        return True
    if lowered in ("false", "0", "no", "off"):
        return False
    raise QueryError(f"Invalid value for '{param}': expected true or false, got {text!r}", param)


def parse_limit(text: str | None, param: str, *, default: int, maximum: int) -> int:
    if text is None:
        return default
    try:
        limit = int(text)
    except ValueError:
        raise QueryError(f"Invalid value for '{param}': {text!r} is not an integer", param) from None
    if not 1 <= limit <= maximum:
        raise QueryError(f"Invalid value for '{param}': must be between 1 and {maximum}, got {limit}", param)
    return limit


def parse_order(text: str | None, param: str = "order", default: Order = "asc") -> Order:
    if text is None:
        return default
    if text == "asc":
        return "asc"
    if text == "desc":
        return "desc"
    raise QueryError(f"Invalid value for '{param}': expected 'asc' or 'desc', got {text!r}", param)


def iso(moment: datetime | None) -> str | None:
    """ISO 8601 in UTC; the store hands back tz-aware datetimes in the connection's zone."""
    if moment is None:
        return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.astimezone(UTC).isoformat()


def _after_cursor(created: Any, key: Any, at: datetime, after_id: str,
                  order: Order) -> ColumnElement[bool]:
    """Rows strictly after ``(at, after_id)`` in ``(created, key)`` order: a keyset cursor, no OFFSET."""
    if order == "asc":
        return or_(created > at, and_(created == at, key > after_id))
    return or_(created < at, and_(created == at, key < after_id))


# -- trajectories -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TrajectoryFilter:
    """Which trajectories a list or an export covers; ``None`` fields do not filter."""

    alias: str | None = None
    since: datetime | None = None  # created at or after
    until: datetime | None = None  # created before
    status: str | None = None  # "open" | "closed"
    task: str | None = None  # task_key
    has_reward: bool | None = None  # a row in scores or feedback
    client_key_id: str | None = None

    def conditions(self) -> list[ColumnElement[bool]]:
        out: list[ColumnElement[bool]] = []
        if self.alias is not None:
            out.append(col(Trajectory.alias) == self.alias)
        if self.since is not None:
            out.append(col(Trajectory.created_at) >= self.since)
        if self.until is not None:
            out.append(col(Trajectory.created_at) < self.until)
        if self.status is not None:
            out.append(col(Trajectory.status) == self.status)
        if self.task is not None:
            out.append(col(Trajectory.task_key) == self.task)
        if self.client_key_id is not None:
            out.append(col(Trajectory.client_key_id) == self.client_key_id)
        if self.has_reward is not None:
            rewarded = or_(exists().where(col(Score.trajectory_id) == col(Trajectory.id)),
                           exists().where(col(Feedback.trajectory_id) == col(Trajectory.id)))
            out.append(rewarded if self.has_reward else ~rewarded)
        return out

    @classmethod
    def from_query(cls, params: dict[str, str], now: datetime | None = None) -> TrajectoryFilter:
        """From query-string values (the admin API and the CLI use the same spelling)."""
        since, until, has_reward = params.get("since"), params.get("until"), params.get("has_reward")
        return cls(alias=params.get("alias") or None, status=params.get("status") or None,
                   task=params.get("task") or None, client_key_id=params.get("client_key_id") or None,
                   since=parse_time(since, "since", now) if since else None,
                   until=parse_time(until, "until", now) if until else None,
                   has_reward=parse_bool(has_reward, "has_reward") if has_reward else None)


def trajectory_json(trajectory: Trajectory, reward: float | None = None, has_reward: bool = False
                    ) -> dict[str, Any]:
    """A trajectory row as the admin API shows it (plus its latest score and whether any reward exists)."""
    return {"id": trajectory.id, "object": "trajectory", "alias": trajectory.alias, "status": trajectory.status,
            "explicit": trajectory.explicit, "client_key_id": trajectory.client_key_id,
            "task_key": trajectory.task_key, "group_key": trajectory.group_key,
            "created_at": iso(trajectory.created_at), "updated_at": iso(trajectory.updated_at),
            "closed_at": iso(trajectory.closed_at), "close_reason": trajectory.close_reason,
            "turn_count": trajectory.turn_count, "branch_count": trajectory.branch_count,
            "latest_turn_id": trajectory.latest_turn_id, "extra_metadata": trajectory.extra_metadata,
            "parent_trajectory_id": trajectory.parent_trajectory_id, "reward": reward, "has_reward": has_reward}


def turn_json(turn: Turn) -> dict[str, Any]:
    """Every column of a turn, timestamps as ISO 8601 UTC."""
    out = turn.model_dump(mode="json")
    out["created_at"] = iso(turn.created_at)
    return out


def list_trajectories(store: Store, flt: TrajectoryFilter = TrajectoryFilter(), *, limit: int = 100,
                      after: str | None = None, order: Order = "desc") -> Page:
    """One page of trajectories matching ``flt``, by creation time; ``after`` is the last id seen."""
    with store.session() as session:
        query = select(Trajectory).where(*flt.conditions())
        if after is not None:
            cursor = session.get(Trajectory, after)
            if cursor is None:
                raise QueryError(f"Invalid value for 'after': no trajectory {after!r}", "after")
            query = query.where(_after_cursor(col(Trajectory.created_at), col(Trajectory.id), cursor.created_at,
                                              cursor.id, order))
        keys = (col(Trajectory.created_at), col(Trajectory.id))
        query = query.order_by(*(k.asc() if order == "asc" else k.desc() for k in keys)).limit(limit + 1)
        rows = list(session.exec(query).all())
        rewards, rewarded = _rewards(session, [t.id for t in rows[:limit]])
        data = [trajectory_json(t, rewards.get(t.id), t.id in rewarded) for t in rows[:limit]]
        return Page(data=data, has_more=len(rows) > limit)


def _rewards(session: Session, trajectory_ids: Sequence[str]) -> tuple[dict[str, float], set[str]]:
    """Latest score per trajectory, and which trajectories have any score or feedback row."""
    if not trajectory_ids:
        return {}, set()
    latest: dict[str, float] = {}
    scores = session.exec(select(Score.trajectory_id, Score.value).where(col(Score.trajectory_id).in_(trajectory_ids))
                          .order_by(col(Score.created_at), col(Score.id))).all()
    for trajectory_id, value in scores:
        latest[trajectory_id] = value  # ascending order: the last one written wins
    with_feedback = session.exec(select(Feedback.trajectory_id).distinct()
                                 .where(col(Feedback.trajectory_id).in_(trajectory_ids))).all()
    return latest, set(latest) | set(with_feedback)


def get_trajectory(store: Store, trajectory_id: str) -> dict[str, Any] | None:
    with store.session() as session:
        trajectory = session.get(Trajectory, trajectory_id)
        if trajectory is None:
            return None
        rewards, rewarded = _rewards(session, [trajectory_id])
        return trajectory_json(trajectory, rewards.get(trajectory_id), trajectory_id in rewarded)


def trajectory_detail(store: Store, trajectory_id: str) -> dict[str, Any] | None:
    """The trajectory with its turns (in order), its branches, its scores, its feedback and its sub-agents'
    trajectories (those naming it as their parent, oldest first)."""
    with store.session() as session:
        trajectory = session.get(Trajectory, trajectory_id)
        if trajectory is None:
            return None
        turns = list(session.exec(select(Turn).where(Turn.trajectory_id == trajectory_id).order_by(
            col(Turn.created_at), col(Turn.depth), col(Turn.choice_index), col(Turn.id))).all())
        scores = session.exec(select(Score).where(Score.trajectory_id == trajectory_id)
                              .order_by(col(Score.created_at), col(Score.id))).all()
        feedback = session.exec(select(Feedback).where(Feedback.trajectory_id == trajectory_id)
                                .order_by(col(Feedback.created_at), col(Feedback.id))).all()
        latest = scores[-1].value if scores else None
        out = trajectory_json(trajectory, latest, bool(scores) or bool(feedback))
        out["turns"] = [turn_json(t) for t in turns]
        out["branches"] = branches(turns)
        out["scores"] = [{**s.model_dump(mode="json"), "created_at": iso(s.created_at)} for s in scores]
        out["feedback"] = [{**f.model_dump(mode="json"), "created_at": iso(f.created_at)} for f in feedback]
        sub_agents = session.exec(select(Trajectory).where(Trajectory.parent_trajectory_id == trajectory_id)
                                  .order_by(col(Trajectory.created_at), col(Trajectory.id))).all()
        sub_rewards, sub_rewarded = _rewards(session, [t.id for t in sub_agents])
        out["sub_agents"] = [trajectory_json(t, sub_rewards.get(t.id), t.id in sub_rewarded) for t in sub_agents]
        return out


def branches(turns: Sequence[Turn]) -> list[list[str]]:
    """Root-to-leaf paths of turn ids, one per leaf, leaves in the order they were created.

    A turn whose parent lies outside this trajectory (a closed trajectory continued into a
    new one) is a root here: a branch covers this trajectory's turns only.
    """
    by_id = {t.id: t for t in turns}
    parents = {t.parent_turn_id for t in turns if t.parent_turn_id in by_id}
    out = []
    for leaf in turns:  # already in creation order
        if leaf.id in parents:
            continue
        path = [leaf.id]
        node = leaf
        while node.parent_turn_id in by_id:
            node = by_id[node.parent_turn_id]
            path.append(node.id)
        out.append(path[::-1])
    return out


def delete_trajectory(store: Store, trajectory_id: str) -> DeleteCounts | None:
    """Delete a trajectory with its turns, group memberships, scores and feedback; None when unknown."""
    with store.session() as session:
        if session.get(Trajectory, trajectory_id) is None:
            return None
        counts = _delete_trajectories(session, [trajectory_id])
        session.commit()
        return counts


def delete_client_data(store: Store, client_key_id: str) -> DeleteCounts:
    """Delete everything a client key left: its trajectories (whole), its turns elsewhere, its feedback."""
    with store.session() as session:
        owned = list(session.exec(select(Trajectory.id).where(Trajectory.client_key_id == client_key_id)).all())
        counts = _delete_trajectories(session, owned)
        # Turns of this key in other trajectories (an explicit id can join a trajectory another key began).
        stray = list(session.exec(select(Turn).where(Turn.client_key_id == client_key_id)).all())
        more = _delete_turns(session, stray)
        counts.turns += more.turns
        counts.trajectories += more.trajectories
        counts.scores += more.scores
        counts.feedback += more.feedback
        counts.group_members += more.group_members
        result = session.exec(delete(Feedback).where(col(Feedback.client_key_id) == client_key_id))
        counts.feedback += result.rowcount or 0
        session.commit()
        return counts


def _delete_trajectories(session: Session, trajectory_ids: Sequence[str]) -> DeleteCounts:
    counts = DeleteCounts()
    if not trajectory_ids:
        return counts
    turns = list(session.exec(select(Turn).where(col(Turn.trajectory_id).in_(trajectory_ids))).all())
    _reparent_children(session, turns)
    counts.turns = _rowcount(session.exec(delete(Turn).where(col(Turn.trajectory_id).in_(trajectory_ids))))
    counts.scores = _rowcount(session.exec(delete(Score).where(col(Score.trajectory_id).in_(trajectory_ids))))
    counts.feedback = _rowcount(session.exec(delete(Feedback).where(col(Feedback.trajectory_id)
                                                                    .in_(trajectory_ids))))
    groups = set(session.exec(select(GroupMember.group_id).where(col(GroupMember.trajectory_id)
                                                                 .in_(trajectory_ids))).all())
    counts.group_members = _rowcount(session.exec(delete(GroupMember).where(col(GroupMember.trajectory_id)
                                                                            .in_(trajectory_ids))))
    counts.trajectories = _rowcount(session.exec(delete(Trajectory).where(col(Trajectory.id).in_(trajectory_ids))))
    _resize_groups(session, groups)
    return counts


def _delete_turns(session: Session, turns: Sequence[Turn]) -> DeleteCounts:
    """Delete single turns: children move up to the nearest surviving ancestor, trajectories are recounted,
    and a trajectory left with no turn is deleted whole."""
    if not turns:
        return DeleteCounts()
    _reparent_children(session, turns)
    ids = [t.id for t in turns]
    counts = DeleteCounts(turns=_rowcount(session.exec(delete(Turn).where(col(Turn.id).in_(ids)))))
    emptied = []
    for trajectory_id in sorted({t.trajectory_id for t in turns}):
        if not _recount(session, trajectory_id):
            emptied.append(trajectory_id)
    more = _delete_trajectories(session, emptied)
    counts.trajectories, counts.scores = more.trajectories, more.scores
    counts.feedback, counts.group_members = more.feedback, more.group_members
    return counts


def _reparent_children(session: Session, doomed: Sequence[Turn]) -> None:
    """Point the surviving children of turns about to be deleted at their nearest surviving ancestor."""
    parent_of = {t.id: t.parent_turn_id for t in doomed}
    children = session.exec(select(Turn).where(col(Turn.parent_turn_id).in_(list(parent_of)),
                                               col(Turn.id).not_in(list(parent_of)))).all()
    for child in children:
        ancestor = child.parent_turn_id
        while ancestor in parent_of:
            ancestor = parent_of[ancestor]
        child.parent_turn_id = ancestor
        session.add(child)
    session.flush()


def _recount(session: Session, trajectory_id: str) -> bool:
    """Refresh a trajectory's turn_count, branch_count and latest_turn_id; False when no turn is left."""
    trajectory = session.get(Trajectory, trajectory_id)
    turns = list(session.exec(select(Turn).where(Turn.trajectory_id == trajectory_id)
                              .order_by(col(Turn.created_at), col(Turn.id))).all())
    if trajectory is None or not turns:
        return False
    trajectory.turn_count = len(turns)
    trajectory.branch_count = max(1, len(branches(turns)))
    trajectory.latest_turn_id = turns[-1].id
    session.add(trajectory)
    session.flush()
    return True


def _resize_groups(session: Session, group_ids: Iterable[str]) -> None:
    for group_id in group_ids:
        group = session.get(GroupRow, group_id)
        if group is not None:
            group.size = int(session.exec(select(func.count()).select_from(GroupMember)
                                          .where(GroupMember.group_id == group_id)).one())
            session.add(group)


def _rowcount(result: Any) -> int:
    return int(getattr(result, "rowcount", 0) or 0)


# -- stored completions (OpenAI) ----------------------------------------------------------------------------

@dataclass(frozen=True)
class CompletionFilter:
    """OpenAI's list filters: ``model`` (as the client asked for it, or the alias) and ``metadata[k]=v``."""

    model: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)

    def conditions(self, dialect: str) -> list[ColumnElement[bool]]:
        out: list[ColumnElement[bool]] = []
        if self.model is not None:
            out.append(or_(col(Turn.requested_model) == self.model, col(Turn.alias) == self.model))
        for key, value in self.metadata.items():
            out.append(_metadata_value(key, dialect) == value)
        return out


def _metadata_value(key: str, dialect: str) -> ColumnElement[str]:
    """``request_metadata[key]`` as text. DuckDB reads a key that starts with ``$`` or ``/`` as a JSON path, so
    there the key goes in a quoted path (``$."a.b"``), where only ``*`` still means every key."""
    if dialect != "duckdb":
        return Turn.request_metadata[key].as_string()  # type: ignore[index]
    if key == "*":
        raise QueryError("Invalid value for 'metadata[*]': '*' cannot be filtered on (it means every key)",
                         "metadata[*]")
    path = '$."' + key.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return func.json_extract_string(Turn.request_metadata, path)


def _owned(owner: Owner) -> list[ColumnElement[bool]]:
    """Chat turns the client saw (forked siblings share the completion id but were never sent), of ``owner``."""
    conditions: list[ColumnElement[bool]] = [col(Turn.endpoint) == CHAT_ENDPOINT, col(Turn.source) == "client"]
    if not isinstance(owner, _EveryKey):
        conditions.append(col(Turn.client_key_id).is_not_distinct_from(owner))
    return conditions


def _completion_turns(session: Session, completion_id: str, owner: Owner) -> list[Turn]:
    return list(session.exec(select(Turn).where(Turn.completion_id == completion_id, *_owned(owner))
                             .order_by(col(Turn.choice_index), col(Turn.id))).all())


OPENAI_FINISH_REASONS: Final = frozenset({"stop", "length", "tool_calls", "content_filter", "function_call"})


def openai_finish(finish_reason: str | None) -> dict[str, Any]:
    """A stored finish reason in OpenAI's words: ``finish_reason``, plus ``flywheel.finish_reason`` when OpenAI has
    no word for it. An answer that ended any other way (``client_disconnected``) never sampled its end: ``length``,
    as a cut-off answer reads; one whose engine gave no reason ended whole: ``stop``."""
    if finish_reason is None or finish_reason in OPENAI_FINISH_REASONS:
        return {"finish_reason": finish_reason or "stop"}
    return {"finish_reason": "length", "flywheel": {"finish_reason": finish_reason}}


def completion_json(turns: Sequence[Turn]) -> dict[str, Any]:
    """A ``chat.completion`` object rebuilt from the turns of one completion id (one per choice)."""
    first = turns[0]
    choices = [{"index": t.choice_index, **openai_finish(t.finish_reason), "logprobs": None,
                "message": {"role": "assistant", "content": None, "refusal": None, **(t.response_message or {})}}
               for t in turns]
    completion_tokens = sum(t.completion_tokens for t in turns)
    return {"id": first.completion_id, "object": "chat.completion", "created": int(first.created_at.timestamp()),
            "model": first.requested_model, "choices": choices,
            "usage": {"prompt_tokens": first.prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": first.prompt_tokens + completion_tokens},
            "service_tier": None, "system_fingerprint": None, "metadata": first.request_metadata or {}}


def list_completions(store: Store, owner: Owner, flt: CompletionFilter = CompletionFilter(), *, limit: int = 20,
                     after: str | None = None, order: Order = "asc") -> Page:
    """One page of stored chat completions, ordered by creation time, ``after`` = last completion id seen."""
    created = func.min(col(Turn.created_at)).label("created")
    grouped = (select(col(Turn.completion_id).label("completion_id"), created)
               .where(*_owned(owner), *flt.conditions(store.engine.dialect.name)).group_by(col(Turn.completion_id))
               .subquery())
    with store.session() as session:
        query = select(grouped.c.completion_id, grouped.c.created)
        if after is not None:
            at = session.exec(select(func.min(col(Turn.created_at))).where(Turn.completion_id == after,
                                                                             *_owned(owner))).one()
            if at is None:
                raise QueryError(f"Invalid value for 'after': no chat completion {after!r}", "after")
            query = query.where(_after_cursor(grouped.c.created, grouped.c.completion_id, at, after, order))
        keys = (grouped.c.created, grouped.c.completion_id)
        query = query.order_by(*(k.asc() if order == "asc" else k.desc() for k in keys)).limit(limit + 1)
        ids = [row[0] for row in session.exec(query).all()]
        page_ids = ids[:limit]
        turns = session.exec(select(Turn).where(col(Turn.completion_id).in_(page_ids), *_owned(owner))
                             .order_by(col(Turn.choice_index), col(Turn.id))).all() if page_ids else []
        by_completion: dict[str, list[Turn]] = {}
        for turn in turns:
            by_completion.setdefault(turn.completion_id, []).append(turn)
        return Page(data=[completion_json(by_completion[i]) for i in page_ids], has_more=len(ids) > limit)


def get_completion(store: Store, completion_id: str, owner: Owner) -> dict[str, Any] | None:
    with store.session() as session:
        turns = _completion_turns(session, completion_id, owner)
        return completion_json(turns) if turns else None


def update_completion_metadata(store: Store, completion_id: str, owner: Owner,
                               metadata: dict[str, str] | None) -> dict[str, Any] | None:
    """Replace the completion's metadata (every choice's turn), as OpenAI's update does."""
    with store.session() as session:
        turns = _completion_turns(session, completion_id, owner)
        for turn in turns:
            turn.request_metadata = dict(metadata) if metadata is not None else None
            session.add(turn)
        session.commit()
        return completion_json(turns) if turns else None


def delete_completion(store: Store, completion_id: str, owner: Owner) -> bool:
    """Delete the completion's turns (children re-parented, trajectory recounted); False when unknown."""
    with store.session() as session:
        turns = _completion_turns(session, completion_id, owner)
        if not turns:
            return False
        _delete_turns(session, turns)
        session.commit()
        return True


def completion_messages(store: Store, completion_id: str, owner: Owner, *, limit: int = 20,
                        after: str | None = None, order: Order = "asc") -> Page | None:
    """The request messages of a completion, as ``ChatCompletionStoreMessage`` objects; None when unknown."""
    with store.session() as session:
        turns = _completion_turns(session, completion_id, owner)
    if not turns:
        return None
    messages = [store_message(f"{completion_id}-{i}", m) for i, m in enumerate(turns[0].request_messages or [])]
    if order == "desc":
        messages.reverse()
    if after is not None:
        position = next((i for i, m in enumerate(messages) if m["id"] == after), None)
        if position is None:
            raise QueryError(f"Invalid value for 'after': no message {after!r} in {completion_id!r}", "after")
        messages = messages[position + 1:]
    return Page(data=messages[:limit], has_more=len(messages) > limit)


def store_message(message_id: str, message: dict[str, Any]) -> dict[str, Any]:
    """A request message as OpenAI lists it: text ``content``, and ``content_parts`` when parts were sent."""
    out: dict[str, Any] = {"id": message_id, **{k: v for k, v in message.items() if k != "content"}}
    content = message.get("content")
    if isinstance(content, list):
        texts = [p.get("text") or "" for p in content if isinstance(p, dict) and p.get("type") == "text"]
        out["content"] = "".join(texts)
        out["content_parts"] = content
    else:
        out["content"] = content
        out["content_parts"] = None
    return out
