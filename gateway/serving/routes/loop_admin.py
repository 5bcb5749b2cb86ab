"""The loop's admin API: status, versions, promote, rollback, a round now, a job now.

    GET  /flywheel/v1/status                              per alias: serving version, canary and its A/B
                                                          numbers, pending work, last run of each job,
                                                          reward per version
    GET  /flywheel/v1/aliases/{alias}/versions            every version with training metrics and gate results
    GET  /flywheel/v1/aliases/{alias}/rewards?since=T     every rewarded conversation: version, reward, time
    POST /flywheel/v1/aliases/{alias}/promote  {"version": N}
    POST /flywheel/v1/aliases/{alias}/rollback {"version": N | null}   null: the version served before
    POST /flywheel/v1/aliases/{alias}/train    {"promote", "group_ids", "args"}   one round now (child process)
    POST /flywheel/v1/aliases/{alias}/candidates {"path"}             an adapter trained elsewhere, for the gate
    POST /flywheel/v1/loop/run                 {"job", "alias"}       one loop job now
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field
from starlette.responses import Response

from flywheel.gateway.core.config import AdapterVersion
from flywheel.gateway.core.errors import BadRequest, OpenAIError
from flywheel.gateway.core.http import json_response, read_body
from flywheel.gateway.core.openapi import ERRORS, json_body, query
from flywheel.gateway.core.protocol import parse_json_object, validate_request
from flywheel.gateway.core.store_api import JobRunRecord
from flywheel.gateway.serving.gateway_state import GatewayState
from flywheel.gateway.serving.loop.promotion import promote_version, register_adapter
from flywheel.gateway.serving.loop.scheduler import ALIAS_JOBS, GLOBAL_JOBS, Loop
from flywheel.gateway.serving.routes.admin import adapter_directory, alias_info
from flywheel.gateway.serving.served_model import ServedModel
from flywheel.gateway.serving.store_client import as_it_is

router = APIRouter(prefix="/flywheel/v1")


class Conflict(OpenAIError):
    def __init__(self, message: str) -> None:
        super().__init__(message, status_code=409, error_type="invalid_request_error", code="conflict")


async def _admin(request: Request) -> GatewayState:
    state = GatewayState.of(request)
    state.auth.admin(request)
    return state


async def _body(request: Request, model: type[BaseModel], state: GatewayState) -> dict[str, Any]:
    raw = await read_body(request, state.settings.max_body_bytes)
    body = parse_json_object(raw) if raw.strip() else {}
    validate_request(model, body)
    return body


@router.get("/status", responses=ERRORS)
async def status(request: Request) -> Response:
    state = await _admin(request)
    loop = Loop.of(request)
    with as_it_is():  # polled by screens every second: the turns of the last moment show at the next poll
        aliases = [await alias_status(state, alias, loop) for alias in state.settings.aliases]
    return json_response({"aliases": aliases, "replica": {"role": loop.leadership.role}})


async def last_runs(state: GatewayState, alias: str, loop: Loop) -> dict[str, JobRunRecord]:
    """Each job's latest run: the leader's own (quiet ticks and running ones included), else the store's."""
    jobs = [*GLOBAL_JOBS, *ALIAS_JOBS]
    known = loop.latest_runs(alias, jobs) if loop.leadership.leading else {}
    missing = [job for job in jobs if job not in known]
    stored = await state.store.last_runs(alias, missing) if missing else {}
    return {job: known.get(job) or stored[job] for job in jobs if job in known or job in stored}


async def alias_status(state: GatewayState, alias: str, loop: Loop) -> dict[str, Any]:
    store = state.store
    served = state.router.get(alias)
    rows = (await store.serving())[alias]
    canary = state.router.canaries.get(alias)
    head = state.router.explorers.get(alias)
    flight = rows.in_flight
    return {
        "alias": alias,
        "serving": {**alias_info(served), "row": rows.serving},
        "candidate": flight,
        "canary": {"version": canary.served.version, "fraction": canary.fraction, "started_at": canary.started_at,
                   "ab": ((flight.gate if flight else None) or {}).get("online")} if canary else None,
        "monitor": ((rows.serving.gate if rows.serving else None) or {}).get("monitor"),
        "forks_from": {"version": head.version, "adapter": head.adapter} if head else None,  # else: the serving one
        "fork_shares": state.fork_yield.shares(alias),  # fork_turns = "untied": each turn position's share
        "pending": await store.pending(alias),
        "jobs": await last_runs(state, alias, loop),
        "reward_by_version": (await store.reward_by_version(alias)).model_dump(exclude_none=True),
        "loop": {"enabled": state.settings.loop.enabled, "workers": state.settings.train.workers,
                 "gate": state.settings.loop.gate.offline,
                 "canary": state.settings.loop.canary.enabled, "monitor": state.settings.loop.monitor.enabled},
    }


@router.get("/aliases/{alias}/versions", responses=ERRORS)
async def list_versions(alias: str, request: Request) -> Response:
    state = await _admin(request)
    state.router.get(alias)
    return json_response({"alias": alias, "serving": state.router.get(alias).version,
                          "data": await state.store.versions(alias)})


class RewardsQuery(BaseModel):
    since: datetime | None = Field(default=None, description="an ISO 8601 time: conversations closed after it")


@router.get("/aliases/{alias}/rewards", openapi_extra=query(RewardsQuery), responses=ERRORS)
async def list_rewards(alias: str, request: Request) -> Response:
    """Every finished, rewarded conversation of the alias in the order it closed: version, reward, time."""
    state = await _admin(request)
    state.router.get(alias)
    raw = request.query_params.get("since")
    try:
        since = datetime.fromisoformat(raw) if raw is not None else None
    except ValueError:
        raise BadRequest("Invalid value for 'since': an ISO 8601 time", param="since") from None
    return json_response(await state.store.rewards(alias, since=since))


class PromoteRequest(BaseModel):
    version: AdapterVersion


@router.post("/aliases/{alias}/promote", openapi_extra=json_body(PromoteRequest), responses=ERRORS)
async def promote(alias: str, request: Request) -> Response:
    """Serve a stored version now (by hand: no gate). A canary running for the alias is stopped first."""
    state = await _admin(request)
    body = await _body(request, PromoteRequest, state)
    state.router.get(alias)
    return json_response(alias_info(await promote_by_hand(state, alias, body["version"])))


async def promote_by_hand(state: GatewayState, alias: str, version: int, reason: str = "promoted by hand"
                          ) -> ServedModel:
    """Serve ``version`` now, no gate (the admin API, the dashboard); a canary of another version is stopped."""
    await _end_canary(state, alias, unless_version=version)
    return await promote_version(state, alias, version, reason=reason)


class RollbackRequest(BaseModel):
    version: AdapterVersion | None = None


@router.post("/aliases/{alias}/rollback", openapi_extra=json_body(RollbackRequest, required=False),
             responses=ERRORS)
async def rollback(alias: str, request: Request) -> Response:
    """Return to an earlier version (default: the one served before the current one)."""
    state = await _admin(request)
    body = await _body(request, RollbackRequest, state)
    state.router.get(alias)
    return json_response(alias_info(await rollback_by_hand(state, alias, body.get("version"))))


async def rollback_by_hand(state: GatewayState, alias: str, version: int | None = None,
                           reason: str = "rolled back by hand") -> ServedModel:
    """Back to ``version`` (None: the one served before the current one); the current one is ``rolled_back``."""
    if version is None:
        version = await state.store.rollback_target(alias)
    await _end_canary(state, alias)
    return await promote_version(state, alias, version, replaced_status="rolled_back", reason=reason)


async def _end_canary(state: GatewayState, alias: str, unless_version: int | None = None) -> None:
    split = state.router.canaries.get(alias)
    if split is not None and split.served.version != unless_version:
        # The store first: a replica that looks meanwhile sees a decided version, never a canary to restart.
        await state.store.decide(alias, split.served.version, "rejected",
                                 "canary stopped: another version was chosen by hand")
        await state.router.stop_canary(alias)


class CandidateRequest(BaseModel):
    path: str  # a PEFT adapter directory trained elsewhere


@router.post("/aliases/{alias}/candidates", openapi_extra=json_body(CandidateRequest), responses=ERRORS)
async def add_candidate(alias: str, request: Request) -> Response:
    """Register an adapter trained elsewhere as the next version, a candidate: the loop's gate decides on it."""
    state = await _admin(request)
    body = await _body(request, CandidateRequest, state)
    state.router.get(alias)
    path = adapter_directory(state, body["path"])
    rows = (await state.store.serving())[alias]
    busy = rows.training or rows.waiting
    if busy is not None:  # like the loop's rounds: one may wait while a canary runs, not two
        raise Conflict(f"{alias} already has version {busy.version} in flight ({busy.status})")
    return json_response(await register_adapter(state, alias, path, source="manual"))


class TrainRequest(BaseModel):
    promote: bool = False  # serve the new version at once (ART's semantics); false: the loop's gate decides
    group_ids: list[str] | None = None  # train on these scored groups only
    args: dict[str, Any] = Field(default_factory=dict)  # GRPOArgs overrides for this round


@router.post("/aliases/{alias}/train", openapi_extra=json_body(TrainRequest, required=False), responses=ERRORS)
async def train_now(alias: str, request: Request) -> Response:
    """Run one round now in a child process (the same path as the loop and ``flywheel train``); waits for it."""
    state = await _admin(request)
    body = TrainRequest.model_validate(await _body(request, TrainRequest, state))
    state.router.get(alias)
    loop = Loop.of(request)
    lock = loop.lock("train", alias)
    if lock.locked():  # this gateway runs one; a round of another process refuses this one its version
        raise Conflict(f"{alias} is already training: one round at a time")
    async with lock:
        result = await loop.child.run(alias, body.group_ids, body.args)
    if result.reply is None or result.reply.summary is None:
        why = result.reply.error if result.reply else result.tail[-1500:]
        log = f" (log {result.log_path})" if result.log_path else ""
        raise BadRequest(f"the training round failed{log}: {why}",
                         param=result.reply.param if result.reply else None, code="training_failed")
    summary = result.reply.summary
    finished = summary.status == "finished"
    if finished and body.promote:
        assert summary.version is not None
        await _end_canary(state, alias)
        await promote_version(state, alias, summary.version, reason="trained and promoted through the admin API")
    return json_response({"status": "finished" if finished else "skipped", "version": summary.version,
                          "adapter_path": summary.adapter_path, "metrics": summary.metrics,
                          "promoted": finished and body.promote})


class JobRequest(BaseModel):
    job: str
    alias: str | None = None


@router.post("/loop/run", openapi_extra=json_body(JobRequest), responses=ERRORS)
async def run_job(request: Request) -> Response:
    """Run one loop job now and answer with its outcome (the same run the scheduler would record)."""
    state = await _admin(request)
    body = JobRequest.model_validate(await _body(request, JobRequest, state))
    if body.job not in (*ALIAS_JOBS, *GLOBAL_JOBS):
        raise BadRequest(f"Invalid value for 'job': one of {', '.join((*GLOBAL_JOBS, *ALIAS_JOBS))}", param="job")
    if body.job in ALIAS_JOBS:
        if body.alias is None:
            raise BadRequest(f"'{body.job}' runs for one alias: give 'alias'", param="alias")
        state.router.get(body.alias)
    return json_response(await Loop.of(request).run(body.job, body.alias if body.job in ALIAS_JOBS else None))
