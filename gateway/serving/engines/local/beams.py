"""``n`` choices drawn without replacement: stochastic beam search (Kool, van Hoof & Welling, ICML 2019).

The ``n`` completions with the largest Gumbel-perturbed log-probabilities, found beam by beam: distinct
sequences, the first of them an exact sample of the policy and together a sample of ``n`` without
replacement. Forked turns' siblings are drawn this way (``[groups] fork_draw``) so that a group holds
every answer the policy still gives weight to, not four copies of its favourite (docs/learning.md).

Each beam keeps ``phi``, its log-probability under the sampling distribution (temperature, top-p), and
``g``, its perturbed value; a child's perturbed value is drawn conditioned on the largest of its
siblings' being the parent's (the paper's appendix B, in its numerically stable form). ``kappa``, the
largest perturbed value left out, is the (n+1)-th largest over all sequences: given it, a sequence is
in the sample with probability ``q = 1 - exp(-exp(phi - kappa))`` (the paper's section 4), what an
unbiased estimator weights it by (:func:`log_inclusion`).

Beams are reordered every step, so a choice's text is known only at the end: the whole answer comes
in one step (a streamed request gets it as one chunk).
"""

from __future__ import annotations

import math
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import torch

from flywheel.gateway.serving.engines.local.decoding import Choice, Delta, Sampling, top_p_filter
from flywheel.gateway.serving.engines.local.runtime import Runtime


@dataclass
class Beam:
    tokens: list[int]
    logprobs: list[float]  # log_softmax(logits / T) of each token: what sampling one at a time reports
    top: list[list[tuple[int, float]]]
    phi: float  # log-probability of the sequence under the sampling distribution
    g: float  # its perturbed value
    done: bool


def log_inclusion(phi: float, kappa: float) -> float:
    """log q, q = 1 - exp(-exp(phi - kappa)): the chance a sequence is among the drawn given ``kappa``."""
    if kappa == -math.inf:  # nothing was left out: every sequence there is was drawn
        return 0.0
    x = phi - kappa
    if x > 40:
        return 0.0
    rate = math.exp(x)
    return math.log(-math.expm1(-rate)) if rate > 1e-12 else x


def perturbed_children(parent_g: torch.Tensor, phi: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Perturbed values of every child (rows x vocab), their maximum per row equal to ``parent_g`` (rows x 1)."""
    u = torch.rand(phi.shape, generator=generator, device=phi.device).clamp(1e-20, 1 - 1e-7)
    g_tilde = phi - torch.log(-torch.log(u))  # phi + Gumbel(0, 1)
    z = g_tilde.max(dim=-1, keepdim=True).values
    # g = -log(exp(-parent_g) - exp(-z) + exp(-g_tilde)), stably (appendix B)
    v = parent_g - g_tilde + torch.log1p(-torch.exp(g_tilde - z).clamp(max=1 - 1e-7))
    return parent_g - v.clamp(min=0) - torch.log1p(torch.exp(-v.abs()))


def stochastic_beam_search(runtime: Runtime, prompt: list[int], sampling: Sampling, generator: torch.Generator,
                           ) -> Generator[None, None, tuple[list[Beam], float]]:
    """One decode step per ``next()``; returns the ``n`` beams, largest perturbed value first, and kappa."""
    n, device = sampling.n, runtime.device
    beams = [Beam([], [], [], 0.0, 0.0, False)]
    kappa = -math.inf
    inputs = torch.tensor([prompt], dtype=torch.long, device=device)
    cache: Any = None
    while True:
        logits, cache = runtime.forward(inputs, cache, sampling.adapter)
        scaled = logits / sampling.temperature
        logprobs = torch.log_softmax(scaled, dim=-1)
        drawn = logprobs if sampling.top_p >= 1.0 else \
            torch.log(top_p_filter(torch.softmax(scaled, dim=-1), sampling.top_p)).log_softmax(dim=-1)
        phi = torch.tensor([b.phi for b in beams], device=device)[:, None] + drawn
        g = perturbed_children(torch.tensor([b.g for b in beams], device=device)[:, None], phi, generator)
        g = g.masked_fill(torch.tensor([b.done for b in beams], device=device)[:, None], -math.inf)
        best = torch.topk(g, min(n + 1, g.shape[-1]), dim=-1)
        top = logprobs.topk(sampling.top_logprobs, dim=-1) if sampling.top_logprobs else None
        candidates: list[tuple[float, int, int | None]] = []  # (g, parent row, token; None: the beam as it is)
        for row, beam in enumerate(beams):
            if beam.done:
                candidates.append((beam.g, row, None))
                continue
            values, tokens = best.values[row].tolist(), best.indices[row].tolist()
            candidates += [(value, row, token) for value, token in zip(values[:n], tokens[:n], strict=True)
                           if value > -math.inf]
            if len(values) > n:
                kappa = max(kappa, values[n])
        candidates.sort(key=lambda c: c[0], reverse=True)
        kappa = max([kappa] + [c[0] for c in candidates[n:]])
        beams = [_child(beams[row], row, token, value, phi, logprobs, top, sampling, runtime)
                 for value, row, token in candidates[:n]]
        if all(b.done for b in beams):
            return beams, kappa
        parents = torch.tensor([row for _, row, _ in candidates[:n]], dtype=torch.long, device=device)
        if cache is not None:
            cache.reorder_cache(parents)
        # a finished beam rides along on its last token: its logits are never read again
        inputs = torch.tensor([b.tokens[-1] for b in beams], dtype=torch.long, device=device)[:, None]
        yield


def _child(beam: Beam, row: int, token: int | None, g: float, phi: torch.Tensor, logprobs: torch.Tensor,
           top: Any, sampling: Sampling, runtime: Runtime) -> Beam:
    if token is None:
        return beam
    child = Beam([*beam.tokens, token], [*beam.logprobs, logprobs[row, token].item()],
                 beam.top + ([list(zip(top.indices[row].tolist(), top.values[row].tolist(), strict=True))]
                             if top is not None else []),
                 phi[row, token].item(), g, False)
    if sampling.stop:  # only the text can tell
        child.done = replay(child, 0, sampling, runtime).finish_reason is not None
    else:
        child.done = (token in runtime.eos_ids and not sampling.ignore_eos) or len(child.tokens) >= sampling.max_tokens
    return child


def replay(beam: Beam, index: int, sampling: Sampling, runtime: Runtime, deltas: list[Delta] | None = None) -> Choice:
    """The beam's tokens through a fresh :class:`Choice`: stop strings, end of turn, text; its deltas into
    ``deltas`` when given."""
    choice = Choice(index, sampling, runtime.eos_ids, runtime.vocab.detokenizer())
    for i, token in enumerate(beam.tokens):
        delta = choice.add(token, beam.logprobs[i] if sampling.logprobs else None,
                           beam.top[i] if sampling.top_logprobs else None)
        if delta is not None and deltas is not None:
            deltas.append(delta)
        if choice.finish_reason is not None:
            break
    return choice
