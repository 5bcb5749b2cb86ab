"""A small real OpenAI-compatible judge on loopback whose scores follow from the trajectories.

litellm reaches it as ``openai/<any name>`` with ``api_base=judge.base_url``. For each
request it reads the judge prompt the way a model would: every
``<trajectory id="...">...</trajectory>`` block in the user message, and scores each by
how often the ``target`` word ("good" unless told otherwise; or any of several words) occurs in it:
``score = n / (n + 1)`` (0, 0.5, 0.667, ...), so tests can assert the ranking. Text in
``<shared_context>`` does not count: it is common to all.

It records every request body in ``requests`` and can be told to misbehave, one fault per
request, in order (``faults``), then behave:

- ``"malformed"``: content that is not JSON;  ``"fenced"``: valid JSON inside a ```json fence
- ``"wrong_count"``: one score too few;  ``"unknown_id"``: an id that was not sent
- ``"out_of_range"``: a score of 1.5
- ``"http500"`` / ``"http400"``: an OpenAI error body with that status
- ``"slow"``: sleep ``slow_s`` before answering (longer than the caller's timeout)

Usage reported: ``prompt_tokens`` = characters of the prompt // 4, ``completion_tokens``
= 20 per score, so a model name litellm knows (``openai/gpt-4o-mini``) gets a real price.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from flywheel.gateway.core.processes import free_port
from tests.scripted_openai import LoopbackServer

TRAJECTORY_BLOCK = re.compile(r'<trajectory id="([^"]+)">\n(.*?)\n</trajectory>', re.DOTALL)
FAULTS = frozenset({"malformed", "fenced", "wrong_count", "unknown_id", "out_of_range", "http500", "http400",
                    "slow"})


def keyword_scores(prompt: str, target: str | Sequence[str] = "good") -> list[dict[str, Any]]:
    """The scripted judgement of a judge prompt: one score per trajectory block, by keyword count.

    ``target`` is one word or several (each occurrence of any of them counts).
    """
    words = [target] if isinstance(target, str) else list(target)
    pattern = re.compile(r"\b(?:" + "|".join(re.escape(w) for w in words) + r")\b", re.IGNORECASE)
    scores = []
    for trajectory_id, block in TRAJECTORY_BLOCK.findall(prompt):
        count = len(pattern.findall(block))
        scores.append({"trajectory_id": trajectory_id, "explanation": f"names the target {count} times",
                       "score": round(count / (count + 1), 4)})
    return scores


def scored_blocks(prompt: str, scorer: Callable[[str], float]) -> list[dict[str, Any]]:
    """One score per trajectory block from ``scorer(block_text)`` (a dense reward, for learning tests)."""
    return [{"trajectory_id": trajectory_id, "explanation": "scored by the test's reward", "score": scorer(block)}
            for trajectory_id, block in TRAJECTORY_BLOCK.findall(prompt)]


@dataclass
class ScriptedJudge:
    """Context manager: a uvicorn server in a background thread on a free loopback port."""

    faults: list[str] = field(default_factory=list)  # consumed one per request, first to last
    target: str | Sequence[str] = "good"  # the word(s) whose count makes a trajectory better
    scorer: Callable[[str], float] | None = None  # instead of target: score each block's text directly
    slow_s: float = 1.0  # how long a "slow" fault sleeps
    delay_s: float = 0.0  # every answer waits this long (to observe concurrency)
    requests: list[dict[str, Any]] = field(default_factory=list)
    port: int = field(default_factory=free_port)
    in_flight: int = 0
    max_in_flight: int = 0

    def __post_init__(self) -> None:
        unknown = set(self.faults) - FAULTS
        if unknown:
            raise ValueError(f"unknown faults {sorted(unknown)}; known: {sorted(FAULTS)}")

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def config_toml(self) -> str:
        """The gateway's ``[judge]`` section for this judge (no retries: the scripted faults come in order)."""
        return (f'[judge]\nmodel = "openai/judge"\napi_base = "{self.base_url}"\napi_key = "unused"\n'
                "max_retries = 0\n")

    def prompts(self) -> list[str]:
        """The user message of every request so far (the part with the trajectories)."""
        return [next(m["content"] for m in body["messages"] if m["role"] == "user") for body in self.requests]

    def __enter__(self) -> ScriptedJudge:
        self._server = LoopbackServer(Starlette(routes=[Route("/v1/chat/completions", self._chat, methods=["POST"])]),
                                      self.port)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.stop()

    async def _chat(self, request: Request) -> JSONResponse:
        body = await request.json()
        self.requests.append(body)
        fault = self.faults.pop(0) if self.faults else None
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay_s + (self.slow_s if fault == "slow" else 0.0))
            if fault in ("http500", "http400"):
                status = int(fault[4:])
                return JSONResponse({"error": {"message": f"scripted judge failure {status}", "type": "server_error",
                                               "param": None, "code": None}}, status_code=status)
            prompt = "\n".join(str(m.get("content") or "") for m in body["messages"])
            user = next(str(m.get("content") or "") for m in body["messages"] if m["role"] == "user")
            scores = keyword_scores(user, self.target) if self.scorer is None else scored_blocks(user, self.scorer)
            content = self._misbehave(fault, scores)
            usage = {"prompt_tokens": len(prompt) // 4, "completion_tokens": 20 * len(scores)}
            usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
            return JSONResponse({"id": f"chatcmpl-judge-{len(self.requests)}", "object": "chat.completion",
                                 "created": int(time.time()), "model": body["model"],
                                 "choices": [{"index": 0, "finish_reason": "stop", "logprobs": None,
                                              "message": {"role": "assistant", "content": content}}],
                                 "usage": usage})
        finally:
            self.in_flight -= 1

    @staticmethod
    def _misbehave(fault: str | None, scores: list[dict[str, Any]]) -> str:
        if fault == "malformed":
            return "Trajectory 1 is clearly the best, I would give it 0.9."
        if fault == "wrong_count":
            scores = scores[:-1]
        elif fault == "unknown_id":
            scores = [{**scores[0], "trajectory_id": "99"}, *scores[1:]]
        elif fault == "out_of_range":
            scores = [{**scores[0], "score": 1.5}, *scores[1:]]
        text = json.dumps({"scores": scores})
        return f"```json\n{text}\n```" if fault == "fenced" else text
