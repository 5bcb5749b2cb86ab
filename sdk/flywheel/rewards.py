"""RULER, ART's ``art.rewards``: a judge model scores a group's trajectories relative to each other.

    groups = await flywheel.gather_trajectory_groups(
        (flywheel.TrajectoryGroup(rollout(model, s) for _ in range(8)) for s in scenarios),
        after_each=lambda group: ruler_score_group(group, "openai/o3", swallow_exceptions=True))

The judging itself is the gateway's (``judge/``: deduplication, shared context, checked answers,
retries; docs/judge.md), imported on the first call: it needs ``flywheel-rl[gateway]``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from pydantic_core import to_jsonable_python
from rich.console import Console

from flywheel.errors import MissingExtraError
from flywheel.trajectories import TrajectoryGroup
from flywheel.types import USE_DEFAULT, UseDefault

__all__ = ["ruler", "ruler_score_group"]

log = logging.getLogger("flywheel")


def _judge() -> ModuleType:
    try:
        import flywheel.judge as judge  # the subpackage itself, not this package's face
    except ImportError as exc:
        raise MissingExtraError("RULER runs the gateway's judge, which is not installed here: "
                                "pip install 'flywheel-rl[gateway]'") from exc
    return judge


def _rubric(judge: ModuleType, rubric: str | UseDefault) -> str:
    return judge.DEFAULT_RUBRIC if rubric is USE_DEFAULT else str(rubric)


async def ruler(message_lists: Sequence[Sequence[dict[str, Any]]], judge_model: str = "openai/o3",
                extra_litellm_params: dict[str, Any] | None = None, rubric: str | UseDefault = USE_DEFAULT,
                tools: list[dict[str, Any]] | None = None, *, debug: bool = False) -> list[Any]:
    """Score trajectories given as message lists; ``result[i]`` (``trajectory_id``, ``explanation``, ``score``
    in [0, 1]) belongs to ``message_lists[i]``. ``rubric`` left at USE_DEFAULT is ``judge.DEFAULT_RUBRIC``;
    ``extra_litellm_params`` go to ``litellm.acompletion`` (``api_base``, ``temperature``, ...).

    Raises ``judge.JudgeError`` (the judge failed or answered unusably, after retries).
    """
    judge = _judge()
    result = await judge.ruler(to_jsonable_python(message_lists), judge_model, rubric=_rubric(judge, rubric),
                               tools=tools, extra_litellm_params=extra_litellm_params)
    if debug:
        _print_scores(judge_model, result.scores)
    return list(result.scores)


async def ruler_score_group(group: TrajectoryGroup, judge_model: str = "openai/o3",
                            extra_litellm_params: dict[str, Any] | None = None,
                            rubric: str | UseDefault = USE_DEFAULT, *, swallow_exceptions: bool = False,
                            debug: bool = False) -> TrajectoryGroup | None:
    """A copy of ``group`` whose rewards are the judge's scores (the group itself is left as it was).

    Per trajectory: ``metrics["independent_reward"]`` keeps the reward it had, ``metrics["ruler_score"]``
    and ``reward`` become the score, and the judge's explanation goes into ``logs``. With
    ``swallow_exceptions`` a failed judging returns None (``gather_trajectory_groups`` then drops the
    group) instead of raising.
    """
    for position, trajectory in enumerate(group.trajectories):
        if trajectory.additional_histories:
            raise ValueError(f"trajectory {position}: RULER does not judge additional_histories yet (as in ART)")
    judge = _judge()
    candidates = [judge.Candidate(to_jsonable_python(t.messages()), to_jsonable_python(t.tools))
                  for t in group.trajectories]
    try:
        result = await judge.judge_candidates(candidates, judge_model, rubric=_rubric(judge, rubric),
                                              extra_litellm_params=extra_litellm_params)
    except judge.JudgeError as exc:
        if not swallow_exceptions:
            raise
        log.warning("RULER: group left unscored: %s: %s", type(exc).__name__, exc)
        return None
    scored = group.model_copy(deep=True)
    for trajectory, score in zip(scored.trajectories, result.scores, strict=True):
        trajectory.metrics["independent_reward"] = trajectory.reward
        trajectory.metrics["ruler_score"] = score.score
        trajectory.reward = score.score
        trajectory.log(f"RULER explanation: {score.explanation}")
    if debug:
        _print_scores(judge_model, result.scores)
    return scored


def _print_scores(judge_model: str, scores: Sequence[Any]) -> None:
    console = Console(stderr=True)
    console.print(f"[bold]RULER[/bold] ({judge_model})")
    for score in scores:
        console.print(f"  trajectory {score.trajectory_id}: {score.score:.3f}  {score.explanation}")
