"""What the store-backed routes share: the store caught up with the gateway, store calls off the event loop,
filter errors as 400s naming the parameter, and their 404 (a bounded body and JSON answers: core/http.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from starlette.requests import Request

from flywheel.gateway.core.errors import BadRequest, NotFound

if TYPE_CHECKING:
    from flywheel.capture.store import Store

T = TypeVar("T")


def query_error(exc: Exception) -> BadRequest:
    """A ``flywheel.capture.queries.QueryError`` (a bad filter, limit or cursor) as a 400 naming the parameter."""
    return BadRequest(str(exc), param=getattr(exc, "param", None), code="invalid_value")


async def run_query(function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """A blocking store call on a worker thread; filter errors become 400s naming the parameter."""
    from flywheel.capture.queries import QueryError

    try:
        return await asyncio.to_thread(function, *args, **kwargs)
    except QueryError as exc:
        raise query_error(exc) from None


def not_found(kind: str, identifier: str) -> NotFound:
    """The 404 of a store-backed route: ``No trajectory found with id '...'``."""
    return NotFound(f"No {kind} found with id '{identifier}'.", code="not_found")


async def caught_up_store(request: Request, *, admin: bool) -> tuple[Store, str | None]:
    """The store, caught up with what the gateway answered so far, and the caller's key id.

    ``admin``: the admin key is required (401 otherwise); else the client key, whose id scopes
    what the caller may see (None when no client keys are configured).
    """
    from flywheel.gateway.storeproc.store_state import StoreState

    state = StoreState.of(request)
    if admin:
        state.auth.admin(request)
        key_id = None
    else:
        key_id = state.auth.client(request)
    await state.caught_up(request)
    return state.store, key_id
