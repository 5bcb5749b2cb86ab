"""A task's reward hook: its own check of one answer, where a task has a checkable outcome.

The operator names it in the configuration (``[judge] reward_hook``, ``[loop.gate] reward_hook``): a
Python entry point ``module:function`` called as ``function(messages, tools, answer) -> float``, or an
http(s) URL that gets ``{"messages", "tools", "answer"}`` and answers ``{"reward": float}``.
``messages`` is the conversation before the answer; ``answer`` is the assistant message it scores.
Nothing a client sends names a hook: only the configuration does.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import math
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

Message = dict[str, Any]
RewardHook = Callable[[list[Message], list[dict[str, Any]] | None, Message], Awaitable[float]]


class RewardHookError(RuntimeError):
    """The hook could not be loaded, failed, or answered something that is not a finite number."""


def load_reward_hook(target: str, timeout_s: float = 60.0) -> RewardHook:
    """The hook ``target`` names, as an async function of (messages, tools, answer)."""
    if target.startswith(("http://", "https://")):
        return _http_hook(target, timeout_s)
    module_name, _, attribute = target.partition(":")
    if not module_name or not attribute:
        raise RewardHookError(f"reward hook {target!r}: expected module:function or an http(s) URL")
    try:
        function = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise RewardHookError(f"reward hook {target!r} cannot be loaded: {exc}") from exc

    async def call(messages: list[Message], tools: list[dict[str, Any]] | None, answer: Message) -> float:
        running = function(messages, tools, answer) if inspect.iscoroutinefunction(function) \
            else asyncio.to_thread(function, messages, tools, answer)
        try:
            value = await asyncio.wait_for(running, timeout_s)
        except TimeoutError as exc:
            raise RewardHookError(f"reward hook {target} did not answer within {timeout_s} s") from exc
        except Exception as exc:  # the task's own code: whatever it raises fails this group, not the scoring run
            raise RewardHookError(f"reward hook {target} raised {exc!r}") from exc
        return _finite(target, value)

    return call


def _http_hook(url: str, timeout_s: float) -> RewardHook:
    async def call(messages: list[Message], tools: list[dict[str, Any]] | None, answer: Message) -> float:
        try:
            async with httpx.AsyncClient(timeout=timeout_s) as client:
                response = await client.post(url, json={"messages": messages, "tools": tools, "answer": answer})
        except httpx.HTTPError as exc:
            raise RewardHookError(f"reward hook {url} could not be reached: {exc}") from exc
        if response.status_code != 200:
            raise RewardHookError(f"reward hook {url} answered {response.status_code}")
        try:
            return _finite(url, response.json()["reward"])
        except (ValueError, KeyError, TypeError) as exc:
            raise RewardHookError(f"reward hook {url} answered no 'reward' number") from exc

    return call


def _finite(target: str, value: Any) -> float:
    try:
        reward = float(value)
    except (TypeError, ValueError) as exc:
        raise RewardHookError(f"reward hook {target} returned {value!r}, not a number") from exc
    if not math.isfinite(reward):
        raise RewardHookError(f"reward hook {target} returned {reward}")
    return reward


def split_answer(messages: list[Message]) -> tuple[list[Message], Message] | None:
    """A member's messages as (the conversation before its last answer, that answer); None without one."""
    for position in range(len(messages) - 1, -1, -1):
        if messages[position].get("role") == "assistant":
            return messages[:position], messages[position]
    return None
