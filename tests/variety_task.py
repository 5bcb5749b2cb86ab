"""The variety task of the forked-loop tests: an answer earns n / (n + 10) for its n distinct characters.

Dense and never saturated, so a fork group of the untrained tiny model's samples has rewards to tell
apart. ``reward`` is its reward hook (``[judge] reward_hook = "tests.variety_task:reward"``), plugged in
the way a user's would be; the judge stand-in of the same tests scores with ``variety`` too.
"""

from __future__ import annotations

from typing import Any


def variety(text: str) -> float:
    distinct = len(set(text))
    return distinct / (distinct + 10)


def reward(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, answer: dict[str, Any]) -> float:
    return variety(str(answer.get("content") or ""))


def broken(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, answer: dict[str, Any]) -> float:
    raise ValueError("the task's own bug")
