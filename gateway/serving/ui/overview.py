"""The overview: per alias, what serves, what is on trial and how it is doing, traffic, rewards, the jobs."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from flywheel.gateway.core.errors import OpenAIError
from flywheel.gateway.serving.gateway_state import GatewayState
from flywheel.gateway.serving.loop.scheduler import Loop
from flywheel.gateway.serving.routes.loop_admin import alias_status
from flywheel.gateway.serving.ui import common
from flywheel.gateway.serving.ui.charts import Timeline, reward_chart, series_class, traffic_chart
from flywheel.gateway.serving.ui.render import page
from flywheel.gateway.serving.ui.session import PATH, PageError

router = APIRouter(prefix=PATH)

WINDOWS = {"15m": 900, "1h": 3600, "6h": 6 * 3600, "24h": 86400, "7d": 7 * 86400}


@router.get("")
@router.get("/")
async def overview(request: Request) -> Response:
    viewer = common.viewer(request)
    window = request.query_params.get("window", "24h")
    if window not in WINDOWS:
        raise PageError(400, f"Invalid value for 'window': {window!r}; one of {', '.join(WINDOWS)}.")
    cards = [await alias_card(request, alias, WINDOWS[window]) for alias in common.aliases(request)]
    return page(request, viewer, "overview.html", cards=cards, window=window, windows=list(WINDOWS))


async def alias_card(request: Request, alias: str, window_s: int) -> dict[str, Any]:
    """Everything the overview shows for one alias."""
    try:
        status = await alias_status(GatewayState.of(request), alias, Loop.of(request))
    except OpenAIError as exc:  # the store process is restarting
        raise PageError(exc.status_code, exc.message) from None
    now = time.time()
    since = now - window_s
    store = common.store(request)
    rewards = (await common.read(store.rewards(alias))).rewards
    bucket_s = max(1, window_s // 8640)  # the traffic's resolution: at most 8640 buckets a window
    traffic = await common.read(store.ui_traffic(alias, datetime.fromtimestamp(since, tz=UTC), bucket_s))
    points = [(r.closed_at.timestamp(), r.version, r.reward) for r in rewards if r.closed_at]
    counts = [(float(t.start), t.version, t.turns) for t in traffic]
    timeline = Timeline.covering([p[0] for p in points] + [c[0] for c in counts], since, now, min_slot_s=bucket_s)
    shown = sorted({v for _, v, _ in points if v is not None} | {v for _, v, _ in counts})
    turns: dict[int, int] = {}
    for _, version, n in counts:
        turns[version] = turns.get(version, 0) + n
    return {"alias": alias, "status": status, "reward_chart": reward_chart(points, timeline),
            "traffic_chart": traffic_chart(counts, timeline), "legend": [(v, series_class(v)) for v in shown],
            "turns": turns, "failures": await common.read(store.ui_failed_jobs(alias, limit=5))}
