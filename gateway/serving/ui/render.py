"""Rendering the dashboard's pages: one Jinja environment (autoescaped), formatting filters, safe headers.

Everything a client sent (messages, tool arguments, ids, metadata) is untrusted HTML: templates
never mark it safe, and the Content-Security-Policy allows only this dashboard's own script and
style files (no inline script), so even an escaping mistake could not run a script.
"""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from jinja2 import Environment, FileSystemLoader, StrictUndefined, select_autoescape
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response

from flywheel.gateway.serving.ui.session import COOKIE, MAX_AGE_S, PATH, Viewer

HERE = Path(__file__).parent
SECURITY_HEADERS = {
    "content-security-policy": "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
                               "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
    "referrer-policy": "same-origin",
    "cache-control": "no-store",
}


def when(value: datetime | str | None) -> str:
    """A time (or its ISO 8601 text) as ``2026-01-31 14:05:09 UTC``."""
    if not value:
        return "—"
    moment = value if isinstance(value, datetime) else datetime.fromisoformat(value)
    moment = moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)
    return moment.strftime("%Y-%m-%d %H:%M:%S UTC")


def num(value: Any, digits: int = 3) -> str:
    """A number for people: ints as they are, floats to ``digits`` places, missing as a dash."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    if isinstance(value, int):
        return str(value)
    return "∞" if math.isinf(value) else f"{value:.{digits}f}"


def pretty(value: Any) -> str:
    """JSON indented for a <pre>; a string that holds JSON (tool arguments) is parsed first."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return value
    return json.dumps(value, indent=2, ensure_ascii=False, sort_keys=True)


def short(value: str | None, keep: int = 12) -> str:
    if not value:
        return "—"
    return value if len(value) <= keep + 1 else value[:keep] + "…"


environment = Environment(loader=FileSystemLoader(HERE / "templates"), autoescape=select_autoescape(default=True),
                          undefined=StrictUndefined, trim_blocks=True, lstrip_blocks=True)
environment.filters.update(when=when, num=num, pretty=pretty, short=short)
environment.globals["root"] = PATH


def page(request: Request, viewer: Viewer | None, template: str, status: int = 200, **context: Any) -> Response:
    """A rendered page with the dashboard's headers (and the session cookie a new viewer gets)."""
    html = environment.get_template(template).render(request=request, viewer=viewer, **context)
    response = HTMLResponse(html, status_code=status, headers=SECURITY_HEADERS)
    if viewer is not None and viewer.new_cookie is not None:
        set_session(request, response, viewer.new_cookie)
    return response


def set_session(request: Request, response: Response, cookie: str) -> None:
    response.set_cookie(COOKIE, cookie, max_age=MAX_AGE_S, path=PATH, httponly=True, samesite="strict",
                        secure=request.url.scheme == "https")
