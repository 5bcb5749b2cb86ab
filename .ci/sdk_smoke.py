"""The SDK alone (``pip install flywheel-rl``, no extras) against a stand-in gateway on loopback.

Run by ``.ci/run`` in a venv of its own, once beside openai 2.x and once beside openai 3.x. It
checks what an agent's environment relies on: ``import flywheel`` loads no server or ML package;
a scope's calls through sync and async clients (shared by concurrent rollouts) carry their own
trajectory id and the scope is closed at exit; feedback; the admin client; ART's rollout shape
with ``model.openai_client()``; the server-only features and the ``flywheel`` command say which
extra to install, in one line.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import openai

import flywheel

SERVER_PACKAGES = {"torch", "transformers", "fastapi", "uvicorn", "duckdb", "sqlmodel", "litellm"}
SERVER_PARTS = {"flywheel.gateway", "flywheel.capture", "flywheel.judge", "flywheel.trainer"}
loaded = (SERVER_PACKAGES & {name.split(".")[0] for name in sys.modules}) | (
    SERVER_PARTS & {".".join(name.split(".")[:2]) for name in sys.modules})
assert not loaded, f"import flywheel loaded {sorted(loaded)}"

seen: list[tuple[str, str, dict[str, str], Any]] = []  # method, path, flywheel headers, body


class StandIn(BaseHTTPRequestHandler):
    """Answers the few routes the SDK calls, in the gateway's shapes, and records every request."""

    def log_message(self, *args: Any) -> None:
        pass

    def _answer(self, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _record(self) -> Any:
        length = int(self.headers.get("content-length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        tags = {k.lower(): v for k, v in self.headers.items() if k.lower().startswith("x-flywheel-")}
        seen.append((self.command, self.path, tags, body))
        return body

    def do_GET(self) -> None:
        self._record()
        self._answer({"data": [{"alias": "agent", "version": 0}]})

    def do_POST(self) -> None:
        body = self._record()
        if self.path == "/v1/chat/completions":
            self._answer({"id": f"chatcmpl-{len(seen)}", "object": "chat.completion", "created": 1,
                          "model": body["model"], "choices": [{"index": 0, "finish_reason": "stop", "logprobs": None,
                                                               "message": {"role": "assistant", "content": "ok"}}],
                          "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})
        else:
            self._answer({"id": "fb_1", "trajectory_id": "traj_x", "reward": 1.0})


server = ThreadingHTTPServer(("127.0.0.1", 0), StandIn)
threading.Thread(target=server.serve_forever, daemon=True).start()
url = f"http://127.0.0.1:{server.server_address[1]}"
ask = [{"role": "user", "content": "hi"}]

client = openai.OpenAI(base_url=f"{url}/v1", api_key="sk-smoke", max_retries=0)
with flywheel.trajectory(client, group_id="g1") as scope:
    client.chat.completions.create(model="agent", messages=ask)
    scope.reward = 1.0
chat = [s for s in seen if s[1] == "/v1/chat/completions"]
assert chat[-1][2] == {"x-flywheel-trajectory-id": scope.id, "x-flywheel-group-id": "g1"}, chat[-1]
assert seen[-1][1] == "/flywheel/v1/feedback" and seen[-1][3]["trajectory_id"] == scope.id, seen[-1]
flywheel.feedback(client, completion_id="chatcmpl-1", label="good")
assert seen[-1][3] == {"completion_id": "chatcmpl-1", "label": "good"}, seen[-1]


async def concurrent_scopes() -> None:
    shared = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="sk-smoke", max_retries=0)

    async def one() -> str:
        async with flywheel.trajectory(shared) as scope:
            await shared.chat.completions.create(model="agent", messages=ask)
            await asyncio.sleep(0)
            await shared.chat.completions.create(model="agent", messages=ask)
        return scope.id

    ids = await asyncio.gather(one(), one())
    tagged = [s[2].get("x-flywheel-trajectory-id") for s in seen if s[1] == "/v1/chat/completions"][-4:]
    assert sorted(tagged) == sorted(ids * 2), (tagged, ids)
    closed = [s[1] for s in seen if s[1].endswith("/close")]
    assert sorted(closed) == sorted(f"/flywheel/v1/trajectories/{i}/close" for i in ids), closed


async def art_rollouts() -> None:
    backend = flywheel.Gateway(url, admin_key="admin-smoke")
    model = flywheel.TrainableModel(name="agent", project="smoke", base_model="any")
    await model.register(backend)

    async def rollout() -> flywheel.Trajectory:
        trajectory = flywheel.Trajectory(messages_and_choices=list(ask), reward=0)
        completion = await model.openai_client().chat.completions.create(model=model.name,
                                                                          messages=trajectory.messages())
        trajectory.messages_and_choices.append(completion.choices[0])
        return trajectory

    groups = await flywheel.gather_trajectory_groups([flywheel.TrajectoryGroup(rollout() for _ in range(2))])
    ids = {t.id for t in groups[0]}
    tagged = {s[2].get("x-flywheel-trajectory-id") for s in seen if s[1] == "/v1/chat/completions"}
    assert len(ids) == 2 and ids <= tagged, (ids, tagged)
    assert groups[0].trajectories[0].messages()[-1] == {"role": "assistant", "content": "ok"}
    await backend.close()


asyncio.run(concurrent_scopes())
asyncio.run(art_rollouts())

try:
    asyncio.run(flywheel.rewards.ruler_score_group(flywheel.TrajectoryGroup([]), "openai/o3"))
    raise AssertionError("RULER ran without the judge installed")
except flywheel.MissingExtraError as exc:
    assert "flywheel-rl[gateway]" in str(exc), exc

command = Path(sys.executable).with_name("flywheel")
done = subprocess.run([str(command), "serve"], capture_output=True, text=True, timeout=60)
assert done.returncode == 2 and done.stdout == "", done
assert done.stderr.count("\n") == 1 and "pip install 'flywheel-rl[gateway]'" in done.stderr, done.stderr
server.shutdown()
print(f"SDK smoke test passed with openai {openai.__version__}")
