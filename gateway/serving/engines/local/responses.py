"""OpenAI shapes of what the worker produced: responses, chunks, logprobs, usage (vLLM's dialect)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from flywheel.gateway.serving.engines.base import Body, Chunk
from flywheel.gateway.serving.engines.local.decoding import Delta, Token
from flywheel.gateway.serving.engines.local.prompts import PreparedRequest
from flywheel.gateway.serving.engines.local.toolcalls import parse_tool_calls
from flywheel.gateway.serving.engines.local.vocabulary import Vocabulary

MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM reports impossible tokens the same way


@dataclass
class Result:
    """Everything one choice produced, for non-streaming responses."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    tokens: list[Token] = field(default_factory=list)
    finish_reason: str = "stop"
    inclusion_logprob: float | None = None

    def add(self, delta: Delta) -> None:
        self.tokens.extend(delta.tokens)
        self.token_ids.extend(t.id for t in delta.tokens)
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self.text = delta.full_text or ""
            self.inclusion_logprob = delta.inclusion_logprob


def _logprob(value: float | None) -> float:
    return max(float(value if value is not None else MIN_LOGPROB), MIN_LOGPROB)


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def chat_logprobs(vocab: Vocabulary, tokens: list[Token], top_n: int) -> list[dict[str, Any]]:
    entries = []
    for token in tokens:
        text, raw = vocab.show(token.id)
        alternatives = []
        for alt_id, alt_lp in (token.top or [])[:top_n]:
            alt_text, alt_raw = vocab.show(alt_id)
            alternatives.append({"token": alt_text, "logprob": _logprob(alt_lp), "bytes": alt_raw})
        entries.append({"token": text, "logprob": _logprob(token.logprob), "bytes": raw,
                        "top_logprobs": alternatives})
    return entries


def legacy_logprobs(vocab: Vocabulary, tokens: list[Token], top_n: int) -> dict[str, Any]:
    return {
        "tokens": [vocab.show(t.id)[0] for t in tokens],
        "token_logprobs": [_logprob(t.logprob) for t in tokens],
        "top_logprobs": [{vocab.show(i)[0]: _logprob(lp) for i, lp in (t.top or [])[:top_n]} for t in tokens],
        "text_offset": [t.offset for t in tokens],
    }


def head(kind: str, model: Any) -> Body:
    """The fields every chunk of one response (or the response itself) shares."""
    prefix = "chatcmpl" if kind.startswith("chat.") else "cmpl"
    return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()), "model": model}


def chat_response(request: PreparedRequest, results: list[Result], model: Any, vocab: Vocabulary) -> Body:
    sampling = request.sampling
    choices = []
    for index, result in enumerate(results):
        content: str | None = result.text
        calls: list[dict[str, Any]] = []
        if request.parse_tools:
            content, calls = parse_tool_calls(result.text)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        choice: dict[str, Any] = {
            "index": index, "message": message,
            "logprobs": ({"content": chat_logprobs(vocab, result.tokens, sampling.top_logprobs)}
                         if sampling.logprobs else None),
            "finish_reason": "tool_calls" if calls else result.finish_reason}
        if request.return_token_ids:
            choice["token_ids"] = result.token_ids
        if result.inclusion_logprob is not None:  # drawn without replacement: log q given the draw's threshold
            choice["inclusion_logprob"] = result.inclusion_logprob
        choices.append(choice)
    response: Body = {**head("chat.completion", model), "choices": choices,
                      "usage": usage(len(request.prompts[0]), sum(len(r.token_ids) for r in results))}
    if request.return_token_ids:
        response["prompt_token_ids"] = request.prompts[0]
    return response


def completion_response(request: PreparedRequest, results: list[Result], model: Any, vocab: Vocabulary) -> Body:
    sampling, n = request.sampling, request.sampling.n
    choices = []
    for index, result in enumerate(results):
        choice: dict[str, Any] = {
            "index": index, "text": result.text,
            "logprobs": legacy_logprobs(vocab, result.tokens, sampling.top_logprobs) if sampling.logprobs else None,
            "finish_reason": result.finish_reason}
        if request.return_token_ids:
            choice["prompt_token_ids"] = request.prompts[index // n]
            choice["token_ids"] = result.token_ids
        if result.inclusion_logprob is not None:
            choice["inclusion_logprob"] = result.inclusion_logprob
        choices.append(choice)
    prompt_tokens = sum(len(p) for p in request.prompts)
    return {**head("text_completion", model), "choices": choices,
            "usage": usage(prompt_tokens, sum(len(r.token_ids) for r in results))}


class ChatChunks:
    """The ``chat.completion.chunk`` objects of one streamed chat response."""

    def __init__(self, request: PreparedRequest, model: Any, vocab: Vocabulary) -> None:
        self.request = request
        self.vocab = vocab
        self.head = head("chat.completion.chunk", model)

    def _chunk(self, choice: dict[str, Any], **extra: Any) -> Chunk:
        return {**self.head, "choices": [choice], **extra}

    def opening(self) -> Iterator[Chunk]:
        """One role chunk per choice; the first carries the prompt's token ids when asked for."""
        extra = {"prompt_token_ids": self.request.prompts[0]} if self.request.return_token_ids else {}
        for index in range(self.request.sampling.n):
            yield self._chunk({"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                               "finish_reason": None}, **extra)

    def piece(self, index: int, delta: dict[str, Any], tokens: list[Token], finish: str | None) -> Chunk:
        sampling = self.request.sampling
        choice: dict[str, Any] = {
            "index": index, "delta": delta,
            "logprobs": ({"content": chat_logprobs(self.vocab, tokens, sampling.top_logprobs)}
                         if sampling.logprobs and tokens else None),
            "finish_reason": finish}
        if self.request.return_token_ids:
            choice["token_ids"] = [t.id for t in tokens]
        return self._chunk(choice)

    def of(self, delta: Delta) -> Iterator[Chunk]:
        """The chunks of one delta: its text, or, at the end, the last text, the tool calls and the finish."""
        if delta.finish_reason is None:
            yield self.piece(delta.index, {"content": delta.text}, delta.tokens, None)
            return
        text, finish = delta.text, delta.finish_reason
        calls: list[dict[str, Any]] = []
        if self.request.parse_tools:
            content, calls = parse_tool_calls(delta.text)
            if calls:
                text, finish = content or "", "tool_calls"
        tokens = delta.tokens
        if text:
            yield self.piece(delta.index, {"content": text}, tokens, None)
            tokens = []
        if calls:
            tool_deltas = [{"index": k, **call} for k, call in enumerate(calls)]
            yield self.piece(delta.index, {"tool_calls": tool_deltas}, tokens, None)
            tokens = []
        yield self.piece(delta.index, {}, tokens, finish)

    def usage(self, completion_tokens: int) -> Chunk:
        return {**self.head, "choices": [], "usage": usage(len(self.request.prompts[0]), completion_tokens)}


class CompletionChunks:
    """The ``text_completion`` chunks of one streamed legacy completion."""

    def __init__(self, request: PreparedRequest, model: Any, vocab: Vocabulary) -> None:
        self.request = request
        self.vocab = vocab
        self.head = head("text_completion", model)
        self._started: set[int] = set()

    def of(self, job: int, delta: Delta) -> Chunk:
        sampling = self.request.sampling
        index = job * sampling.n + delta.index
        choice: dict[str, Any] = {
            "index": index, "text": delta.text,
            "logprobs": legacy_logprobs(self.vocab, delta.tokens, sampling.top_logprobs) if sampling.logprobs else None,
            "finish_reason": delta.finish_reason}
        if self.request.return_token_ids:
            if index not in self._started:  # vLLM sends the prompt's ids with each choice's first chunk
                choice["prompt_token_ids"] = self.request.prompts[job]
            choice["token_ids"] = [t.id for t in delta.tokens]
        self._started.add(index)
        return {**self.head, "choices": [choice]}

    def usage(self, completion_tokens: int) -> Chunk:
        return {**self.head, "choices": [], "usage": usage(sum(len(p) for p in self.request.prompts),
                                                           completion_tokens)}
