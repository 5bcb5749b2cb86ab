"""The colour task of the loop tests: asked to pick a colour, an answer of "blue" is worth 1, anything else 0.

``gate_reward`` is the promotion gate's reward hook for it (``[loop.gate] reward_hook =
"tests.colour_task:gate_reward"``): a task with a checkable outcome, plugged in the way a user's would be.
"""

from __future__ import annotations

from typing import Any

PROMPT = [{"role": "user", "content": "Pick a colour."}]
ANSWERS = ["red", "green", "blue"]


def reward_of(text: str) -> float:
    return 1.0 if text.strip().startswith("blue") else 0.0


def gate_reward(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, answer: dict[str, Any]) -> float:
    return reward_of(str(answer.get("content") or ""))
