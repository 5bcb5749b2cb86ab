"""The agent side every example shares: the episode protocol, the agent loop, and the zero-code runner.

No SDK here: the agent is a plain ``openai`` program pointed at the gateway by ``base_url``.
An environment is an :class:`Episode`: the opening messages, a reply to each assistant message
(tool results, the opponent's move, the customer's answer) until it is over, and a reward.
``zero_code`` plays episodes and reports each one's reward with one ``POST /flywheel/v1/feedback``
(by the id of its last completion); the gateway groups same-task episodes and its loop (or
``flywheel groups && flywheel score && flywheel train``) trains on them. The explicit, ART-style
form is in ``examples/art_loop.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx
import openai
from openai.types.chat.chat_completion import Choice
from openai.types.chat.chat_completion_message import ChatCompletionMessage

Message = dict[str, Any]


class Episode(Protocol):
    """One run of an environment, driven by :func:`play`."""

    tools: list[dict[str, Any]] | None
    max_turns: int

    def start(self) -> list[Message]:
        """The system prompt and the first user message."""

    def respond(self, message: ChatCompletionMessage) -> list[Message] | None:
        """What the environment answers the model's message with, or None when the episode is over."""

    def reward(self) -> float: ...

    def metrics(self) -> dict[str, float]: ...


@dataclass
class Played:
    """An episode's conversation (the model's turns as the Choices it returned), outcome and last completion."""

    items: list[Message | Choice]
    reward: float
    metrics: dict[str, float]
    last_completion_id: str | None


def as_message(item: Message | Choice) -> Message:
    if isinstance(item, Choice):
        return item.message.model_dump(include={"role", "content", "tool_calls"}, exclude_none=True)
    return item


async def play(client: openai.AsyncOpenAI, model: str, episode: Episode, *, max_tokens: int,
               temperature: float = 1.0) -> Played:
    """Run one episode to its end (or ``max_turns`` model turns) with any OpenAI-compatible client."""
    items: list[Message | Choice] = list(episode.start())
    extra: dict[str, Any] = {"tools": episode.tools} if episode.tools else {}
    last_id = None
    for _ in range(episode.max_turns):
        messages: Any = [as_message(i) for i in items]
        completion = await client.chat.completions.create(model=model, messages=messages,
                                                          max_tokens=max_tokens, temperature=temperature, **extra)
        last_id = completion.id
        choice = completion.choices[0]
        items.append(choice)
        replies = episode.respond(choice.message)
        if replies is None:
            break
        items.extend(replies)
    return Played(items=items, reward=episode.reward(), metrics=episode.metrics(), last_completion_id=last_id)


# -- command lines


def parser(description: str, *, steps: int = 10, groups: int = 4, group_size: int = 4, max_tokens: int = 64,
           judge: bool = False) -> argparse.ArgumentParser:
    """The options both forms take; ``explicit`` ones are ignored by ``zero_code`` and the other way round."""
    p = argparse.ArgumentParser(description=description)
    where = p.add_argument_group("where the model is served")
    where.add_argument("--base-url", help="zero-code: the gateway's OpenAI URL, e.g. http://127.0.0.1:8000/v1")
    where.add_argument("--api-key", default=os.environ.get("FLYWHEEL_API_KEY", "unused"),
                       help="the gateway's client key, when it has client keys (default $FLYWHEEL_API_KEY)")
    where.add_argument("--gateway", help="explicit: a running gateway's URL (its alias --model is trained)")
    where.add_argument("--admin-key", default=os.environ.get("FLYWHEEL_ADMIN_KEY"),
                       help="explicit: the gateway's admin key (default $FLYWHEEL_ADMIN_KEY)")
    where.add_argument("--base-model", default="tiny",
                       help="explicit without --gateway: what LocalBackend serves: an HF id in the HF cache, a "
                            "model directory, or 'tiny' (the offline test model; default)")
    where.add_argument("--vllm-base-url", help="explicit without --gateway: serve through this vLLM server")
    where.add_argument("--path", default=".flywheel", help="explicit without --gateway: LocalBackend's directory")
    where.add_argument("--model", default="agent", help="the model name the agent sends (the gateway alias)")
    run = p.add_argument_group("the run")
    run.add_argument("--steps", type=int, default=steps, help="training steps (zero-code: rounds of episodes)")
    run.add_argument("--groups", type=int, default=groups, help="scenarios per step")
    run.add_argument("--group-size", type=int, default=group_size, help="rollouts per scenario")
    run.add_argument("--max-tokens", type=int, default=max_tokens, help="tokens per model turn")
    run.add_argument("--learning-rate", type=float, help="explicit: learning rate (default: the gateway's)")
    run.add_argument("--no-train", action="store_true", help="explicit: gather and log only")
    run.add_argument("--seed", type=int, default=0, help="scenarios are drawn from this seed")
    if judge:
        rate = p.add_argument_group("RULER")
        rate.add_argument("--judge-model", default="openai/o3", help="any litellm model string")
        rate.add_argument("--judge-api-base", help="the judge's OpenAI-style URL with /v1 (a local vLLM, ...)")
        rate.add_argument("--judge-api-key", default=os.environ.get("JUDGE_API_KEY"),
                          help="the judge's key (default $JUDGE_API_KEY; else litellm's provider variable)")
    return p


@dataclass
class FeedbackSender:
    """Posts each finished episode's reward to the gateway, by the id of its last completion."""

    base_url: str
    api_key: str
    sent: list[dict[str, Any]] = field(default_factory=list)

    async def send(self, completion_id: str, reward: float) -> None:
        root = self.base_url.rstrip("/").removesuffix("/v1")
        async with httpx.AsyncClient(timeout=30) as http:
            response = await http.post(f"{root}/flywheel/v1/feedback", json={"completion_id": completion_id,
                                                                              "reward": reward},
                                       headers={"authorization": f"Bearer {self.api_key}"})
        response.raise_for_status()
        self.sent.append(response.json())


def step_scenarios(options: argparse.Namespace, scenario: Callable[[int], Any]) -> Callable[[int], list[Any]]:
    """The scenarios of each step: ``groups`` of them, numbered on from ``seed`` (new ones every step)."""
    return lambda step: [scenario(options.seed + step * options.groups + i) for i in range(options.groups)]


async def zero_code(options: argparse.Namespace, *, episode: Callable[[Any], Episode],
                    scenarios: Callable[[int], Sequence[Any]]) -> list[float]:
    """Play ``group_size`` episodes per scenario with a plain client and report each reward as feedback."""
    if not options.base_url:
        raise SystemExit("error: zero-code examples need --base-url (the gateway's OpenAI URL)")
    client = openai.AsyncOpenAI(base_url=options.base_url, api_key=options.api_key)
    feedback = FeedbackSender(options.base_url, options.api_key)
    curve = []
    for round_ in range(options.steps):
        async def one(scenario: Any) -> float:
            played = await play(client, options.model, episode(scenario), max_tokens=options.max_tokens)
            if played.last_completion_id is not None:
                await feedback.send(played.last_completion_id, played.reward)
            return played.reward

        rewards = await asyncio.gather(*(one(s) for s in scenarios(round_) for _ in range(options.group_size)))
        curve.append(statistics.fmean(rewards))
        print(f"round {round_}: mean reward {curve[-1]:.3f} over {len(rewards)} episodes", flush=True)
    await client.close()
    return curve


Main = Callable[[list[str] | None], Coroutine[Any, Any, list[float]]]


def zero_code_main(description: str, *, episode: Callable[[Any], Episode], scenario: Callable[[int], Any],
                   **defaults: Any) -> Main:
    """An example's zero-code entry point: ``await main(argv)`` parses its options and plays; the reward curve."""
    async def main(argv: list[str] | None = None) -> list[float]:
        options = parser(description, **defaults).parse_args(argv)
        return await zero_code(options, episode=episode, scenarios=step_scenarios(options, scenario))
    return main
