"""A judge stand-in for the learning suite: an OpenAI-compatible server that scores RULER prompts by the tasks' rewards.

    python -m bench.learning_judge --port 8900     # then [judge] model = "openai/judge", api_base = ".../v1"

It reads a RULER prompt the way a model would: the ``<shared_context>`` messages every trajectory
begins with, then each ``<trajectory id="...">`` block's own messages (judge/ruler.py writes both as
JSON). It finds the task by the conversation's system prompt (bench/learning_tasks.py) and answers
each trajectory's score with that task's reward of the whole conversation, in RULER's JSON shape.
An unknown task scores 0. A real judge model would stand here in production; this one is exact, so
the suite measures the loop, not the judge.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from bench.learning_tasks import Message, task_of

SHARED = re.compile(r"<shared_context>\nEvery trajectory begins with these messages:\n(.*?)\n</shared_context>",
                    re.DOTALL)
BLOCK = re.compile(r'<trajectory id="([^"]+)">\n(?:<tools>\n.*?\n</tools>\n)?(.*?)\n</trajectory>', re.DOTALL)


def judge_scores(prompt: str) -> list[dict[str, Any]]:
    """One RULER score per trajectory block of ``prompt``."""
    shared = SHARED.search(prompt)
    opening: list[Message] = json.loads(shared.group(1)) if shared else []
    scores = []
    for trajectory_id, block in BLOCK.findall(prompt):
        messages = [*opening, *json.loads(block)]
        task = task_of(messages)
        score = task.score(messages) if task is not None else 0.0
        scores.append({"trajectory_id": trajectory_id, "score": round(score, 4),
                       "explanation": f"{task.name if task else 'unknown task'}: reward {score:.3f}"})
    return scores


async def chat(request: Request) -> JSONResponse:
    body = await request.json()
    user = next((m["content"] for m in body.get("messages", []) if m.get("role") == "user"), "")
    content = json.dumps({"scores": judge_scores(user)})
    return JSONResponse({
        "id": f"judge-{time.monotonic_ns()}", "object": "chat.completion", "created": int(time.time()),
        "model": body.get("model", "judge"),
        "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": content}}],
        "usage": {"prompt_tokens": len(user) // 4, "completion_tokens": len(content) // 4,
                  "total_tokens": (len(user) + len(content)) // 4}})


app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    uvicorn.run(app, host="127.0.0.1", port=parser.parse_args().port, log_level="warning")


if __name__ == "__main__":
    main()
