"""Reassemble a streamed response into the non-streaming shape, exactly.

Content deltas are concatenated per choice; tool-call fragments are joined by their
``index`` (the id, type and name come once, the arguments in pieces); per-chunk token
ids and logprobs are appended in order; the usage chunk and vLLM's
``prompt_token_ids`` (first chunk) are kept.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    role: str = "assistant"
    tool_calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    legacy_logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    saw_token_ids: bool = False
    saw_logprobs: bool = False


class StreamAssembler:
    """Feed it every chunk of one stream; ``response()`` gives the equivalent full response."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.id: str | None = None
        self.created: int | None = None
        self.model: str | None = None
        self.prompt_token_ids: list[int] | None = None
        self.usage: dict[str, Any] | None = None
        self._choices: dict[int, _Choice] = {}

    def add(self, chunk: dict[str, Any]) -> None:
        self.id = self.id or chunk.get("id")
        self.created = self.created or chunk.get("created")
        self.model = self.model or chunk.get("model")
        if chunk.get("prompt_token_ids") is not None:
            self.prompt_token_ids = chunk["prompt_token_ids"]
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            state = self._choices.setdefault(int(choice.get("index", 0)), _Choice())
            if self.endpoint == "chat.completions":
                self._add_delta(state, choice.get("delta") or {})
            elif choice.get("text"):
                state.text.append(choice["text"])
            if choice.get("token_ids") is not None:
                state.saw_token_ids = True
                state.token_ids.extend(choice["token_ids"])
            if self.prompt_token_ids is None and choice.get("prompt_token_ids") is not None:
                self.prompt_token_ids = choice["prompt_token_ids"]
            self._add_logprobs(state, choice.get("logprobs"))
            if choice.get("finish_reason"):
                state.finish_reason = choice["finish_reason"]

    @staticmethod
    def _add_delta(state: _Choice, delta: dict[str, Any]) -> None:
        if delta.get("role"):
            state.role = delta["role"]
        if delta.get("content"):
            state.text.append(delta["content"])
        for call in delta.get("tool_calls") or ():
            slot = state.tool_calls.setdefault(int(call.get("index", 0)),
                                               {"id": None, "type": "function",
                                                "function": {"name": "", "arguments": ""}})
            if call.get("id"):
                slot["id"] = call["id"]
            if call.get("type"):
                slot["type"] = call["type"]
            function = call.get("function") or {}
            if function.get("name"):
                slot["function"]["name"] += function["name"]
            if function.get("arguments"):
                slot["function"]["arguments"] += function["arguments"]

    @staticmethod
    def _add_logprobs(state: _Choice, logprobs: Any) -> None:
        if not isinstance(logprobs, dict):
            return
        state.saw_logprobs = True
        if isinstance(logprobs.get("content"), list):
            state.logprobs.extend(logprobs["content"])
        if isinstance(logprobs.get("token_logprobs"), list):
            state.legacy_logprobs.extend(logprobs["token_logprobs"])

    def completion_tokens(self, *, below: int) -> int:
        """Tokens sampled for the choices with an index below ``below`` (a forked stream's client part)."""
        return sum(len(state.token_ids) for index, state in self._choices.items() if index < below)

    def response(self) -> dict[str, Any]:
        choices = [self._choice(index, state) for index, state in sorted(self._choices.items())]
        out: dict[str, Any] = {"id": self.id, "created": self.created, "model": self.model, "choices": choices,
                               "object": "chat.completion" if self.endpoint == "chat.completions"
                               else "text_completion", "usage": self.usage}
        if self.prompt_token_ids is not None:
            out["prompt_token_ids"] = self.prompt_token_ids
        return out

    def _choice(self, index: int, state: _Choice) -> dict[str, Any]:
        text = "".join(state.text)
        out: dict[str, Any] = {"index": index, "finish_reason": state.finish_reason}
        if self.endpoint == "chat.completions":
            message: dict[str, Any] = {"role": state.role, "content": text or None}
            if state.tool_calls:
                message["tool_calls"] = [state.tool_calls[i] for i in sorted(state.tool_calls)]
            out["message"] = message
            out["logprobs"] = {"content": state.logprobs} if state.saw_logprobs else None
        else:
            out["text"] = text
            out["logprobs"] = {"token_logprobs": state.legacy_logprobs} if state.saw_logprobs else None
        if state.saw_token_ids:
            out["token_ids"] = state.token_ids
        return out
