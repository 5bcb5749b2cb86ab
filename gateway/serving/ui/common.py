"""What every dashboard page needs: the viewer, store reads, a posted form, the alias a URL names."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import TypeVar
from urllib.parse import parse_qs

from starlette.requests import Request

from flywheel.gateway.core.errors import OpenAIError
from flywheel.gateway.core.http import read_body
from flywheel.gateway.core.store_api import StoreApi
from flywheel.gateway.serving.gateway_state import GatewayState
from flywheel.gateway.serving.ui.session import PageError, Sessions, Viewer

FORM_LIMIT = 64 * 1024  # the dashboard's forms are a few fields


def sessions(request: Request) -> Sessions:
    found: Sessions = request.app.state.dashboard_sessions
    return found


def viewer(request: Request, *, page: bool = True) -> Viewer:
    return sessions(request).viewer(request, page=page)


T = TypeVar("T")


def store(request: Request) -> StoreApi:
    return GatewayState.of(request).store


async def read(answer: Awaitable[T]) -> T:
    """A store read's answer (``core/store_api.py``), or a readable error page."""
    try:
        return await answer
    except OpenAIError as exc:  # the store process is restarting (502), or refused the arguments
        raise PageError(exc.status_code, exc.message) from None


async def read_one(answer: Awaitable[T | None], kind: str, identifier: str) -> T:
    """A store read's answer about one thing, or a 404 page when it answers None (no such thing)."""
    found = await read(answer)
    if found is None:
        raise PageError(404, f"No {kind} found with id {identifier!r}.")
    return found


async def form(request: Request) -> dict[str, str]:
    """A posted URL-encoded form, first value of each field (bounded before it is read)."""
    body = await read_body(request, FORM_LIMIT)
    try:
        fields = parse_qs(body.decode(), keep_blank_values=True, strict_parsing=False)
    except UnicodeDecodeError:
        raise PageError(400, "The form was not valid UTF-8.") from None
    return {key: values[0] for key, values in fields.items()}


def known_alias(request: Request, alias: str) -> str:
    if alias not in GatewayState.of(request).settings.aliases:
        raise PageError(404, f"There is no alias named {alias!r}.")
    return alias


def aliases(request: Request) -> list[str]:
    return list(GatewayState.of(request).settings.aliases)
