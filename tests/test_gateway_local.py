"""The OpenAI API of a real gateway process (local engine), driven by the official ``openai`` client."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import (
    ADAPTER_ANSWER,
    ADAPTER_QUESTION,
    ADMIN_KEY,
    CLIENT_KEY,
    WEATHER_ANSWER,
    WEATHER_QUESTION,
    WEATHER_TOOL,
)
from tests.gateway_process import GatewayProcess

HI = [{"role": "user", "content": "Say hello"}]


@pytest.fixture(scope="module")
def client(local_gateway: GatewayProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{local_gateway.url}/v1", api_key=CLIENT_KEY, max_retries=0)


@pytest.fixture
def aclient(local_gateway: GatewayProcess) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{local_gateway.url}/v1", api_key=CLIENT_KEY, max_retries=0)


def sse_payloads(response: httpx.Response) -> list[Any]:
    """Every ``data:`` payload of a raw SSE response, ``[DONE]`` kept as a string."""
    out: list[Any] = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def assert_openai_chunks(chunks: list[Any]) -> None:
    """The invariants OpenAI's own streams keep."""
    assert chunks
    assert len({c.id for c in chunks}) == 1
    assert len({c.created for c in chunks}) == 1
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    for chunk in chunks:
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or ():
                assert call.index is not None


def test_plain_chat(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model="gpt-4o", messages=HI, max_tokens=8, seed=1)
    assert reply.object == "chat.completion"
    assert reply.model == "gpt-4o"  # answered under the name the agent sent
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage is not None and reply.usage.completion_tokens <= 8
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    extras = reply.model_dump()
    assert "prompt_token_ids" not in extras and "token_ids" not in extras["choices"][0]
    assert reply.choices[0].logprobs is None  # asked for by the gateway, not by the client


def test_seeded_sampling_repeats(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(model="gpt-4o", messages=HI, max_tokens=8, seed=7, temperature=1.0)
    again = client.chat.completions.create(model="gpt-4o", messages=HI, max_tokens=8, seed=7, temperature=1.0)
    assert first.choices[0].message.content == again.choices[0].message.content


async def test_async_chat_and_stream(aclient: openai.AsyncOpenAI) -> None:
    reply = await aclient.chat.completions.create(model="gpt-4o-mini", messages=HI, max_tokens=6)
    assert reply.model == "gpt-4o-mini"  # matched the glob route "gpt-4*"
    stream = await aclient.chat.completions.create(model="gpt-4o", messages=HI, max_tokens=6, stream=True)
    chunks = [chunk async for chunk in stream]
    assert_openai_chunks(chunks)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_stream_matches_non_stream(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {"model": "gpt-4o", "messages": HI, "max_tokens": 10, "temperature": 0}
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    assert_openai_chunks(chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content
    assert all(c.usage is None for c in chunks)  # no usage chunk unless asked


def test_stream_usage_chunk_comes_last(local_gateway: GatewayProcess) -> None:
    body = {"model": "gpt-4o", "messages": HI, "max_tokens": 5, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{local_gateway.url}/v1/chat/completions", json=body,
                      headers={"authorization": f"Bearer {CLIENT_KEY}"}, timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        payloads = sse_payloads(response)
    assert payloads[-1] == "[DONE]"
    usage_chunk = payloads[-2]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 5
    assert all(p["choices"] for p in payloads[:-2])


def test_tool_call_round_trip(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(model="gpt-4o", messages=WEATHER_QUESTION, tools=[WEATHER_TOOL],
                                           temperature=0, max_tokens=40)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls is not None
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    messages: list[Any] = [*WEATHER_QUESTION, choice.message.model_dump(exclude_none=True),
                           {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "sunny"}'}]
    second = client.chat.completions.create(model="gpt-4o", messages=messages, tools=[WEATHER_TOOL],
                                            temperature=0, max_tokens=20)
    assert second.choices[0].message.content == WEATHER_ANSWER
    assert second.choices[0].finish_reason == "stop"


def test_tool_call_streamed(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(model="gpt-4o", messages=WEATHER_QUESTION, tools=[WEATHER_TOOL],
                                                 temperature=0, max_tokens=40, stream=True))
    assert_openai_chunks(chunks)
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert calls and calls[0].index == 0 and calls[0].function.name == "get_weather"
    arguments = "".join(tc.function.arguments or "" for tc in calls if tc.index == 0)
    assert json.loads(arguments) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_n_choices(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model="gpt-4o", messages=HI, max_tokens=6, n=3, seed=3)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    chunks = list(client.chat.completions.create(model="gpt-4o", messages=HI, max_tokens=6, n=2, stream=True))
    assert_openai_chunks(chunks)
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1}


def test_logprobs_and_token_ids(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model="gpt-4o", messages=HI, max_tokens=6, logprobs=True,
                                           top_logprobs=2, extra_body={"return_token_ids": True})
    raw = reply.model_dump()
    choice = raw["choices"][0]
    assert len(choice["token_ids"]) == reply.usage.completion_tokens == len(choice["logprobs"]["content"])
    assert len(raw["prompt_token_ids"]) == reply.usage.prompt_tokens
    for entry in choice["logprobs"]["content"]:
        assert entry["logprob"] <= 0 and len(entry["top_logprobs"]) == 2
    chunks = list(client.chat.completions.create(model="gpt-4o", messages=HI, max_tokens=6, stream=True, logprobs=True,
                                                 extra_body={"return_token_ids": True, "ignore_eos": True}))
    streamed_ids = [t for c in chunks for ch in c.model_dump()["choices"] for t in (ch.get("token_ids") or [])]
    assert len(streamed_ids) == 6
    assert chunks[0].model_dump().get("prompt_token_ids") == raw["prompt_token_ids"]


def test_completions_endpoint(client: openai.OpenAI) -> None:
    reply = client.completions.create(model="gpt-4o", prompt="Once upon a time", max_tokens=5, logprobs=1,
                                      extra_body={"ignore_eos": True})  # an unseeded sample may draw EOS early
    assert reply.object == "text_completion" and reply.usage is not None
    assert reply.choices[0].logprobs is not None and len(reply.choices[0].logprobs.tokens or []) == 5
    chunks = list(client.completions.create(model="gpt-4o", prompt="Once", max_tokens=4, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert len({c.id for c in chunks}) == 1
    assert "".join(c.choices[0].text for c in chunks if c.choices)


def test_models_lists_aliases(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == ["agent"]
    assert client.models.retrieve("agent").id == "agent"


def test_response_format_text_accepted_and_unknown_params_ignored(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model="gpt-4o", messages=HI, max_tokens=3,
                                           response_format={"type": "text"}, user="u-1", store=False,
                                           extra_body={"some_future_param": {"x": 1}})
    assert reply.choices[0].message.role == "assistant"


def test_adapter_hot_swap(client: openai.OpenAI, local_gateway: GatewayProcess, adapter_dir: Any) -> None:
    admin = {"authorization": f"Bearer {ADMIN_KEY}"}
    url = f"{local_gateway.url}/flywheel/v1/aliases/agent/adapter"
    ask: dict[str, Any] = {"model": "gpt-4o", "messages": ADAPTER_QUESTION, "temperature": 0, "max_tokens": 12}
    before = client.chat.completions.create(**ask).choices[0].message.content
    assert before != ADAPTER_ANSWER
    switched = httpx.put(url, json={"path": str(adapter_dir)}, headers=admin, timeout=60)
    assert switched.status_code == 200, switched.text
    assert switched.json()["adapter"] == "agent@1"
    try:
        assert client.chat.completions.create(**ask).choices[0].message.content == ADAPTER_ANSWER
    finally:
        back = httpx.put(url, json={"path": None}, headers=admin, timeout=60)
    assert back.status_code == 200 and back.json()["adapter"] is None
    assert client.chat.completions.create(**ask).choices[0].message.content == before


def test_healthz_and_metrics(client: openai.OpenAI, local_gateway: GatewayProcess) -> None:
    client.chat.completions.create(model="gpt-4o", messages=HI, max_tokens=2)
    health = httpx.get(f"{local_gateway.url}/healthz")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    text = httpx.get(f"{local_gateway.url}/metrics").text
    assert 'flywheel_requests_total{alias="agent",endpoint="chat.completions",status="200"}' in text
    assert "flywheel_request_latency_seconds_bucket" in text
    assert 'flywheel_tokens_total{alias="agent",kind="completion"}' in text


def test_forked_stream_shows_the_client_only_its_choices(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(
        model="gpt-4o", messages=HI, max_tokens=5, n=2, stream=True, stream_options={"include_usage": True},
        extra_body={"return_token_ids": True}, extra_headers={"X-Flywheel-Fork": "2"}))
    assert_openai_chunks(chunks)
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1}  # the engine drew 4; the client asked 2
    sampled = sum(len(ch.get("token_ids") or []) for c in chunks for ch in c.model_dump()["choices"])
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == sampled
