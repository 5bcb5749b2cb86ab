"""Big exchanges serialized piece by piece write the line ``CapturedExchange.to_line`` writes."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import orjson
import pytest

from flywheel.capture.turns import CapturedExchange
from flywheel.gateway.serving.exchange_lines import (
    OFF_LOOP_LINE_BYTES,
    dumps_in_pieces,
    estimated_bytes,
    line_in_pieces,
)


def exchange(tokens: int, top: int, prompt: str = "hi") -> CapturedExchange:
    entry = {"token": "a", "logprob": -0.5, "bytes": [97],
             "top_logprobs": [{"token": "b", "logprob": -1.25, "bytes": [98]}] * top}
    response = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
                "prompt_token_ids": list(range(700)),
                "choices": [{"index": 0, "finish_reason": "length", "token_ids": list(range(tokens)),
                             "message": {"role": "assistant", "content": "é" * tokens},
                             "logprobs": {"content": [entry] * tokens}}],
                "usage": {"prompt_tokens": 700, "completion_tokens": tokens, "total_tokens": 700 + tokens}}
    request = {"model": "m", "messages": [{"role": "user", "content": prompt}], "logprobs": True,
               "top_logprobs": top, "metadata": {"deep": [[{"x": [1.5, None, True]}]]}}
    return CapturedExchange(completion_id="chatcmpl-1", endpoint="chat.completions", requested_model="m",
                            alias="a", engine_model="a@1", adapter_version=1, client_key_id=None, request=request,
                            response=response, created_at=datetime(2025, 1, 2, 3, 4, 5, 6, tzinfo=UTC),
                            latency_ms=12.5, trajectory_id="t", task=None, group_id=None)


@pytest.mark.parametrize(("tokens", "top"), [(0, 0), (3, 2), (5_000, 20)])
def test_the_line_in_pieces_is_the_line(tokens: int, top: int) -> None:
    captured = exchange(tokens, top, prompt="x" * 10_000)
    line = line_in_pieces(captured)
    assert line == captured.to_line()
    assert CapturedExchange.from_line(line) == captured


@pytest.mark.parametrize("value", [[], {}, [[]] * 600, list(range(1000)), {"a": {"b": [{"c": "d"}] * 300}}, "s", 1])
def test_dumps_in_pieces_matches_orjson(value: Any) -> None:
    for depth in (0, 1, 5):
        assert dumps_in_pieces(value, depth) == orjson.dumps(value)


def test_what_counts_as_big() -> None:
    assert estimated_bytes(exchange(10, 0), request_bytes=2_000) < OFF_LOOP_LINE_BYTES
    assert estimated_bytes(exchange(10, 0), request_bytes=2 * OFF_LOOP_LINE_BYTES) > OFF_LOOP_LINE_BYTES
    assert estimated_bytes(exchange(5_000, 20), request_bytes=2_000) > OFF_LOOP_LINE_BYTES  # logprobs add up
