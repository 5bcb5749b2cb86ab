"""LocalEngine called directly: response shapes, sampling controls (draws without replacement too), tools,
adapters, concurrency."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import re
import time
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from flywheel.gateway.core.config import LocalEngineConfig
from flywheel.gateway.core.errors import BadRequest, NotFound, UpstreamError
from flywheel.gateway.serving.engines.base import Engine
from flywheel.gateway.serving.engines.local import LocalEngine
from flywheel.gateway.serving.engines.local.beams import log_inclusion
from flywheel.gateway.serving.engines.local.decoding import Choice, Sampling
from tests.support import (
    ADAPTER_TEXT,
    GREETING_MESSAGES,
    WEATHER_MESSAGES,
    WEATHER_TOOLS,
    greeting_adapter,
    tiny_dir,
    tool_model,
)

HI = [{"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.getbasetemp() / "flywheel-models"
    tiny_dir(root)
    return root


@pytest.fixture(scope="module")
def engine(root: Path) -> Iterator[LocalEngine]:
    # The engine binds to no event loop (each request captures the running one), so one
    # engine serves every test's loop.
    engine = LocalEngine(LocalEngineConfig(model="tiny", max_batch_n=4), root)
    asyncio.run(engine.start())
    yield engine
    asyncio.run(engine.aclose())


@pytest.fixture(scope="module")
def tool_engine(root: Path) -> Iterator[LocalEngine]:
    engine = LocalEngine(LocalEngineConfig(model=str(tool_model(root))), root)
    asyncio.run(engine.start())
    yield engine
    asyncio.run(engine.aclose())


@pytest.fixture(scope="module")
def tokenizer(root: Path) -> Any:
    return AutoTokenizer.from_pretrained(root / "models" / "tiny")


def chat_body(**extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": HI, "max_tokens": 16, "seed": 7, **extra}


async def collect(stream: Any) -> list[dict[str, Any]]:
    return [chunk async for chunk in stream]


def stream_text(chunks: list[dict[str, Any]], index: int = 0) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                   if c["choices"] and c["choices"][0]["index"] == index)


# --------------------------------------------------------------------------- shapes


async def test_is_an_engine(engine: LocalEngine) -> None:
    assert isinstance(engine, Engine)
    health = await engine.health()
    assert health["engine"] == "local" and health["model"] == "tiny"
    assert health["device"] == ("cuda" if torch.cuda.is_available() else "cpu")  # device "auto"
    assert health["adapters"] == [] and health["active_requests"] == 0


async def test_decoding_logs_no_deprecation(engine: LocalEngine) -> None:
    """The engine speaks the transformers API it pins: decoding warns of nothing deprecated (a FutureWarning or a
    transformers log line would land in the gateway's log)."""
    from transformers.utils import logging as hf_logging

    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    library = logging.getLogger("transformers")  # transformers' loggers do not propagate to the root
    hf_logging.warning_once.cache_clear()  # type: ignore[attr-defined]  # a warning logged once per process
    library.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as warned:  # the decode's worker thread warns into the same list
            warnings.simplefilter("always")
            await engine.chat(chat_body())
            await collect(engine.chat_stream(chat_body(stream=True)))
    finally:
        library.removeHandler(handler)
    said = [r.getMessage() for r in records] + [str(w.message) for w in warned]
    assert not [line for line in said if "deprecat" in line.lower()], said


async def test_not_started_is_an_upstream_error(root: Path) -> None:
    with pytest.raises(UpstreamError):
        await LocalEngine(LocalEngineConfig(), root).health()


async def test_chat_response_shape(engine: LocalEngine) -> None:
    response = await engine.chat(chat_body())
    assert re.match(r"^chatcmpl-[0-9a-f]+$", response["id"])
    assert response["object"] == "chat.completion" and isinstance(response["created"], int)
    assert response["model"] == "tiny"
    (choice,) = response["choices"]
    assert choice["index"] == 0 and choice["logprobs"] is None
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    assert "tool_calls" not in choice["message"] and "token_ids" not in choice
    assert choice["finish_reason"] in ("stop", "length")
    usage = response["usage"]
    assert usage["prompt_tokens"] > 0 and 0 < usage["completion_tokens"] <= 16
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert "prompt_token_ids" not in response


async def test_chat_stream_shape_matches_non_stream(engine: LocalEngine) -> None:
    body = chat_body(stream=True, stream_options={"include_usage": True})
    chunks = await collect(engine.chat_stream(body))
    whole = await engine.chat(chat_body())
    assert len({c["id"] for c in chunks}) == 1 and len({c["created"] for c in chunks}) == 1
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == "tiny" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finals) == 1 and finals[0]["choices"][0]["delta"] == {}
    assert finals[0]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    assert chunks[-2] is finals[0]
    assert stream_text(chunks) == whole["choices"][0]["message"]["content"]


async def test_content_parts_and_max_completion_tokens(engine: LocalEngine) -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi there"}]}]
    a = await engine.chat(chat_body(messages=parts, max_completion_tokens=5, max_tokens=99))
    b = await engine.chat(chat_body(max_tokens=5))
    assert a["choices"][0]["message"] == b["choices"][0]["message"]
    assert a["usage"]["completion_tokens"] <= 5


# --------------------------------------------------------------------------- sampling controls


async def test_seed_determinism(engine: LocalEngine) -> None:
    first = await engine.chat(chat_body(max_tokens=24))
    again = await engine.chat(chat_body(max_tokens=24))
    other = await engine.chat(chat_body(max_tokens=24, seed=8))
    text = first["choices"][0]["message"]["content"]
    assert again["choices"][0]["message"]["content"] == text
    assert other["choices"][0]["message"]["content"] != text


async def test_n_samples(engine: LocalEngine) -> None:
    response = await engine.chat(chat_body(n=3, return_token_ids=True))
    choices = response["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert len({tuple(c["token_ids"]) for c in choices}) == 3  # independent samples
    assert response["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in choices)
    chunks = await collect(engine.chat_stream(chat_body(n=3, stream=True)))
    for choice in choices:
        assert stream_text(chunks, choice["index"]) == choice["message"]["content"]
    with pytest.raises(BadRequest) as err:
        await engine.chat(chat_body(n=5))
    assert err.value.param == "n"


async def test_max_tokens_gives_length(engine: LocalEngine) -> None:
    response = await engine.chat(chat_body(max_tokens=3, temperature=0))
    assert response["choices"][0]["finish_reason"] == "length"  # a random model never says <|im_end|>
    assert response["usage"]["completion_tokens"] == 3
    with pytest.raises(BadRequest) as err:
        await engine.chat(chat_body(max_tokens=5000))
    assert err.value.param == "max_tokens"


async def test_stop_strings(engine: LocalEngine) -> None:
    greedy = {"temperature": 0, "max_tokens": 30}
    text = (await engine.chat(chat_body(**greedy)))["choices"][0]["message"]["content"]
    stop = text[6:9]
    expected = text[:text.index(stop)]
    response = await engine.chat(chat_body(stop=[stop, "never-appears"], **greedy))
    assert response["choices"][0]["message"]["content"] == expected
    assert response["choices"][0]["finish_reason"] == "stop"
    chunks = await collect(engine.chat_stream(chat_body(stop=stop, stream=True, **greedy)))
    assert stream_text(chunks) == expected
    assert all(stop not in (c["choices"][0]["delta"].get("content") or "") for c in chunks if c["choices"])


async def test_tiny_top_p_is_greedy(engine: LocalEngine) -> None:
    greedy_text = (await engine.chat(chat_body(temperature=0)))["choices"][0]["message"]["content"]
    nucleus = await engine.chat(chat_body(temperature=1.5, top_p=1e-6, seed=123))
    assert nucleus["choices"][0]["message"]["content"] == greedy_text


async def test_engine_limits_are_400s_naming_the_field(engine: LocalEngine, tokenizer: Any) -> None:
    # Bodies reach the engine validated (gateway/core/protocol.py); what it refuses is what it cannot do or hold.
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    chat_cases = [
        (chat_body(response_format={"type": "json_object"}), "response_format"),
        (chat_body(n=5), "n"),
        (chat_body(max_tokens=5000), "max_tokens"),
        (chat_body(max_completion_tokens=5000), "max_completion_tokens"),
        (chat_body(messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}, image]}]),
         "messages[0].content[1]"),
        (chat_body(messages=[{"role": "user", "content": "word " * 5000}]), "messages"),
    ]
    for body, param in chat_cases:
        with pytest.raises(BadRequest) as err:
            await engine.chat(body)
        assert err.value.param == param
        with pytest.raises(BadRequest) as streamed:
            await anext(engine.chat_stream({**body, "stream": True}))  # raised before any chunk exists
        assert streamed.value.param == param
    completion_cases = [
        ({"prompt": "x", "echo": True}, "echo"),
        ({"prompt": [len(tokenizer) + 10]}, "prompt"),
        ({"prompt": "word " * 5000}, "prompt"),
    ]
    for extra, param in completion_cases:
        with pytest.raises(BadRequest) as err:
            await engine.completion({"model": "tiny", "max_tokens": 2, **extra})
        assert err.value.param == param
    assert (await engine.health())["active_requests"] == 0
    await engine.chat(chat_body(response_format={"type": "text"}))  # allowed


class _Pieces:
    """A detokenizer whose token i is the string pieces[i]."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces

    def add(self, token_id: int) -> str:
        return self.pieces[token_id]

    def flush(self) -> str:
        return ""


def _run_choice(pieces: list[str], **sampling: Any) -> list[tuple[str, list[int], str | None]]:
    choice = Choice(0, Sampling(**{"max_tokens": 100, **sampling}), {99}, _Pieces(pieces))  # type: ignore[arg-type]
    out = []
    for token_id in range(len(pieces)):
        delta = choice.add(token_id, None, None)
        if delta is not None:
            out.append((delta.text, [t.id for t in delta.tokens], delta.finish_reason))
        if choice.finish_reason:
            break
    return out


def test_hold_back_releases_text_with_its_tokens() -> None:
    # A stop-string prefix is held, then released with its tokens when it does not complete
    # (a token travels with the first delta that releases any of its text).
    assert _run_choice(["ab", " E", "N", "X", "yz"], stop=["END"]) == [
        ("ab", [0], None), (" ", [1], None), ("ENX", [2, 3], None), ("yz", [4], None)]
    # When it completes, the text stops before it; the tokens still travel with the last delta.
    assert _run_choice(["ab", " E", "ND", "zz"], stop=["END"]) == [
        ("ab", [0], None), (" ", [1], None), ("", [2], "stop")]
    # Tool calls: content streams, whitespace and the markup are held until the end.
    pieces = ["Sure.", "\n", "<tool_call>", '{"name": "f"}', "</tool_call>"]
    assert _run_choice(pieces, hold_tool_calls=True, max_tokens=5) == [
        ("Sure.", [0], None), ('\n<tool_call>{"name": "f"}</tool_call>', [1, 2, 3, 4], "length")]


# --------------------------------------------------------------------------- logprobs and token ids


async def test_logprobs_and_token_ids(engine: LocalEngine, tokenizer: Any, root: Path) -> None:
    body = chat_body(logprobs=True, top_logprobs=3, return_token_ids=True, temperature=0.7, max_tokens=12)
    response = await engine.chat(body)
    choice = response["choices"][0]
    ids, entries = choice["token_ids"], choice["logprobs"]["content"]
    assert len(ids) == len(entries) == response["usage"]["completion_tokens"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == choice["message"]["content"]
    # A random model emits partial UTF-8 sequences too; both sides show them as U+FFFD.
    joined = b"".join(bytes(e["bytes"]) for e in entries)
    assert joined.decode(errors="replace") == choice["message"]["content"]
    for entry in entries:
        tops = entry["top_logprobs"]
        assert len(tops) == 3 and tops[0]["logprob"] >= tops[1]["logprob"] >= tops[2]["logprob"]
        assert entry["logprob"] <= tops[0]["logprob"] + 1e-6
    prompt = response["prompt_token_ids"]
    assert len(prompt) == response["usage"]["prompt_tokens"]
    # Reported logprobs are log_softmax(logits / temperature) of an independent forward pass.
    model = AutoModelForCausalLM.from_pretrained(root / "models" / "tiny").eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1]
    expected = torch.log_softmax(logits / 0.7, dim=-1).gather(1, torch.tensor(ids)[:, None]).squeeze(1)
    assert torch.allclose(expected, torch.tensor([e["logprob"] for e in entries]), atol=1e-4)
    # Streaming carries the same ids and logprobs, spread over the chunks.
    chunks = await collect(engine.chat_stream({**body, "stream": True}))
    assert chunks[0]["prompt_token_ids"] == prompt
    streamed_ids = [i for c in chunks if c["choices"] for i in c["choices"][0].get("token_ids", [])]
    streamed = [e for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
                for e in c["choices"][0]["logprobs"]["content"]]
    assert streamed_ids == ids and streamed == entries


async def test_greedy_logprobs_are_raw(engine: LocalEngine) -> None:
    response = await engine.chat(chat_body(logprobs=True, top_logprobs=1, temperature=0, max_tokens=5))
    for entry in response["choices"][0]["logprobs"]["content"]:
        assert entry["logprob"] == pytest.approx(entry["top_logprobs"][0]["logprob"])
        assert entry["token"] == entry["top_logprobs"][0]["token"]


# --------------------------------------------------------------------------- completions


async def test_completions(engine: LocalEngine, tokenizer: Any) -> None:
    ids = tokenizer("The weather")["input_ids"]
    body = {"model": "tiny", "prompt": [tokenizer("Hello")["input_ids"], ids], "n": 2, "max_tokens": 6,
            "seed": 3, "logprobs": 2, "return_token_ids": True}
    response = await engine.completion(body)
    assert re.match(r"^cmpl-[0-9a-f]+$", response["id"]) and response["object"] == "text_completion"
    choices = response["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert choices[2]["prompt_token_ids"] == ids
    assert choices[0]["prompt_token_ids"] == tokenizer("Hello")["input_ids"]
    for choice in choices:
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"])
        assert len(lp["tokens"]) == len(choice["token_ids"])
        assert all(len(top) == 2 for top in lp["top_logprobs"])
        assert "".join(lp["tokens"]) == choice["text"] == tokenizer.decode(choice["token_ids"])
        assert lp["text_offset"][0] == 0
    assert response["usage"]["prompt_tokens"] == len(ids) + len(tokenizer("Hello")["input_ids"])
    chunks = await collect(engine.completion_stream({**body, "stream": True,
                                                    "stream_options": {"include_usage": True}}))
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == response["usage"]
    for choice in choices:
        mine = [c["choices"][0] for c in chunks
                if c["choices"] and c["choices"][0]["index"] == choice["index"]]
        assert "".join(c["text"] for c in mine) == choice["text"]
        assert mine[0]["prompt_token_ids"] == choice["prompt_token_ids"]
        assert mine[-1]["finish_reason"] == choice["finish_reason"]
        assert [i for c in mine for i in c["token_ids"]] == choice["token_ids"]
    single = await engine.completion({"model": "tiny", "prompt": "Hello", "max_tokens": 2})
    assert len(single["choices"]) == 1 and single["choices"][0]["logprobs"] is None
    texts = await engine.completion({"model": "tiny", "prompt": ["Hello", "The weather"], "max_tokens": 6,
                                     "seed": 3, "n": 2})
    assert [c["text"] for c in texts["choices"]] == [c["text"] for c in choices]
    with pytest.raises(BadRequest) as err:
        await engine.completion({"model": "tiny", "prompt": "x", "echo": True})
    assert err.value.param == "echo"


# --------------------------------------------------------------------------- tool calls


async def test_tool_call_non_stream(tool_engine: LocalEngine) -> None:
    body = {"model": "m", "messages": WEATHER_MESSAGES, "tools": WEATHER_TOOLS, "temperature": 0}
    response = await tool_engine.chat(body)
    choice = response["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert re.match(r"^call_[0-9a-f]{24}$", call["id"]) and call["type"] == "function"
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}


async def test_tool_call_stream(tool_engine: LocalEngine) -> None:
    body = {"model": "m", "messages": WEATHER_MESSAGES, "tools": WEATHER_TOOLS, "temperature": 0,
            "stream": True, "return_token_ids": True}
    chunks = await collect(tool_engine.chat_stream(body))
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert stream_text(chunks) == ""  # the markup never leaks as content
    calls = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert len(calls) == 1
    (call,) = calls[0]
    assert call["index"] == 0 and call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    whole = await tool_engine.chat({**body, "stream": False})
    streamed_ids = [i for c in chunks for i in c["choices"][0].get("token_ids", [])]
    assert streamed_ids == whole["choices"][0]["token_ids"]


# --------------------------------------------------------------------------- adapters


async def greedy(engine: LocalEngine, model: str, messages: list[dict[str, Any]] = GREETING_MESSAGES) -> str:
    response = await engine.chat({"model": model, "messages": messages, "temperature": 0, "max_tokens": 12})
    return str(response["choices"][0]["message"]["content"])


async def test_adapter_load_use_unload(engine: LocalEngine, root: Path) -> None:
    adapter = str(greeting_adapter(root))
    base = await greedy(engine, "tiny")
    await engine.load_adapter("greet@1", adapter)
    try:
        assert (await engine.health())["adapters"] == ["greet@1"]
        assert await greedy(engine, "greet@1") == ADAPTER_TEXT
        assert await greedy(engine, "tiny") == base  # base requests bypass the adapter
        await engine.load_adapter("greet@2", adapter)  # a second adapter: load_adapter path
        assert await greedy(engine, "greet@2") == ADAPTER_TEXT
        with pytest.raises(BadRequest):
            await engine.load_adapter("greet@2", adapter)
        await engine.unload_adapter("greet@2")
        assert await greedy(engine, "greet@1") == ADAPTER_TEXT
    finally:
        await engine.unload_adapter("greet@1")  # the last one: back to the plain model
    assert (await engine.health())["adapters"] == []
    assert await greedy(engine, "greet@1") == base  # unknown names fall back to the base model
    with pytest.raises(NotFound):
        await engine.unload_adapter("greet@1")
    with pytest.raises(BadRequest):
        await engine.load_adapter("nope", str(root / "missing"))
    await engine.load_adapter("greet@3", adapter)  # wrapping again after the unwrap works
    assert await greedy(engine, "greet@3") == ADAPTER_TEXT
    await engine.unload_adapter("greet@3")


async def test_concurrent_base_and_adapter(engine: LocalEngine, root: Path) -> None:
    await engine.load_adapter("side@1", str(greeting_adapter(root)))
    try:
        alone_base = await greedy(engine, "tiny")
        stream_body = {"model": "tiny", "messages": GREETING_MESSAGES, "temperature": 0, "max_tokens": 12,
                       "stream": True}
        base_chunks, adapted, base_again = await asyncio.gather(
            collect(engine.chat_stream(stream_body)), greedy(engine, "side@1"), greedy(engine, "tiny"))
        assert stream_text(base_chunks) == alone_base == base_again
        assert adapted == ADAPTER_TEXT
        # Round-robin, one step per job: a short request overtakes a long one already running.
        finished: list[str] = []

        async def long_base() -> None:
            await collect(engine.chat_stream({**stream_body, "max_tokens": 100}))
            finished.append("long base")

        async def short_adapter() -> None:
            await asyncio.sleep(0.02)  # let the long one start first
            assert await greedy(engine, "side@1") == ADAPTER_TEXT
            finished.append("short adapter")

        await asyncio.gather(long_base(), short_adapter())
        assert finished == ["short adapter", "long base"]
    finally:
        await engine.unload_adapter("side@1")


# --------------------------------------------------------------------------- liveness


async def test_health_answers_while_generating(engine: LocalEngine) -> None:
    stream = engine.chat_stream(chat_body(max_tokens=400, stream=True, ignore_eos=True))
    await anext(stream)  # role chunk
    await anext(stream)  # first content: the job is running
    health = await engine.health()  # answered on the event loop while the worker decodes
    assert health["active_requests"] == 1 and health["running_jobs"] == 1
    await stream.aclose()  # what the gateway does when the client disconnects


async def wait_for_no_running_jobs(engine: LocalEngine) -> None:
    deadline = time.monotonic() + 30
    while (await engine.health())["running_jobs"] and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert (await engine.health())["running_jobs"] == 0


async def test_disconnect_cancels_the_job(engine: LocalEngine) -> None:
    stream = engine.chat_stream(chat_body(max_tokens=1000, stream=True, ignore_eos=True))
    async for chunk in stream:
        if chunk["choices"][0]["delta"].get("content"):
            break
    await stream.aclose()
    assert (await engine.health())["active_requests"] == 0
    await wait_for_no_running_jobs(engine)  # the worker drops the job before its next step
    # Cancelling a non-streaming call's task cancels its job too.
    task = asyncio.create_task(engine.chat(chat_body(max_tokens=1000, ignore_eos=True)))
    deadline = time.monotonic() + 30
    while (await engine.health())["running_jobs"] == 0 and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert (await engine.health())["active_requests"] == 0
    await wait_for_no_running_jobs(engine)


# --------------------------------------------------------------------------- drawn without replacement

COLD = 0.1  # the tiny model is close to uniform at T = 1: colder, a few sequences carry most of the mass


def ids_of(response: dict[str, Any]) -> list[tuple[int, ...]]:
    return [tuple(c["token_ids"]) for c in response["choices"]]


async def test_choices_are_distinct_where_independent_ones_repeat(engine: LocalEngine, root: Path) -> None:
    cold = 0.03
    body = {"model": "tiny", "messages": HI, "max_tokens": 3, "n": 4, "temperature": cold,
            "return_token_ids": True, "logprobs": True}
    independent = [ids_of(await engine.chat({**body, "seed": s})) for s in range(8)]
    drawn = [await engine.chat({**body, "seed": s, "draw_without_replacement": True}) for s in range(8)]
    assert sum(len(set(ids)) < 4 for ids in independent) >= 6  # the control: this cold, independent ones repeat
    assert all(len(set(ids_of(r))) == 4 for r in drawn)
    # Each drawn choice says how likely it was to be among the drawn (log q <= 0); independent ones say nothing.
    assert all(c["inclusion_logprob"] <= 0 for r in drawn for c in r["choices"])
    assert "inclusion_logprob" not in (await engine.chat({**body, "seed": 0}))["choices"][0]
    # Each choice reports its tokens' log_softmax(logits / T), as an independent forward pass computes them.
    model = AutoModelForCausalLM.from_pretrained(root / "models" / "tiny").eval()
    response = drawn[0]
    prompt = response["prompt_token_ids"]
    for choice in response["choices"]:
        ids = choice["token_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1]
        expected = torch.log_softmax(logits / cold, dim=-1).gather(1, torch.tensor(ids)[:, None]).squeeze(1)
        reported = torch.tensor([e["logprob"] for e in choice["logprobs"]["content"]])
        assert torch.allclose(expected, reported, atol=1e-4)
        assert choice["finish_reason"] == "length"
    # Same seed, same draw; streamed, the same choices
    assert ids_of(await engine.chat({**body, "seed": 0, "draw_without_replacement": True})) == ids_of(response)
    chunks = [c async for c in engine.chat_stream({**body, "seed": 0, "draw_without_replacement": True,
                                                   "stream": True})]
    streamed = {i: [t for c in chunks if c["choices"] and c["choices"][0]["index"] == i
                    for t in c["choices"][0].get("token_ids", [])] for i in range(4)}
    assert [tuple(streamed[i]) for i in range(4)] == ids_of(response)


async def test_pairs_follow_the_without_replacement_law_over_whole_sequences(engine: LocalEngine,
                                                                             root: Path) -> None:
    """Two-token sequences, two choices: P(first = a, second = b) = p(a) p(b) / (1 - p(a)), p over sequences.

    The first step alone is the Gumbel-top-k trick; the second tests the conditioned perturbations."""
    model = AutoModelForCausalLM.from_pretrained(root / "models" / "tiny").eval()
    prompt = (await engine.completion({"model": "tiny", "prompt": "Hello", "max_tokens": 1,
                                       "return_token_ids": True}))["choices"][0]["prompt_token_ids"]
    with torch.no_grad():
        first = torch.softmax(model(torch.tensor([prompt])).logits[0, -1] / COLD, dim=-1)
        heads = first.topk(3).indices.tolist()
        seq_p: dict[tuple[int, int], float] = {}
        for a in heads:
            second = torch.softmax(model(torch.tensor([[*prompt, a]])).logits[0, -1] / COLD, dim=-1)
            for b in second.topk(3).indices.tolist():
                seq_p[(a, b)] = first[a].item() * second[b].item()
    top = sorted(seq_p, key=seq_p.__getitem__, reverse=True)[:4]
    expected = {(s, t): seq_p[s] * seq_p[t] / (1 - seq_p[s]) for s, t in itertools.permutations(top, 2)}
    draws = 500
    seen: Counter[tuple[tuple[int, ...], tuple[int, ...]] | str] = Counter()
    for seed in range(draws):
        response = await engine.completion({"model": "tiny", "prompt": prompt, "max_tokens": 2, "n": 2,
                                            "temperature": COLD, "seed": seed, "return_token_ids": True,
                                            "draw_without_replacement": True})
        a, b = ids_of(response)
        seen[(a, b) if (a, b) in expected else "other"] += 1
    assert sum(expected.values()) > 0.5  # the cells below carry most of the mass
    cells = [*expected, "other"]
    law = {**expected, "other": 1 - sum(expected.values())}
    total_variation = sum(abs(seen[c] / draws - law[c]) for c in cells) / 2
    assert total_variation < 0.08, (total_variation, {c: (seen[c], round(law[c] * draws)) for c in cells})


async def test_a_cold_draw_is_refused_naming_the_field(engine: LocalEngine) -> None:
    with pytest.raises(BadRequest) as err:
        await engine.chat({"model": "tiny", "messages": HI, "n": 2, "temperature": 0,
                           "draw_without_replacement": True})
    assert err.value.param == "draw_without_replacement"


def test_inclusion_probability_is_one_minus_exp_of_minus_exp() -> None:
    assert log_inclusion(-1.0, float("-inf")) == 0.0  # nothing left out: every sequence was drawn
    assert log_inclusion(-1.0, -3.0) == pytest.approx(torch.log1p(-torch.exp(-torch.exp(torch.tensor(2.0)))).item())
    assert log_inclusion(-30.0, -3.0) == pytest.approx(-27.0)  # q -> p / exp(kappa) for rare sequences
