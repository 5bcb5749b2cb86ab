"""In-memory trajectory types, shaped like OpenPipe ART's so its users feel at home.

A captured trajectory (one branch of a stored conversation) and one built by an
explicit rollout loop both become a :class:`Trajectory`: the OpenAI messages in order
(assistant turns included), the tools, a reward, metrics and metadata. The judge
scores :class:`TrajectoryGroup` s; the trainer turns them into samples; the ART-style
export writes them as JSON.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field


class Trajectory(BaseModel):
    """One attempt at a task: messages (with the model's choices), tools, reward."""

    messages_and_choices: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    reward: float = 0.0
    metrics: dict[str, float | int | bool] = Field(default_factory=dict)
    metadata: dict[str, Any] = Field(default_factory=dict)
    logs: list[str] = Field(default_factory=list)
    id: str | None = None  # the store's trajectory id, when captured
    leaf_turn_id: str | None = None  # which branch of a stored trajectory this is

    def messages(self) -> list[dict[str, Any]]:
        return list(self.messages_and_choices)


class TrajectoryGroup(BaseModel):
    """Trajectories that pursued the same goal; rewards only matter relative to each other."""

    trajectories: list[Trajectory]
    id: str | None = None  # the store's group id, when formed from captured traffic
    metadata: dict[str, Any] = Field(default_factory=dict)
