"""The linker's hashes must not change between versions: stored ``h_out`` values have to keep matching."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from flywheel.capture.canonical import ROOT, canonical_message, content_text, prefix_hashes, task_key

CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "Tu es un agent de voyage. Réponds en français — «toujours»."},
    {"role": "user", "content": [{"type": "text", "text": "Quote \"this\", a back\\slash,\ttab,\nnewline, \x01 ctrl"},
                                 {"type": "image_url", "image_url": {"url": "data:..."}}]},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "search", "arguments": '{"q": "東京 🗼", "limit": 3, "near": {"b": 1, "a": 2}}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "line\u2028separator and \u00e9"},
    {"role": "assistant", "content": "Voilà.", "name": "agent", "refusal": None},
]


def reference_hashes(messages: list[dict[str, Any]]) -> list[str]:
    """The definition (docs/capture.md): sha256 chained over stdlib-JSON canonical messages."""
    out, current = [], ROOT
    for message in messages:
        encoded = json.dumps(canonical_message(message), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        current = hashlib.sha256((current + encoded).encode()).hexdigest()
        out.append(current)
    return out


def test_prefix_hashes_follow_the_definition() -> None:
    assert prefix_hashes(CONVERSATION) == reference_hashes(CONVERSATION)


def test_reserializing_the_history_keeps_the_hashes() -> None:
    resent = [dict(m) for m in CONVERSATION]
    resent[0] = {"role": "system", "content": [{"type": "text", "text": CONVERSATION[0]["content"]}], "name": None}
    call = dict(resent[2]["tool_calls"][0])
    call["id"] = "call_regenerated"
    call["function"] = {"name": "search", "arguments": '{"near":{"a":2,"b":1},"limit":3,"q":"東京 🗼"}'}
    resent[2] = {**resent[2], "tool_calls": [call]}
    assert prefix_hashes(resent) == prefix_hashes(CONVERSATION)
    edited = [*resent[:1], {"role": "user", "content": "another question"}, *resent[2:]]
    assert prefix_hashes(edited)[0] == prefix_hashes(CONVERSATION)[0]
    assert all(a != b for a, b in zip(prefix_hashes(edited)[1:], prefix_hashes(CONVERSATION)[1:], strict=True))


TOOLS: list[dict[str, Any]] = [{"type": "function", "function": {
    "name": "search_hotels", "description": "Find hotels — «near» a place", "strict": True,
    "parameters": {"type": "object", "required": ["city"], "additionalProperties": False, "properties": {
        "city": {"type": "string"}, "n": {"type": "integer", "minimum": 1, "maximum": 20, "default": 3},
        "budget": {"type": ["number", "null"], "multipleOf": 0.5, "enum": [49.5, 100, None]}}}}}]


def test_task_key_follows_the_definition() -> None:
    """sha256 of the stdlib's sorted compact JSON of [system, tools, first user message]: stored keys keep grouping."""
    def reference(tools: list[dict[str, Any]]) -> str:
        payload = json.dumps([CONVERSATION[0]["content"], tools, content_text(CONVERSATION[1]["content"])],
                             sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        return "task_" + hashlib.sha256(payload.encode()).hexdigest()[:24]

    assert task_key(CONVERSATION, TOOLS) == reference(TOOLS)
    huge = [{**TOOLS[0], "x-limit": 1 << 70}]  # beyond what orjson encodes: the same definition still holds
    assert task_key(CONVERSATION, huge) == reference(huge)
