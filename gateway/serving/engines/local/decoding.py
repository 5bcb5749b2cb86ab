"""Choosing tokens and cutting text: temperature and top-p sampling, stop strings, tool-call hold-back.

Decoding is our own loop rather than ``model.generate``: the worker needs one step at a
time per job, per-token logprobs in OpenAI's shape, streaming that holds back possible
stop strings and tool-call markers, and the exact token ids for training capture.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flywheel.gateway.serving.engines.local.toolcalls import partial_marker_start, tool_call_hold_start
from flywheel.gateway.serving.engines.local.vocabulary import Detokenizer


@dataclass(frozen=True)
class Sampling:
    """Decoding parameters of one request (validated by ``flywheel.gateway.core.protocol`` and the engine's limits)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stop: tuple[str, ...] = ()
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    adapter: str | None = None  # None: the base model
    hold_tool_calls: bool = False  # chat with tools: stream must not leak <tool_call> text
    ignore_eos: bool = False  # vLLM's extension: keep sampling past EOS until max_tokens
    without_replacement: bool = False  # the n choices are distinct: stochastic beam search (beams.py)


@dataclass
class Token:
    id: int
    logprob: float | None
    top: list[tuple[int, float]] | None
    offset: int  # characters of completion text before this token (legacy text_offset)


@dataclass
class Delta:
    """What one choice produced since its last delta (worker -> event loop)."""

    index: int
    text: str
    tokens: list[Token]
    finish_reason: str | None = None
    full_text: str | None = None  # the whole completion text, on the final delta
    inclusion_logprob: float | None = None  # drawn without replacement: log q, on the final delta (beams.py)


class Choice:
    """Text state of one sampled sequence: stop strings, hold-back, finish."""

    def __init__(self, index: int, sampling: Sampling, eos_ids: set[int], detokenizer: Detokenizer) -> None:
        self.index = index
        self.sampling = sampling
        self.eos_ids = eos_ids
        self.detokenizer = detokenizer
        self.token_count = 0
        self.text = ""
        self.released = 0  # characters of text already handed out
        self.pending: list[Token] = []  # tokens whose text is not handed out yet
        self.finish_reason: str | None = None
        self._stopped_by_string = False  # text was cut at a stop string: nothing more to flush

    def add(self, token_id: int, logprob: float | None, top: list[tuple[int, float]] | None) -> Delta | None:
        self.token_count += 1
        self.pending.append(Token(token_id, logprob, top, len(self.text)))
        if token_id in self.eos_ids and not self.sampling.ignore_eos:
            self.finish_reason = "stop"
        else:
            self.text += self.detokenizer.add(token_id)
            self._check_stop()
        if self.finish_reason is None and self.token_count >= self.sampling.max_tokens:
            self.finish_reason = "length"
        if self.finish_reason is not None:
            if not self._stopped_by_string:
                self.text += self.detokenizer.flush()
            return self._release(len(self.text))
        end = self._hold_start()
        return self._release(end) if end > self.released else None

    def _check_stop(self) -> None:
        # Any stop string lies after `released`: a possible stop prefix is never released.
        hits = [i for s in self.sampling.stop if (i := self.text.find(s, self.released)) >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self.finish_reason = "stop"
            self._stopped_by_string = True

    def _hold_start(self) -> int:
        end = len(self.text)
        for stop in self.sampling.stop:
            end = min(end, partial_marker_start(self.text, stop))
        if self.sampling.hold_tool_calls:
            end = min(end, tool_call_hold_start(self.text, self.released))
        return max(end, self.released)

    def _release(self, end: int) -> Delta:
        finished = self.finish_reason is not None
        delta = Delta(self.index, self.text[self.released:end], self.pending, self.finish_reason,
                      self.text if finished else None)
        self.released, self.pending = end, []
        return delta


@dataclass
class Picked:
    """One decode step's tokens, one per row, with their logprobs when asked for."""

    tokens: list[int]
    logprobs: list[float] | None = None
    top: list[list[tuple[int, float]]] | None = None


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    # Keep the smallest prefix whose mass reaches top_p (the most likely token always stays).
    outside = sorted_probs.cumsum(dim=-1) - sorted_probs > top_p
    sorted_probs = sorted_probs.masked_fill(outside, 0.0)
    return torch.zeros_like(probs).scatter(-1, order, sorted_probs)


def sample(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> Picked:
    """Pick one token per row of ``logits`` (rows x vocab, float32)."""
    if sampling.temperature > 0:
        scaled = logits / sampling.temperature
        probs = torch.softmax(scaled, dim=-1)
        if sampling.top_p < 1.0:
            probs = top_p_filter(probs, sampling.top_p)
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(1)
    else:
        scaled = logits
        tokens = logits.argmax(dim=-1)
    if not sampling.logprobs:
        return Picked(tokens.tolist())
    # log_softmax(logits / temperature) before top-p (raw when greedy): what TRL recomputes, vLLM's processed_logprobs
    logprobs = torch.log_softmax(scaled, dim=-1)
    chosen = logprobs.gather(1, tokens[:, None]).squeeze(1).tolist()
    top = None
    if sampling.top_logprobs > 0:
        values, indices = logprobs.topk(sampling.top_logprobs, dim=-1)
        top = [list(zip(ids, vals, strict=True)) for ids, vals in zip(indices.tolist(), values.tolist(),
                                                                        strict=True)]
    return Picked(tokens.tolist(), chosen, top)
