"""Capture through a real gateway: unmodified clients become linked trajectories in DuckDB.

The engine is the upstream engine pointed at a scripted OpenAI-compatible server, so
replies (tool calls included) are known. The store is read from the DuckDB file after
the gateway stopped (one process per file) — which also proves shutdown drains.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import pytest
from sqlmodel import col, select

from flywheel.capture.models import Trajectory, Turn
from flywheel.capture.store import Store
from tests.gateway_process import GatewayProcess
from tests.scripted_openai import Reply, ScriptedOpenAI
from tests.waiting import wait_for

SYSTEM = {"role": "system", "content": "You are a helpful travel agent."}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


def agent_reply(body: dict[str, Any]) -> Reply:
    """Weather questions get a tool call, tool results an answer, anything else an echo."""
    last = body["messages"][-1]
    if last["role"] == "tool":
        return Reply(content=f"It is {json.loads(last['content'])['sky']} there.")
    text = last["content"] if isinstance(last["content"], str) else "".join(p["text"] for p in last["content"])
    if "weather in" in text:
        city = text.rsplit("weather in ", 1)[1].rstrip("?")
        call = {"id": f"call_{city}", "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}
        return Reply(content=None, tool_calls=[call], finish_reason="tool_calls")
    return Reply(content=f"echo {text}")


@pytest.fixture
def upstream() -> Iterator[ScriptedOpenAI]:
    with ScriptedOpenAI(reply=agent_reply) as server:
        yield server


def start_gateway(tmp: Path, upstream: ScriptedOpenAI, extra: str = "", name: str = "gateway") -> GatewayProcess:
    return GatewayProcess(tmp, f"""
[engines.up]
base_url = "{upstream.base_url}"
[aliases.agent]
engine = "up"
base_model = "scripted"
{extra}
""", name=name).start()


def stored(gateway: GatewayProcess, database: Path | None = None) -> tuple[list[Trajectory], list[Turn]]:
    """Everything in the gateway's store, read from the file once the gateway is stopped."""
    gateway.stop()
    store = Store(database or gateway.dir / "data" / "flywheel.duckdb")
    try:
        with store.session() as session:
            trajectories = list(session.exec(select(Trajectory).order_by(col(Trajectory.created_at))))
            turns = list(session.exec(select(Turn).order_by(col(Turn.created_at), col(Turn.depth))))
        return trajectories, turns
    finally:
        store.close()


def run_agent(client: openai.OpenAI, city: str, *, stream: bool) -> list[str]:
    """A tool-using agent loop with the plain openai client; returns the completion ids it saw."""
    messages: list[Any] = [SYSTEM, {"role": "user", "content": f"What is the weather in {city}?"}]
    ids = []
    for _ in range(3):
        if stream:
            chunks = list(client.chat.completions.create(model="gpt-4o", messages=messages, tools=TOOLS,
                                                         stream=True))
            ids.append(chunks[0].id)
            content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
            message: dict[str, Any] = {"role": "assistant", "content": content or None}
            if calls:
                message["tool_calls"] = [{"id": tc.id, "type": "function", "function": {
                    "name": tc.function.name, "arguments": tc.function.arguments}} for tc in calls]
        else:
            reply = client.chat.completions.create(model="gpt-4o", messages=messages, tools=TOOLS)
            ids.append(reply.id)
            message = reply.choices[0].message.model_dump(exclude_none=True)
        messages.append(message)
        if message.get("tool_calls"):
            call = message["tool_calls"][0]
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": json.dumps({"sky": "sunny"})})
        else:
            messages.append({"role": "user", "content": f"Thanks! And tomorrow in {city}?"})
    return ids


@pytest.mark.parametrize("stream", [False, True])
def test_agent_loop_becomes_one_trajectory(tmp_path: Path, upstream: ScriptedOpenAI, stream: bool) -> None:
    gateway = start_gateway(tmp_path, upstream)
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
    seen = {city: run_agent(client, city, stream=stream) for city in ("Paris", "Oslo")}
    trajectories, turns = stored(gateway)
    assert len(trajectories) == 2
    for trajectory in trajectories:
        mine = sorted((t for t in turns if t.trajectory_id == trajectory.id), key=lambda t: t.depth)
        assert [t.depth for t in mine] == [0, 1, 2] and trajectory.turn_count == 3
        assert trajectory.branch_count == 1
        city = mine[0].request_messages[-1]["content"].rsplit(" ", 1)[1].rstrip("?")  # type: ignore[index]
        assert [t.completion_id for t in mine] == seen[city]  # every turn, in order, of one conversation
        assert mine[0].finish_reason == "tool_calls"
        call = mine[0].response_message["tool_calls"][0]  # type: ignore[index]
        assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {
            "city": city}
        assert mine[1].response_message["content"] == "It is sunny there."  # type: ignore[index]
        assert mine[1].parent_turn_id == mine[0].id and mine[2].parent_turn_id == mine[1].id
        assert mine[0].prompt_token_ids == [7, 7, 7, 7, 7]  # the exact ids the engine returned
        assert mine[0].completion_token_ids is not None


async def test_fifty_concurrent_conversations_never_cross_link(tmp_path: Path, upstream: ScriptedOpenAI) -> None:
    gateway = await asyncio.to_thread(start_gateway, tmp_path, upstream)
    client = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)

    async def conversation(index: int) -> list[str]:
        # Half the conversations open with word-for-word the same question (and get the same reply).
        opening = "Hello there" if index % 2 else f"Hello from traveller {index}"
        messages: list[Any] = [SYSTEM, {"role": "user", "content": opening}]
        ids = []
        for turn in range(3):
            await asyncio.sleep(0.001 * ((index * 7 + turn) % 5))  # interleave the turns
            reply = await client.chat.completions.create(model="gpt-4o", messages=messages)
            ids.append(reply.id)
            messages += [reply.choices[0].message.model_dump(exclude_none=True),
                         {"role": "user", "content": f"traveller {index} turn {turn}"}]
        return ids

    await asyncio.gather(*(conversation(i) for i in range(50)))
    trajectories, turns = await asyncio.to_thread(stored, gateway)
    assert len(trajectories) == 50
    assert all(t.turn_count == 3 and t.branch_count == 1 for t in trajectories)
    for trajectory in trajectories:
        mine = sorted((t for t in turns if t.trajectory_id == trajectory.id), key=lambda t: t.depth)
        assert [t.depth for t in mine] == [0, 1, 2]
        owners = {m["content"].split(" turn ")[0] for t in mine[1:]  # type: ignore[union-attr]
                  for m in t.request_messages[2:] if m["role"] == "user"}  # type: ignore[index]
        assert len(owners) == 1  # every later turn comes from the same traveller


def test_reserialized_history_still_links(tmp_path: Path, upstream: ScriptedOpenAI) -> None:
    gateway = start_gateway(tmp_path, upstream)
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
    first = client.chat.completions.create(model="gpt-4o", tools=TOOLS, messages=[
        SYSTEM, {"role": "user", "content": "What is the weather in Rome?"}])
    call = first.choices[0].message.tool_calls[0]  # type: ignore[index]
    # Another client library's rendering of the same history: parts, reordered/spaced JSON, nulls.
    history: list[Any] = [
        {"role": "system", "content": [{"type": "text", "text": SYSTEM["content"]}], "name": None},
        {"role": "user", "content": [{"type": "text", "text": "What is the weather "},
                                     {"type": "text", "text": "in Rome?"}]},
        {"role": "assistant", "content": None, "refusal": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": "get_weather",
                                                             "arguments": '{ "city" :  "Rome" }'}}]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "grey"}'},
    ]
    client.chat.completions.create(model="gpt-4o", tools=TOOLS, messages=history)
    trajectories, turns = stored(gateway)
    assert len(trajectories) == 1 and [t.depth for t in turns] == [0, 1]


def test_rewind_branches_and_explicit_ids_win(tmp_path: Path, upstream: ScriptedOpenAI) -> None:
    gateway = start_gateway(tmp_path, upstream)
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
    opening: list[Any] = [SYSTEM, {"role": "user", "content": "plan a trip"}]
    first = client.chat.completions.create(model="gpt-4o", messages=opening)
    said = first.choices[0].message.model_dump(exclude_none=True)
    client.chat.completions.create(model="gpt-4o", messages=[*opening, said, {"role": "user", "content": "to Rome"}])
    # The user rewinds: same history up to the first answer, a different follow-up.
    client.chat.completions.create(model="gpt-4o", messages=[*opening, said, {"role": "user", "content": "to Oslo"}])
    # Explicit ids bind unrelated-looking requests together, by header and by metadata.
    client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "a"}],
                                   extra_headers={"X-Flywheel-Trajectory-Id": "my-run-1"})
    client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "b"}],
                                   metadata={"trajectory_id": "my-run-1"})
    trajectories, turns = stored(gateway)
    by_id = {t.id: t for t in trajectories}
    assert by_id["my-run-1"].explicit and by_id["my-run-1"].turn_count == 2
    branched = next(t for t in trajectories if t.id != "my-run-1")
    assert branched.turn_count == 3 and branched.branch_count == 2
    root = next(t for t in turns if t.trajectory_id == branched.id and t.depth == 0)
    children = [t for t in turns if t.parent_turn_id == root.id]
    assert len(children) == 2  # two branches share the first turn


def test_opt_out_sampling_and_redaction(tmp_path: Path, upstream: ScriptedOpenAI) -> None:
    gateway = start_gateway(tmp_path, upstream, """
[capture.redaction]
patterns = ["SECRET-[0-9]+"]
""")
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
    private = "mail ann@example.com or call +1 (555) 123-4567, key sk-abcdefghijklmnopqrstuv, code SECRET-42"
    reply = client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": private}])
    assert reply.choices[0].message.content == f"echo {private}"  # the client gets the original text
    client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "do not keep me"}],
                                   extra_headers={"X-Flywheel-Capture": "off"})
    _, turns = stored(gateway)
    assert len(turns) == 1
    kept = json.dumps([turns[0].request_messages, turns[0].response_message])
    for secret in ("ann@example.com", "555", "sk-abc", "SECRET-42"):
        assert secret not in kept
    for label in ("EMAIL", "PHONE", "API_KEY", "CUSTOM_0"):
        assert f"[REDACTED:{label}]" in kept
    assert turns[0].redacted and turns[0].prompt_token_ids is None and turns[0].completion_token_ids is None


def test_capture_off_by_config_on_by_header(tmp_path: Path, upstream: ScriptedOpenAI) -> None:
    gateway = start_gateway(tmp_path, upstream, "[capture]\nenabled = false\n")
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
    client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "skip"}])
    client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "keep"}],
                                   extra_headers={"X-Flywheel-Capture": "on"})
    _, turns = stored(gateway)
    assert [t.request_messages[0]["content"] for t in turns] == ["keep"]  # type: ignore[index]


def capture_counts(gateway: GatewayProcess) -> dict[str, float]:
    counts = {}
    for line in httpx.get(f"{gateway.url}/metrics").text.splitlines():
        if line.startswith("flywheel_capture_turns_total{"):
            counts[line.split('"')[1]] = float(line.rsplit(" ", 1)[1])
    return counts


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs: filling it makes the store unwritable for real (disk full)."""
    mountpoint = tmp_path / "small-disk"
    mountpoint.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mountpoint)], check=True)
    try:
        yield mountpoint
    finally:
        subprocess.run(["umount", "-l", str(mountpoint)], check=False)


def fill(path: Path) -> None:
    with path.open("wb") as filler:
        try:
            while True:
                filler.write(b"\0" * 65536)
                filler.flush()
        except OSError:
            pass


def test_unwritable_store_spools_then_reingests(tmp_path: Path, upstream: ScriptedOpenAI, small_disk: Path) -> None:
    database = small_disk / "store.duckdb"
    gateway = start_gateway(tmp_path, upstream, f'[capture]\ndatabase = "{database}"\nretry_s = 0.3\n')
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
    ask = lambda i: client.chat.completions.create(  # noqa: E731
        model="gpt-4o", messages=[{"role": "user", "content": f"request {i} " + "x" * 2000}])
    for i in range(5):
        ask(i)
    wait_for(lambda: capture_counts(gateway)["written"] >= 5)
    fill(small_disk / "filler")
    for i in range(5, 25):
        assert ask(i).choices[0].message.content  # every client request still succeeds
    wait_for(lambda: capture_counts(gateway)["spooled"] >= 1)
    (small_disk / "filler").unlink()
    wait_for(lambda: capture_counts(gateway)["written"] + capture_counts(gateway)["reingested"] >= 25)
    _, turns = stored(gateway, database)
    assert sorted(int(t.request_messages[0]["content"].split()[1]) for t in turns) == list(range(25))  # type: ignore


def test_gateway_sigkill_loses_nothing_handed_over(tmp_path: Path, upstream: ScriptedOpenAI) -> None:
    """The window for a killed gateway: an exchange is on the store socket one loop iteration after its
    last byte; from there the store process reads the socket to its end, writes, and exits."""
    gateway = start_gateway(tmp_path, upstream, "[capture]\nbatch_wait_s = 5.0\n")
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
    for i in range(20):
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": f"n{i}"}])
    wait_for(lambda: capture_counts(gateway).get("queued", 0) >= 20)  # handed over, not yet written
    assert gateway.proc is not None
    gateway.proc.send_signal(signal.SIGKILL)  # the store process still holds the 20 turns in an open batch
    gateway.proc.wait(timeout=10)
    _, turns = stored(gateway)  # waits for the store process, which notices its gateway is gone
    assert sorted(t.request_messages[0]["content"] for t in turns) == sorted(f"n{i}" for i in range(20))  # type: ignore


def test_ctrl_c_stops_the_gateway_and_its_store_process_writes_what_it_holds(tmp_path: Path,
                                                                              upstream: ScriptedOpenAI) -> None:
    """SIGINT (Ctrl-C) stops the gateway, exit status 0; its SIGTERM reaches the store process's server while it
    waits between its once-a-second looks (``storeproc/quiet_server.py``), which writes the open batch first."""
    gateway = start_gateway(tmp_path, upstream, "[capture]\nbatch_wait_s = 5.0\n")
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
    for i in range(5):
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": f"c{i}"}])
    wait_for(lambda: capture_counts(gateway).get("queued", 0) >= 5)  # in the open batch, not written
    assert gateway.proc is not None
    gateway.proc.send_signal(signal.SIGINT)
    assert gateway.proc.wait(timeout=30) == 0
    _, turns = stored(gateway)
    assert sorted(t.request_messages[0]["content"] for t in turns) == [f"c{i}" for i in range(5)]  # type: ignore


def test_a_killed_store_process_is_restarted_and_fails_no_client(tmp_path: Path, upstream: ScriptedOpenAI) -> None:
    """The gateway restarts a killed store process, and what is answered meanwhile goes to the spool and then
    to the store."""
    gateway = start_gateway(tmp_path, upstream, "[capture]\nbatch_wait_s = 0.05\nretry_s = 0.3\n")
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
    ask = lambda i: client.chat.completions.create(  # noqa: E731
        model="gpt-4o", messages=[{"role": "user", "content": f"n{i}"}])
    for i in range(20):
        ask(i)
    wait_for(lambda: capture_counts(gateway).get("written", 0) >= 20)
    victim = gateway.store_process
    victim.kill()
    victim.wait(timeout=10)
    for i in range(20, 30):
        assert ask(i).choices[0].message.content  # clients never notice
    wait_for(lambda: httpx.get(f"{gateway.url}/healthz").json()["store"] == "ok")
    gateway.children = psutil.Process(gateway.proc.pid).children()  # the new store process
    wait_for(lambda: capture_counts(gateway)["reingested"] + capture_counts(gateway)["written"] >= 10)
    _, turns = stored(gateway)
    assert sorted(t.request_messages[0]["content"] for t in turns) == sorted(f"n{i}" for i in range(30))  # type: ignore


def test_store_process_sigkill_under_load_stores_every_turn_once(tmp_path: Path, upstream: ScriptedOpenAI) -> None:
    """Killed with a batch open (read from its socket, not yet written) under concurrent load, half of it streamed,
    the store process loses no turn: the gateway spools what it had not acknowledged, and re-ingesting skips
    what the dead process had committed after all, so no turn is stored twice."""
    gateway = start_gateway(tmp_path, upstream, "[capture]\nretry_s = 0.3\n")  # batch_wait_s: 1 s, a wide window
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
    total, answered = 400, Counter[str]()

    def ask(i: int) -> None:
        messages: list[Any] = [{"role": "user", "content": f"n{i}"}]
        if i % 2:
            chunks = client.chat.completions.create(model="gpt-4o", messages=messages, stream=True)
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == f"echo n{i}"
        else:
            assert client.chat.completions.create(model="gpt-4o", messages=messages).choices[0].message.content
        answered[f"n{i}"] += 1

    with ThreadPoolExecutor(16) as pool:
        requests = [pool.submit(ask, i) for i in range(total)]
        wait_for(lambda: len(answered) >= total // 4, "a quarter of the requests answered")
        wait_for(lambda: (counts := capture_counts(gateway))["queued"] > counts.get("written", 0) + 50,
                 "turns read by the store process and not yet written")
        gateway.store_process.kill()
        for request in requests:
            request.result()  # no client notices
    wait_for(lambda: httpx.get(f"{gateway.url}/healthz").json()["store"] == "ok", "the store process back")
    gateway.children = psutil.Process(gateway.proc.pid).children()  # type: ignore[union-attr]  # the new one
    spool = gateway.dir / "data" / "spool" / "turns.jsonl"
    wait_for(lambda: not (spool.exists() and spool.stat().st_size) and not list(spool.parent.glob("*.ingesting-*")),
             "the spool re-ingested", timeout_s=30)
    _, turns = stored(gateway)
    assert Counter(t.request_messages[0]["content"] for t in turns) == answered  # type: ignore[index]


def test_sigterm_drains_the_queue(tmp_path: Path, upstream: ScriptedOpenAI) -> None:
    gateway = start_gateway(tmp_path, upstream, "[capture]\nbatch_wait_s = 5.0\nbatch_size = 1000\n")
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
    for i in range(10):
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": f"t{i}"}])
    _, turns = stored(gateway)  # stop() sends SIGTERM right away: the batch was still open
    assert len(turns) == 10


def test_idle_trajectories_close(tmp_path: Path, upstream: ScriptedOpenAI) -> None:
    gateway = start_gateway(tmp_path, upstream, "[capture]\nidle_close_s = 1.0\n")
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
    client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "bye"}])
    wait_for(lambda: httpx.get(f"{gateway.url}/flywheel/v1/trajectories", params={"status": "closed"},
                                 timeout=10).json()["data"])
    trajectories, _ = stored(gateway)
    assert [(t.status, t.close_reason) for t in trajectories] == [("closed", "idle")]
