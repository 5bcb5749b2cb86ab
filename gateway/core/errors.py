"""OpenAI-shaped errors: one exception type, one wire shape, one mapping.

Every failure the HTTP API reports goes out as
``{"error": {"message", "type", "param", "code"}}`` with a fitting status:

    OpenAIError                  base; carries status, message, type, param, code
     ├── BadRequest              400 invalid_request_error (names the field in ``param``)
     ├── Unauthorized            401 invalid_request_error / invalid_api_key
     ├── NotFound                404 invalid_request_error / model_not_found (and other unknown ids)
     ├── Conflict                409 invalid_request_error (the object is not in a state that allows it)
     ├── PayloadTooLarge         413 invalid_request_error
     ├── UpstreamError           502 upstream_error (engine unreachable or failed)
     └── UpstreamTimeout         504 upstream_error / timeout

Engines raise these; routes never build error JSON by hand.
"""

from __future__ import annotations

from typing import Any

import orjson


class OpenAIError(Exception):
    """An error the API reports to the client in OpenAI's shape."""

    status_code = 500
    error_type = "server_error"
    default_code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 status_code: int | None = None, error_type: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code if code is not None else self.default_code
        if status_code is not None:
            self.status_code = status_code
        if error_type is not None:
            self.error_type = error_type

    def to_dict(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.error_type,
                          "param": self.param, "code": self.code}}

    def to_json(self) -> bytes:
        return orjson.dumps(self.to_dict())


class BadRequest(OpenAIError):
    """A parameter is missing, malformed or unsupported; ``param`` names it."""

    status_code = 400
    error_type = "invalid_request_error"


class Unauthorized(OpenAIError):
    """Missing or wrong API key (the key itself is never echoed)."""

    status_code = 401
    error_type = "invalid_request_error"
    default_code = "invalid_api_key"


class NotFound(OpenAIError):
    """The requested model (or another named object) does not exist."""

    status_code = 404
    error_type = "invalid_request_error"
    default_code = "model_not_found"


class Conflict(OpenAIError):
    """The request is well formed, but the object it names is not in a state that allows it."""

    status_code = 409
    error_type = "invalid_request_error"
    default_code = "conflict"


class PayloadTooLarge(OpenAIError):
    """The request body is over the configured limit."""

    status_code = 413
    error_type = "invalid_request_error"
    default_code = "request_too_large"


class UpstreamError(OpenAIError):
    """The engine (upstream server or local model) failed or could not be reached."""

    status_code = 502
    error_type = "upstream_error"
    default_code = "upstream_error"


class UpstreamTimeout(OpenAIError):
    """The engine did not answer within the configured timeout."""

    status_code = 504
    error_type = "upstream_error"
    default_code = "timeout"
