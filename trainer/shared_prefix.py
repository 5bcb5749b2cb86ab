"""Per-token logprobs of a batch whose prompts begin alike, the common beginning forwarded once.

An agent's requests share a system prompt and tool schemas, and a group's members share their
whole context: in a batch of GRPO samples most prompt tokens are the same in every row. The
forward here runs that common prefix once (batch 1, its keys and values kept in a cache), repeats
the cache for every row, and forwards each row's own suffix against it, its positions continued.
Attention over the cache is the same arithmetic as over the repeated tokens, and gradients reach
the prefix's activations from every row (the repeat's backward sums them), so logprobs and
gradients equal the whole-batch forward's up to rounding; tests/test_shared_prefix.py holds it.

Layout, as TRL's: ``input_ids`` = left-padded prompts then right-padded completions; the last
``logits_to_keep`` columns are the completions. The suffix keeps the batch's columns from the
shortest padding on, so completions stay where TRL reads them; a row's columns that the cache
already holds (its prefix, when its padding is longer) are masked out of the suffix.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import Tensor

MIN_SHARED_TOKENS = 32  # below this the second forward costs more than the prefix saves


def prompt_padding(attention_mask: Tensor, logits_to_keep: int) -> Tensor:
    """Each row's left padding: the prompt columns before its first token."""
    prompt_width = attention_mask.size(1) - logits_to_keep
    return prompt_width - attention_mask[:, :prompt_width].sum(1)


def shared_prefix_length(input_ids: Tensor, attention_mask: Tensor, logits_to_keep: int) -> int:
    """Prompt tokens every row starts with, at most its shortest prompt less one (whose logit scores the answer)."""
    import torch

    prompt_width = input_ids.size(1) - logits_to_keep
    pads = prompt_padding(attention_mask, logits_to_keep)
    longest = int((prompt_width - pads).min()) - 1
    if longest <= 0:
        return 0
    columns = pads[:, None] + torch.arange(longest, device=input_ids.device)[None]
    b_prompt = input_ids.gather(1, columns)  # (B, longest): each row's real prompt from its first token
    differs = (b_prompt != b_prompt[:1]).any(0).nonzero()
    return longest if differs.numel() == 0 else int(differs[0])


def shared_prefix_forward(model: Any, input_ids: Tensor, attention_mask: Tensor, logits_to_keep: int,
                          prefix_len: int, **fused_kwargs: Any) -> Any:
    """TRL's fused-head output (``log_probs``, ``entropy``) of the completions, the first ``prefix_len`` tokens once.

    ``model`` carries TRL's fused LM head (``trl.trainer.utils.add_fused_lm_head``): the suffix's
    forward returns per-token log-probabilities, not logits. ``prefix_len`` <= ``shared_prefix_length``.
    """
    import torch

    rows, width = input_ids.shape
    pads = prompt_padding(attention_mask, logits_to_keep)
    first = int(pads[0])
    prefix = input_ids[:1, first:first + prefix_len]
    cache = model(input_ids=prefix, attention_mask=torch.ones_like(prefix), use_cache=True, logits_to_keep=1).cache
    cache.batch_repeat_interleave(rows)

    start = int(pads.min()) + prefix_len  # the suffix's first column
    b_positions = torch.arange(start, width, device=input_ids.device)[None] - pads[:, None]
    b_suffix_mask = attention_mask[:, start:] * (b_positions >= prefix_len)  # the cache holds the rest
    b_suffix = input_ids[:, start:]
    labels = b_suffix.masked_fill(b_suffix_mask == 0, -100)  # as TRL: only the completion tokens are scored
    labels[:, :-logits_to_keep] = -100
    mask = torch.cat([b_suffix_mask.new_ones(rows, prefix_len), b_suffix_mask], dim=1)
    return model(input_ids=b_suffix, attention_mask=mask, position_ids=b_positions.clamp(min=0), cache=cache,
                 labels=labels, fused_lm_head=True, **fused_kwargs)
