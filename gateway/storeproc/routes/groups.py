"""Groups a client sends with their rewards (the SDK's ``model.train``/``backend.train``), stored to be trained.

    POST /flywheel/v1/groups   (admin)
    {"alias": "agent", "key": "group_...",             the group id the rollouts' calls carried (optional)
     "trajectories": [{"trajectory_id": "traj_..." | null, "messages": [...], "choices": [2, 4],
                       "tools": [...] | null, "reward": 0.75}, ...]}

Each trajectory becomes one member of a new explicit group with status ``scored``:

1. **Captured** (the usual case: its calls went through the gateway): the turn whose ``h_out``
   is the hash of its messages up to its last choice (the positions in ``choices``: what the
   model sampled; else its last assistant message) is its leaf — inside ``trajectory_id`` when
   the client knows it, else the oldest such turn of the alias not yet taken. A trajectory id
   with no such turn (its messages were changed afterwards) takes its latest turn. The member is
   that branch, trained on the exact tokens the engine sampled.
2. **Built by hand** (not found): each choice is stored as a turn with ``source = "sdk"`` through
   the recorder (redacted, hashed and linked like captured traffic), in a new trajectory. There are
   no token ids, so the trainer renders them with the chat template (``retokenized``). A trajectory
   with neither a match nor a choice is refused: nothing in it was sampled by the model.

A member that already belonged to another (automatic) group moves to this one: the client said
which attempts compete. Every member is closed and gets two ``scores`` rows: ``source="client"``
(what the client reported) and ``source="reward"`` (the final reward the trainer reads).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field
from sqlmodel import Session, col, select
from starlette.responses import Response

from flywheel.capture.canonical import prefix_hashes
from flywheel.capture.models import Group, GroupMember, Score, Trajectory, Turn, utcnow
from flywheel.capture.redaction import Redactor
from flywheel.capture.store import Store
from flywheel.capture.turns import CapturedExchange, new_id
from flywheel.gateway.core.errors import BadRequest, NotFound, OpenAIError
from flywheel.gateway.core.http import json_response, read_body
from flywheel.gateway.core.protocol import parse_json_object, validate_request
from flywheel.gateway.storeproc.store_state import StoreState

router = APIRouter(prefix="/flywheel/v1")


class UploadedTrajectory(BaseModel):
    trajectory_id: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    choices: list[int] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    reward: float = Field(allow_inf_nan=False)


class UploadedGroup(BaseModel):
    alias: str
    key: str | None = Field(default=None, max_length=512)
    trajectories: list[UploadedTrajectory] = Field(min_length=1)


@dataclass
class Member:
    """Where one uploaded trajectory ended up."""

    trajectory_id: str
    leaf_turn_id: str | None
    reward: float
    captured: bool


def leaf_position(trajectory: UploadedTrajectory, index: int) -> int:
    """The message the member ends with: its last choice, else its last assistant message (400 if none)."""
    messages = trajectory.messages
    for position in trajectory.choices:
        if not 0 <= position < len(messages) or messages[position].get("role") != "assistant":
            raise BadRequest(f"Invalid value for 'trajectories[{index}].choices': {position} is not the position "
                             "of an assistant message", param=f"trajectories[{index}].choices")
    if trajectory.choices:
        return max(trajectory.choices)
    assistants = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    if not assistants:
        raise BadRequest(f"Invalid value for 'trajectories[{index}].messages': no assistant message, so nothing "
                         "the model said to train on", param=f"trajectories[{index}].messages")
    return assistants[-1]


def leaf_hash(messages: list[dict[str, Any]], leaf: int, redactor: Redactor | None) -> str:
    """The ``h_out`` a captured turn answering with ``messages[leaf]`` has (hashed as stored: redacted)."""
    kept = messages[: leaf + 1]
    return prefix_hashes([redactor.json(m) for m in kept] if redactor else kept)[-1]


def find_captured(session: Session, alias: str, trajectory_id: str | None, h_out: str, taken: set[str],
                  ) -> tuple[str, str] | None:
    """(trajectory id, leaf turn id) of the captured branch this trajectory is, or None."""
    turns = session.exec(select(Turn).where(Turn.h_out == h_out, Turn.alias == alias, Turn.source != "fork")
                         .order_by(col(Turn.created_at), col(Turn.id))).all()
    if trajectory_id is not None and trajectory_id not in taken:
        for turn in turns:
            if turn.trajectory_id == trajectory_id:
                return turn.trajectory_id, turn.id
        known = session.get(Trajectory, trajectory_id)
        if known is not None and known.alias == alias and known.latest_turn_id:
            return trajectory_id, known.latest_turn_id
    grouped = set(session.exec(select(GroupMember.trajectory_id).join(
        Group, col(Group.id) == col(GroupMember.group_id)).where(Group.source != "fork")))
    free = [t for t in turns if t.trajectory_id not in taken]
    ranked = [t for t in free if t.trajectory_id not in grouped] + [t for t in free if t.trajectory_id in grouped]
    return (ranked[0].trajectory_id, ranked[0].id) if ranked else None


def resolve_captured(store: Store, upload: UploadedGroup, leaves: list[int], redactor: Redactor | None,
                     ) -> list[Member | None]:
    """Each uploaded trajectory's captured member, or None where it has to be stored by hand."""
    taken: set[str] = set()
    members: list[Member | None] = []
    with store.session() as session:
        for trajectory, leaf in zip(upload.trajectories, leaves, strict=True):
            found = find_captured(session, upload.alias, trajectory.trajectory_id,
                                  leaf_hash(trajectory.messages, leaf, redactor), taken)
            if found is None:
                members.append(None)
                continue
            taken.add(found[0])
            members.append(Member(trajectory_id=found[0], leaf_turn_id=found[1], reward=trajectory.reward,
                                  captured=True))
    return members


def hand_built_exchanges(alias: str, trajectory: UploadedTrajectory, now: datetime) -> tuple[str, list[bytes]]:
    """A new trajectory id and one exchange line per choice: the turns a captured run would have left."""
    trajectory_id = new_id("traj")
    lines = []
    for position in sorted(trajectory.choices):
        request: dict[str, Any] = {"model": alias, "messages": trajectory.messages[:position]}
        if trajectory.tools:
            request["tools"] = trajectory.tools
        completion_id = new_id("sdk")
        response = {"id": completion_id, "object": "chat.completion", "model": alias,
                    "choices": [{"index": 0, "message": trajectory.messages[position], "finish_reason": "stop"}]}
        exchange = CapturedExchange(completion_id=completion_id, endpoint="chat.completions", requested_model=alias,
                                    alias=alias, engine_model="sdk", adapter_version=0, client_key_id=None,
                                    request=request, response=response, created_at=now, latency_ms=0.0,
                                    trajectory_id=trajectory_id, source="sdk")
        lines.append(exchange.to_line())
    return trajectory_id, lines


def latest_turns(store: Store, trajectory_ids: list[str]) -> dict[str, str | None]:
    with store.session() as session:
        return {tid: (row.latest_turn_id if (row := session.get(Trajectory, tid)) else None) for tid in trajectory_ids}


def _leave_other_groups(session: Session, trajectory_id: str) -> None:
    """Take a trajectory out of the automatic groups it is in (fork groups keep their single turns)."""
    rows = session.exec(select(GroupMember, Group).join(Group, col(Group.id) == col(GroupMember.group_id))
                        .where(GroupMember.trajectory_id == trajectory_id, Group.source != "fork")).all()
    for membership, group in rows:
        session.delete(membership)
        group.size = max(0, group.size - 1)
        if group.size == 0:
            session.delete(group)
        else:
            session.add(group)


def store_group(store: Store, alias: str, key: str, members: list[Member]) -> dict[str, Any]:
    """The new scored group with its members, their closing and their scores, in one transaction."""
    now = utcnow()
    group = Group(id=new_id("grp"), source="explicit", key=key, alias=alias, status="scored", size=len(members),
                  created_at=now, closed_at=now)
    with Session(store.engine, expire_on_commit=False) as session:
        session.add(group)
        for member in members:
            _leave_other_groups(session, member.trajectory_id)
            session.add(GroupMember(group_id=group.id, trajectory_id=member.trajectory_id,
                                    leaf_turn_id=member.leaf_turn_id, added_at=now))
            trajectory = session.get(Trajectory, member.trajectory_id)
            if trajectory is not None and trajectory.status != "closed":
                trajectory.status, trajectory.closed_at, trajectory.close_reason = "closed", now, "client"
                session.add(trajectory)
            for source, explanation in (("client", "reported with the group by the client"),
                                        ("reward", "client: the reward the client reported")):
                session.add(Score(id=new_id("score"), trajectory_id=member.trajectory_id, group_id=group.id,
                                  source=source, value=member.reward, explanation=explanation))
        session.commit()
    return {"id": group.id, "object": "flywheel.group", "alias": alias, "key": key, "source": group.source,
            "status": group.status, "size": group.size,
            "members": [{"trajectory_id": m.trajectory_id, "leaf_turn_id": m.leaf_turn_id, "reward": m.reward,
                         "captured": m.captured} for m in members]}


@router.post("/groups")
async def post_group(request: Request) -> Response:
    """Store a group of trajectories with their rewards, ready for ``POST /flywheel/v1/aliases/{alias}/train``."""
    state = StoreState.of(request)
    state.auth.admin(request)
    body = parse_json_object(await read_body(request, state.settings.max_body_bytes))
    validate_request(UploadedGroup, body)
    upload = UploadedGroup.model_validate(body)
    if upload.alias not in state.settings.aliases:
        raise NotFound(f"No alias named '{upload.alias}' (aliases: {', '.join(state.settings.aliases)}).",
                       param="alias")
    leaves = [leaf_position(t, i) for i, t in enumerate(upload.trajectories)]
    await state.caught_up(request)  # the rollouts' last turns may still be on their way in
    redactor = state.recorder.redactor
    members = await asyncio.to_thread(resolve_captured, state.store, upload, leaves, redactor)
    built: dict[int, str] = {}
    now = utcnow()
    for index, (trajectory, member) in enumerate(zip(upload.trajectories, members, strict=True)):
        if member is not None:
            continue
        if not trajectory.choices:
            raise BadRequest(f"Invalid value for 'trajectories[{index}]': it was not captured by this gateway and "
                             "has no choices (messages the model sampled) to store in its place",
                             param=f"trajectories[{index}].choices")
        built[index], lines = hand_built_exchanges(upload.alias, trajectory, now)
        for line in lines:
            state.recorder.submit(line)
    if built:
        await state.recorder.flush()
        leaf_of = await asyncio.to_thread(latest_turns, state.store, list(built.values()))
        if None in leaf_of.values():
            raise OpenAIError("The store is not writable now; the trajectories built by hand were spooled. "
                              "Send the group again later.", status_code=503, code="store_unavailable",
                              error_type="server_error")
        for index, trajectory_id in built.items():
            members[index] = Member(trajectory_id=trajectory_id, leaf_turn_id=leaf_of[trajectory_id],
                                    reward=upload.trajectories[index].reward, captured=False)
    stored = await asyncio.to_thread(store_group, state.store, upload.alias, upload.key or new_id("group"),
                                     [m for m in members if m is not None])
    return json_response(stored)
