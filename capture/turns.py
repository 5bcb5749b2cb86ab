"""From one request/response exchange to the turn rows the store keeps.

The gateway hands the recorder a :class:`CapturedExchange` (references to the dicts it
already has, built after the last byte went out). :func:`prepare_turns` does the
rest off the request path: one row per choice, canonical hashes for the linker,
redaction, and the exact token ids and logprobs when the engine returned them.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import os
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import orjson

from flywheel.capture.canonical import ROOT, extend_hash, message_hash, prefix_hashes, task_key
from flywheel.capture.redaction import Redactor

log = logging.getLogger("flywheel.capture")

_NOT_PARAMS = {"messages", "prompt", "tools", "metadata", "model", "stream", "stream_options"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{os.urandom(16).hex()}"  # 128 random bits, as uuid4().hex but cheaper


def turn_id(exchange_id: str, position: int) -> str:
    """The id of the turn of the ``position``-th choice: the same every time its exchange is prepared."""
    return "turn_" + hashlib.blake2b(f"{exchange_id}/{position}".encode(), digest_size=16).hexdigest()


@dataclass
class CapturedExchange:
    """One answered request, as the gateway saw it."""

    completion_id: str
    endpoint: str  # "chat.completions" | "completions"
    requested_model: str
    alias: str
    engine_model: str
    adapter_version: int
    client_key_id: str | None
    request: dict[str, Any]  # the client's body
    response: dict[str, Any]  # the engine's full answer in non-streaming shape (token ids included)
    created_at: datetime
    latency_ms: float
    trajectory_id: str | None = None  # X-Flywheel-Trajectory-Id or metadata.trajectory_id
    parent_trajectory_id: str | None = None  # X-Flywheel-Parent-Trajectory-Id: a sub-agent's call, for that agent
    task: str | None = None  # X-Flywheel-Task
    group_id: str | None = None  # X-Flywheel-Group-Id
    source: str = "client"  # "client" | "fork"
    client_choices: int | None = None  # forked request: choices from this index on are siblings the client never saw
    other_arm: tuple[int, int, str] | None = None  # (choice index, adapter_version, engine_model): a canary's fork
    explored: tuple[int, int, str] | None = None  # (first choice index, version, engine_model): the head's siblings
    # Fixed where the exchange is made: its turns' ids derive from it, so a resent or re-spooled exchange is skipped.
    exchange_id: str = field(default_factory=lambda: os.urandom(16).hex())

    def to_line(self) -> bytes:
        """One JSON line, as the gateway streams it to the store process (orjson: ~10 us, no copies)."""
        return orjson.dumps(self) + b"\n"

    @classmethod
    def from_line(cls, line: bytes) -> CapturedExchange:
        data = orjson.loads(line)
        data["created_at"] = datetime.fromisoformat(data["created_at"])
        return cls(**data)


@dataclass
class PreparedTurn:
    """A turn row ready to link and insert (already redacted); JSON-serializable for the spool."""

    row: dict[str, Any]
    explicit_trajectory_id: str | None
    assistant_prefix_hashes: list[str] = field(default_factory=list)  # last assistant message first
    parent_trajectory_id: str | None = None  # the sub-agent's parent, as the client tagged it

    def to_json(self) -> dict[str, Any]:
        # Not dataclasses.asdict: it deep-copies the row (token ids, messages)
        return {"row": {**self.row, "created_at": self.row["created_at"].isoformat()},
                "explicit_trajectory_id": self.explicit_trajectory_id,
                "assistant_prefix_hashes": self.assistant_prefix_hashes,
                "parent_trajectory_id": self.parent_trajectory_id}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PreparedTurn:
        row = {**data["row"], "created_at": datetime.fromisoformat(data["row"]["created_at"])}
        return cls(row=row, explicit_trajectory_id=data["explicit_trajectory_id"],
                   assistant_prefix_hashes=data["assistant_prefix_hashes"],
                   parent_trajectory_id=data.get("parent_trajectory_id"))  # absent in older spools


def turn_position(messages: list[dict[str, Any]]) -> int:
    """Which turn of its conversation a request asks for: the assistant messages before it (0: the first)."""
    return sum(m.get("role") == "assistant" for m in messages)


def prepare_turns(exchange: CapturedExchange, redactor: Redactor | None) -> list[PreparedTurn]:
    """One :class:`PreparedTurn` per choice of the response, from the exchange with every text redacted."""
    redaction = redact_exchange(exchange, redactor)
    exchange = redaction.exchange
    request = exchange.request
    redacted_messages = messages = _request_messages(exchange)  # redacted above
    hashes = prefix_hashes(redacted_messages)
    h_ctx = hashes[-1] if hashes else ROOT
    assistant_hashes = [hashes[i] for i in range(len(messages) - 1, -1, -1) if messages[i].get("role") == "assistant"]
    metadata = request.get("metadata") if isinstance(request.get("metadata"), dict) else None
    explicit = exchange.trajectory_id or _metadata_text(metadata, "trajectory_id")
    parent_trajectory = exchange.parent_trajectory_id or _metadata_text(metadata, "parent_trajectory_id")
    h_replied_to = message_hash(redacted_messages[-1]) if redacted_messages else None
    tools = request.get("tools")
    usage = exchange.response.get("usage") or {}
    prompt_ids = exchange.response.get("prompt_token_ids")
    choices = exchange.response.get("choices") or []
    single_choice_tokens = int(usage.get("completion_tokens") or 0) if len(choices) == 1 else 0
    out: list[PreparedTurn] = []
    for position, choice in enumerate(choices):
        stored_message = _response_message(choice, exchange.endpoint)
        redacted = redaction.prompt_changed or position in redaction.changed_choices
        completion_ids = choice.get("token_ids")
        index = int(choice.get("index", 0))
        forked = exchange.client_choices is not None and index >= exchange.client_choices
        other, explored = exchange.other_arm, exchange.explored
        if other is not None and index == other[0]:  # the canary's other arm
            version, engine_model = other[1], other[2]
        elif explored is not None and index >= explored[0]:  # the training head's siblings
            version, engine_model = explored[1], explored[2]
        else:
            version, engine_model = exchange.adapter_version, exchange.engine_model
        row: dict[str, Any] = {
            "id": turn_id(exchange.exchange_id, position),
            "completion_id": exchange.completion_id,
            "choice_index": index,
            "source": "fork" if forked else exchange.source,
            "endpoint": exchange.endpoint,
            "created_at": exchange.created_at,
            "latency_ms": exchange.latency_ms,
            "requested_model": exchange.requested_model,
            "alias": exchange.alias,
            "engine_model": engine_model,
            "adapter_version": version,
            "client_key_id": exchange.client_key_id,
            "request_messages": redacted_messages,
            "tools": tools,
            "params": {k: v for k, v in request.items() if k not in _NOT_PARAMS},
            "request_metadata": metadata,
            "response_message": stored_message,
            "finish_reason": choice.get("finish_reason"),
            # Training must never see the tokens of text that redaction changed.
            "prompt_token_ids": None if redacted else (prompt_ids or choice.get("prompt_token_ids")),
            "completion_token_ids": None if redacted else completion_ids,
            "completion_logprobs": None if redacted else _sampled_logprobs(choice),
            "inclusion_logprob": choice.get("inclusion_logprob") if forked else None,
            "canary_pair": True if other is not None and index == other[0] else None,
            "prompt_tokens": int(usage.get("prompt_tokens") or 0),
            "completion_tokens": len(completion_ids) if completion_ids else single_choice_tokens,
            "h_ctx": h_ctx,
            "h_out": extend_hash(h_ctx, stored_message),
            "task_key": exchange.task or task_key(redacted_messages, tools),
            "group_key": exchange.group_id,
            "redacted": redacted,
            "h_answer": message_hash(stored_message),
            "h_replied_to": h_replied_to,
        }
        out.append(PreparedTurn(row=row, explicit_trajectory_id=explicit, assistant_prefix_hashes=assistant_hashes,
                                parent_trajectory_id=parent_trajectory))
    return out


def _metadata_text(metadata: dict[str, Any] | None, key: str) -> str | None:
    """A tag the client put in the body's ``metadata`` (as a string), or None."""
    return str(metadata[key]) if metadata and metadata.get(key) else None


def prepare_lines(lines: list[bytes], redactor: Redactor | None, outcome: Counter[str]) -> list[PreparedTurn]:
    """The turns of the exchanges in ``lines`` (:meth:`CapturedExchange.to_line`); an unreadable line, or an
    exchange that cannot be prepared, is logged and counted as failed in ``outcome``: never the batch's end."""
    out: list[PreparedTurn] = []
    for line in lines:
        try:
            out.extend(prepare_turns(CapturedExchange.from_line(line), redactor))
        except Exception:  # one odd exchange must cost itself only, never its batch or the writer task
            log.exception("could not prepare a captured exchange (%d bytes)", len(line))
            outcome["failed"] += 1
    return out


def _request_messages(exchange: CapturedExchange) -> list[dict[str, Any]]:
    if exchange.endpoint == "chat.completions":
        return list(exchange.request.get("messages") or [])
    prompt = exchange.request.get("prompt")
    return [{"role": "user", "content": prompt if isinstance(prompt, str) else str(prompt)}]


def _response_message(choice: dict[str, Any], endpoint: str) -> dict[str, Any]:
    if endpoint != "chat.completions":
        return {"role": "assistant", "content": choice.get("text") or ""}
    message = choice.get("message") or {}
    out: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
    if message.get("tool_calls"):
        out["tool_calls"] = message["tool_calls"]
    return out


def _sampled_logprobs(choice: dict[str, Any]) -> list[float] | None:
    logprobs = choice.get("logprobs")
    if not isinstance(logprobs, dict):
        return None
    if isinstance(logprobs.get("content"), list):
        return [float(entry["logprob"]) for entry in logprobs["content"]]
    if isinstance(logprobs.get("token_logprobs"), list):
        return [float(x) for x in logprobs["token_logprobs"]]
    return None


@dataclass(frozen=True)
class RedactedExchange:
    """A captured exchange with every text redacted, and which texts that the engine's tokens cover changed."""

    exchange: CapturedExchange
    prompt_changed: bool  # the request (what the prompt tokens were rendered from) changed
    changed_choices: frozenset[int]  # positions in response["choices"] whose answer changed


def redact_exchange(exchange: CapturedExchange, redactor: Redactor | None) -> RedactedExchange:
    """Every string a turn row takes from ``exchange``, redacted: the whole request (messages, tools, params,
    metadata, unknown fields: keys and values), each choice's answer, and the strings the client named
    (model, trajectory, task, group). Token ids and logprobs are not text and are not walked; the ids the
    gateway or the engine made (completion id, alias, engine model) are kept as they are."""
    if redactor is None:
        return RedactedExchange(exchange, False, frozenset())
    request, response = exchange.request, exchange.response
    redacted_request = redactor.json(request)
    choices = response.get("choices") or []
    redacted_choices = [_answer(choice, redactor) for choice in choices]
    changed = frozenset(i for i, (new, old) in enumerate(zip(redacted_choices, choices, strict=True)) if new is not old)
    def maybe(text: str | None) -> str | None:
        return None if text is None else redactor.text(text)

    out = copy.copy(exchange)  # not dataclasses.replace: it re-runs __init__ over every field
    out.request, out.requested_model = redacted_request, redactor.text(exchange.requested_model)
    out.response = {**response, "choices": redacted_choices} if changed else response
    out.trajectory_id, out.task, out.group_id = maybe(exchange.trajectory_id), maybe(exchange.task), \
        maybe(exchange.group_id)
    return RedactedExchange(out, _prompt_changed(request, redacted_request), changed)


def _prompt_changed(before: dict[str, Any], after: dict[str, Any]) -> bool:
    """Whether redaction changed a request field the prompt may be rendered from (all but ``_NOT_PROMPT``)."""
    if after is before:
        return False
    if any(key not in after for key in before):  # a top-level key was itself redacted
        return True
    return any(after[key] is not item for key, item in before.items() if key not in _NOT_PROMPT)


# Never rendered into the prompt (vLLM passes unknown fields to the template): redacting these keeps the token ids
_NOT_PROMPT = frozenset({"metadata", "user", "model"})


def _answer(choice: Any, redactor: Redactor) -> Any:
    """A choice with its answer (chat ``message``, legacy ``text``) redacted; its logprobs are not stored."""
    if not isinstance(choice, dict):
        return choice
    key = "message" if "message" in choice else "text"
    answer = choice.get(key)
    redacted = redactor.json(answer)
    return choice if redacted is answer else {**choice, key: redacted}
