"""Training side of Flywheel: captured groups -> samples -> GRPO (TRL + PEFT) -> versioned LoRA adapters.

Importing ``trainer`` is cheap: torch, transformers, peft and TRL load only when a round
runs (``train_round``) or the tiny model is built.

    from trainer import GRPOArgs, build_samples, train_round, adapters
"""

from typing import TYPE_CHECKING, Any

from flywheel.trainer import adapters
from flywheel.trainer.grpo_args import GRPOArgs, RoundResult
from flywheel.trainer.sample_plan import CapturedRollout, GroupPlan, passthrough_reward, plan_groups
from flywheel.trainer.samples import (
    AdvantageScale,
    Sample,
    SampleBatch,
    Skipped,
    Truncation,
    build_samples,
    group_advantages,
    is_zero_variance,
    member_sequences,
    turn_tokens,
)

if TYPE_CHECKING:
    from flywheel.trainer.grpo import train_round


def __getattr__(name: str) -> Any:
    # flywheel.trainer.grpo on first use: `python -m flywheel.trainer.grpo` must not find it imported already.
    if name == "train_round":
        from flywheel.trainer import grpo

        return grpo.train_round
    raise AttributeError(f"module 'trainer' has no attribute {name!r}")


__all__ = [
    "AdvantageScale",
    "CapturedRollout",
    "GRPOArgs",
    "GroupPlan",
    "RoundResult",
    "Sample",
    "SampleBatch",
    "Skipped",
    "Truncation",
    "adapters",
    "build_samples",
    "group_advantages",
    "is_zero_variance",
    "member_sequences",
    "passthrough_reward",
    "plan_groups",
    "train_round",
    "turn_tokens",
]
