"""Installs the dashboard on the gateway's app: its pages, the login, the static files, its error pages."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, FastAPI, Request
from starlette.responses import RedirectResponse, Response

from flywheel.gateway.core.config import Settings
from flywheel.gateway.serving.ui import browse, common, overview, versions
from flywheel.gateway.serving.ui.render import HERE, SECURITY_HEADERS, page, set_session
from flywheel.gateway.serving.ui.session import (
    COOKIE,
    PATH,
    LoginRequired,
    PageError,
    Sessions,
    check_csrf,
    login_url,
    safe_next,
)

router = APIRouter(prefix=PATH)

STATIC_TYPES = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8"}
STATIC = {path.name: path.read_bytes() for path in (HERE / "static").iterdir() if path.suffix in STATIC_TYPES}


def install(app: FastAPI, settings: Settings) -> None:
    """Mount the dashboard at ``/flywheel/ui`` (the catch-all 404 page last)."""
    app.state.dashboard_sessions = Sessions(settings)
    # HTML pages, not API: left out of the OpenAPI document (/openapi.json)
    for pages in (overview.router, browse.router, versions.router, router):
        app.include_router(pages, include_in_schema=False)
    app.add_api_route(PATH + "/{rest:path}", not_found, methods=["GET", "POST"], include_in_schema=False)
    app.add_exception_handler(PageError, error_page)  # type: ignore[arg-type]
    app.add_exception_handler(LoginRequired, to_login)  # type: ignore[arg-type]


@router.get("/static/{name}")
async def static(name: str) -> Response:
    """The dashboard's own script (htmx, vendored) and style sheet; no login needed."""
    if name not in STATIC:
        raise PageError(404, f"No static file {name!r}.")
    return Response(STATIC[name], media_type=STATIC_TYPES[Path(name).suffix],
                    headers={"cache-control": "public, max-age=3600", "x-content-type-options": "nosniff"})


@router.get("/login")
async def login_form(request: Request) -> Response:
    if not common.sessions(request).keyed:  # no admin key: loopback clients need no login
        return RedirectResponse(PATH, status_code=303)
    return page(request, None, "login.html", next_path=safe_next(request.query_params.get("next")), failed=False)


@router.post("/login")
async def login(request: Request) -> Response:
    sessions = common.sessions(request)
    fields = await common.form(request)
    target = safe_next(fields.get("next"))
    if not sessions.keyed:
        return RedirectResponse(PATH, status_code=303)
    if not sessions.key_matches(request, fields.get("key", "")):
        return page(request, None, "login.html", status=401, next_path=target, failed=True)
    response = RedirectResponse(target, status_code=303)
    set_session(request, response, sessions.issue()[0])
    return response


@router.post("/logout")
async def logout(request: Request) -> Response:
    viewer = common.viewer(request, page=False)
    check_csrf(viewer, (await common.form(request)).get("csrf"))
    response = RedirectResponse(f"{PATH}/login" if viewer.keyed else PATH, status_code=303)
    response.delete_cookie(COOKIE, path=PATH, httponly=True, samesite="strict")
    return response


async def not_found(request: Request) -> Response:
    common.viewer(request)
    raise PageError(404, f"There is no dashboard page at {request.url.path}.")


async def error_page(request: Request, exc: PageError) -> Response:
    return page(request, None, "error.html", status=exc.status, code=exc.status, message=exc.message)


async def to_login(request: Request, exc: LoginRequired) -> Response:
    return RedirectResponse(login_url(exc.next_path), status_code=303, headers=SECURITY_HEADERS)
