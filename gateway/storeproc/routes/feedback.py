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
from starlette.responses import Response

from flywheel.capture.feedback import FeedbackItem
from flywheel.capture.recorder import FeedbackNotWritten
from flywheel.gateway.core.errors import BadRequest, NotFound, OpenAIError
from flywheel.gateway.core.http import json_response
from flywheel.gateway.core.openapi import ERRORS, json_body, query
from flywheel.gateway.core.protocol import parse_json_object, validate_request
from flywheel.gateway.storeproc import store_ops
from flywheel.gateway.storeproc.store_state import StoreState
from flywheel.judge.rewards import InvalidFeedbackError, feedback_reward

router = APIRouter(prefix="/flywheel/v1")
FEEDBACK_TIMEOUT_S = 30.0  # the recorder writes a batch within batch_wait_s; a stuck store is answered 503

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
    await state.received_all(request)  # a completion answered a moment ago may still be on its way in
    item = FeedbackItem(trajectory_id=feedback.trajectory_id, completion_id=feedback.completion_id,
                        reward=feedback.reward, label=feedback.label, comment=feedback.comment, client_key_id=key_id)
    try:  # written with the batch that holds that completion's turn, answered once it commits
        recorded = await asyncio.wait_for(state.recorder.record_feedback(item), FEEDBACK_TIMEOUT_S)
    except (FeedbackNotWritten, TimeoutError) as exc:
        raise OpenAIError(f"Feedback not recorded: {exc or 'its batch was not written in time'}; send it again.",
                          status_code=503, code="store_unavailable") from None
    if recorded is None:
        param = "trajectory_id" if feedback.trajectory_id else "completion_id"
        raise NotFound(f"No captured trajectory for {param} '{body[param]}'.", param=param, code="not_found")
    return Response(orjson.dumps({"id": recorded.feedback_id, "object": "flywheel.feedback",
                                  "trajectory_id": recorded.trajectory_id, "reward": reward}),
                    media_type="application/json")


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
