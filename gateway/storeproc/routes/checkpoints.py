"""Evaluation results per adapter version, and deleting a version's files (the SDK's ``model.log`` and
``model.delete_checkpoints``). Served by the store process; every route needs the admin key.

    POST   /flywheel/v1/aliases/{alias}/metrics             {"split": "val", "version": N | null,
                                                            "metrics": [{"name": "reward", "value": 0.7, "n": 16}]}
    GET    /flywheel/v1/aliases/{alias}/metrics?split=val    the logged rows, oldest first
    DELETE /flywheel/v1/aliases/{alias}/versions/{version}   the adapter files go, the status becomes ``deleted``

A metric logged without a version belongs to the version serving the alias then (0: the base
model). A version may be deleted only when it is not in use — not serving (``promoted``), not
training, waiting for its gate or on canary (``gateway/storeproc/versions.py: IN_FLIGHT``) — and only
when its files are the gateway's own (under ``<data_dir>/adapters/<alias>/``): an adapter
registered from elsewhere belongs to whoever put it there. Both refusals answer 409.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field
from sqlmodel import col, select
from starlette.responses import Response

from flywheel.capture.models import EvalMetric, utcnow
from flywheel.capture.store import Store
from flywheel.capture.turns import new_id
from flywheel.gateway.core.errors import NotFound, OpenAIError
from flywheel.gateway.core.http import json_response, read_body
from flywheel.gateway.core.protocol import parse_json_object, validate_request
from flywheel.gateway.storeproc import versions
from flywheel.gateway.storeproc.routes.helpers import caught_up_store, not_found
from flywheel.gateway.storeproc.store_state import StoreState

router = APIRouter(prefix="/flywheel/v1")

KEEP_STATUSES = ("promoted", *versions.IN_FLIGHT)  # serving, or on its way to serve: its files are in use


class LoggedMetric(BaseModel):
    name: str = Field(min_length=1, max_length=200)
    value: float = Field(allow_inf_nan=False)
    n: int = Field(default=0, ge=0)


class MetricsLog(BaseModel):
    split: str = Field(min_length=1, max_length=100)
    version: int | None = Field(default=None, ge=0)
    metrics: list[LoggedMetric]


def write_metrics(store: Store, alias: str, log: MetricsLog) -> list[dict[str, Any]]:
    now = utcnow()
    with store.session() as session:
        version = log.version
        if version is None:
            serving = versions.serving(session, alias)
            version = serving.version if serving is not None else 0
        rows = [EvalMetric(id=new_id("eval"), alias=alias, version=version, split=log.split, metric=m.name,
                           value=m.value, n=m.n, created_at=now) for m in log.metrics]
        session.add_all(rows)
        session.commit()
        return [_metric_json(row) for row in rows]


def read_metrics(store: Store, alias: str, split: str | None) -> list[dict[str, Any]]:
    with store.session() as session:
        query = select(EvalMetric).where(EvalMetric.alias == alias)
        if split:
            query = query.where(EvalMetric.split == split)
        return [_metric_json(row) for row in session.exec(query.order_by(col(EvalMetric.created_at),
                                                                         col(EvalMetric.id)))]


def _metric_json(row: EvalMetric) -> dict[str, Any]:
    return {"alias": row.alias, "version": row.version, "split": row.split, "metric": row.metric,
            "value": row.value, "n": row.n, "created_at": row.created_at.isoformat()}


def _known_alias(request: Request, alias: str) -> None:
    aliases = StoreState.of(request).settings.aliases
    if alias not in aliases:
        raise NotFound(f"No alias named '{alias}' (aliases: {', '.join(aliases)}).", param="alias")


@router.post("/aliases/{alias}/metrics")
async def log_metrics(alias: str, request: Request) -> Response:
    state = StoreState.of(request)
    store, _ = await caught_up_store(request, admin=True)
    _known_alias(request, alias)
    body = parse_json_object(await read_body(request, state.settings.max_body_bytes))
    validate_request(MetricsLog, body)
    rows = await asyncio.to_thread(write_metrics, store, alias, MetricsLog.model_validate(body))
    return json_response({"object": "list", "data": rows})


@router.get("/aliases/{alias}/metrics")
async def list_metrics(alias: str, request: Request) -> Response:
    store, _ = await caught_up_store(request, admin=True)
    _known_alias(request, alias)
    rows = await asyncio.to_thread(read_metrics, store, alias, request.query_params.get("split"))
    return json_response({"object": "list", "data": rows})


class VersionInUse(OpenAIError):
    status_code = 409
    error_type = "invalid_request_error"
    default_code = "version_in_use"


def delete_version_files(store: Store, data_dir: Path, alias: str, version: int) -> dict[str, Any] | None:
    """Remove a version's adapter directory and mark it ``deleted``; None when the version does not exist."""
    with store.session() as session:
        try:
            row = versions.get(session, alias, version)
        except versions.VersionError:
            return None
        if row.status in KEEP_STATUSES:
            raise VersionInUse(f"{alias} version {version} is {row.status}: it is in use and is kept. Promote, "
                               "roll back or wait for its gate first.")
        owned = (data_dir / "adapters" / alias).resolve()
        path = Path(row.path).resolve()
        if not path.is_relative_to(owned):
            raise VersionInUse(f"{alias} version {version} lives at {row.path}, outside the gateway's adapter "
                               "directory: its files are not the gateway's to delete.", code="not_owned")
        if row.status != "deleted":
            shutil.rmtree(path, ignore_errors=True)
            row.status = "deleted"
            session.add(row)
            session.commit()
        return {"object": "adapter_version.deleted", "alias": alias, "version": version, "deleted": True,
                "path": row.path}


@router.delete("/aliases/{alias}/versions/{version}")
async def delete_version(alias: str, version: int, request: Request) -> Response:
    state = StoreState.of(request)
    store, _ = await caught_up_store(request, admin=True)
    _known_alias(request, alias)
    deleted = await asyncio.to_thread(delete_version_files, store, state.settings.data_dir, alias, version)
    if deleted is None:
        raise not_found(f"version of {alias}", str(version))
    return json_response(deleted)
