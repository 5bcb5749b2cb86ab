"""Client feedback, written in the recorder's batch: each names a trajectory (by id, or by a chat completion in
it), is recorded, and closes that trajectory and its sub-agents' — the whole batch's feedback in a few
set-based statements of the transaction that writes its turns (docs/capture.md, "Feedback rides the batch")."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import insert, update
from sqlmodel import Session, col, select

from flywheel.capture.models import Feedback, Trajectory, Turn, utcnow
from flywheel.capture.turns import new_id
from flywheel.capture.write_stamps import note_closed, note_rows


@dataclass(frozen=True)
class FeedbackItem:
    """What a client said (``POST /flywheel/v1/feedback``), already validated; ``client_key_id`` is who said it: a
    client key sees only its own trajectories."""

    trajectory_id: str | None
    completion_id: str | None
    reward: float | None = None
    label: str | None = None
    comment: str | None = None
    client_key_id: str | None = None


@dataclass(frozen=True)
class Recorded:
    trajectory_id: str
    feedback_id: str


@dataclass
class FeedbackBatch:
    """The feedback a batch of turns carries; ``recorded`` is filled, item by item, once the batch commits
    (None: no trajectory of the client's matched)."""

    items: Sequence[FeedbackItem]
    recorded: list[Recorded | None] = field(default_factory=list)


_FEEDBACK = Feedback.__table__  # type: ignore[attr-defined]


def write_feedback(session: Session, items: Sequence[FeedbackItem], written: Sequence[dict[str, Any]] = (), *,
                   sub_agents: bool = True) -> list[Recorded | None]:
    """Find each item's trajectory, insert the feedback rows and close the trajectories, in the caller's
    transaction (whose turns are visible here: a completion answered in this very batch is found).
    ``written``: the turns this transaction wrote (the batch's rows); a completion among them is matched
    from them, without a query. ``sub_agents``: as for :func:`close_trajectories`."""
    recorded, rows = match_feedback(session, items, written)
    insert_feedback(session, rows, sub_agents=sub_agents)
    return recorded


def match_feedback(session: Session, items: Sequence[FeedbackItem], written: Sequence[dict[str, Any]] = (),
                   owners: dict[str, str | None] | None = None
                   ) -> tuple[list[Recorded | None], list[dict[str, Any]]]:
    """What each item recorded (None: no trajectory of the client's matched) and the feedback rows to insert; reads
    only. ``written`` as for :func:`write_feedback`; ``owners``: the client key of trajectories not stored yet (a
    batch's own), by id."""
    if not items:
        return [], []
    owners = {**_trajectory_owners(session, [i.trajectory_id for i in items
                                             if i.trajectory_id and i.trajectory_id not in (owners or {})]),
              **(owners or {})}
    by_completion = _completion_trajectories(session, [i.completion_id for i in items
                                                       if i.completion_id and not i.trajectory_id], written)
    recorded: list[Recorded | None] = []
    rows: list[dict[str, Any]] = []  # the feedback table's columns, as plain rows: no ORM object per item
    now = utcnow()
    for item in items:
        trajectory_id = _match(item, owners, by_completion)
        if trajectory_id is None:
            recorded.append(None)
            continue
        rows.append({"id": new_id("fb"), "trajectory_id": trajectory_id, "completion_id": item.completion_id,
                     "reward": item.reward, "label": item.label, "comment": item.comment,
                     "client_key_id": item.client_key_id, "created_at": now})
        recorded.append(Recorded(trajectory_id, rows[-1]["id"]))
    return recorded, rows


def insert_feedback(session: Session, rows: list[dict[str, Any]], *, sub_agents: bool = True,
                    closed: Collection[str] = ()) -> None:
    """Insert :func:`match_feedback`'s rows and close their trajectories; ``closed``: those closed already in this
    transaction (a batch's own rows), whose sub-agents are still closed here."""
    if not rows:
        return
    session.execute(insert(_FEEDBACK), rows)  # Core: the ORM's bulk insert adds nothing for plain rows
    note_rows(session.connection(), "feedback", rows)
    close_trajectories(session, sorted({row["trajectory_id"] for row in rows}), "feedback", sub_agents=sub_agents,
                       closed=closed)


def close_trajectories(session: Session, trajectory_ids: Sequence[str], reason: str, *,
                       sub_agents: bool = True, closed: Collection[str] = ()) -> None:
    """Close these trajectories, and their sub-agents' still open (reason ``parent``): two set-based updates, the
    second only where the store may hold sub-agents at all (``sub_agents``: ``Store.sub_agents``). ``closed``: ids
    among them this transaction closed already (in the rows it wrote): only their sub-agents are closed here."""
    if not trajectory_ids:
        return
    now = utcnow()
    still_open = [trajectory_id for trajectory_id in trajectory_ids if trajectory_id not in closed]
    if still_open:
        done = session.execute(update(Trajectory)
                               .where(col(Trajectory.id).in_(still_open), col(Trajectory.status) != "closed")
                               .values(status="closed", closed_at=now, close_reason=reason)
                               .returning(col(Trajectory.id)).execution_options(synchronize_session=False))
        note_closed(session.connection(), (trajectory_id for trajectory_id, in done), reason)
    if sub_agents:
        done = session.execute(update(Trajectory)
                               .where(col(Trajectory.parent_trajectory_id).in_(trajectory_ids),
                                      col(Trajectory.status) == "open")
                               .values(status="closed", closed_at=now, close_reason="parent")
                               .returning(col(Trajectory.id)).execution_options(synchronize_session=False))
        note_closed(session.connection(), (trajectory_id for trajectory_id, in done), "parent")


def _trajectory_owners(session: Session, ids: list[str]) -> dict[str, str | None]:
    if not ids:
        return {}
    found = session.execute(select(Trajectory.id, Trajectory.client_key_id).where(col(Trajectory.id).in_(ids)))
    return {trajectory_id: key for trajectory_id, key in found}


def _completion_trajectories(session: Session, ids: list[str], written: Sequence[dict[str, Any]]
                             ) -> dict[str, list[tuple[str, str | None]]]:
    """Per completion id, the (trajectory, client key) of its client-facing turns, first choice first: from the
    turns just ``written`` when they hold it (a completion's choices are one exchange, written together), else
    from the store."""
    if not ids:
        return {}
    wanted = set(ids)
    mine = sorted((t for t in written if t["completion_id"] in wanted and t["source"] != "fork"),
                  key=lambda t: t["choice_index"])
    by_completion: dict[str, list[tuple[str, str | None]]] = {}
    for turn in mine:
        by_completion.setdefault(turn["completion_id"], []).append((turn["trajectory_id"], turn["client_key_id"]))
    stored = sorted(wanted - by_completion.keys())
    if stored:
        for completion_id, trajectory_id, key in session.execute(
                select(Turn.completion_id, Turn.trajectory_id, Turn.client_key_id)
                .where(col(Turn.completion_id).in_(stored), col(Turn.source) != "fork")
                .order_by(col(Turn.choice_index))):
            by_completion.setdefault(completion_id, []).append((trajectory_id, key))
    return by_completion


def _match(item: FeedbackItem, owners: dict[str, str | None],
           by_completion: dict[str, list[tuple[str, str | None]]]) -> str | None:
    mine = item.client_key_id
    if item.trajectory_id:
        ok = item.trajectory_id in owners and (mine is None or owners[item.trajectory_id] == mine)
        return item.trajectory_id if ok else None
    for trajectory_id, key in by_completion.get(item.completion_id or "", []):
        if mine is None or key == mine:
            return trajectory_id
    return None
