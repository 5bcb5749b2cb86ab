"""The one client of a running gateway's admin API (``/flywheel/v1/...``): the SDK, the CLI and training rounds use it.

    with AdminClient("http://127.0.0.1:8000", admin_key) as admin:
        admin.call("GET", "/flywheel/v1/status")                                  # the decoded JSON answer
        admin.download("/flywheel/v1/training/adapters/agent/3", file)            # streamed into an open file
        admin.upload("/flywheel/v1/training/adapters/agent/4", tar, "application/x-tar")

It owns the base URL, the admin key (a bearer header), timeouts and the transport, and turns every failure
into one of two exceptions: :class:`AdminError` (the gateway answered an error: status, code, message, param
of its OpenAI-shaped body) or :class:`AdminUnreachable` (no answer). Each user maps them into its own terms:
``flywheel.Gateway`` into the SDK's typed errors, the ``flywheel`` commands into a one-line error, a round
into ``RoundError`` (docs/architecture.md §2, "One admin client"). It needs httpx alone, so the SDK's
install has it and the gateway's CLI and training code import it from below (the SDK's floor).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import IO, Any

import httpx

from flywheel.types import USE_DEFAULT, UseDefault

__all__ = ["TIMEOUT", "AdminCallError", "AdminClient", "AdminError", "AdminUnreachable"]

TIMEOUT = httpx.Timeout(60.0, connect=5.0)

Timeout = httpx.Timeout | float | None


class AdminCallError(Exception):
    """An admin call that failed; ``str()`` is one line that says why."""


class AdminError(AdminCallError):
    """The gateway answered with an error: its status and the code, message and param of its OpenAI-shaped body."""

    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 method: str, path: str) -> None:
        super().__init__(f"gateway answered {status}: {message}")
        self.status, self.message, self.code, self.param = status, message, code, param
        self.method, self.path = method, path

    @classmethod
    def of(cls, response: httpx.Response) -> AdminError:
        """What a read, non-2xx answer says; a body that is not OpenAI-shaped gives its start as the message."""
        error: dict[str, Any] = {}
        try:
            body = response.json()
        except ValueError:
            body = None
        if isinstance(body, dict) and isinstance(body.get("error"), dict):
            error = body["error"]
        code, param = error.get("code"), error.get("param")
        return cls(response.status_code, str(error.get("message") or response.text[:300] or response.reason_phrase),
                   code=None if code is None else str(code), param=None if param is None else str(param),
                   method=response.request.method, path=response.request.url.path)


class AdminUnreachable(AdminCallError):
    """No answer: the connection was refused, timed out or dropped; ``cause`` is httpx's exception."""

    def __init__(self, gateway: str, method: str, url: str, cause: httpx.HTTPError) -> None:
        reason = f"{type(cause).__name__}: {cause}" if str(cause) else type(cause).__name__
        super().__init__(f"gateway at {gateway} failed: {reason}")
        self.method, self.url, self.cause = method, url, cause


class AdminClient:
    """A running gateway's admin API at ``url`` (its root, without ``/v1``); ``admin_key`` None sends none.

    ``timeout``: every call's, unless the call names its own. ``transport``: an ``httpx.BaseTransport`` to use
    instead of the network.
    """

    def __init__(self, url: str, admin_key: str | None, *, timeout: Timeout = TIMEOUT,
                 transport: httpx.BaseTransport | None = None) -> None:
        self.url = url.rstrip("/")
        headers = {"authorization": f"Bearer {admin_key}"} if admin_key else {}
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout, transport=transport)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> AdminClient:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    @contextmanager
    def stream(self, method: str, path: str, *, params: dict[str, Any] | None = None, json: Any = None,
               content: IO[bytes] | bytes | None = None, headers: dict[str, str] | None = None,
               timeout: Timeout | UseDefault = USE_DEFAULT) -> Iterator[httpx.Response]:
        """The 2xx answer, its body not read yet; any other answer is an :class:`AdminError`, none (also while the
        body streams) an :class:`AdminUnreachable`."""
        try:
            with self._http.stream(method, path, params=params, json=json, content=content, headers=headers,
                                   timeout=httpx.USE_CLIENT_DEFAULT if timeout is USE_DEFAULT else timeout
                                   ) as response:
                if not response.is_success:
                    response.read()
                    raise AdminError.of(response)
                yield response
        except httpx.HTTPError as exc:
            raise AdminUnreachable(self.url, method, f"{self.url}{path}", exc) from exc

    def request(self, method: str, path: str, *, params: dict[str, Any] | None = None, json: Any = None,
                content: IO[bytes] | bytes | None = None, headers: dict[str, str] | None = None,
                timeout: Timeout | UseDefault = USE_DEFAULT) -> httpx.Response:
        """The 2xx answer, read."""
        with self.stream(method, path, params=params, json=json, content=content, headers=headers,
                         timeout=timeout) as response:
            response.read()
            return response

    def call(self, method: str, path: str, *, params: dict[str, Any] | None = None, json: Any = None,
             content: IO[bytes] | bytes | None = None, headers: dict[str, str] | None = None,
             timeout: Timeout | UseDefault = USE_DEFAULT) -> Any:
        """The decoded JSON answer (None for an empty one)."""
        response = self.request(method, path, params=params, json=json, content=content, headers=headers,
                                timeout=timeout)
        return response.json() if response.content else None

    def download(self, path: str, file: IO[bytes]) -> None:
        """``GET path``'s body written into ``file`` as it arrives (an adapter's archive never sits in memory)."""
        with self.stream("GET", path) as response:
            for chunk in response.iter_bytes():
                file.write(chunk)

    def upload(self, path: str, file: IO[bytes], content_type: str) -> Any:
        """``PUT path`` with ``file``'s bytes as the body, read and sent in pieces; the decoded JSON answer."""
        return self.call("PUT", path, content=file, headers={"content-type": content_type})
