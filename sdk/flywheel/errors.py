"""What the SDK raises (the tree is in the package docstring, ``flywheel/__init__.py``)."""

from __future__ import annotations

import httpx

from flywheel.admin_client import AdminError

__all__ = [
    "AuthenticationError",
    "BadRequestError",
    "FlywheelError",
    "GatewayConnectionError",
    "GatewayError",
    "GatewayStartError",
    "MissingExtraError",
    "NotFoundError",
    "NotRegisteredError",
]


class FlywheelError(Exception):
    """Base of everything the SDK raises."""


class GatewayError(FlywheelError):
    """The gateway answered with an error; ``status_code``, ``code`` and ``param`` come from its OpenAI-shaped body."""

    def __init__(self, message: str, *, status_code: int, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.code = code
        self.param = param


class BadRequestError(GatewayError):
    """400: the gateway refused the request as sent; ``param`` names what was wrong."""


class AuthenticationError(GatewayError):
    """401: a missing or wrong client or admin key."""


class NotFoundError(GatewayError):
    """404: no such alias, trajectory, version or route."""


class GatewayConnectionError(FlywheelError):
    """The gateway could not be reached (refused, timed out, dropped the connection)."""


class GatewayStartError(FlywheelError):
    """``LocalBackend``'s gateway process did not start; the message ends with its log."""


class NotRegisteredError(FlywheelError, ValueError):
    """A model was used before ``await model.register(backend)`` (a ValueError, as in ART)."""


class MissingExtraError(FlywheelError, ImportError):
    """A feature needs the server parts: ``pip install 'flywheel-rl[gateway]'`` (or ``[train]``)."""


_BY_STATUS: dict[int, type[GatewayError]] = {400: BadRequestError, 401: AuthenticationError, 404: NotFoundError}


def gateway_error(error: AdminError) -> GatewayError:
    """The SDK's error for an admin call the gateway answered with an error: the subclass for its status."""
    kind = _BY_STATUS.get(error.status, GatewayError)
    return kind(f"{error.method} {error.path} answered {error.status}: {error.message}", status_code=error.status,
                code=error.code, param=error.param)


def raise_for_answer(response: httpx.Response) -> None:
    """Nothing for a 2xx answer; otherwise the :class:`GatewayError` subclass for its status."""
    if not response.is_success:
        raise gateway_error(AdminError.of(response))
