"""The canary split: a share of an alias's conversations goes to the candidate, and stays there.

A conversation never changes version midway, or its reward would belong to neither. The
gateway cannot see conversations (the linker runs later, in the store process), so it keeps
the evidence itself: every answer it sends while a canary runs is remembered by a key of the
assistant message (its tool-call ids, which the engine made up, or its text) with the arm that
produced it. A later request that carries that message as its latest assistant message goes to
the same arm. Requests tagged with ``X-Flywheel-Trajectory-Id`` are split by a hash of the id.
First turns, and conversations the memory lost (it is bounded), are split at random.
"""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from flywheel.gateway.serving.served_model import ServedModel


def assistant_key(message: dict[str, Any] | None) -> str | None:
    """What identifies an answer when the client sends it back: its tool-call ids, else its text."""
    if not message:
        return None
    calls = message.get("tool_calls") or []
    ids = [str(c.get("id")) for c in calls if isinstance(c, dict) and c.get("id")]
    if ids:
        return "calls:" + ",".join(ids)
    content = message.get("content")
    if isinstance(content, list):  # text parts
        content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    if not content:
        return None
    return "text:" + hashlib.blake2b(str(content).encode(), digest_size=16).hexdigest()


def last_assistant(messages: list[dict[str, Any]]) -> dict[str, Any] | None:
    for message in reversed(messages):
        if isinstance(message, dict) and message.get("role") == "assistant":
            return message
    return None


@dataclass
class CanarySplit:
    """Routes ``fraction`` of an alias's new conversations to ``served`` (the candidate), sticky."""

    served: ServedModel
    fraction: float
    started_at: str  # ISO time: conversations that started since then are the experiment's
    capacity: int = 200_000  # remembered answers; the oldest are forgotten first
    _arms: OrderedDict[str, bool] = field(default_factory=OrderedDict)
    _random: random.Random = field(default_factory=random.Random)

    def assign(self, messages: list[dict[str, Any]] | None, trajectory_id: str | None) -> tuple[bool, bool]:
        """(to the candidate?, was it decided by the conversation's own history or id?)."""
        if trajectory_id:
            digest = hashlib.sha256(f"{self.started_at}:{trajectory_id}".encode()).digest()
            return int.from_bytes(digest[:4], "big") / 2**32 < self.fraction, True
        key = assistant_key(last_assistant(messages or []))
        if key is not None and key in self._arms:
            return self._arms[key], True
        return self._random.random() < self.fraction, False

    def remember(self, message: dict[str, Any] | None, candidate: bool) -> None:
        """Record which arm produced an answer the client may send back."""
        key = assistant_key(message)
        if key is None:
            return
        self._arms[key] = candidate
        self._arms.move_to_end(key)
        while len(self._arms) > self.capacity:
            self._arms.popitem(last=False)
