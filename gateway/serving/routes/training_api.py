"""Admin API for a trainer in another process (``flywheel train``, the loop's training child, a worker).

    GET  /flywheel/v1/training/batch?alias=A&max_groups=N[&group_ids=g1,g2]  scored groups, base weights,
                                                                            the version serving now (with
                                                                            ``[train] workers``: none unless
                                                                            the loop's rule says a round is
                                                                            due and no version is in flight)
    POST /flywheel/v1/training/versions  {"alias"}                          reserve the next version number
    POST /flywheel/v1/training/rounds    {"alias", "version", ...}          record a finished round
    POST /flywheel/v1/training/failures  {"alias", "version", "error"}      record a round that failed
    GET  /flywheel/v1/training/adapters/{alias}/{version}                   a version's files, as a tar
    PUT  /flywheel/v1/training/adapters/{alias}/{version}  (tar body)       a reserved version's files, from a
                                                                            worker with no shared filesystem

Every route reads and writes the store as it is: what the gateway answered a moment ago (turns still in
the store process's batch) is nothing a round needs, and waiting for it made each call write that batch early.

The archive is ``trainer/adapters.py: pack``'s: the PEFT adapter, its round file and optimizer state,
nothing else (``unpack`` refuses any other member). An uploaded version lands in the directory the
gateway reserved for it; a round report never names where its files are.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field
from starlette.background import BackgroundTask
from starlette.responses import FileResponse, Response

from flywheel.capture.batches import TrainingGroup
from flywheel.gateway.core.errors import BadRequest, Conflict, NotFound, PayloadTooLarge
from flywheel.gateway.core.http import json_response, read_body
from flywheel.gateway.core.openapi import ERRORS, json_body, query
from flywheel.gateway.core.protocol import parse_json_object, validate_request
from flywheel.gateway.core.store_api import Version
from flywheel.gateway.core.training_config import base_model_path, grpo_args
from flywheel.gateway.core.training_wire import RoundReport
from flywheel.gateway.serving.gateway_state import GatewayState
from flywheel.gateway.serving.loop.promotion import promote_version
from flywheel.gateway.serving.routes.admin import alias_info
from flywheel.gateway.serving.store_client import as_it_is

router = APIRouter(prefix="/flywheel/v1/training")


Body = TypeVar("Body", bound=BaseModel)


class BatchQuery(BaseModel):
    alias: str
    max_groups: int | None = Field(default=None, ge=1, description="default: train.max_groups")
    group_ids: str | None = Field(default=None, description="comma-separated group ids: only these")


async def _admin_body(request: Request, model: type[Body]) -> tuple[GatewayState, Body]:
    state = GatewayState.of(request)
    state.auth.admin(request)
    body = parse_json_object(await read_body(request, state.settings.max_body_bytes))
    validate_request(model, body)
    return state, model.model_validate(body)


@router.get("/batch", openapi_extra=query(BatchQuery), responses=ERRORS)
async def get_batch(request: Request) -> Response:
    """Scored, untrained groups of an alias, with the base weights and the version the round continues from."""
    state = GatewayState.of(request)
    state.auth.admin(request)
    params = request.query_params
    raw = params.get("max_groups") or str(state.settings.train.max_groups)
    if not raw.isdigit() or int(raw) < 1:
        raise BadRequest("Invalid value for 'max_groups': a positive integer", param="max_groups")
    group_ids = [g for g in (params.get("group_ids") or "").split(",") if g] or None
    with as_it_is():
        return json_response(await _batch(request, state, params.get("alias") or "", int(raw), group_ids))


async def _batch(request: Request, state: GatewayState, alias: str, max_groups: int,
                 group_ids: list[str] | None) -> dict[str, Any]:
    """The batch's answer: groups, base weights, the version it continues from, GRPOArgs."""
    state.router.get(alias)  # an alias that does not exist is the client's error, here
    try:
        base = base_model_path(state.settings, alias)
    except ValueError as exc:
        raise BadRequest(f"Invalid training request: {exc}", param="alias") from None
    args = asdict(grpo_args(state.settings, base))

    async def batch() -> list[TrainingGroup]:
        if state.settings.train.workers and group_ids is None and not await _worker_round_due(request, state, alias):
            return []  # trainer workers ask often: a round only when the loop would train
        return await state.store.training_batch(alias, max_groups, group_ids)

    groups, head = await asyncio.gather(batch(), state.store.training_head(alias))  # both at once
    current = {"version": head.version, "path": head.path} if head else None
    return {"alias": alias, "base_model": base, "current": current, "groups": groups, "args": args}


async def _worker_round_due(request: Request, state: GatewayState, alias: str) -> bool:
    """``[train] workers``: the loop's rule (``loop.min_groups``, ``loop.train_every_s``), one version in flight."""
    from flywheel.gateway.serving.loop.scheduler import Loop, training_due

    if (await state.store.serving())[alias].in_flight is not None:
        return False
    pending = await state.store.pending(alias)
    return training_due(pending, state.settings.loop, Loop.of(request).started_at)


class VersionRequest(BaseModel):
    alias: str


@router.post("/versions", openapi_extra=json_body(VersionRequest), responses=ERRORS)
async def reserve_version(request: Request) -> Response:
    """The next version number of an alias and the directory to write it into (status ``training``)."""
    state, body = await _admin_body(request, VersionRequest)
    served = state.router.get(body.alias)
    with as_it_is():
        head = await state.store.training_head(body.alias)
        # never while another round of the alias trains, whichever process runs it; with workers, never while a
        # version is in flight
        return json_response(await state.store.reserve_version(body.alias, served.base_model,
                                                               parent_version=head.version if head else None,
                                                               alone=state.settings.train.workers, one_round=True))


@router.post("/rounds", openapi_extra=json_body(RoundReport), responses=ERRORS)
async def post_round(request: Request) -> Response:
    """Record a finished round (the version becomes a candidate); with ``promote``, serve it at once."""
    state, report = await _admin_body(request, RoundReport)
    served = state.router.get(report.alias)
    with as_it_is():
        adapter = await state.store.record_round(report.alias, report.version, report.parent_version,
                                                 promote=False,  # the store would promote without the engine: below
                                                 result=report.result, batch_group_ids=report.batch_group_ids)
        if report.promote and adapter is not None:
            served = await promote_version(state, report.alias, report.version,
                                           reason="promoted by hand (--promote)")
    return json_response({"adapter_version": adapter, "served": alias_info(served)})


class FailureReport(BaseModel):
    alias: str
    version: int = Field(ge=1)
    error: str = Field(max_length=100_000)
    group_ids: list[str] = Field(default_factory=list)


@router.post("/failures", openapi_extra=json_body(FailureReport), responses=ERRORS)
async def post_failure(request: Request) -> Response:
    """A round that raised: its run is recorded failed, its groups stay for the next round."""
    state, report = await _admin_body(request, FailureReport)
    state.router.get(report.alias)
    with as_it_is():
        return json_response(await state.store.record_failed_round(report.alias, report.version, report.error,
                                                                   report.group_ids))


async def _version_row(request: Request, alias: str, version: int) -> tuple[GatewayState, Version]:
    state = GatewayState.of(request)
    state.auth.admin(request)
    state.router.get(alias)
    with as_it_is():
        rows = await state.store.versions(alias)
    row = next((r for r in rows if r.version == version), None)
    if row is None:
        raise NotFound(f"{alias} has no version {version}.", param="version", code="version_not_found")
    return state, row


@router.get("/adapters/{alias}/{version}", responses=ERRORS)
async def download_adapter(alias: str, version: int, request: Request) -> Response:
    """A version's files as a tar: the adapter a worker on another machine continues from."""
    from flywheel.trainer import adapters

    _, row = await _version_row(request, alias, version)
    if not adapters.is_complete(row.path):
        raise NotFound(f"{alias} version {version} has no adapter files ({row.status}).", param="version",
                       code="version_not_found")
    fd, archive = tempfile.mkstemp(suffix=".tar")
    with os.fdopen(fd, "wb") as out:
        await asyncio.to_thread(adapters.pack, row.path, out)
    return FileResponse(archive, media_type="application/x-tar", filename=f"{alias}-{version}.tar",
                        background=BackgroundTask(os.unlink, archive))


@router.put("/adapters/{alias}/{version}", responses=ERRORS)
async def upload_adapter(alias: str, version: int, request: Request) -> Response:
    """A reserved version's files (``status`` ``training``), written once into the directory reserved for it."""
    from flywheel.trainer import adapters

    state, row = await _version_row(request, alias, version)
    if row.status != "training" or adapters.is_complete(row.path):
        state_now = "uploaded already" if row.status == "training" else row.status
        raise Conflict(f"{alias} version {version} is {state_now}: only a reserved version (training) takes an "
                       "upload, once.", param="version", code="version_not_training")
    limit = state.settings.train.max_upload_mb * 1024 * 1024
    Path(row.path).parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile(dir=Path(row.path).parent) as spool:  # beside it: the same filesystem
        size = 0
        async for chunk in request.stream():  # to disk, not memory: an adapter with its optimizer state is large
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(f"The upload is over train.max_upload_mb ({state.settings.train.max_upload_mb}).")
            await asyncio.to_thread(spool.write, chunk)
        spool.seek(0)
        try:
            names = await asyncio.to_thread(adapters.unpack, spool, row.path)
        except adapters.AdapterError as exc:
            raise BadRequest(f"Invalid adapter upload: {exc}", param="body") from None
    return json_response({"alias": alias, "version": version, "files": names, "bytes": size})
