"""Canonical messages and the prefix hashes the linker matches on (architecture §4).

Clients re-serialize history in their own ways; the canonical form removes the
differences that do not change meaning, so the same conversation hashes the same:

- content as a string vs a list of text parts -> one string; ``None`` -> ``""``;
- tool-call arguments -> compact JSON with sorted keys (when they parse);
- absent vs null optional fields -> absent; tool-call ids (opaque, often regenerated) dropped.

Hashes chain: ``H(m_0..m_i) = sha256(H(m_0..m_{i-1}) || canon(m_i))``, so every
prefix's hash comes out of one pass over the messages (O(messages) per request).

:func:`message_hash` hashes one message on its own, tool-call ids included: the tail
linker's evidence that a request repeats an answer the gateway gave (docs/capture.md).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import orjson

ROOT = hashlib.sha256(b"flywheel/1").hexdigest()  # the hash of the empty conversation


def content_text(content: Any) -> str:
    """String content, or the text parts of a list content joined (images etc. by their type)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict):
                text = part.get("text")
                if text is not None and not isinstance(text, str):  # not OpenAI's shape, but never a crash
                    text = str(text)
                parts.append(text if part.get("type") in ("text", None) else f"[{part.get('type')}]")
            else:
                parts.append(str(part))
        return "".join(p or "" for p in parts)
    return str(content)


def canonical_arguments(arguments: Any) -> str:
    """Tool-call arguments as compact sorted JSON; text that is not JSON is kept as is."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return arguments
    return json.dumps(arguments, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def canonical_message(message: dict[str, Any]) -> dict[str, Any]:
    """The meaning-bearing fields of one chat message, normalized."""
    out: dict[str, Any] = {"role": message.get("role"), "content": content_text(message.get("content"))}
    if message.get("name"):
        out["name"] = message["name"]
    calls = message.get("tool_calls") or []
    if calls:
        out["tool_calls"] = [{"name": (c.get("function") or {}).get("name"),
                              "arguments": canonical_arguments((c.get("function") or {}).get("arguments"))}
                             for c in calls]
    return out


def message_hash(message: dict[str, Any]) -> str:
    """One message on its own: its canonical form plus its tool-call ids (``tool_calls[].id``, ``tool_call_id``).

    The ids are kept here, unlike in the prefix hashes: the engine generated them, so an answer
    that carries them is one the gateway gave in one conversation only.
    """
    canonical = canonical_message(message)
    calls = message.get("tool_calls")
    if calls:  # the common message has none: no list built for it
        call_ids = [call.get("id") for call in calls if isinstance(call, dict)]
        if any(call_ids):
            canonical["call_ids"] = call_ids
    tool_call_id = message.get("tool_call_id")
    if tool_call_id:
        canonical["tool_call_id"] = tool_call_id
    return hashlib.sha256(orjson.dumps(canonical, option=orjson.OPT_SORT_KEYS)).hexdigest()


def _step(previous: str, message: dict[str, Any]) -> str:
    # orjson: json.dumps(sort_keys=True)'s compact bytes for these dicts, faster (tests/test_canonical.py)
    encoded = orjson.dumps(canonical_message(message), option=orjson.OPT_SORT_KEYS)
    return hashlib.sha256(previous.encode() + encoded).hexdigest()


def prefix_hashes(messages: list[dict[str, Any]]) -> list[str]:
    """``out[i]`` is the hash of ``messages[: i + 1]``."""
    hashes: list[str] = []
    current = ROOT
    for message in messages:
        current = _step(current, message)
        hashes.append(current)
    return hashes


def extend_hash(h_prefix: str, message: dict[str, Any]) -> str:
    """The hash of a conversation extended by one message (``h_out`` from ``h_ctx``)."""
    return _step(h_prefix, message)


def task_key(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
    """Hash of the system prompt, the tool schemas and the first user message (architecture §5)."""
    system = next((content_text(m.get("content")) for m in messages if m.get("role") in ("system", "developer")), "")
    first_user = next((content_text(m.get("content")) for m in messages if m.get("role") == "user"), "")
    try:  # orjson: the stdlib's sorted compact bytes for JSON tool schemas, faster (tests/test_canonical.py)
        payload = orjson.dumps([system, tools or [], first_user], option=orjson.OPT_SORT_KEYS)
    except TypeError:  # what orjson refuses (an integer beyond 64 bits): the stdlib
        payload = json.dumps([system, tools or [], first_user], sort_keys=True, separators=(",", ":"),
                             ensure_ascii=False).encode()
    return "task_" + hashlib.sha256(payload).hexdigest()[:24]
