"""Client feedback, and the admin jobs that turn traffic into scored groups.

``POST /flywheel/v1/feedback`` (client key) names a trajectory by its id or by the ``id``
of any chat completion in it (which every client already has), with a reward and/or a
label (``good``/``bad``) and an optional comment. Feedback closes the trajectory: the
client has said how it went. ``POST /flywheel/v1/jobs/groups`` and
``POST /flywheel/v1/jobs/score`` (admin) run group formation and the scoring job now.
"""

from __future__ import annotations

import asyncio

import orjson
from fastapi import APIRouter, Request
from pydantic import BaseModel, Field, ValidationInfo, field_validator
from sqlalchemy import insert
from sqlmodel import Session, col, select
from starlette.responses import Response

from flywheel.capture.models import Feedback, Trajectory, Turn
from flywheel.capture.store import Store, close_in, retry_on_conflict
from flywheel.capture.turns import new_id
from flywheel.gateway.core.errors import BadRequest, NotFound
from flywheel.gateway.core.http import json_response
from flywheel.gateway.core.openapi import ERRORS, json_body, query
from flywheel.gateway.core.protocol import parse_json_object, validate_request
from flywheel.gateway.storeproc import store_ops
from flywheel.gateway.storeproc.store_state import StoreState
from flywheel.judge.rewards import InvalidFeedbackError, feedback_reward

router = APIRouter(prefix="/flywheel/v1")

class FeedbackRequest(BaseModel):
    trajectory_id: str | None = None
    completion_id: str | None = Field(default=None, validate_default=True)  # checked even when absent
    reward: float | None = None
    label: str | None = None
    comment: str | None = Field(default=None, max_length=10_000)

    @field_validator("completion_id")
    @classmethod
    def _names_a_trajectory(cls, completion_id: str | None, info: ValidationInfo) -> str | None:
        # A field's validator (not the model's), so the 400 names a parameter.
        if not (completion_id or info.data.get("trajectory_id")):
            raise ValueError("give trajectory_id or completion_id")
        return completion_id


class ScoreQuery(BaseModel):
    alias: str | None = Field(default=None, description="only this alias's groups")


def _find_trajectory(session: Session, trajectory_id: str | None, completion_id: str | None,
                     client_key_id: str | None) -> str | None:
    if trajectory_id:
        found = session.execute(select(Trajectory.client_key_id).where(Trajectory.id == trajectory_id)).first()
        ok = found is not None and (client_key_id is None or found[0] == client_key_id)
        return trajectory_id if ok else None
    query = select(Turn.trajectory_id).where(Turn.completion_id == completion_id, Turn.source != "fork")
    if client_key_id is not None:
        query = query.where(col(Turn.client_key_id) == client_key_id)
    return session.exec(query.limit(1)).first()


def _record_feedback(store: Store, request: FeedbackRequest, client_key_id: str | None) -> tuple[str, str] | None:
    """Find the trajectory, record the feedback and close the trajectory in one transaction: (trajectory id,
    feedback id), or None when no trajectory matches."""
    def write() -> tuple[str, str] | None:
        with store.session() as session:
            trajectory_id = _find_trajectory(session, request.trajectory_id, request.completion_id, client_key_id)
            if trajectory_id is None:
                return None
            feedback_id = new_id("fb")
            row = Feedback(id=feedback_id, trajectory_id=trajectory_id, completion_id=request.completion_id,
                           reward=request.reward, label=request.label, comment=request.comment,
                           client_key_id=client_key_id)
            session.execute(insert(Feedback).values(row.model_dump()))
            close_in(session, trajectory_id, "feedback")
            session.commit()
            return trajectory_id, feedback_id
    return retry_on_conflict(write)


@router.post("/feedback", openapi_extra=json_body(FeedbackRequest), responses=ERRORS)
async def post_feedback(request: Request) -> Response:
    state = StoreState.of(request)
    key_id = state.auth.client(request)
    body = parse_json_object(await request.body())
    validate_request(FeedbackRequest, body)
    feedback = FeedbackRequest.model_validate(body)
    try:
        reward = feedback_reward(feedback.reward, feedback.label)
    except InvalidFeedbackError as exc:
        raise BadRequest(f"Invalid feedback: {exc}", param="label" if feedback.label else "reward") from None
    store = state.store
    await state.caught_up(request)  # a completion answered a moment ago may still be on its way in
    recorded = await asyncio.to_thread(_record_feedback, store, feedback, key_id)
    if recorded is None:
        param = "trajectory_id" if feedback.trajectory_id else "completion_id"
        raise NotFound(f"No captured trajectory for {param} '{body[param]}'.", param=param, code="not_found")
    trajectory_id, feedback_id = recorded
    return Response(orjson.dumps({"id": feedback_id, "object": "flywheel.feedback", "trajectory_id": trajectory_id,
                                  "reward": reward}), media_type="application/json")


@router.post("/jobs/groups", responses=ERRORS)
async def form_groups_now(request: Request) -> Response:
    state = StoreState.of(request)
    state.auth.admin(request)
    await state.caught_up(request)
    formed = await asyncio.to_thread(store_ops.run_group_formation, state.store, state.settings)
    return json_response({"formed": formed})


@router.post("/jobs/score", openapi_extra=query(ScoreQuery), responses=ERRORS)
async def score_now(request: Request) -> Response:
    state = StoreState.of(request)
    state.auth.admin(request)
    alias = request.query_params.get("alias")
    return json_response(await store_ops.score(state.store, state.settings, alias=alias))
