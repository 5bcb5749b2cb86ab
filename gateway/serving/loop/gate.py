"""The offline promotion gate: the candidate and the serving version answer the same held-out contexts.

M recent contexts that were never trained on (the first request of conversations kept out of
every group: ``[loop.gate] holdout_fraction``) are answered by both versions through the engine
(capture off: the gateway calls the engine directly). Each pair is scored by the configured
reward hook (``[loop.gate] reward_hook``, else ``[judge] reward_hook``: ``flywheel.judge.hook``) —
the way a task with a checkable outcome plugs in — or, without a hook, by RULER comparing the two
answers. The candidate wins a context when its
score is higher, ties count half; it passes when its win rate reaches ``win_rate``. It fails only
when its losses outnumber its wins beyond chance (a one-sided sign test over the contexts that did
not tie, at ``fail_alpha``); otherwise, and when every context ties, the gate learned too little
about the candidate: ``inconclusive``, and the canary decides.
"""

from __future__ import annotations

import asyncio
import logging
import math
import statistics
from collections.abc import Awaitable, Callable
from typing import Any

from flywheel.gateway.core.config import GateConfig, JudgeConfig
from flywheel.gateway.core.store_api import HeldoutContext
from flywheel.gateway.serving.served_model import ServedModel
from flywheel.judge.hook import RewardHookError, load_reward_hook

log = logging.getLogger("flywheel.gate")

Scorer = Callable[[list[dict[str, Any]], list[dict[str, Any]] | None, dict[str, Any], dict[str, Any]],
                  Awaitable[tuple[float, float]]]


class GateError(RuntimeError):
    """The gate could not score (the hook or the judge failed): the candidate keeps waiting."""


def hook_scorer(target: str, timeout_s: float = 60.0) -> Scorer:
    """Both answers scored independently by the reward hook (``module:function`` or an http(s) URL)."""
    try:
        hook = load_reward_hook(target, timeout_s)
    except RewardHookError as exc:
        raise GateError(str(exc)) from exc

    async def score(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, candidate: dict[str, Any],
                    baseline: dict[str, Any]) -> tuple[float, float]:
        try:
            return await hook(messages, tools, candidate), await hook(messages, tools, baseline)
        except RewardHookError as exc:
            raise GateError(str(exc)) from exc

    return score


def ruler_scorer(judge: JudgeConfig) -> Scorer:
    """The two answers judged against each other by RULER (the ``[judge]`` model)."""
    async def score(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, candidate: dict[str, Any],
                    baseline: dict[str, Any]) -> tuple[float, float]:
        from flywheel.capture.trajectory import Trajectory, TrajectoryGroup
        from flywheel.judge.rubric import resolve_rubric
        from flywheel.judge.ruler import ruler_score_group

        group = TrajectoryGroup(trajectories=[
            Trajectory(messages_and_choices=[*messages, candidate], tools=tools),
            Trajectory(messages_and_choices=[*messages, baseline], tools=tools)])
        scored = await ruler_score_group(group, judge.model, rubric=resolve_rubric(judge.rubrics, None, None),
                                         swallow_exceptions=True, **judge.call_kwargs())
        if scored is None:
            raise GateError(f"the judge {judge.model} could not score the pair")
        a, b = (float(t.metrics["ruler_score"]) for t in scored.trajectories)
        return a, b

    return score


async def answer(model: ServedModel, context: HeldoutContext, config: GateConfig) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model.engine_model, "messages": context.messages,
                            "max_tokens": config.max_tokens, "temperature": config.temperature}
    if context.tools:
        body["tools"] = context.tools
    result = await model.engine.chat(body)
    message: dict[str, Any] = result["choices"][0]["message"]
    return message


def loss_p_value(wins: int, losses: int) -> float:
    """Sign test: the chance of at least ``losses`` losses among the untied contexts if neither version is better."""
    n = wins + losses
    return sum(math.comb(n, k) for k in range(losses, n + 1)) / 2 ** n


def gate_decision(wins: int, ties: int, contexts: int, threshold: float, fail_alpha: float) -> str:
    """``passed`` at the win rate; ``failed`` on significant losses; else ``inconclusive`` (all ties included)."""
    if ties == contexts:
        return "inconclusive"  # 0.5 by ties alone: nothing learned
    if (wins + ties / 2) / contexts >= threshold:
        return "passed"
    return "failed" if loss_p_value(wins, contexts - wins - ties) <= fail_alpha else "inconclusive"


def gate_hook(gate: GateConfig, judge: JudgeConfig) -> str | None:
    """The reward hook the gate scores with: its own, else the one that scores groups (``[judge]``); None: RULER."""
    return gate.reward_hook or (judge.reward_hook if judge.enabled else None)


async def offline_gate(candidate: ServedModel, baseline: ServedModel, contexts: list[HeldoutContext],
                       config: GateConfig, scorer: Scorer, concurrency: int = 4,
                       scorer_name: str = "ruler") -> dict[str, Any]:
    """Answer every context with both versions, score each pair, and decide."""
    semaphore = asyncio.Semaphore(concurrency)

    async def one(context: HeldoutContext) -> tuple[float, float]:
        async with semaphore:
            ours, theirs = await asyncio.gather(answer(candidate, context, config), answer(baseline, context, config))
            return await scorer(context.messages, context.tools, ours, theirs)

    scores = await asyncio.gather(*(one(c) for c in contexts))
    wins = sum(1 for a, b in scores if a > b)
    ties = sum(1 for a, b in scores if a == b)
    losses = len(scores) - wins - ties
    win_rate = (wins + ties / 2) / len(scores)
    decision = gate_decision(wins, ties, len(scores), config.win_rate, config.fail_alpha)
    return {"contexts": len(scores), "wins": wins, "ties": ties, "losses": losses,
            "win_rate": win_rate, "threshold": config.win_rate,
            "loss_p_value": loss_p_value(wins, losses), "fail_alpha": config.fail_alpha,
            "decision": decision, "passed": decision == "passed",
            "candidate_mean": statistics.fmean(a for a, _ in scores),
            "baseline_mean": statistics.fmean(b for _, b in scores),
            "candidate_version": candidate.version, "baseline_version": baseline.version,
            "scorer": scorer_name}
