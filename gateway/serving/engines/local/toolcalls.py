"""Hermes / Qwen2.5 tool calls: ``<tool_call>{json}</tool_call>`` blocks in generated text.

The model writes each call as a JSON object ``{"name": ..., "arguments": {...}}`` between
the markers. :func:`parse_tool_calls` turns the blocks into OpenAI ``tool_calls`` and
returns what is left as content; streaming uses :func:`partial_marker_start` to hold back
text that may turn out to be the start of a block.
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"

# A complete block, or one running to the end of the text: small models often stop right after the JSON
_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|(?=<tool_call>)|\Z)", re.DOTALL)


def new_call_id() -> str:
    """An OpenAI-style tool call id: ``call_`` + 24 hex digits."""
    return "call_" + secrets.token_hex(12)


def _to_call(payload: str) -> dict[str, Any] | None:
    """The OpenAI tool call a block's JSON describes, or None when it is not a valid call."""
    try:
        data = json.loads(payload)
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not data["name"]:
        return None
    arguments = data.get("arguments", data.get("parameters", {}))
    # A string is already JSON (OpenAI's wire form): keep it as the model wrote it.
    encoded = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": new_call_id(), "type": "function",
            "function": {"name": data["name"], "arguments": encoded}}


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Split generated text into (content, OpenAI tool calls).

    Valid blocks are removed from the text; blocks whose JSON does not parse or lacks a
    name stay in the content verbatim. When at least one call was extracted the remaining
    content is stripped (None if nothing is left); when none was, the text comes back
    unchanged (None only if empty), so plain answers are never altered.
    """
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    position = 0
    for match in _BLOCK.finditer(text):
        call = _to_call(match.group(1).strip())
        if call is None:
            continue
        kept.append(text[position:match.start()])
        position = match.end()
        calls.append(call)
    if not calls:
        return (text or None), []
    kept.append(text[position:])
    content = "".join(kept).strip()
    return (content or None), calls


def partial_marker_start(text: str, marker: str) -> int:
    """Index from which ``text`` ends with a proper, non-empty prefix of ``marker``.

    Returns ``len(text)`` when no tail of the text could grow into the marker. Streaming
    holds back ``text[index:]`` until the next tokens show whether the marker completes.
    """
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return len(text) - size
    return len(text)


def tool_call_hold_start(text: str, start: int = 0) -> int:
    """Index from which streamed content must be held back because a tool call may begin there.

    That is the first complete ``<tool_call>`` at or after ``start``, else a trailing
    partial marker; whitespace right before either is held too, so streamed content ends
    where the non-streamed content (stripped around the calls) ends.
    """
    found = text.find(TOOL_CALL_START, start)
    index = found if found >= 0 else partial_marker_start(text, TOOL_CALL_START)
    while index > start and text[index - 1].isspace():
        index -= 1
    return max(index, start)
