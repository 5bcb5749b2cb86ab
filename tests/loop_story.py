"""A gateway with a story to tell, for the dashboard and tracking tests.

The loop runs by itself against the vLLM stand-in (``tests/vllm_standin.py``, as in
``tests/test_loop_versions.py``) with a scripted RULER judge. The test plays the training child
through its own HTTP API (reserve a version, report a round with its metrics), then the agents'
clients: conversations on the canary with feedback, tool-using conversations in an explicit group
that the judge scores. What it leaves, step by step, is in :func:`tell`.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from itertools import count
from pathlib import Path
from typing import Any

import httpx
import openai

from tests.gateway_process import GatewayProcess
from tests.scripted_judge import ScriptedJudge
from tests.scripted_openai import Reply
from tests.test_loop_versions import CANARY, admin, converse, start, status
from tests.vllm_standin import BASE, VllmStandIn
from tests.waiting import wait_for

WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                                 "parameters": {"type": "object",
                                                                "properties": {"city": {"type": "string"}}}}}
HOSTILE = "Weather in <b>Paris</b>? <script>alert('xss')</script>"  # client text is untrusted HTML


def judged(judge: ScriptedJudge, extra: str = "") -> str:
    """The story's configuration beyond the vLLM stand-in's alias: the scripted judge, the canary loop."""
    return f"""
[judge]
model = "openai/judge"
api_base = "{judge.base_url}"
api_key = "unused"
max_retries = 0
[groups]
form_every_s = 3600
{CANARY}
{extra}"""


def tool_agent(vllm: VllmStandIn) -> Callable[[dict[str, Any]], Reply]:
    """The stand-in as a tool-using agent: calls get_weather, then reports the tool's answer."""
    calls = count(1)

    def reply(body: dict[str, Any]) -> Reply:
        last = body["messages"][-1]
        if body.get("tools") and last["role"] == "user":
            arguments = json.dumps({"city": "Paris", "units": "metric"})
            return Reply(content=None, finish_reason="tool_calls", tool_calls=[
                {"id": f"call_{next(calls)}", "type": "function",
                 "function": {"name": "get_weather", "arguments": arguments}}])
        if last["role"] == "tool":
            return Reply(content=f"Report ({body['model']}): {last['content']}")
        return vllm._say_who(body)

    return reply


def report_round(gateway: GatewayProcess, metrics: dict[str, float]) -> int:
    """Play the training child: reserve the next version, write its adapter directory, report the round."""
    reserved = admin(gateway, "POST", "/training/versions", json={"alias": "agent"})
    path = Path(reserved["path"])
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    (path / "adapter_model.safetensors").write_bytes(b"")  # the vLLM stand-in reads neither file's weights
    now = datetime.now(UTC).isoformat()
    result = {"status": "finished", "adapter_dir": str(path), "optimizer_state": None, "metrics": metrics,
              "steps": [], "config": {"learning_rate": 1e-5}, "group_ids": [], "skipped": {}, "base_model": BASE,
              "init_adapter": None, "started_at": now, "finished_at": now}
    admin(gateway, "POST", "/training/rounds", json={"alias": "agent", "version": reserved["version"],
                                                     "parent_version": reserved["parent_version"], "result": result})
    return int(reserved["version"])


def canary_until(gateway: GatewayProcess, client: openai.OpenAI, reward_of: Callable[[str], float],
                 done: Callable[[dict[str, Any]], bool], what: str) -> None:
    """Conversations with feedback until the loop decides (``done`` on the status), bounded."""
    wait_for(lambda: status(gateway)["canary"], what=f"the canary before {what}")
    for _ in range(120):
        converse(client, gateway, 1, reward_of)
        if done(status(gateway)):
            return
    wait_for(lambda: done(status(gateway)), what=what)


def weather_group(gateway: GatewayProcess, vllm: VllmStandIn) -> list[str]:
    """Three tool-using conversations in one explicit group, closed; one of them branched by a retry."""
    vllm.reply = tool_agent(vllm)
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
    forecasts = {"weather-a": "good and sunny, 24 C", "weather-b": "good, good, clear skies", "weather-c": "rain"}
    for trajectory_id, forecast in forecasts.items():
        headers = {"X-Flywheel-Trajectory-Id": trajectory_id, "X-Flywheel-Group-Id": "weather"}
        messages: list[Any] = [{"role": "system", "content": "You answer with the weather tool."},
                               {"role": "user", "content": HOSTILE}]
        first = client.chat.completions.create(model="agent", messages=messages, tools=[WEATHER_TOOL],
                                               extra_headers=headers)
        call = first.choices[0].message
        messages += [call.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.tool_calls[0].id, "content": forecast}]  # type: ignore[index]
        client.chat.completions.create(model="agent", messages=messages, tools=[WEATHER_TOOL], extra_headers=headers)
        if trajectory_id == "weather-a":  # the client retried its last request: a second branch
            client.chat.completions.create(model="agent", messages=messages, tools=[WEATHER_TOOL],
                                           extra_headers=headers)
        closed = httpx.post(f"{gateway.url}/flywheel/v1/trajectories/{trajectory_id}/close", timeout=30)
        assert closed.status_code == 200, closed.text
    vllm.reply = vllm._say_who
    formed = admin(gateway, "POST", "/loop/run", json={"job": "form_groups"})
    assert formed["status"] == "ok", formed
    scored = admin(gateway, "POST", "/loop/run", json={"job": "score", "alias": "agent"})
    assert scored["counts"]["scored"] >= 1, scored
    return list(forecasts)


@dataclass
class Story:
    gateway: GatewayProcess
    versions: dict[str, int] = field(default_factory=dict)  # rejected, promoted (then rolled back), canary
    trajectories: list[str] = field(default_factory=list)  # the weather group's


def tell(tmp: Path, vllm: VllmStandIn, judge: ScriptedJudge, extra: str = "", *, full: bool = True) -> Story:
    """Weather group scored; v1 (trained) rejected by the canary; v2 (trained) promoted by it, then rolled back
    by the monitor; with ``full``, v3 fails to load twice (failed gate runs) and then stays on canary."""
    gateway = start(tmp, vllm, judged(judge, extra), name="story")
    story = Story(gateway)
    story.trajectories = weather_group(gateway, vllm)
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
    random.seed(7)
    rejected = report_round(gateway, {"losses/loss": 0.92, "reward/mean": 0.41, "losses/approx_kl": 0.0})
    story.versions["rejected"] = rejected
    canary_until(gateway, client, lambda m: 0.0 if m == f"agent@{rejected}" else 0.8,
                 lambda s: s["canary"] is None, "the rejection of version 1")
    promoted = report_round(gateway, {"losses/loss": 0.61, "reward/mean": 0.74, "losses/approx_kl": 0.05})
    story.versions["promoted"] = promoted
    canary_until(gateway, client, lambda m: 1.0 if m == f"agent@{promoted}" else 0.3,
                 lambda s: s["serving"]["version"] == promoted, "the promotion of version 2")
    for _ in range(120):  # its live reward drops: the monitor rolls it back by itself
        converse(client, gateway, 1, lambda m: 0.0)
        if status(gateway)["serving"]["version"] == 0:
            break
    wait_for(lambda: status(gateway)["serving"]["version"] == 0, what="the automatic rollback")
    if full:
        failing = f"agent@{promoted + 1}"
        vllm.refuse_listing.add(failing)  # loads "fine" but is never listed: the gate's canary start fails
        story.versions["canary"] = report_round(gateway, {"losses/loss": 0.55, "reward/mean": 0.8})
        wait_for(lambda: status(gateway)["jobs"]["gate"]["status"] == "failed", what="a failed gate run")
        vllm.refuse_listing.discard(failing)
        wait_for(lambda: status(gateway)["canary"], what="version 3 on canary")
    return story
