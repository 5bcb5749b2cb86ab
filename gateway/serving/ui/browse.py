"""Trajectories (a filtered list, one as a conversation) and groups (members side by side with their scores)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from flywheel.capture.queries import QueryError, parse_bool, parse_time
from flywheel.gateway.serving.ui import common
from flywheel.gateway.serving.ui.conversation import branch_steps, leaf_branch
from flywheel.gateway.serving.ui.render import page
from flywheel.gateway.serving.ui.session import PATH, PageError

router = APIRouter(prefix=PATH)

PAGE_SIZE = 50
STATUSES = ("open", "closed")
FILTERS = ("alias", "version", "status", "since", "until", "task", "min_reward", "max_reward", "has_reward", "q")


def trajectory_filters(params: dict[str, str]) -> dict[str, Any]:
    """The list's filters from the query string, checked here so a bad one gets a page that names it."""
    out: dict[str, Any] = {}
    try:
        for key in ("since", "until"):
            if params.get(key):
                out[key] = parse_time(params[key], key).isoformat()
        if params.get("has_reward"):
            out["has_reward"] = parse_bool(params["has_reward"], "has_reward")
    except QueryError as exc:
        raise PageError(400, str(exc)) from None
    if params.get("version"):
        if not params["version"].isdigit():
            raise PageError(400, f"Invalid value for 'version': {params['version']!r} is not a version number.")
        out["version"] = int(params["version"])
    for key in ("min_reward", "max_reward"):
        if params.get(key):
            try:
                out[key] = float(params[key])
            except ValueError:
                raise PageError(400, f"Invalid value for '{key}': {params[key]!r} is not a number.") from None
    if params.get("status") and params["status"] not in STATUSES:
        raise PageError(400, f"Invalid value for 'status': {params['status']!r}; open or closed.")
    for key in ("alias", "status", "task"):
        if params.get(key):
            out[key] = params[key]
    if params.get("q"):
        out["text"] = params["q"]
    return out


@router.get("/trajectories")
async def trajectories(request: Request) -> Response:
    viewer = common.viewer(request)
    params = {key: request.query_params.get(key, "").strip() for key in (*FILTERS, "after")}
    listed = await common.read(common.store(request).ui_trajectories(trajectory_filters(params), PAGE_SIZE,
                                                                     params["after"] or None))
    kept = {key: value for key, value in params.items() if value and key != "after"}
    return page(request, viewer, "trajectories.html", rows=listed["data"], has_more=listed["has_more"],
                last_id=listed["last_id"], params=params, kept=kept, aliases=common.aliases(request),
                statuses=STATUSES)


@router.get("/trajectories/{trajectory_id:path}")
async def trajectory(trajectory_id: str, request: Request) -> Response:
    viewer = common.viewer(request)
    detail = await common.read_one(common.store(request).ui_trajectory(trajectory_id), "trajectory", trajectory_id)
    branches = detail["branches"] or [[]]
    raw = request.query_params.get("branch")
    if raw is not None and not (raw.isdigit() and 1 <= int(raw) <= len(branches)):
        raise PageError(400, f"Invalid value for 'branch': {raw!r}; from 1 to {len(branches)}.")
    chosen = int(raw) - 1 if raw is not None else len(branches) - 1
    steps = branch_steps(detail["turns"], branches[chosen])
    return page(request, viewer, "trajectory.html", t=detail, steps=steps, branch=chosen + 1,
                branches=len(branches))


@router.get("/groups")
async def groups(request: Request) -> Response:
    viewer = common.viewer(request)
    alias = request.query_params.get("alias") or None
    if alias is not None:
        common.known_alias(request, alias)
    status = request.query_params.get("status") or None
    rows = await common.read(common.store(request).ui_groups(alias, status, limit=200))
    return page(request, viewer, "groups.html", rows=rows, alias=alias, status_filter=status,
                aliases=common.aliases(request))


@router.get("/groups/{group_id:path}")
async def group(group_id: str, request: Request) -> Response:
    viewer = common.viewer(request)
    found = await common.read_one(common.store(request).ui_group(group_id), "group", group_id)
    members = []
    for member in found["members"]:
        detail = member["trajectory"]
        branches = detail["branches"] or [[]]
        chosen = leaf_branch(branches, member["leaf_turn_id"])
        members.append({**member, "steps": branch_steps(detail["turns"], branches[chosen]), "branch": chosen + 1})
    members.sort(key=lambda m: -max([s["value"] for s in m["scores"]] or [float("-inf")]))  # best first
    return page(request, viewer, "group.html", g=found["group"], members=members)
