"""A span per captured completion, following OpenTelemetry's GenAI semantic conventions.

Built in the store process right after a batch of turns is written (:class:`TracedStore`), from
what the turns hold: the request's arrival and latency, the models, the token counts, the finish
reasons and — known only once the linker has placed the turn — the trajectory, which becomes
``gen_ai.conversation.id`` and ``session.id`` (how Langfuse groups a conversation's traces). The
request path pays nothing; the store process pays one indexed lookup per batch.

The conversation text goes out only with ``[telemetry] capture_content`` (the stored text, so
redaction has already applied), as the conventions' opt-in ``gen_ai.input.messages`` /
``gen_ai.output.messages`` / ``gen_ai.tool.definitions``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as gen_ai
from opentelemetry.semconv._incubating.attributes.session_attributes import SESSION_ID
from sqlmodel import col, select

from flywheel.capture.models import Turn
from flywheel.capture.store import Store
from flywheel.capture.turns import PreparedTurn
from flywheel.gateway.core.tracing import Tracing

log = logging.getLogger("flywheel.telemetry")

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_OPERATIONS = {"chat.completions": "chat", "completions": "text_completion"}
# Request fields recorded as gen_ai.request.*, with the type the convention gives them.
_NUMERIC_PARAMS = {"temperature": gen_ai.GEN_AI_REQUEST_TEMPERATURE, "top_p": gen_ai.GEN_AI_REQUEST_TOP_P,
                   "frequency_penalty": gen_ai.GEN_AI_REQUEST_FREQUENCY_PENALTY,
                   "presence_penalty": gen_ai.GEN_AI_REQUEST_PRESENCE_PENALTY}
_INTEGER_PARAMS = {"max_tokens": gen_ai.GEN_AI_REQUEST_MAX_TOKENS,
                   "max_completion_tokens": gen_ai.GEN_AI_REQUEST_MAX_TOKENS, "seed": gen_ai.GEN_AI_REQUEST_SEED}


def unix_ns(moment: datetime) -> int:
    """Nanoseconds since the epoch, exact to the microsecond (a float timestamp is not)."""
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return (moment - _EPOCH) // timedelta(microseconds=1) * 1000


class TracedStore(Store):
    """The store, emitting a completion span for every turn a write stored."""

    def __init__(self, url: str | Path, tracing: Tracing, *, capture_content: bool) -> None:
        super().__init__(url)
        self.tracing = tracing
        self.capture_content = capture_content

    def write_turns(self, prepared: Iterable[PreparedTurn], **options: Any) -> int:
        batch = list(prepared)
        written = super().write_turns(batch, **options)
        try:
            self._trace([item.row for item in batch])
        except Exception:  # tracing must never fail capture
            log.exception("could not build the spans of %d turns", len(batch))
        return written

    def close(self) -> None:
        self.tracing.shutdown()  # after the recorder's drain: the last batch's spans go out too
        super().close()

    def _trace(self, rows: list[dict[str, Any]]) -> None:
        linked = self._trajectories([row["id"] for row in rows])
        completions: dict[str, list[dict[str, Any]]] = {}
        for row in rows:
            if row["id"] in linked:  # a turn the write did not store (a spool's duplicate) has no span now
                completions.setdefault(row["completion_id"], []).append({**row, "trajectory_id": linked[row["id"]]})
        for turns in completions.values():
            name, start, end, attributes = completion_span(turns, capture_content=self.capture_content)
            self.tracing.emit(name, start, end, attributes, client=True)

    def _trajectories(self, turn_ids: list[str]) -> dict[str, str]:
        """Where the linker put each turn: its trajectory id."""
        found: dict[str, str] = {}
        with self.session() as session:
            for start in range(0, len(turn_ids), 500):
                chunk = turn_ids[start:start + 500]
                found.update(session.exec(select(Turn.id, Turn.trajectory_id).where(col(Turn.id).in_(chunk))).all())
        return found


def completion_span(turns: Sequence[dict[str, Any]], *, capture_content: bool = False
                    ) -> tuple[str, int, int, dict[str, Any]]:
    """(name, start ns, end ns, attributes) of the span of one completion: its turns, one per choice."""
    shown = [t for t in turns if t["source"] != "fork"] or list(turns)  # what the client received
    first = shown[0]
    operation = _OPERATIONS.get(first["endpoint"], first["endpoint"])
    start = unix_ns(first["created_at"])
    attributes: dict[str, Any] = {
        gen_ai.GEN_AI_OPERATION_NAME: operation,
        gen_ai.GEN_AI_PROVIDER_NAME: "flywheel",
        gen_ai.GEN_AI_REQUEST_MODEL: first["requested_model"],
        gen_ai.GEN_AI_RESPONSE_MODEL: first["engine_model"],
        gen_ai.GEN_AI_RESPONSE_ID: first["completion_id"],
        gen_ai.GEN_AI_RESPONSE_FINISH_REASONS: [t["finish_reason"] or "" for t in shown],
        gen_ai.GEN_AI_USAGE_INPUT_TOKENS: int(first["prompt_tokens"] or 0),
        gen_ai.GEN_AI_USAGE_OUTPUT_TOKENS: sum(int(t["completion_tokens"] or 0) for t in shown),
        gen_ai.GEN_AI_CONVERSATION_ID: first["trajectory_id"],
        SESSION_ID: first["trajectory_id"],
        "flywheel.alias": first["alias"],
        "flywheel.adapter_version": int(first["adapter_version"]),
        "flywheel.turn_ids": [t["id"] for t in shown],
        "flywheel.forked_samples": len(turns) - len(shown),
        "flywheel.redacted": any(t["redacted"] for t in shown),
    }
    if first.get("client_key_id"):
        attributes["flywheel.client_key_id"] = first["client_key_id"]
    attributes |= request_attributes(first.get("params") or {}, len(shown))
    if capture_content:
        attributes |= content_attributes(first, shown)
    end = start + int(float(first["latency_ms"] or 0.0) * 1_000_000)
    return f"{operation} {first['requested_model']}", start, end, attributes


def request_attributes(params: dict[str, Any], choices: int) -> dict[str, Any]:
    """The sampling parameters the client sent, where they have the convention's type (client input)."""
    out: dict[str, Any] = {}
    for key, name in _NUMERIC_PARAMS.items():
        value = params.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            out[name] = float(value)
    for key, name in _INTEGER_PARAMS.items():
        value = params.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            out[name] = value
    stop = params.get("stop")
    stops = [stop] if isinstance(stop, str) else stop
    if isinstance(stops, list) and stops and all(isinstance(s, str) for s in stops):
        out[gen_ai.GEN_AI_REQUEST_STOP_SEQUENCES] = stops
    if choices != 1:
        out[gen_ai.GEN_AI_REQUEST_CHOICE_COUNT] = choices
    return out


def content_attributes(first: dict[str, Any], shown: Sequence[dict[str, Any]]) -> dict[str, str]:
    """The opt-in content attributes, as JSON in the conventions' message shape (role + parts)."""
    out = {gen_ai.GEN_AI_INPUT_MESSAGES: json.dumps([genai_message(m) for m in first["request_messages"] or []]),
           gen_ai.GEN_AI_OUTPUT_MESSAGES: json.dumps([{**genai_message(t["response_message"] or {}),
                                                       "finish_reason": t["finish_reason"]} for t in shown])}
    if first.get("tools"):
        out[gen_ai.GEN_AI_TOOL_DEFINITIONS] = json.dumps(first["tools"])
    return out


def genai_message(message: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI chat message as a GenAI message: text, tool calls and tool results as typed parts."""
    role = message.get("role") or "user"
    content = message.get("content")
    if role == "tool":
        return {"role": role, "parts": [{"type": "tool_call_response", "id": message.get("tool_call_id"),
                                         "response": content}]}
    parts: list[dict[str, Any]] = []
    if isinstance(content, str) and content:
        parts.append({"type": "text", "content": content})
    elif isinstance(content, list):
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text":
                parts.append({"type": "text", "content": part.get("text")})
            elif isinstance(part, dict):
                parts.append({"type": str(part.get("type"))})  # images and audio: the kind, not the data
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        parts.append({"type": "tool_call", "id": call.get("id"), "name": function.get("name"),
                      "arguments": function.get("arguments")})
    return {"role": role, "parts": parts}
