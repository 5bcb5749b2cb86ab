"""A client that leaves mid-stream: its turn is recorded as truncated, counted apart, and its generation stops.

Both engines: the local engine directly, and the upstream engine relaying to it (``relay_gateway``), where
the relay must close its upstream request so that the gateway behind it sees its client leave too.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

import httpx
import pytest

from tests.conftest import CLIENT_KEY
from tests.gateway_process import GatewayProcess
from tests.waiting import wait_for

T = TypeVar("T")
AUTH = {"authorization": f"Bearer {CLIENT_KEY}"}
LONG = {"messages": [{"role": "user", "content": "Tell me a long story"}], "max_tokens": 1500, "ignore_eos": True,
        "stream": True}


def requests_counted(gateway: GatewayProcess, status: str) -> float:
    """``flywheel_requests_total`` summed over endpoints and aliases, for one status label."""
    total = 0.0
    for line in httpx.get(f"{gateway.url}/metrics").text.splitlines():
        if line.startswith("flywheel_requests_total{") and f'status="{status}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def leave_after_first_content(gateway: GatewayProcess, model: str) -> str:
    """Start a long stream, read up to its first piece of content, hang up; the completion id."""
    with httpx.stream("POST", f"{gateway.url}/v1/chat/completions", json={**LONG, "model": model}, headers=AUTH,
                      timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            payload = json.loads(line[len("data: "):]) if line.startswith("data: {") else {}
            if payload.get("choices") and payload["choices"][0]["delta"].get("content"):
                return str(payload["id"])
    raise AssertionError("the stream ended before any content")


def stored_completion(gateway: GatewayProcess, completion_id: str) -> dict[str, Any]:
    def probe() -> dict[str, Any] | None:
        response = httpx.get(f"{gateway.url}/v1/chat/completions/{completion_id}", headers=AUTH, timeout=30)
        return response.json() if response.status_code == 200 else None
    return wait_for(probe, f"the stored completion {completion_id}")


def assert_cut_short(choice: dict[str, Any]) -> None:
    """OpenAI's words for an answer without its end, and Flywheel's reason beside them."""
    assert choice["finish_reason"] == "length"
    assert choice["flywheel"] == {"finish_reason": "client_disconnected"}


def local_engine(gateway: GatewayProcess) -> dict[str, Any]:
    return dict(httpx.get(f"{gateway.url}/healthz", timeout=60).json()["engines"]["local"])


def wait_until_idle(local_gateway: GatewayProcess) -> None:
    """No job left running by an earlier test: what follows counts on the worker's ring being empty."""
    wait_for(lambda: local_engine(local_gateway)["running_jobs"] == 0, "an idle local engine", timeout_s=120)


def assert_worker_idle_after_a_short_request(local_gateway: GatewayProcess) -> None:
    """The worker steps jobs round-robin: had the abandoned job (1500 tokens) not been dropped, it would still
    be running when a 20-token request that started after the disconnect was noticed has finished."""
    short = {"model": "gpt-4o", "messages": LONG["messages"], "max_tokens": 20, "ignore_eos": True}
    answered = httpx.post(f"{local_gateway.url}/v1/chat/completions", json=short, headers=AUTH, timeout=60)
    assert answered.status_code == 200
    engine = local_engine(local_gateway)
    assert engine["running_jobs"] == 0 and engine["active_requests"] == 0


def test_local_engine_disconnect(local_gateway: GatewayProcess) -> None:
    wait_until_idle(local_gateway)
    before = requests_counted(local_gateway, "499")
    completion_id = leave_after_first_content(local_gateway, "gpt-4o")
    wait_for(lambda: requests_counted(local_gateway, "499") == before + 1, "the disconnect counted as 499")
    assert_worker_idle_after_a_short_request(local_gateway)
    stored = stored_completion(local_gateway, completion_id)
    assert_cut_short(stored["choices"][0])
    assert stored["choices"][0]["message"]["content"]  # what was produced before the client left is kept
    assert 0 < stored["usage"]["completion_tokens"] < 1500


def test_upstream_engine_disconnect_closes_the_upstream_request(relay_gateway: GatewayProcess,
                                                                local_gateway: GatewayProcess) -> None:
    wait_until_idle(local_gateway)
    relay_before, upstream_before = requests_counted(relay_gateway, "499"), requests_counted(local_gateway, "499")
    completion_id = leave_after_first_content(relay_gateway, "relay")
    wait_for(lambda: requests_counted(relay_gateway, "499") == relay_before + 1, "the relay's 499")
    # The relay hung up on its upstream: the gateway behind it saw its own client leave.
    wait_for(lambda: requests_counted(local_gateway, "499") == upstream_before + 1, "the upstream's 499")
    assert_worker_idle_after_a_short_request(local_gateway)
    stored = stored_completion(relay_gateway, completion_id)
    assert_cut_short(stored["choices"][0])
    assert 0 < stored["usage"]["completion_tokens"] < 1500


def test_a_stream_read_to_its_end_is_not_a_disconnect(local_gateway: GatewayProcess) -> None:
    before = requests_counted(local_gateway, "499")
    body = {**LONG, "model": "gpt-4o", "max_tokens": 8}
    with httpx.stream("POST", f"{local_gateway.url}/v1/chat/completions", json=body, headers=AUTH,
                      timeout=60) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    completion_id = json.loads(lines[0][len("data: "):])["id"]
    assert stored_completion(local_gateway, completion_id)["choices"][0]["finish_reason"] == "length"
    assert requests_counted(local_gateway, "499") == before


def test_a_client_that_leaves_before_a_non_streaming_answer(relay_gateway: GatewayProcess,
                                                            local_gateway: GatewayProcess) -> None:
    wait_until_idle(local_gateway)
    relay_before, upstream_before = requests_counted(relay_gateway, "499"), requests_counted(local_gateway, "499")
    body = {**LONG, "model": "relay", "stream": False}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up long before 1500 tokens are generated
        httpx.post(f"{relay_gateway.url}/v1/chat/completions", json=body, timeout=httpx.Timeout(60, read=0.5))
    wait_for(lambda: requests_counted(relay_gateway, "499") == relay_before + 1, "the relay's 499")
    # The relay cancelled its upstream call: the gateway behind it saw its client leave and dropped the job.
    wait_for(lambda: requests_counted(local_gateway, "499") == upstream_before + 1, "the upstream's 499")
    assert_worker_idle_after_a_short_request(local_gateway)
