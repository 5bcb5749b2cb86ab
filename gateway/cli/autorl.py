"""``flywheel autorl``: train an alias from a task description alone (ART's AutoRL): no labelled data.

1. A model writes ``--inputs`` diverse inputs for the task (any litellm model string, or ``gateway``:
   the alias itself, with capture off).
2. The agent runs ``--rollouts`` times on each input through the running gateway: the built-in one
   answers each input in one turn under the task description as its system prompt; or name yours,
   ``--agent module:function``, an ART rollout: ``async def rollout(model, task_input) -> Trajectory``.
3. RULER scores each input's rollouts against each other (the judge: ``--judge-model``, default the
   configuration's ``[judge]``); a group the judge fails on is dropped.
4. One training step on the scored groups, served at once; repeated ``--steps`` times on the same inputs.

It drives the SDK (``import flywheel``) against the gateway's HTTP API, like any client would.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import re
from collections.abc import Awaitable, Callable
from typing import Annotated, Any

import typer
from rich.console import Console

import flywheel
from flywheel.gateway.cli.common import AdminKeyOption, ConfigOption, GatewayOption, Target, fail, locate
from flywheel.rewards import ruler_score_group

Agent = Callable[[flywheel.Model, str], Awaitable[flywheel.Trajectory]]

GENERATOR_PROMPT = """You write inputs for an AI agent, to train it on its task. The task:

<task>
{task}
</task>

Write {count} different inputs the agent could receive for this task: varied in topic, difficulty, length and
phrasing, each complete on its own, as a real user would send it. Reply with a JSON object and nothing else:
{{"inputs": ["...", "..."]}}"""
_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)


def parse_inputs(content: str | None) -> list[str]:
    """The ``inputs`` list of a generator's answer (a ```json fence is tolerated); [] when unusable."""
    text = (content or "").strip()
    fenced = _FENCE.match(text)
    try:
        data = json.loads(fenced.group(1) if fenced else text)
    except ValueError:
        return []
    items = data.get("inputs") if isinstance(data, dict) else data
    return [item.strip() for item in items if isinstance(item, str) and item.strip()] if isinstance(items, list) else []


async def generate_inputs(task: str, count: int, model: str, litellm_params: dict[str, Any],
                          attempts: int = 3) -> list[str]:
    """``count`` distinct inputs from the generator model (asking again, up to ``attempts`` times, for the rest)."""
    from flywheel.judge.ruler import _litellm

    litellm = _litellm()  # the judge's one way to load litellm (offline cost map, no banners)
    inputs: list[str] = []
    for _ in range(attempts):
        missing = count - len(inputs)
        if missing <= 0:
            break
        response = await litellm.acompletion(model=model, messages=[
            {"role": "user", "content": GENERATOR_PROMPT.format(task=task, count=missing)}],
            temperature=1.0, **litellm_params)
        for item in parse_inputs(response.choices[0].message.content):
            if item not in inputs:
                inputs.append(item)
    return inputs[:count]


def load_agent(spec: str) -> Agent:
    """``module:function`` -> the function (a one-line CLI error when it cannot be found)."""
    module_name, _, name = spec.partition(":")
    if not module_name or not name:
        fail(f"--agent: expected module:function, got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        fail(f"--agent: cannot import {module_name!r}: {exc}")
    agent = getattr(module, name, None)
    if not callable(agent):
        fail(f"--agent: {module_name} has no function {name!r}")
    return agent


def answering_agent(task: str, max_tokens: int) -> Agent:
    """The built-in agent: one answer to the input, with the task description as its system prompt."""
    async def rollout(model: flywheel.Model, task_input: str) -> flywheel.Trajectory:
        trajectory = flywheel.Trajectory(messages_and_choices=[{"role": "system", "content": task},
                                                               {"role": "user", "content": task_input}])
        completion = await model.openai_client().chat.completions.create(
            model=model.name, messages=trajectory.messages(), max_tokens=max_tokens)
        trajectory.messages_and_choices.append(completion.choices[0])
        return trajectory
    return rollout


async def run(backend: flywheel.Gateway, alias: str, agent: Agent, inputs: list[str], *, rollouts: int, steps: int,
              judge_model: str, judge_params: dict[str, Any], train: bool, learning_rate: float | None) -> None:
    model = flywheel.TrainableModel(name=alias, project="autorl", base_model=alias)
    await model.register(backend)

    async def judged(group: flywheel.TrajectoryGroup) -> flywheel.TrajectoryGroup | None:
        return await ruler_score_group(group, judge_model, extra_litellm_params=judge_params,
                                       swallow_exceptions=True)

    for step in range(steps):
        groups = await flywheel.gather_trajectory_groups(
            (flywheel.TrajectoryGroup(agent(model, task_input) for _ in range(rollouts)) for task_input in inputs),
            pbar_desc=f"step {step}", max_exceptions=0.25, after_each=judged)
        typer.echo(f"step {step}: {len(groups)} of {len(inputs)} groups gathered and judged")
        if not groups:
            fail("no group was judged: check the judge (--judge-model, --judge-api-base)")
        if not train:
            continue
        result = await backend.train(model, groups, learning_rate=flywheel.USE_DEFAULT if learning_rate is None
                                     else learning_rate)
        typer.echo(f"step {step}: {result.status}; {alias} serves version {result.step}")


def autorl(task: Annotated[str, typer.Option(help="What the agent is for, in plain words (its system prompt).")],
           alias: Annotated[str, typer.Option("--alias", help="The alias to train.")],
           config: ConfigOption = None, gateway: GatewayOption = None, admin_key: AdminKeyOption = None,
           api_key: Annotated[str | None, typer.Option(
               "--api-key", envvar="FLYWHEEL_API_KEY", show_default=False,
               help="A client key of the gateway, for the agent's calls (default: $FLYWHEEL_API_KEY).")] = None,
           agent: Annotated[str | None, typer.Option(
               help="The agent, as module:function (an ART rollout taking (model, task_input)); default: one answer "
                    "per input.")] = None,
           inputs: Annotated[int, typer.Option(min=1, help="How many task inputs to generate.")] = 16,
           rollouts: Annotated[int, typer.Option(min=2, help="Rollouts per input (the group size).")] = 4,
           steps: Annotated[int, typer.Option(min=1, help="Training steps over the inputs.")] = 1,
           input_model: Annotated[str, typer.Option(
               help="Writes the inputs: a litellm model string, or 'gateway' (the alias itself).")] = "gateway",
           input_api_base: Annotated[str | None, typer.Option(help="The input model's URL, with /v1.")] = None,
           judge_model: Annotated[str | None, typer.Option(
               help="RULER's judge (litellm model string); default: the configuration's [judge] model.")] = None,
           judge_api_base: Annotated[str | None, typer.Option(help="The judge's URL, with /v1.")] = None,
           max_tokens: Annotated[int, typer.Option(min=1, help="The built-in agent's answer length.")] = 512,
           learning_rate: Annotated[float | None, typer.Option(help="Default: the gateway's [train] args.")] = None,
           train: Annotated[bool, typer.Option(help="Train after judging (--no-train: gather and judge only).")] = True,
           ) -> None:
    """Generate task inputs, run the agent on each through the gateway, score with RULER, train: no data needed.

    Example: flywheel autorl --task "Answer billing questions for Acme's customers" --alias support --inputs 32
    """
    location = locate(Target(config, gateway, admin_key, None, None))
    if location.url is None:
        fail("autorl drives its agent through a running gateway: start one (flywheel serve) or pass --gateway URL")
    settings = location.settings
    if alias not in settings.aliases and gateway is None:
        fail(f"--alias: no alias named {alias!r} in the configuration")
    chosen = load_agent(agent) if agent else answering_agent(task, max_tokens)
    judge_settings = settings.judge.call_kwargs()
    judge_params = {"api_base": judge_api_base or judge_settings["api_base"], "api_key": judge_settings["api_key"]}
    if input_model == "gateway":
        generator, generator_params = f"openai/{alias}", {
            "api_base": f"{location.url}/v1", "api_key": api_key or "unused",
            "extra_headers": {"X-Flywheel-Capture": "off"}}
    else:
        generator, generator_params = input_model, {"api_base": input_api_base} if input_api_base else {}
    with Console(stderr=True).status(f"{generator} writes {inputs} inputs"):
        try:
            written = asyncio.run(generate_inputs(task, inputs, generator, generator_params))
        except Exception as exc:  # litellm's errors: the provider's message, one line
            fail(f"the input model {generator} failed: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
    if len(written) < 2:
        fail(f"the input model {generator} gave {len(written)} usable inputs; ask a stronger model (--input-model)")
    typer.echo(f"{len(written)} inputs written; first: {written[0][:100]!r}")
    with flywheel.Gateway(location.url, admin_key=location.admin_key, api_key=api_key) as backend:
        try:
            asyncio.run(run(backend, alias, chosen, written, rollouts=rollouts, steps=steps,
                            judge_model=judge_model or settings.judge.model,
                            judge_params={k: v for k, v in judge_params.items() if v},
                            train=train, learning_rate=learning_rate))
        except flywheel.FlywheelError as exc:
            fail(str(exc))
