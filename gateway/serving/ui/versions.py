"""Versions: training metrics and gate results of every version; promote and roll back, confirmed first.

The buttons lead to a confirmation page; its form posts the session's CSRF token, and the action
runs the admin API's own code (``gateway/serving/routes/loop_admin.py: promote_by_hand, rollback_by_hand``).
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import RedirectResponse, Response

from flywheel.gateway.core.errors import OpenAIError
from flywheel.gateway.serving.gateway_state import GatewayState
from flywheel.gateway.serving.routes.loop_admin import promote_by_hand, rollback_by_hand
from flywheel.gateway.serving.ui import common
from flywheel.gateway.serving.ui.render import page
from flywheel.gateway.serving.ui.session import PATH, PageError, check_csrf

router = APIRouter(prefix=PATH)

SHOWN_METRICS = ("reward/mean", "reward/std", "losses/loss", "losses/approx_kl", "losses/clipfrac", "samples/groups")
ACTIONS = ("promote", "rollback")


def version_number(raw: str | None) -> int:
    if raw is None or not raw.isdigit():
        raise PageError(400, f"Invalid value for 'version': {raw!r} is not a version number (0: the base model).")
    return int(raw)


@router.get("/versions")
async def first_alias(request: Request) -> Response:
    common.viewer(request)
    return RedirectResponse(f"{PATH}/versions/{common.aliases(request)[0]}", status_code=303)


@router.get("/versions/{alias}")
async def versions(alias: str, request: Request) -> Response:
    viewer = common.viewer(request)
    common.known_alias(request, alias)
    rows = (await common.read(common.store(request).versions(alias)))[::-1]  # newest first
    serving = GatewayState.of(request).router.get(alias).version
    done = request.query_params.get("done")
    return page(request, viewer, "versions.html", alias=alias, rows=rows, serving=serving,
                aliases=common.aliases(request), shown_metrics=SHOWN_METRICS,
                done=done if done in ACTIONS else None)


@router.get("/versions/{alias}/{action}")
async def confirm(alias: str, action: str, request: Request) -> Response:
    """What the switch will do, and the button that does it."""
    viewer = common.viewer(request)
    common.known_alias(request, alias)
    state = GatewayState.of(request)
    if action == "promote":
        target = version_number(request.query_params.get("version"))
    elif action == "rollback":
        target = await common.read(common.store(request).rollback_target(alias))
    else:
        raise PageError(404, f"No such action {action!r}: promote or rollback.")
    canary = state.router.canaries.get(alias)
    return page(request, viewer, "confirm.html", alias=alias, action=action, target=target,
                serving=state.router.get(alias).version,
                stops_canary=canary.served.version if canary and canary.served.version != target else None)


@router.post("/versions/{alias}/{action}")
async def switch(alias: str, action: str, request: Request) -> Response:
    """Promote or roll back, as the admin API does; then back to the versions page."""
    viewer = common.viewer(request, page=False)
    common.known_alias(request, alias)
    fields = await common.form(request)
    check_csrf(viewer, fields.get("csrf"))
    state = GatewayState.of(request)
    try:
        if action == "promote":
            await promote_by_hand(state, alias, version_number(fields.get("version")),
                                  reason="promoted by hand (dashboard)")
        elif action == "rollback":
            await rollback_by_hand(state, alias, version_number(fields.get("version")),  # the one confirmed
                                   reason="rolled back by hand (dashboard)")
        else:
            raise PageError(404, f"No such action {action!r}: promote or rollback.")
    except OpenAIError as exc:  # an unknown version, an engine that refused it
        raise PageError(exc.status_code, exc.message) from None
    return RedirectResponse(f"{PATH}/versions/{alias}?done={action}", status_code=303)
