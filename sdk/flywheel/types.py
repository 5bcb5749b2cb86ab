"""Training settings and results, and the sentinel that means "the gateway's own setting"."""

from __future__ import annotations

import enum
from typing import Literal

from pydantic import BaseModel

__all__ = ["USE_DEFAULT", "TrainConfig", "TrainResult", "UseDefault"]


class UseDefault(enum.Enum):
    """The type of :data:`USE_DEFAULT`."""

    USE_DEFAULT = "USE_DEFAULT"

    def __repr__(self) -> str:
        return "USE_DEFAULT"


USE_DEFAULT = UseDefault.USE_DEFAULT
"""An argument left at ``USE_DEFAULT`` takes the gateway's configured value (``[train] args``; the
tiny model's CPU settings for the tiny model). ``None`` keeps its own meaning where it has one."""


class TrainConfig(BaseModel):
    """ART's per-step settings for ``model.train``. Only the fields you set are sent: the others keep
    the gateway's configuration (ART's defaults, 5e-6 and 0.0, would stall a tiny model on CPU)."""

    learning_rate: float = 5e-6
    beta: float = 0.0  # KL coefficient against the reference model


class TrainResult(BaseModel):
    """What one training step produced (ART's ``LocalTrainResult``, plus what the gateway decided).

    ``step`` is the version the model serves after the step: the new adapter's version when it
    trained, the unchanged one when the step was skipped (every group had equal rewards).
    """

    step: int
    metrics: dict[str, float]
    checkpoint_path: str | None = None
    status: Literal["finished", "skipped"] = "finished"
    promoted: bool = False
