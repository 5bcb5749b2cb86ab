"""The learning suite's agent: one task of bench/learning_tasks.py on the plain `openai` client, nothing else.

    python -m bench.learning_agent --task argument --shape repeated --base-url http://127.0.0.1:8000/v1
    python -m bench.learning_agent --task two_calls --shape unique --base-url ... --episodes 200

``repeated``: a pool of requests, each ``--group-size`` times in a row, every episode's reward posted
to ``/flywheel/v1/feedback`` (the only thing the agent knows of Flywheel). ``unique``: every request
carries a new ticket number and nothing is posted: the gateway's forks and the judge make the groups
and the rewards. Each episode: the task's first messages, then turns until the environment ends the
episode (a tool result, or nothing more), at most four. A turn that runs into its ``max_tokens`` ends
the episode with reward 0. One JSON line per episode on stdout: ``episode``, ``reward``, ``at``
(seconds since start), ``error`` when the API failed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai

from bench.learning_tasks import TASKS, Message, Request, Task

MAX_TURNS = 4


@dataclass
class Args:
    task: str = "tool_choice"
    shape: str = "repeated"
    base_url: str = "http://127.0.0.1:8000/v1"
    episodes: int = 0  # 0: until interrupted
    concurrency: int = 4
    group_size: int = 4
    pool: int = 48
    seed: int = 0


def schedule(task: Task, args: Args) -> Iterator[tuple[int, Request, int | None]]:
    """(episode, request, ticket): a shuffled pool in blocks of ``group_size``, or a new ticket each time."""
    rng = random.Random(args.seed)
    pool = [task.request(rng) for _ in range(args.pool)]
    index = 0
    while not args.episodes or index < args.episodes:
        if args.shape == "unique":
            yield index, task.request(rng), 10_000 + index
            index += 1
            continue
        for request in rng.sample(pool, len(pool)):
            for _ in range(args.group_size):
                if args.episodes and index >= args.episodes:
                    return
                yield index, request, None
                index += 1


async def episode(client: openai.AsyncOpenAI, task: Task, args: Args,
                  request: Request, ticket: int | None) -> tuple[float, str | None]:
    """Run one episode: (reward, id of its last completion)."""
    messages: list[Message] = task.first_messages(request, ticket)
    completion_id = None
    for _ in range(MAX_TURNS):
        reply = await client.chat.completions.create(
            model="agent", messages=messages, tools=task.tools or openai.omit,  # type: ignore[arg-type]
            max_tokens=task.max_tokens, temperature=1.0)
        choice, completion_id = reply.choices[0], reply.id
        if choice.finish_reason == "length" or (reply.usage and reply.usage.completion_tokens >= task.max_tokens):
            return 0.0, completion_id
        messages.append(choice.message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}))
        answer = task.step(messages)
        if answer is None:
            break
        messages.append(answer)
    return task.score(messages), completion_id


async def post_feedback(http: httpx.AsyncClient, base_url: str, completion_id: str, reward: float) -> None:
    """POST an episode's reward; a failure goes to stderr (the episode is done: its reward is on stdout)."""
    url = base_url.rstrip("/").removesuffix("/v1") + "/flywheel/v1/feedback"
    try:
        for _ in range(5):  # the completion may not be stored yet: 404 for a moment
            response = await http.post(url, json={"completion_id": completion_id, "reward": reward})
            if response.status_code != 404:
                response.raise_for_status()
                return
            await asyncio.sleep(2.0)
    except httpx.HTTPError as exc:
        print(f"feedback for {completion_id} failed: {type(exc).__name__}: {exc}"[:300], file=sys.stderr)


async def run(args: Args) -> None:
    task, started = TASKS[args.task], time.monotonic()
    jobs = schedule(task, args)
    async with openai.AsyncOpenAI(base_url=args.base_url, api_key="unused", timeout=120.0) as client, \
            httpx.AsyncClient(timeout=60.0) as http:

        sending: set[asyncio.Task[None]] = set()

        async def worker() -> None:
            for index, request, ticket in jobs:
                record: dict[str, Any] = {"episode": index}
                try:
                    reward, completion_id = await episode(client, task, args, request, ticket)
                    if args.shape == "repeated" and completion_id:
                        # In the background, as an application sends a rating: the next episode does not wait
                        sent = asyncio.create_task(post_feedback(http, args.base_url, completion_id, reward))
                        sending.add(sent)
                        sent.add_done_callback(sending.discard)
                    record["reward"] = reward
                except (openai.APIError, httpx.HTTPError) as exc:
                    record["error"] = f"{type(exc).__name__}: {exc}"[:300]
                record["at"] = round(time.monotonic() - started, 2)
                print(json.dumps(record), flush=True)

        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        await asyncio.gather(*sending)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=sorted(TASKS), default=Args.task)
    parser.add_argument("--shape", choices=("repeated", "unique"), default=Args.shape)
    for name in ("base_url", "episodes", "concurrency", "group_size", "pool", "seed"):
        default = getattr(Args, name)
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run(Args(**vars(parser.parse_args()))))


if __name__ == "__main__":
    main()
