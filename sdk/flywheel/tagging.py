"""Tags on calls and outcomes of conversations: the helpers an agent may use with its own ``openai`` client.

    client = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="sk-...")
    with flywheel.trajectory(client, group_id="run-7") as t:    # every call inside is one trajectory
        client.chat.completions.create(model="gpt-4o", messages=[...])
        t.reward = 1.0                                          # reported (and the trajectory closed) at exit
    flywheel.feedback(client, completion_id=reply.id, label="good")

Tagging works by a request hook on the client's HTTP client that adds the ``X-Flywheel-*``
headers of the innermost active scope (a context variable, so concurrent rollouts on one
shared client each tag their own calls). Headers given explicitly on a call win.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Coroutine
from contextvars import ContextVar, Token
from dataclasses import dataclass
from types import TracebackType
from typing import Any, overload

import httpx
import openai

from flywheel.errors import GatewayConnectionError, raise_for_answer

__all__ = ["Tags", "TrajectoryScope", "feedback", "gateway_root", "headers", "install_tagging", "trajectory"]

log = logging.getLogger("flywheel")

OpenAIClient = openai.OpenAI | openai.AsyncOpenAI
_TIMEOUT = httpx.Timeout(30.0, connect=5.0)


def headers(*, trajectory_id: str | None = None, group_id: str | None = None, task: str | None = None,
            capture: bool | None = None, fork: int | None = None) -> dict[str, str]:
    """The ``X-Flywheel-*`` request headers for the tags given (None leaves a tag out)."""
    out: dict[str, str] = {}
    if trajectory_id is not None:
        out["X-Flywheel-Trajectory-Id"] = trajectory_id
    if group_id is not None:
        out["X-Flywheel-Group-Id"] = group_id
    if task is not None:
        out["X-Flywheel-Task"] = task
    if capture is not None:
        out["X-Flywheel-Capture"] = "on" if capture else "off"
    if fork is not None:
        out["X-Flywheel-Fork"] = str(fork)
    return out


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class Tags:
    """The tags of one scope, and how many requests carried them."""

    trajectory_id: str | None = None
    group_id: str | None = None
    task: str | None = None
    requests: int = 0

    def headers(self) -> dict[str, str]:
        return headers(trajectory_id=self.trajectory_id, group_id=self.group_id, task=self.task)


_active: ContextVar[Tags | None] = ContextVar("flywheel_tags", default=None)


def activate(tags: Tags) -> Token[Tags | None]:
    """Make ``tags`` the current scope's (undo with ``deactivate``); tasks created meanwhile inherit them."""
    return _active.set(tags)


def deactivate(token: Token[Tags | None]) -> None:
    _active.reset(token)


def _tag(request: httpx.Request) -> None:
    tags = _active.get()
    if tags is None:
        return
    for name, value in tags.headers().items():
        if name not in request.headers:  # a header the caller set on the call wins
            request.headers[name] = value
    tags.requests += 1


async def _tag_async(request: httpx.Request) -> None:
    _tag(request)


def install_tagging(client: OpenAIClient) -> None:
    """Add the tagging hook to ``client`` once; copies made with ``with_options`` share it."""
    http = client._client  # the httpx (openai 1/2) or httpx2 (openai 3) client: both take event hooks
    hook = _tag_async if isinstance(client, openai.AsyncOpenAI) else _tag
    hooks = http.event_hooks
    if hook not in hooks["request"]:
        http.event_hooks = {**hooks, "request": [*hooks["request"], hook]}


def gateway_root(client: OpenAIClient) -> str:
    """The gateway's root URL from an OpenAI client's ``base_url`` (``http://host:8000/v1`` -> ``http://host:8000``)."""
    base = str(client.base_url).rstrip("/")
    return base.removesuffix("/v1")


def _auth(client: OpenAIClient) -> dict[str, str]:
    return {"authorization": f"Bearer {client.api_key}"} if client.api_key else {}


def _feedback_body(trajectory_id: str | None, completion_id: str | None, reward: float | None, label: str | None,
                   comment: str | None) -> dict[str, Any]:
    if not (trajectory_id or completion_id):
        raise ValueError("feedback: give trajectory_id or completion_id (the id of any chat completion in it)")
    if reward is None and label is None:
        raise ValueError("feedback: give a reward, a label ('good' or 'bad'), or both")
    body = {"trajectory_id": trajectory_id, "completion_id": completion_id, "reward": reward, "label": label,
            "comment": comment}
    return {key: value for key, value in body.items() if value is not None}


def _post(client: openai.OpenAI, path: str, body: dict[str, Any]) -> dict[str, Any]:
    url = gateway_root(client) + path
    try:
        with httpx.Client(timeout=_TIMEOUT) as http:
            response = http.post(url, json=body, headers=_auth(client))
    except httpx.TransportError as exc:
        raise GatewayConnectionError(f"POST {url} failed: {type(exc).__name__}: {exc}") from exc
    raise_for_answer(response)
    answer: dict[str, Any] = response.json()
    return answer


async def _apost(client: openai.AsyncOpenAI, path: str, body: dict[str, Any]) -> dict[str, Any]:
    url = gateway_root(client) + path
    try:
        async with httpx.AsyncClient(timeout=_TIMEOUT) as http:
            response = await http.post(url, json=body, headers=_auth(client))
    except httpx.TransportError as exc:
        raise GatewayConnectionError(f"POST {url} failed: {type(exc).__name__}: {exc}") from exc
    raise_for_answer(response)
    answer: dict[str, Any] = response.json()
    return answer


@overload
def feedback(client: openai.AsyncOpenAI, *, trajectory_id: str | None = None, completion_id: str | None = None,
             reward: float | None = None, label: str | None = None, comment: str | None = None,
             ) -> Coroutine[Any, Any, dict[str, Any]]: ...


@overload
def feedback(client: openai.OpenAI, *, trajectory_id: str | None = None, completion_id: str | None = None,
             reward: float | None = None, label: str | None = None, comment: str | None = None,
             ) -> dict[str, Any]: ...


def feedback(client: OpenAIClient, *, trajectory_id: str | None = None, completion_id: str | None = None,
             reward: float | None = None, label: str | None = None, comment: str | None = None,
             ) -> dict[str, Any] | Coroutine[Any, Any, dict[str, Any]]:
    """Report how a conversation went (``POST /flywheel/v1/feedback``); this also closes its trajectory.

    Name it by ``trajectory_id`` or by ``completion_id`` (the ``id`` of any chat completion in it). Give
    a ``reward`` and/or a ``label`` (``good`` = 1, ``bad`` = 0). With an ``AsyncOpenAI`` client the result
    is awaited: ``await flywheel.feedback(client, ...)``. Returns the gateway's answer
    (``id``, ``trajectory_id``, ``reward``).
    """
    body = _feedback_body(trajectory_id, completion_id, reward, label, comment)
    if isinstance(client, openai.AsyncOpenAI):
        return _apost(client, "/flywheel/v1/feedback", body)
    return _post(client, "/flywheel/v1/feedback", body)


class TrajectoryScope:
    """One conversation: every call made inside the ``with`` (or ``async with``) block carries its id.

    At exit the trajectory is reported: with ``reward`` or ``label`` set, as feedback (which closes
    it); otherwise it is closed (``POST /flywheel/v1/trajectories/{id}/close``), with the reason
    ``exception`` when the block raised. A scope that made no call reports nothing (the gateway has
    no such trajectory). ``closed`` says whether the exit report was sent.
    """

    def __init__(self, client: OpenAIClient, *, trajectory_id: str | None = None, group_id: str | None = None,
                 task: str | None = None) -> None:
        self.client = client
        self.id = trajectory_id or new_id("traj")
        self.reward: float | None = None
        self.label: str | None = None
        self.comment: str | None = None
        self.closed = False
        self._tags = Tags(trajectory_id=self.id, group_id=group_id, task=task)
        self._token: Token[Tags | None] | None = None

    @property
    def headers(self) -> dict[str, str]:
        """The scope's headers, for calls made with another client (LangChain, curl, ...)."""
        return self._tags.headers()

    @property
    def requests(self) -> int:
        """Calls made through ``client`` inside the scope so far."""
        return self._tags.requests

    def _enter(self) -> TrajectoryScope:
        if self._token is not None:
            raise RuntimeError(f"trajectory scope {self.id} is already active")
        install_tagging(self.client)
        self._token = activate(self._tags)
        return self

    def _exit_report(self, failed: bool) -> tuple[str, dict[str, Any]] | None:
        if self._token is not None:
            deactivate(self._token)
            self._token = None
        if self._tags.requests == 0:
            return None
        if self.reward is not None or self.label is not None:
            return "/flywheel/v1/feedback", _feedback_body(self.id, None, self.reward, self.label, self.comment)
        return f"/flywheel/v1/trajectories/{self.id}/close", {"reason": "exception" if failed else "client"}

    def __enter__(self) -> TrajectoryScope:
        if isinstance(self.client, openai.AsyncOpenAI):
            raise TypeError("a trajectory scope on an AsyncOpenAI client is entered with `async with`")
        return self._enter()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        report = self._exit_report(failed=kind is not None)
        if report is None:
            return
        assert isinstance(self.client, openai.OpenAI)  # __enter__ refused the async client
        try:
            _post(self.client, *report)
            self.closed = True
        except Exception:
            self._report_failed(block_raised=kind is not None)

    async def __aenter__(self) -> TrajectoryScope:
        return self._enter()

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        report = self._exit_report(failed=kind is not None)
        if report is None:
            return
        try:
            if isinstance(self.client, openai.AsyncOpenAI):
                await _apost(self.client, *report)
            else:
                _post(self.client, *report)
            self.closed = True
        except Exception:
            self._report_failed(block_raised=kind is not None)

    def _report_failed(self, *, block_raised: bool) -> None:
        """Raise the report's error, unless the block's own exception is already on its way (never mask it)."""
        if not block_raised:
            raise
        log.warning("trajectory %s: reporting it at exit failed (the block raised first)", self.id, exc_info=True)


def trajectory(client: OpenAIClient, *, trajectory_id: str | None = None, group_id: str | None = None,
               task: str | None = None) -> TrajectoryScope:
    """A scope whose calls through ``client`` form one trajectory (``with`` or ``async with``; see TrajectoryScope).

    ``trajectory_id`` defaults to a new ``traj_<hex>``; ``group_id`` puts it in an explicit group
    (the same id on N rollouts: GRPO compares them); ``task`` names the task (groups same-task
    trajectories).
    """
    return TrajectoryScope(client, trajectory_id=trajectory_id, group_id=group_id, task=task)
