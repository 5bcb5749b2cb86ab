"""Faults not covered elsewhere: a slow judge, a full disk under the data directory, an upstream that resets a
stream mid-way. Client requests keep succeeding through each, and what was stored stays whole.

Covered elsewhere: a judge that is down, a killed training child, a stop mid-round and a restart
mid-canary (tests/test_loop_faults.py); an unwritable store file, a killed gateway and a killed
store process (tests/test_capture.py); a broken stream as the client sees it (tests/test_upstream.py).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.gateway_process import GatewayProcess
from tests.scripted_judge import ScriptedJudge
from tests.scripted_openai import Reply, ScriptedOpenAI
from tests.test_capture import capture_counts, fill, stored
from tests.waiting import wait_for

ADMIN = {"authorization": "Bearer admin"}


def ask(client: openai.OpenAI, text: str) -> str:
    reply = client.chat.completions.create(model="m", messages=[{"role": "user", "content": text}])
    return reply.choices[0].message.content or ""


def test_a_slow_judge_slows_no_client_and_its_group_is_scored_once_it_answers(tmp_path: Path) -> None:
    with ScriptedOpenAI(reply=lambda body: Reply(content="an answer")) as upstream, \
            ScriptedJudge(faults=["slow", "slow"], slow_s=30.0) as judge:
        gateway = GatewayProcess(tmp_path, f"""
[engines.up]
base_url = "{upstream.base_url}"
[aliases.agent]
engine = "up"
[auth]
admin_key = "admin"
[capture]
idle_close_s = 1
[groups]
form_every_s = 0.5
min_size = 2
[judge]
model = "openai/judge"
api_base = "{judge.base_url}"
api_key = "unused"
max_retries = 0
timeout_s = 2
[loop]
score_every_s = 0.5
min_groups = 1000
[loop.gate]
holdout_fraction = 0.0  # both conversations must form the group
""").start()
        try:
            client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
            for _ in range(2):  # the same task twice, no feedback: only the judge can score it
                ask(client, "same task")
            wait_for(lambda: judge.in_flight, timeout_s=240, what="a scoring call waiting on the judge")
            assert [ask(client, f"meanwhile {i}") for i in range(10)] == ["an answer"] * 10
            assert judge.in_flight  # all ten were answered while the judge still held its slow answer
            # The first call gave up (timeout_s = 2) while the judge still held its answer: a later run calls again.
            # (The status shows only the latest run of a job, and a failed one for half a second: not waited on.)
            wait_for(lambda: judge.max_in_flight >= 2, timeout_s=120,
                     what="a scoring run that gave up on the slow judge, and the next one calling it again")
            # Two equal answers score equally: the judged group is settled as untrainable (judge/scoring.py).
            wait_for(lambda: status_of(gateway)["pending"]["groups"].get("untrainable"), timeout_s=120,
                     what="the group scored once the judge answers in time")
            assert len(judge.requests) >= 3  # two timed out, then one answered
        finally:
            gateway.stop()


def status_of(gateway: GatewayProcess) -> dict[str, Any]:
    response = httpx.get(f"{gateway.url}/flywheel/v1/status", headers=ADMIN, timeout=60)
    return response.json()["aliases"][0] if response.status_code == 200 else {"jobs": {}, "pending": {"groups": {}}}


@pytest.fixture
def small_data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The data directory on a 16 MiB tmpfs of its own: filling it fills the store's and the spool's disk."""
    mountpoint = tmp_path / "data-disk"
    mountpoint.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mountpoint)], check=True)
    monkeypatch.setenv("FLYWHEEL_DATA_DIR", str(mountpoint))  # the environment beats GatewayProcess's file
    try:
        yield mountpoint
    finally:
        subprocess.run(["umount", "-l", str(mountpoint)], check=False)


def test_a_full_data_disk_fails_no_client_and_capture_resumes_when_space_returns(tmp_path: Path,
                                                                                small_data_dir: Path) -> None:
    with ScriptedOpenAI(reply=lambda body: Reply(content="fine")) as upstream:
        gateway = GatewayProcess(tmp_path, f"""
[engines.up]
base_url = "{upstream.base_url}"
[aliases.agent]
engine = "up"
[capture]
retry_s = 0.3
batch_wait_s = 0.1
""").start()
        try:
            client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
            assert [ask(client, f"before {i}") for i in range(5)] == ["fine"] * 5
            wait_for(lambda: capture_counts(gateway)["written"] >= 5)
            fill(small_data_dir / "filler")
            assert [ask(client, f"full {i} " + "x" * 4000) for i in range(20)] == ["fine"] * 20
            # neither the store nor the spool took them
            wait_for(lambda: capture_counts(gateway)["failed"] >= 1, timeout_s=60)
            assert httpx.get(f"{gateway.url}/healthz").status_code == 200
            (small_data_dir / "filler").unlink()
            assert [ask(client, f"after {i}") for i in range(5)] == ["fine"] * 5
            wait_for(lambda: capture_counts(gateway)["written"] + capture_counts(gateway)["reingested"] >= 10,
                       timeout_s=60)
            _, turns = stored(gateway, small_data_dir / "flywheel.duckdb")  # the file opens and reads after it all
        finally:
            gateway.stop()  # before the fixture unmounts the data directory (stored() stopped it already)
    texts = [t.request_messages[0]["content"] for t in turns]  # type: ignore[index]
    assert {f"before {i}" for i in range(5)} | {f"after {i}" for i in range(5)} <= set(texts)
    assert len(texts) == len(set(texts))  # nothing stored twice


def test_a_stream_the_upstream_resets_fails_that_request_only(tmp_path: Path) -> None:
    def reply(body: dict[str, Any]) -> Reply:
        text = json.dumps(body["messages"])
        return Reply(content="one two three four", break_after_chunks=2 if "break" in text else None)

    with ScriptedOpenAI(reply=reply) as upstream:
        gateway = GatewayProcess(tmp_path, f"""
[engines.up]
base_url = "{upstream.base_url}"
[aliases.agent]
engine = "up"
""").start()
        try:
            client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
            with pytest.raises(openai.APIError):
                list(client.chat.completions.create(model="m", messages=[{"role": "user", "content": "break"}],
                                                    stream=True))
            streamed = ["".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": f"stream {i}"}], stream=True) if c.choices)
                for i in range(3)]
            assert streamed == ["one two three four"] * 3
            assert [ask(client, f"plain {i}") for i in range(3)] == ["one two three four"] * 3
            _, turns = stored(gateway)
        finally:
            gateway.stop()
    by_text = {t.request_messages[0]["content"]: t for t in turns}  # type: ignore[index]
    assert {f"stream {i}" for i in range(3)} | {f"plain {i}" for i in range(3)} <= set(by_text)
    broken = by_text.get("break")
    assert broken is None or broken.finish_reason not in ("stop", "length", "tool_calls")  # never a whole answer

