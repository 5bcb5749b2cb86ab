"""Turning client feedback and judge scores into the one reward a trajectory trains with.

Small pure functions, so the feedback endpoint and the scoring job stay thin::

    value = feedback_reward(reward=None, label="good")                     # 1.0
    final = combine_rewards(judge_score=0.4, feedback=1.0, policy=RewardPolicy())
    final                                                                  # FinalReward(1.0, "feedback")
    group = apply_rewards(scored_group, {"traj_1": 1.0}, RewardPolicy(policy="weighted"))

Policies (``[rewards] policy`` in config):

- ``feedback_overrides`` (default): a person's (or client's) word beats the judge; the judge
  fills in where no feedback came.
- ``judge_only``: feedback is recorded but not trained on.
- ``weighted``: ``(judge_weight * judge + feedback_weight * feedback) / (judge_weight + feedback_weight)``
  when both exist; when only one exists, that one (the weights renormalise to it).

Sources in :class:`FinalReward` are ``"ruler"`` (or ``"hook"``, where the task's reward hook took the
judge's place: ``[judge] reward_hook``), ``"feedback"`` or ``"weighted"``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, model_validator

from flywheel.capture.trajectory import TrajectoryGroup

LABEL_REWARDS: dict[str, float] = {"good": 1.0, "bad": 0.0}  # what a label means as a reward

PolicyName = Literal["feedback_overrides", "judge_only", "weighted"]
RewardSource = Literal["ruler", "hook", "feedback", "weighted"]
ScorerName = Literal["ruler", "hook"]


class InvalidFeedbackError(ValueError):
    """Feedback that says nothing usable: no reward and no label, an unknown label, a non-finite reward."""


class RewardPolicy(BaseModel):
    """The ``[rewards]`` config section: how judge scores and feedback combine."""

    policy: PolicyName = "feedback_overrides"
    judge_weight: float = 0.5  # used by "weighted" only
    feedback_weight: float = 0.5  # used by "weighted" only

    @model_validator(mode="after")
    def _weights_make_sense(self) -> RewardPolicy:
        if self.judge_weight < 0 or self.feedback_weight < 0:
            raise ValueError("reward weights must not be negative")
        if self.policy == "weighted" and self.judge_weight + self.feedback_weight <= 0:
            raise ValueError("the weighted policy needs a positive judge_weight or feedback_weight")
        return self


@dataclass(frozen=True)
class FinalReward:
    """The reward to train with and where it came from."""

    value: float
    source: RewardSource


def feedback_reward(reward: float | None = None, label: str | None = None) -> float:
    """One feedback record as a reward: an explicit ``reward`` wins, else ``good`` -> 1.0, ``bad`` -> 0.0.

    Rewards are not clipped: GRPO only uses them relative to each other, but mixing scales
    under the ``weighted`` policy is the caller's choice, so keep them in [0, 1] to match the
    judge. Raises :class:`InvalidFeedbackError` when neither says anything usable.
    """
    if reward is not None:
        if isinstance(reward, bool) or not math.isfinite(reward):
            raise InvalidFeedbackError(f"reward must be a finite number, got {reward!r}")
        return float(reward)
    if label is None:
        raise InvalidFeedbackError("feedback needs a reward or a label")
    normalized = label.strip().lower()
    if normalized not in LABEL_REWARDS:
        raise InvalidFeedbackError(f"label must be one of {sorted(LABEL_REWARDS)}, got {label!r}")
    return LABEL_REWARDS[normalized]


def combine_rewards(judge_score: float | None, feedback: float | None,
                    policy: RewardPolicy | None = None, scorer: ScorerName = "ruler") -> FinalReward | None:
    """The final reward from a judge score and a feedback reward (either may be missing).

    ``None`` when the policy finds nothing to use (no judge score under ``judge_only``,
    nothing at all otherwise): the trajectory stays unscored and the trainer skips it. ``scorer`` names
    what gave ``judge_score``: RULER or the task's reward hook.
    """
    policy = policy or RewardPolicy()
    if policy.policy == "judge_only":
        return FinalReward(judge_score, scorer) if judge_score is not None else None
    if policy.policy == "feedback_overrides":
        if feedback is not None:
            return FinalReward(feedback, "feedback")
        return FinalReward(judge_score, scorer) if judge_score is not None else None
    # weighted
    if judge_score is not None and feedback is not None:
        total = policy.judge_weight + policy.feedback_weight
        value = (policy.judge_weight * judge_score + policy.feedback_weight * feedback) / total
        return FinalReward(value, "weighted")
    if feedback is not None:
        return FinalReward(feedback, "feedback")
    if judge_score is not None:
        return FinalReward(judge_score, scorer)
    return None


def apply_rewards(group: TrajectoryGroup, feedback_by_trajectory: Mapping[str, float],
                  policy: RewardPolicy | None = None) -> TrajectoryGroup:
    """A copy of ``group`` with each trajectory's final reward set (the input is left untouched).

    The judge score is read from ``metrics["ruler_score"]`` (set by
    :func:`~flywheel.judge.ruler.ruler_score_group`) or ``metrics["hook_score"]`` (the task's reward
    hook; absent when the group was not judged), the
    feedback from ``feedback_by_trajectory[trajectory.id]`` (already one value per
    trajectory, e.g. the latest via :func:`feedback_reward`). Each trajectory gets
    ``metadata["reward_source"]``: ``"ruler"``, ``"hook"``, ``"feedback"``, ``"weighted"``, or ``None``
    when nothing applied; then its reward is left as it was and a trainer must skip it.
    """
    trajectories = []
    for trajectory in group.trajectories:
        copy = trajectory.model_copy(deep=True)
        hook_score = trajectory.metrics.get("hook_score")
        judge_score = trajectory.metrics.get("ruler_score") if hook_score is None else hook_score
        feedback = feedback_by_trajectory.get(trajectory.id) if trajectory.id else None
        final = combine_rewards(float(judge_score) if judge_score is not None else None, feedback, policy,
                                "ruler" if hook_score is None else "hook")
        if feedback is not None:
            copy.metrics["feedback_reward"] = feedback
        if final is not None:
            copy.reward = final.value
        copy.metadata["reward_source"] = final.source if final is not None else None
        trajectories.append(copy)
    return TrajectoryGroup(trajectories=trajectories, id=group.id, metadata=dict(group.metadata))
