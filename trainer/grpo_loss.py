"""GRPO's loss, top to bottom: the loss that trains, in the order of the papers.

``CapturedGRPOTrainer.compute_loss`` (``trainer/trl_adapter.py``) makes the policy's forward
through TRL's fused LM head and calls ``grpo_loss`` on its logprobs: this file is the objective
that is minimized. ``tests/test_grpo_loss.py`` checks the trainer's loss against TRL's own
(``GRPOTrainer._compute_loss``, TRL 1.16) in value, gradients and diagnostics on a real tiny-model
trainer for every ``loss_type`` and ``importance_sampling_level`` we expose, so the two cannot
silently disagree. Shapes: B sequences, T completion tokens; ``b_mask`` is 1 on the tokens the
model sampled (TRL's ``completion_mask * tool_mask``), 0 on padding and on tool / user / template
tokens.

1. **Advantages** (Shao et al. 2024, DeepSeekMath §4.1.2): every attempt i of a group gets
   ``A_i = (r_i - mean(r)) / (std(r) + 1e-4)``, the same for all its tokens. They are computed
   before training, over each whole captured group: ``flywheel.trainer.samples.group_advantages``.
2. **Ratio** of the policy being trained to the old one, per token:
   ``logratio = log pi_theta - log pi_old``, ``ratio = exp(logratio)``; GSPO takes one ratio per
   sequence, ``exp(mean_t logratio)``. pi_old is the sampler (PPO) or, when the samples came from
   an older version than the one trained, a proximal policy (decoupled PPO, Hilton et al. 2022):
   the policy at the round's start.
3. **Surrogate**: PPO's clipped objective with DAPO's asymmetric range
   ``[1 - epsilon_low, 1 + epsilon_high]``; CISPO and SAPO replace the clipping. Decoupled, each
   token's term is weighted by the behaviour weight ``min(pi_prox / mu, cap)``.
4. **KL penalty** to the reference policy, k3 estimator, ``+ beta * KL`` per token.
5. **Aggregation** over tokens and sequences: this is what tells the loss types apart.
6. **Diagnostics** beside the loss: ``approx_kl`` (how far the policy moved from the sampler) and
   ``clipfrac`` (the share of tokens whose gradient the clipping removed).

What a batch is: the trainer calls the loss on each micro-batch and accumulates gradients.
``grpo``, ``sapo``, ``bnpo`` and ``dr_grpo`` are divided by ``micro_batches``, the accumulation
steps (the step's loss is the mean of its micro-batch losses); ``dapo`` and ``cispo`` divide the
token sum by ``num_items_in_batch``, the sampled tokens of the whole step (per process: data
parallelism averages the processes' gradients), so the step's loss is one token mean over the
step. The options TRL has that are not written here (``delta``, ``top_entropy_quantile``,
``off_policy_mask_threshold``, TRL's own vLLM sampling, the entropy bonus, KL without the ratio)
the trainer refuses.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, get_args

if TYPE_CHECKING:
    from torch import Tensor

LossType = Literal["grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo"]
LOSS_TYPES: tuple[str, ...] = get_args(LossType)
CLIPPED_LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo")  # PPO's clipped surrogate, aggregated four ways


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over the positions where ``mask`` is 1 (all of them, or along ``dim``)."""
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1.0)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1.0)


def k3(log_r: Tensor) -> Tensor:
    """KL(q || p) estimator from ``log_r = log p(x) - log q(x)``, x ~ q: ``r - 1 - log r`` >= 0 (Schulman 2020, k3)."""
    import torch

    return torch.exp(log_r) - log_r - 1


def approx_kl(logratio: Tensor, mask: Tensor) -> Tensor:
    """KL(pi_old || pi_theta) over the sampled tokens, k3 of ``logratio`` (cleanrl's PPO logs the same): 0 on-policy."""
    return masked_mean(k3(logratio), mask)


def grpo_loss(b_logps: Tensor, b_old_logps: Tensor, b_advantages: Tensor, b_mask: Tensor, *,
              loss_type: str = "dapo", importance_sampling_level: str = "token", epsilon_low: float = 0.2,
              epsilon_high: float = 0.2, beta: float = 0.0, b_ref_logps: Tensor | None = None,
              max_completion_length: int | None = None, num_items_in_batch: Tensor | None = None,
              micro_batches: int = 1, sapo_temperature_pos: float = 1.0, sapo_temperature_neg: float = 1.05,
              b_behaviour_weights: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """The loss of one batch and its diagnostics (``losses/approx_kl``, ``losses/clipfrac``, ``losses/kl``, ...).

    ``b_logps``: log pi_theta of each completion token at the trainer's temperature, with gradient;
    ``b_old_logps``: the behaviour policy's (the captured logprobs, or the policy's own at the start
    of the step); ``b_ref_logps``: the reference policy's, needed when ``beta > 0``;
    ``num_items_in_batch`` and ``micro_batches``: what the step is (above; default: this batch alone);
    ``b_behaviour_weights``: min(pi_prox / mu, cap) per token when ``b_old_logps`` is a proximal policy's, not
    the sampler's (decoupled PPO); None: the samples are the old policy's own.
    """
    import torch

    assert loss_type in LOSS_TYPES, loss_type
    assert importance_sampling_level in ("token", "sequence"), importance_sampling_level
    b_advantages = b_advantages.unsqueeze(1)  # (B, 1): one advantage for every token of a sequence

    # 2. the importance ratio pi_theta / pi_old
    logratio = b_logps - b_old_logps  # (B, T)
    if importance_sampling_level == "token":
        b_logratio = logratio  # (B, T): PPO's per-token ratio (Schulman et al. 2017, eq. 6)
    else:
        # GSPO (Zheng et al. 2025, eq. 7): the geometric mean of a sequence's token ratios
        b_logratio = masked_mean(logratio, b_mask, dim=-1).unsqueeze(-1)  # (B, 1)
    ratio = torch.exp(b_logratio)  # (B, T) or (B, 1)

    # 3. the surrogate, per token (to minimize)
    if loss_type == "cispo":
        # CISPO (MiniMax 2025, MiniMax-M1 §3.1): REINFORCE on log pi, weighted by the ratio capped at epsilon_high
        # (an absolute cap, ScaleRL's epsilon_max), without gradient through the weight
        per_token_loss = -torch.clamp(ratio, max=epsilon_high).detach() * b_advantages * b_logps  # (B, T)
    elif loss_type == "sapo":
        # SAPO (Gao et al. 2025, Soft Adaptive Policy Optimization): a sigmoid gate instead of the hard clip,
        # steeper (tau_neg > tau_pos) for tokens with a negative advantage
        tau = torch.where(b_advantages > 0, sapo_temperature_pos, sapo_temperature_neg)  # (B, 1)
        per_token_loss = -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * b_advantages
    else:
        # PPO's clipped surrogate (Schulman et al. 2017, eq. 7), clip-higher range (Yu et al. 2025, DAPO eq. 10)
        pg_loss1 = -b_advantages * ratio
        pg_loss2 = -b_advantages * torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
        per_token_loss = torch.max(pg_loss1, pg_loss2)  # (B, T) or (B, 1)

    # decoupled PPO (Hilton et al. 2022, eq. 3): the clipped surrogate around pi_prox, on samples of the behaviour
    # policy mu, weighted by pi_prox / mu truncated (Espeholt et al. 2018's V-trace cap; TRL's vLLM correction)
    if b_behaviour_weights is not None:
        per_token_loss = per_token_loss * b_behaviour_weights  # (B, T)

    # 4. KL(pi_theta || pi_ref), k3 per token (DeepSeekMath eq. 4), times the ratio so that its gradient is the
    # unbiased reverse-KL gradient on samples of pi_old (DeepSeek-V3.2 §3.1; TRL's use_bias_correction_kl, on)
    if beta != 0.0:
        assert b_ref_logps is not None, "beta > 0 needs the reference logprobs"
        per_token_kl = k3(b_ref_logps - b_logps) * ratio  # (B, T)
        per_token_loss = per_token_loss + beta * per_token_kl

    # 5. aggregation over the sampled tokens
    if loss_type in ("grpo", "sapo"):
        # DeepSeekMath eq. 3: the mean over sequences of each sequence's token mean (long answers weigh less per token)
        loss = masked_mean(per_token_loss, b_mask, dim=-1).mean() / micro_batches
    elif loss_type == "bnpo":
        loss = masked_mean(per_token_loss, b_mask) / micro_batches  # one token mean over the batch
    elif loss_type == "dr_grpo":
        # Dr. GRPO (Liu et al. 2025, eq. 3): a constant denominator, B x max_completion_length: no length bias
        assert max_completion_length is not None, "dr_grpo needs max_completion_length"
        loss = (per_token_loss * b_mask).sum() / (b_mask.size(0) * max_completion_length) / micro_batches
    else:
        # DAPO (Yu et al. 2025, eq. 10) and CISPO: token sum over the sampled tokens of the whole step
        tokens = b_mask.sum().clamp(min=1.0) if num_items_in_batch is None else num_items_in_batch
        loss = (per_token_loss * b_mask).sum() / tokens

    # 6. diagnostics, without gradient
    with torch.no_grad():
        stats = {"losses/approx_kl": approx_kl(logratio, b_mask)}
        if beta != 0.0:
            stats["losses/kl"] = masked_mean(per_token_kl, b_mask)
        if loss_type in CLIPPED_LOSS_TYPES:
            # clipped where the clip removes the gradient: below the range with A < 0, above it with A > 0
            is_low_clipped = (ratio < 1 - epsilon_low) & (b_advantages < 0)
            is_high_clipped = (ratio > 1 + epsilon_high) & (b_advantages > 0)
            stats["losses/clipfrac_low"] = _level_mean(is_low_clipped.float(), b_mask)
            stats["losses/clipfrac_high"] = _level_mean(is_high_clipped.float(), b_mask)
            stats["losses/clipfrac"] = _level_mean((is_low_clipped | is_high_clipped).float(), b_mask)
        elif loss_type == "cispo":
            stats["losses/clipfrac"] = _level_mean(((ratio > epsilon_high) & (b_advantages > 0)).float(), b_mask)
    return loss, stats


def piece_weight(loss_type: str, rows: int, tokens: float, total_rows: int, total_tokens: float) -> float:
    """What the loss of a piece of a micro-batch (``rows`` sequences, ``tokens`` sampled tokens) is multiplied by.

    A micro-batch split into pieces (``GRPOArgs.max_tokens_per_micro_batch``) is trained piece by
    piece; the weighted piece losses add up to the micro-batch's loss, term by term (step 5):
    ``dapo``, ``cispo``: token sums over the step's ``num_items_in_batch``, which add up as they
    are; ``grpo``, ``sapo``, ``dr_grpo``: means over sequences, weighted by the piece's share of
    them; ``bnpo``: a token mean, weighted by the piece's share of the sampled tokens.
    """
    if loss_type in ("dapo", "cispo"):
        return 1.0
    if loss_type == "bnpo":
        return tokens / total_tokens if total_tokens > 0 else 0.0
    return rows / total_rows


def diagnostic_weights(stats: dict[str, Tensor], b_mask: Tensor, importance_sampling_level: str) -> Tensor:
    """What each of ``grpo_loss``'s diagnostics is a mean over, to average it across batches and processes.

    The sampled tokens, or for GSPO's clip fractions (one ratio per sequence) the sequences.
    """
    import torch

    tokens, rows = b_mask.sum().float(), torch.tensor(float(b_mask.size(0)), device=b_mask.device)
    per_sequence = importance_sampling_level == "sequence"
    return torch.stack([rows if per_sequence and key.startswith("losses/clipfrac") else tokens for key in stats])


def _level_mean(x: Tensor, mask: Tensor) -> Tensor:
    # a token-level statistic: over sampled tokens; a sequence-level one (B, 1): over sequences (as TRL logs them)
    return x.mean() if x.size(1) == 1 else masked_mean(x, mask)
