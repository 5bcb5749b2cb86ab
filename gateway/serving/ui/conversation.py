"""A trajectory's branch as a conversation to read: each turn's new messages, then the model's answer.

Every request carries its whole history, so a turn's request begins with its parent's request and
answer (that prefix is how the linker placed it, architecture §4); only what came after — tool
results, the user's next message — is new. A turn whose request does not begin that way (its parent
lies in another trajectory, or the client rewrote the history) shows its whole request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Message:
    """A chat message made ready for the page: text, tool calls (name + arguments), or a tool's result."""

    role: str
    text: str | None
    parts: list[str] = field(default_factory=list)  # non-text content parts, by kind (image_url, ...)
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # id, name, arguments (as sent)
    tool_call_id: str | None = None
    tool_name: str | None = None  # the function whose result this is, when the call is in view
    name: str | None = None


@dataclass
class Step:
    """One turn of a branch: what the client added, and the answer it got."""

    turn: dict[str, Any]
    added: list[Message]
    answer: Message
    whole_history: bool  # ``added`` is the turn's whole request, not only what followed its parent


def message(raw: dict[str, Any], calls: dict[str, str]) -> Message:
    """A stored message for display; ``calls`` maps tool-call ids seen so far to their function names."""
    content = raw.get("content")
    texts: list[str] = []
    parts: list[str] = []
    if isinstance(content, str):
        texts.append(content)
    elif isinstance(content, list):
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text":
                texts.append(str(part.get("text") or ""))
            elif isinstance(part, dict):
                parts.append(str(part.get("type")))
    tool_calls = []
    for call in raw.get("tool_calls") or []:
        function = call.get("function") or {}
        tool_calls.append({"id": call.get("id"), "name": function.get("name"), "arguments": function.get("arguments")})
        if call.get("id"):
            calls[str(call["id"])] = str(function.get("name"))
    call_id = raw.get("tool_call_id")
    return Message(role=str(raw.get("role") or "?"), text="\n".join(texts) if texts or content is not None else None,
                   parts=parts, tool_calls=tool_calls, tool_call_id=call_id,
                   tool_name=calls.get(str(call_id)) if call_id else None, name=raw.get("name"))


def branch_steps(turns: list[dict[str, Any]], branch: list[str]) -> list[Step]:
    """The steps of one branch (turn ids root to leaf)."""
    by_id = {t["id"]: t for t in turns}
    calls: dict[str, str] = {}
    steps = []
    for position, turn_id in enumerate(branch):
        turn = by_id[turn_id]
        request = turn.get("request_messages") or []
        parent = by_id.get(branch[position - 1]) if position else None
        known = len(parent.get("request_messages") or []) + 1 if parent else 0
        continues = parent is not None and len(request) >= known and request[known - 1].get("role") == "assistant"
        added = request[known:] if continues else request
        for raw in request[:known] if continues else []:  # calls made earlier name the results that follow
            message(raw, calls)
        steps.append(Step(turn=turn, added=[message(m, calls) for m in added],
                          answer=message(turn.get("response_message") or {}, calls), whole_history=not continues))
    return steps


def leaf_branch(branches: list[list[str]], leaf_turn_id: str | None) -> int:
    """Which branch a group member is: the one ending at ``leaf_turn_id``, else the latest."""
    for index, branch in enumerate(branches):
        if leaf_turn_id is not None and branch and branch[-1] == leaf_turn_id:
            return index
    return len(branches) - 1
