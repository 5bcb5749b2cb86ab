"""The explicit form every example shares: ART's training loop with ``import flywheel as art``.

``group_size`` rollouts per scenario are gathered with ``gather_trajectory_groups`` (optionally
judged by RULER in ``after_each``), logged, and trained on with ``backend.train`` — one step,
served at once — ``steps`` times, against a running gateway (``--gateway``) or a ``LocalBackend``.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import flywheel as art
from examples import agent
from examples.agent import Episode
from flywheel.rewards import ruler_score_group

Rollout = Callable[[art.Model, Any], Awaitable[art.Trajectory]]


def rollout_of(episode_of: Callable[[Any], Episode], *, max_tokens: int) -> Rollout:
    """ART's rollout for an environment: play one episode with the model's client, return its trajectory."""
    async def rollout(model: art.Model, scenario: Any) -> art.Trajectory:
        episode = episode_of(scenario)
        played = await agent.play(model.openai_client(), model.name, episode, max_tokens=max_tokens)
        return art.Trajectory(messages_and_choices=played.items, tools=episode.tools, reward=played.reward,
                              metrics=played.metrics, metadata={"scenario": repr(scenario)})
    return rollout


def open_backend(options: argparse.Namespace) -> art.Gateway:
    if options.gateway:
        return art.Gateway(options.gateway, admin_key=options.admin_key, api_key=options.api_key)
    return art.LocalBackend(path=options.path, vllm_base_url=options.vllm_base_url)


def judge_params(options: argparse.Namespace) -> dict[str, Any]:
    params = {"api_base": options.judge_api_base, "api_key": options.judge_api_key}
    return {key: value for key, value in params.items() if value}


def ruler_scoring(options: argparse.Namespace) -> Callable[[art.TrajectoryGroup],
                                                           Awaitable[art.TrajectoryGroup | None]]:
    """``after_each`` for RULER: a judged copy of each group, or None (dropped) when the judge failed."""
    params = judge_params(options)

    async def score(group: art.TrajectoryGroup) -> art.TrajectoryGroup | None:
        return await ruler_score_group(group, options.judge_model, extra_litellm_params=params,
                                       swallow_exceptions=True)
    return score


async def train(options: argparse.Namespace, *, project: str, rollout: Rollout,
                scenarios: Callable[[int], Sequence[Any]], ruler: bool = False) -> list[float]:
    """ART's training loop; returns the mean reward of each step's rollouts (the reward curve)."""
    curve = []
    with open_backend(options) as backend:
        model = art.TrainableModel(name=options.model, project=project, base_model=options.base_model)
        await model.register(backend)
        for step in range(options.steps):
            groups = await art.gather_trajectory_groups(
                (art.TrajectoryGroup(rollout(model, scenario) for _ in range(options.group_size))
                 for scenario in scenarios(step)),
                pbar_desc=f"step {step}", max_exceptions=0.1, after_each=ruler_scoring(options) if ruler else None)
            rewards = [t.metrics.get("independent_reward", t.reward) for g in groups for t in g]
            curve.append(statistics.fmean(rewards) if rewards else float("nan"))
            print(f"step {step}: mean reward {curve[-1]:.3f} over {len(rewards)} rollouts", flush=True)
            await model.log(groups, split="train")
            if not options.no_train and groups:
                result = await backend.train(model, groups, learning_rate=options.learning_rate or art.USE_DEFAULT)
                print(f"step {step}: {result.status}, serving version {result.step}", flush=True)
    return curve




def explicit_main(description: str, *, project: str, episode: Callable[[Any], Episode],
                  scenario: Callable[[int], Any], ruler: bool = False, **defaults: Any) -> agent.Main:
    """An example's explicit entry point: ``await main(argv)`` parses its options and trains; the reward curve."""
    async def main(argv: list[str] | None = None) -> list[float]:
        options = agent.parser(description, judge=ruler, **defaults).parse_args(argv)
        return await train(options, project=project, rollout=rollout_of(episode, max_tokens=options.max_tokens),
                           scenarios=agent.step_scenarios(options, scenario), ruler=ruler)
    return main
