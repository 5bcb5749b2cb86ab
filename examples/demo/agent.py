"""The demo's agent: a support bot on the plain `openai` client, pointed at the gateway by its base_url.

    python -m examples.demo.agent --base-url http://127.0.0.1:8000/v1 --episodes 64 --concurrency 8 --seed 0
    python -m examples.demo.agent --base-url http://127.0.0.1:8000/v1 --episodes 0     # until interrupted

Nothing here knows about Flywheel except one POST: the episode's task reward goes to
``/flywheel/v1/feedback`` with the id of the episode's last chat completion. Each episode
(examples/demo/task.py): a customer request -> the model calls a tool -> the tool's result ->
the model answers. A turn that is not one well-formed call, or that runs into its
``max_tokens`` (no end of turn), ends the episode with reward 0; the agent never crashes on
what the model writes. Requests come from a fixed pool in blocks of ``--group-size``
identical episodes, so the gateway sees the same task several times at once and groups them.

Output: one JSON line per episode on stdout (``episode``, ``reward``, ``right_tool``, ``tool``,
``expected``, ``completion_ids``, ``latency_s``, ...), then ``{"summary": {...}}``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import httpx
import openai

from examples.demo import task

FEEDBACK_ATTEMPTS = 5
FEEDBACK_RETRY_S = 2.0  # a turn the store could not take at once is spooled and retried about this often


@dataclass
class Args:
    base_url: str = "http://127.0.0.1:8000/v1"
    """the OpenAI-compatible endpoint (the gateway's /v1)"""
    api_key: str = os.environ.get("OPENAI_API_KEY", "unused")
    """sent as the Bearer key (the gateway's client key when it requires one)"""
    model: str = "gpt-4o-mini"
    """the model name the agent asks for (the gateway routes every name to its alias)"""
    episodes: int = 64
    """episodes to run; 0: until interrupted"""
    concurrency: int = 8
    """episodes in flight at once"""
    group_size: int = 8
    """consecutive episodes that share one request (a same-task group for the gateway)"""
    pool: int = 64
    """distinct requests the agent cycles through (task.request_pool)"""
    temperature: float = 1.0
    """sampling temperature of every turn (the trainer's GRPOArgs.temperature must match)"""
    seed: int = 0
    """picks the pool and its order"""
    feedback: bool = True
    """post each episode's reward to /flywheel/v1/feedback"""


@dataclass
class Summary:
    """The episodes so far: means over every episode reported."""

    episodes: int = 0
    reward: float = 0.0
    right_tool: float = 0.0  # share whose first turn called the right tool
    well_formed: float = 0.0  # share whose first turn was one well-formed call
    errors: int = 0
    seconds: float = 0.0
    started: float = field(default_factory=time.perf_counter, repr=False)

    def add(self, record: dict[str, Any]) -> None:
        n = self.episodes = self.episodes + 1
        self.reward += (record["reward"] - self.reward) / n
        self.right_tool += (record["right_tool"] - self.right_tool) / n
        self.well_formed += ((record["tool"] is not None) - self.well_formed) / n
        self.errors += "error" in record
        self.seconds = round(time.perf_counter() - self.started, 2)

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k != "started"}


def schedule(args: Args) -> Iterator[tuple[int, task.Request]]:
    """(episode index, request): the pool reshuffled each pass, each request ``group_size`` times in a row."""
    pool = task.request_pool(args.pool, seed=args.seed)
    rng = random.Random(args.seed)
    index = 0
    while True:
        for request in rng.sample(pool, len(pool)):
            for _ in range(args.group_size):
                if args.episodes and index >= args.episodes:
                    return
                yield index, request
                index += 1


def feedback_url(base_url: str) -> str:
    """The gateway's feedback route beside its OpenAI API (``.../v1`` -> ``.../flywheel/v1/feedback``)."""
    return base_url.rstrip("/").removesuffix("/v1") + "/flywheel/v1/feedback"


async def ask(client: openai.AsyncOpenAI, args: Args, messages: list[dict[str, Any]], max_tokens: int,
              ) -> tuple[str, dict[str, Any], bool]:
    """One chat turn: (completion id, the assistant message, whether it hit max_tokens without ending)."""
    reply = await client.chat.completions.create(model=args.model, messages=messages,  # type: ignore[arg-type]
                                                 tools=task.TOOLS, max_tokens=max_tokens,  # type: ignore[arg-type]
                                                 temperature=args.temperature)
    choice = reply.choices[0]
    message = choice.message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"})
    # Engines report a parsed call as finish_reason "tool_calls" even when max_tokens cut the turn: count tokens.
    used = reply.usage.completion_tokens if reply.usage else 0
    return reply.id, message, choice.finish_reason == "length" or used >= max_tokens


async def post_feedback(http: httpx.AsyncClient, args: Args, completion_id: str, reward: float) -> None:
    """POST the episode's reward; retried a while on 404 (the gateway may not have stored the completion yet).
    A failure is reported on stderr: the episode itself is done."""
    try:
        for attempt in range(FEEDBACK_ATTEMPTS):
            response = await http.post(feedback_url(args.base_url),
                                       json={"completion_id": completion_id, "reward": reward},
                                       headers={"authorization": f"Bearer {args.api_key}"})
            if response.status_code != 404 or attempt == FEEDBACK_ATTEMPTS - 1:
                response.raise_for_status()
                return
            await asyncio.sleep(FEEDBACK_RETRY_S)
    except httpx.HTTPError as exc:
        print(f"feedback for {completion_id} failed: {type(exc).__name__}: {exc}"[:300], file=sys.stderr)


async def episode(client: openai.AsyncOpenAI, args: Args, index: int,
                  request: task.Request) -> dict[str, Any]:
    """Run one episode and report its reward; a model's garbage or an API error gives reward 0."""
    started = time.perf_counter()
    record: dict[str, Any] = {"episode": index, "request": request.text, "expected": request.tool, "tool": None,
                              "right_tool": False, "reward": 0.0, "answer": None, "completion_ids": []}
    messages = task.first_messages(request)
    try:
        completion_id, first, first_truncated = await ask(client, args, messages, task.FIRST_TURN_MAX_TOKENS)
        record["completion_ids"].append(completion_id)
        tool = task.called_tool(first, truncated=first_truncated)
        final, final_truncated = None, False
        if tool is not None:
            result = {"role": "tool", "tool_call_id": first["tool_calls"][0]["id"],
                      "content": task.tool_result(tool)}
            completion_id, final, final_truncated = await ask(client, args, [*messages, first, result],
                                                              task.FINAL_MAX_TOKENS)
            record["completion_ids"].append(completion_id)
            record["answer"] = final.get("content")
        record.update(tool=tool, right_tool=tool == request.tool,
                      reward=task.episode_reward(request, first, final, first_truncated=first_truncated,
                                                 final_truncated=final_truncated))
    except (openai.APIError, httpx.HTTPError) as exc:
        record["error"] = f"{type(exc).__name__}: {exc}"[:300]
    record["latency_s"] = round(time.perf_counter() - started, 3)
    return record


async def run_agent(args: Args, summary: Summary, emit: Callable[[str], Any] = print) -> Summary:
    """Run the episodes ``concurrency`` at a time, adding each to ``summary``; ``emit`` gets it as a JSON line."""
    jobs = schedule(args)
    async with openai.AsyncOpenAI(base_url=args.base_url, api_key=args.api_key, timeout=120.0) as client, \
            httpx.AsyncClient(timeout=60.0) as http:

        sending: set[asyncio.Task[None]] = set()

        async def worker() -> None:
            for index, request in jobs:  # one shared iterator: each worker takes the next episode
                record = await episode(client, args, index, request)
                summary.add(record)
                emit(json.dumps(record))
                if args.feedback and record["completion_ids"] and "error" not in record:
                    # In the background, as an application sends a rating: the next episode does not wait for it
                    sent = asyncio.create_task(post_feedback(http, args, record["completion_ids"][-1],
                                                             record["reward"]))
                    sending.add(sent)
                    sent.add_done_callback(sending.discard)

        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        await asyncio.gather(*sending)
    return summary


def parse_args(argv: list[str] | None = None) -> Args:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for f in fields(Args):
        default = getattr(Args, f.name)
        if isinstance(default, bool):
            parser.add_argument(f"--{f.name.replace('_', '-')}", action=argparse.BooleanOptionalAction,
                                default=default)
        else:
            parser.add_argument(f"--{f.name.replace('_', '-')}", type=type(default), default=default)
    return Args(**vars(parser.parse_args(argv)))


def main() -> None:
    args = parse_args()
    summary = Summary()
    with contextlib.suppress(KeyboardInterrupt):  # --episodes 0 runs until interrupted: still report what ran
        asyncio.run(run_agent(args, summary, emit=lambda line: print(line, flush=True)))
    print(json.dumps({"summary": summary.to_json()}), flush=True)


if __name__ == "__main__":
    main()
