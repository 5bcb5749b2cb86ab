"""Hot swaps under concurrent streaming load on the local engine: nothing fails, nothing mixes.

Two LoRA adapters taught different answers to one question alternate as the alias's version
(each switch registers a new version: ``alias@1``, ``alias@2``, ...) while eight clients stream
that question without pause. Every stream must end normally with exactly the text of one
version (greedy decoding: each version has one answer), and the turn the store captured for it
must record that same version.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import httpx
import openai
from sqlmodel import select

from flywheel.capture.models import Turn
from flywheel.capture.store import Store
from tests.conftest import ADAPTER_ANSWER, ADAPTER_QUESTION
from tests.gateway_process import GatewayProcess
from tests.waiting import wait_for

ADMIN = {"authorization": "Bearer admin"}
SWAPS = 10
OTHER_ANSWER = "The second adapter speaks."


def test_swaps_under_streaming_load_fail_nothing_and_mix_nothing(agent_model: Path, adapter_dir: Path,
                                                        tmp_path: Path) -> None:
    from tests.support import memorize

    other = memorize(agent_model, tmp_path / "other", [(ADAPTER_QUESTION, OTHER_ANSWER)], lora=True)
    gateway = GatewayProcess(tmp_path, f"""
adapter_dirs = ["{adapter_dir.parent}", "{other.parent}"]  # where the test's adapters were built
[engines.local]
model = "{agent_model}"
[aliases.agent]
engine = "local"
[auth]
admin_key = "admin"
""").start()
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
    texts: list[str] = []
    failures: list[str] = []
    stop = threading.Event()

    def stream_forever() -> None:
        while not stop.is_set():
            try:
                chunks = client.chat.completions.create(model="agent", messages=ADAPTER_QUESTION, stream=True,
                                                        temperature=0, max_tokens=16)
                texts.append("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
            except Exception as exc:  # any failure at all is what this test counts
                failures.append(repr(exc))

    def switch(path: Path | None) -> dict[str, Any]:
        response = httpx.put(f"{gateway.url}/flywheel/v1/aliases/agent/adapter", headers=ADMIN, timeout=120,
                             json={"path": str(path) if path else None})
        assert response.status_code == 200, response.text
        result: dict[str, Any] = response.json()
        return result

    def streams_on_current_version(count: int) -> None:
        finished = len(texts)
        wait_for(lambda: len(texts) >= finished + count or failures, what=f"{count} more finished streams")

    base_text = client.chat.completions.create(model="agent", messages=ADAPTER_QUESTION, temperature=0,
                                               max_tokens=16).choices[0].message.content
    expected = {0: base_text}
    workers = [threading.Thread(target=stream_forever) for _ in range(8)]
    for worker in workers:
        worker.start()
    try:
        for swap in range(SWAPS):
            streams_on_current_version(2)  # before the next switch
            path = adapter_dir if swap % 2 == 0 else other
            served = switch(path)
            expected[served["version"]] = ADAPTER_ANSWER if path == adapter_dir else OTHER_ANSWER
        switch(None)  # and back to the base model, version 0
        streams_on_current_version(2)
    finally:
        stop.set()
        for worker in workers:
            worker.join(timeout=120)
    assert not failures, failures[:3]
    assert len(texts) >= SWAPS, len(texts)
    assert set(texts) <= set(expected.values()), set(texts) - set(expected.values())
    assert {ADAPTER_ANSWER, OTHER_ANSWER} <= set(texts)
    versions = httpx.get(f"{gateway.url}/flywheel/v1/aliases/agent/versions", headers=ADMIN).json()["data"]
    assert [v["version"] for v in versions] == list(range(1, SWAPS + 1))  # one new number per switch
    gateway.stop()
    store = Store(gateway.dir / "data" / "flywheel.duckdb")
    try:
        with store.session() as session:
            turns = [t for t in session.exec(select(Turn)) if t.request_messages == ADAPTER_QUESTION]
    finally:
        store.close()
    captured = [(t.adapter_version, (t.response_message or {}).get("content")) for t in turns]
    assert len(captured) >= len(texts)
    mismatched = [(v, text) for v, text in captured if expected[v] != text]
    assert not mismatched, mismatched[:5]  # each turn served, start to end, by the version it records
