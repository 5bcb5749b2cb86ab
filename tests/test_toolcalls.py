"""Hermes / Qwen tool-call parsing, on handwritten text and on text the tiny model generates."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator

import pytest

from flywheel.gateway.core.config import LocalEngineConfig
from flywheel.gateway.serving.engines.local import LocalEngine
from flywheel.gateway.serving.engines.local.toolcalls import (
    parse_tool_calls,
    partial_marker_start,
    tool_call_hold_start,
)
from tests.support import WEATHER_CALL, WEATHER_CALL_TEXT, WEATHER_MESSAGES, WEATHER_TOOLS, tool_model

CALL_ID = re.compile(r"^call_[0-9a-f]{24}$")


def test_single_call() -> None:
    content, calls = parse_tool_calls(WEATHER_CALL_TEXT)
    assert content is None
    assert len(calls) == 1
    assert CALL_ID.match(calls[0]["id"])
    assert calls[0]["type"] == "function"
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert json.loads(calls[0]["function"]["arguments"]) == WEATHER_CALL["arguments"]


def test_content_and_several_calls() -> None:
    text = ('Let me check.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
            '<tool_call>{"name": "b"}</tool_call>')
    content, calls = parse_tool_calls(text)
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["a", "b"]
    assert calls[1]["function"]["arguments"] == "{}"
    assert calls[0]["id"] != calls[1]["id"]


def test_invalid_blocks_stay_in_content() -> None:
    bad_json = "<tool_call>\n{not json}\n</tool_call>"
    no_name = '<tool_call>{"arguments": {}}</tool_call>'
    assert parse_tool_calls(bad_json) == (bad_json, [])
    assert parse_tool_calls(no_name) == (no_name, [])
    content, calls = parse_tool_calls(bad_json + "\n" + WEATHER_CALL_TEXT)
    assert content == bad_json and len(calls) == 1


def test_unterminated_final_call_and_string_arguments() -> None:
    content, calls = parse_tool_calls('Sure <tool_call>\n{"name": "f", "arguments": "{\\"q\\": 1}"}')
    assert content == "Sure"
    assert calls[0]["function"] == {"name": "f", "arguments": '{"q": 1}'}  # not encoded twice
    # An unterminated block followed by another block does not swallow it.
    _, calls = parse_tool_calls('<tool_call>{"name": "x"<tool_call>{"name": "y"}</tool_call>')
    assert [c["function"]["name"] for c in calls] == ["y"]


def test_plain_text_is_untouched() -> None:
    assert parse_tool_calls("  just text\n") == ("  just text\n", [])
    assert parse_tool_calls("") == (None, [])


def test_partial_markers() -> None:
    assert partial_marker_start("abc <tool", "<tool_call>") == 4
    assert partial_marker_start("abc <", "<tool_call>") == 4
    assert partial_marker_start("abc", "<tool_call>") == 3
    assert partial_marker_start("x<tool_call>", "<tool_call>") == 12  # complete: not a *partial* marker
    assert tool_call_hold_start("Hi <tool_ca") == 2
    assert tool_call_hold_start("Hi\n<tool_call>{") == 2
    assert tool_call_hold_start("Hi there  ") == 8  # trailing whitespace could precede a call
    assert tool_call_hold_start("Hi there") == 8
    assert tool_call_hold_start("ab  ", start=3) == 3  # never below what was already released


@pytest.fixture(scope="module")
def tool_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalEngine]:
    root = tmp_path_factory.getbasetemp() / "flywheel-models"
    engine = LocalEngine(LocalEngineConfig(model=str(tool_model(root))), root)
    asyncio.run(engine.start())
    yield engine
    asyncio.run(engine.aclose())


async def test_parses_what_the_model_generates(tool_engine: LocalEngine) -> None:
    # tool_choice "none": the engine leaves the raw generated text alone; parse it here.
    body = {"model": "m", "messages": WEATHER_MESSAGES, "tools": WEATHER_TOOLS, "tool_choice": "none",
            "temperature": 0, "max_tokens": 40}
    raw = (await tool_engine.chat(body))["choices"][0]["message"]["content"]
    assert raw == WEATHER_CALL_TEXT
    content, calls = parse_tool_calls(raw)
    assert content is None
    assert calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
