"""The upstream engine: a second gateway in front of the first (gateway -> gateway over loopback)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import CLIENT_KEY, WEATHER_QUESTION, WEATHER_TOOL
from tests.gateway_process import GatewayProcess
from tests.scripted_openai import Reply, ScriptedOpenAI
from tests.test_gateway_local import HI, assert_openai_chunks, sse_payloads


@pytest.fixture(scope="module")
def relay(relay_gateway: GatewayProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{relay_gateway.url}/v1", api_key="no-keys-on-the-relay", max_retries=0)


@pytest.fixture(scope="module")
def direct(local_gateway: GatewayProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{local_gateway.url}/v1", api_key=CLIENT_KEY, max_retries=0)


def test_relay_matches_direct(relay: openai.OpenAI, direct: openai.OpenAI) -> None:
    ask: dict[str, Any] = {"messages": HI, "max_tokens": 8, "temperature": 0}
    through = relay.chat.completions.create(model="anything-at-all", **ask)  # the default route
    assert through.model == "anything-at-all"
    assert through.choices[0].message.content == direct.chat.completions.create(model="gpt-4o", **ask) \
        .choices[0].message.content
    assert "prompt_token_ids" not in through.model_dump()  # the relay asked upstream for them, then stripped them
    assert through.choices[0].logprobs is None


def test_relay_passes_token_ids_when_asked(relay: openai.OpenAI) -> None:
    reply = relay.chat.completions.create(model="m", messages=HI, max_tokens=4, logprobs=True,
                                          extra_body={"return_token_ids": True, "ignore_eos": True})
    raw = reply.model_dump()
    assert len(raw["choices"][0]["token_ids"]) == 4 and raw["prompt_token_ids"]
    assert len(raw["choices"][0]["logprobs"]["content"]) == 4


def test_relay_streams_chunk_by_chunk(relay_gateway: GatewayProcess, local_gateway: GatewayProcess) -> None:
    body = {"model": "m", "messages": HI, "max_tokens": 40, "stream": True, "temperature": 0,
            "stream_options": {"include_usage": True}}

    def events(url: str, model: str) -> list[Any]:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "model": model}, timeout=60,
                          headers={"authorization": f"Bearer {CLIENT_KEY}"}) as response:
            return sse_payloads(response)

    relayed, direct = events(relay_gateway.url, "m"), events(local_gateway.url, "gpt-4o")
    assert relayed[-1] == "[DONE]"
    # One event out for every event in: passed through as they come, not buffered and re-chunked.
    assert len(relayed) == len(direct) >= 4
    assert [p["choices"] for p in relayed[:-1]] == [p["choices"] for p in direct[:-1]]


def test_relay_stream_with_tools(relay: openai.OpenAI) -> None:
    chunks = list(relay.chat.completions.create(model="m", messages=WEATHER_QUESTION, tools=[WEATHER_TOOL],
                                                temperature=0, max_tokens=40, stream=True))
    assert_openai_chunks(chunks)
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert calls[0].function.name == "get_weather"


def test_upstream_down_is_502(relay: openai.OpenAI) -> None:
    with pytest.raises(openai.APIStatusError) as failure:
        relay.chat.completions.create(model="down", messages=HI, max_tokens=2)
    assert failure.value.status_code == 502
    assert failure.value.body["type"] == "upstream_error"  # type: ignore[index]
    with pytest.raises(openai.APIStatusError) as streamed:
        list(relay.chat.completions.create(model="down", messages=HI, max_tokens=2, stream=True))
    assert streamed.value.status_code == 502


def test_upstream_slower_than_timeout_is_504(relay: openai.OpenAI) -> None:
    with pytest.raises(openai.APIStatusError) as failure:
        relay.chat.completions.create(model="impatient", messages=HI, max_tokens=1500,
                                      extra_body={"ignore_eos": True})
    assert failure.value.status_code == 504
    assert failure.value.body["code"] == "timeout"  # type: ignore[index]


def test_upstream_error_status_is_relayed(relay: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as failure:  # the upstream gateway refuses n above its cap
        relay.chat.completions.create(model="m", messages=HI, max_tokens=2, n=100)
    assert failure.value.body["param"] == "n"  # type: ignore[index]


def test_gateway_adds_training_fields_upstream(tmp_path: Path) -> None:
    with ScriptedOpenAI() as upstream:
        gateway = GatewayProcess(tmp_path, f"""
[engines.up]
base_url = "{upstream.base_url}"
[aliases.relay]
engine = "up"
base_model = "served-name"
""").start()
        try:
            client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
            client.chat.completions.create(model="gpt-4o", messages=HI)
            list(client.chat.completions.create(model="gpt-4o", messages=HI, stream=True))
        finally:
            gateway.stop()
    plain, streamed = upstream.requests
    assert plain["model"] == streamed["model"] == "served-name"
    assert plain["return_token_ids"] is True and plain["logprobs"] is True
    assert streamed["stream_options"] == {"include_usage": True}


def test_failure_mid_stream_is_an_sse_error_event(tmp_path: Path) -> None:
    with ScriptedOpenAI(reply=lambda body: Reply(content="one two three four", break_after_chunks=2)) as upstream:
        gateway = GatewayProcess(tmp_path, f"""
[engines.up]
base_url = "{upstream.base_url}"
[aliases.relay]
engine = "up"
""").start()
        try:
            body = {"model": "m", "messages": HI, "stream": True}
            with httpx.stream("POST", f"{gateway.url}/v1/chat/completions", json=body, timeout=30) as response:
                assert response.status_code == 200
                payloads = sse_payloads(response)
            client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
            with pytest.raises(openai.APIError):
                list(client.chat.completions.create(model="m", messages=HI, stream=True))
        finally:
            gateway.stop()
    assert [p["choices"][0]["delta"] for p in payloads[:2]] == [{"role": "assistant", "content": ""},
                                                                 {"content": "one "}]
    assert payloads[2]["error"]["type"] == "upstream_error"
    assert payloads[-1] == "[DONE]"
