"""GRPO on captured trajectory groups: TRL's GRPOTrainer, fed from the store instead of generating.

    # one round on groups exported as JSON lines (TrainingGroup.to_json), tiny model, CPU:
    python -m flywheel.trainer.grpo --base ~/.flywheel/models/tiny --groups groups.jsonl --out /tmp/adapter --tiny
    # a real model on one GPU (bf16 picked automatically), continuing from the alias's adapter:
    python -m flywheel.trainer.grpo --base Qwen/Qwen2.5-7B-Instruct --groups groups.jsonl --out data/adapters/a/8 \\
        --init-adapter data/adapters/a/7 --optimizer-state data/adapters/a/7/optimizer.pt
    # several GPUs: the same through accelerate
    accelerate launch -m flywheel.trainer.grpo --base ... --groups ... --out ...

The math, top to bottom (what one round does; TRL's ``_compute_loss`` does steps 3-6, and
``trainer/grpo_loss.py`` writes them out, tested equal to TRL's loss and gradients):

1. rewards ``r_i`` of the G attempts of a group (the judge's or the client's), captured;
2. group-relative advantages ``A_i = (r_i - mean(r)) / (std(r) + 1e-4)`` (``flywheel.trainer.samples``;
   groups with equal rewards are skipped);
3. ``logratio = log pi_theta(o_t) - log pi_behaviour(o_t)`` on every token the model sampled
   (``env_mask`` = 1), where ``pi_behaviour`` is the logprob the engine reported when it sampled
   the token if it was sampled as the trainer computes it (at ``args.temperature``, top_p 1, no
   top_k, penalties or grammar: ``flywheel.trainer.samples.offpolicy_params``), else, or where unknown, the
   policy's own logprob at the start of the step (ratio 1);
   ``ratio = exp(logratio)`` per token, or ``exp`` of its masked mean per sequence (GSPO,
   ``importance_sampling_level="sequence"``);
4. clipped surrogate ``pg_loss = max(-A * ratio, -A * clip(ratio, 1 - eps, 1 + eps_high))``
   (``cispo``, ``sapo``: their own weights);
5. ``+ beta * KL(pi_theta || pi_ref)`` (k3 estimator, times the ratio) when ``beta > 0``;
6. aggregated over tokens per ``loss_type`` (``dapo``: over all sampled tokens of the step);
   beside it ``approx_kl`` (k3 of ``logratio``) and ``clipfrac``, logged as ``losses/*``.

What we add to TRL, in ``CapturedGRPOTrainer`` (wrappers around TRL's methods, nothing copied):
the rows of the batch are handed to the rollout (TRL gives ``rollout_func`` only the prompts),
the advantages are ours (computed over each whole captured group; TRL's own equal them for
whole groups, which is checked and logged), the captured behaviour logprobs become
``old_per_token_logps`` so that step 3 clips against the policy that actually sampled (TRL uses
captured logprobs only with its own vLLM), and ``approx_kl`` is computed beside TRL's loss from
the logprobs of TRL's own forward pass. tests/test_trl_contract.py fails, saying what changed,
when TRL's private methods stop being what these wrappers expect.
"""

from __future__ import annotations

import functools
import json
import math
import os
import random
import tempfile
import time
import warnings
from collections import Counter
from dataclasses import asdict, dataclass, field, fields
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal, cast

from flywheel.capture.batches import TrainingGroup
from flywheel.trainer import adapters, model_cache
from flywheel.trainer.grpo_loss import LOSS_TYPES, LossType, approx_kl, piece_weight
from flywheel.trainer.samples import AdvantageScale, Sample, SampleBatch, Skipped, Truncation, build_samples


@dataclass
class GRPOArgs:
    """One training round's configuration. Defaults suit a real instruct model on a GPU; see ``tiny()``."""

    # ALGO LOGIC: the objective (TRL's names and meanings)
    loss_type: LossType = "dapo"
    """grpo, dr_grpo, dapo (TRL's default: mean over all sampled tokens of a step), bnpo, cispo, sapo (grpo_loss.py)"""
    importance_sampling_level: Literal["token", "sequence"] = "token"
    """token: a PPO ratio per token; sequence: one length-normalized ratio per sequence (GSPO)"""
    epsilon: float = 0.2
    """lower clip range: the ratio is clipped at 1 - epsilon"""
    epsilon_high: float | None = None
    """upper clip range (DAPO's clip-higher uses 0.28); None: the same as epsilon. cispo: the ratio's cap (5.0)"""
    beta: float = 0.0
    """KL coefficient against the reference (the base model, or a frozen copy of init_adapter); 0 skips that forward"""
    advantage_scale: AdvantageScale = "group"
    """divide advantages by the group's reward std (group), the round's (batch), or not at all (none, Dr. GRPO)"""
    num_iterations: int = 1
    """passes over each batch of samples (PPO's epochs, TRL's mu); > 1 reuses data, which the clipping keeps safe"""
    temperature: float = 1.0
    """TRL divides logits by it; captured turns sampled otherwise (or with top_p < 1, ...) lose their logprobs"""

    # LoRA (PEFT); ignored when continuing from init_adapter, whose own config is kept
    lora_r: int = 16
    """LoRA rank; vLLM serves up to --max-lora-rank (default 16)"""
    lora_alpha: int = 32
    """LoRA scaling numerator (scale = alpha / r)"""
    lora_dropout: float = 0.0
    """dropout on the LoRA input; 0 keeps trainer logprobs comparable with the engine's"""
    lora_target_modules: list[str] | str = "all-linear"
    """modules that get LoRA; all-linear = every linear layer except lm_head (TRL refuses LoRA on lm_head)"""

    # optimisation
    learning_rate: float = 1e-5
    """AdamW learning rate; LoRA on 1-8B models: 5e-6..5e-5. The random tiny model needs 1e-2 (engineering notes)"""
    lr_scheduler_type: str = "constant"
    """constant: rounds follow each other, a per-round decay to 0 would restart every round"""
    warmup_steps: int = 0
    """linear warmup steps at the start of each round"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient clipping"""
    max_steps: int = -1
    """optimizer steps per round; -1: num_train_epochs passes over the round's groups"""
    num_train_epochs: float = 1.0
    """passes over the groups when max_steps is -1"""
    per_device_train_batch_size: int | None = None
    """sequences per micro-batch per device; None: one group (the group size)"""
    gradient_accumulation_steps: int = 4
    """micro-batches per optimizer step (lowered automatically when the round has fewer groups)"""
    gradient_checkpointing: bool = False
    """recompute activations in backward: less memory, ~30% slower"""
    max_tokens_per_micro_batch: int | None = None
    """token budget: each optimizer step's sequences are trained in length-bucketed pieces of at most this many
    forwarded tokens (rows x padded width), padding trimmed per piece; None: TRL's micro-batches of
    per_device_train_batch_size sequences padded to the longest of the step (docs/trainer.md)"""

    # data: groups -> samples
    num_generations: int | None = None
    """TRL's group size G; None: the size that covers the most sequences of the round"""
    group_size_policy: Literal["bucket", "trim"] = "bucket"
    """bucket: train the groups of exactly G sequences, skip others; trim: also cut larger groups to G (seeded)"""
    min_group_size: int = 2
    """groups with fewer members are skipped"""
    max_prompt_tokens: int = 4096
    """longest prompt of a sequence (see truncation)"""
    max_completion_tokens: int = 2048
    """longest completion (sampled + tool/user tokens) of a sequence; multi-turn members split beyond it"""
    truncation: Truncation = "left"
    """left: cut long prompts from the left, long completions from the right; drop: skip what does not fit"""

    # runtime
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    """auto: bf16 on a GPU that supports it, fp32 on CPU"""
    seed: int = 0
    """seeds LoRA init, data order and trimming"""
    progress: bool = True
    """TRL's progress bar and per-step log lines, and a summary at the end"""
    logging_steps: int = 1
    """log (and record per-step metrics) every this many steps"""

    def __post_init__(self) -> None:
        if self.loss_type not in LOSS_TYPES:  # the ones trainer/grpo_loss.py writes out and tests against TRL
            raise ValueError(f"loss_type must be one of {', '.join(LOSS_TYPES)}, not {self.loss_type!r}")
        if self.importance_sampling_level not in ("token", "sequence"):
            raise ValueError(f"importance_sampling_level must be token or sequence, not "
                             f"{self.importance_sampling_level!r}")

    @classmethod
    def tiny(cls, **overrides: Any) -> GRPOArgs:
        """Settings that make the random tiny model learn on CPU (docs/engineering-notes.md): lr 1e-2, r 16, short."""
        base: dict[str, Any] = dict(learning_rate=1e-2, lora_r=16, lora_alpha=32, gradient_accumulation_steps=1,
                                    max_prompt_tokens=512, max_completion_tokens=64, precision="fp32")
        return cls(**{**base, **overrides})


@dataclass
class RoundResult:
    """What a round produced: the adapter (unless skipped), its metrics, and where the optimizer state went."""

    status: str  # "finished" | "skipped" (nothing trainable: every group skipped, see skipped)
    adapter_dir: Path | None
    optimizer_state: Path | None
    metrics: dict[str, float]  # namespaced: losses/..., reward/..., advantage/..., samples/..., charts/...
    steps: list[dict[str, float]]  # TRL's log line of every logging step
    config: dict[str, Any]  # the full resolved config (args, derived sizes, TRL config, LoRA config, versions)
    group_ids: list[str]  # the groups trained on
    skipped: dict[str, dict[str, int]]  # reason -> {"groups": n, "members": m}
    base_model: str
    init_adapter: str | None
    started_at: datetime
    finished_at: datetime

    def to_json(self) -> dict[str, Any]:
        """Paths and times as strings: what a round reports to the gateway and ``--result-json`` writes."""
        data = asdict(self)
        for key in ("adapter_dir", "optimizer_state"):
            data[key] = str(data[key]) if data[key] is not None else None
        for key in ("started_at", "finished_at"):
            data[key] = data[key].isoformat()
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RoundResult:
        values = dict(data)
        for key in ("adapter_dir", "optimizer_state"):
            values[key] = Path(values[key]) if values[key] is not None else None
        for key in ("started_at", "finished_at"):
            values[key] = datetime.fromisoformat(values[key])
        return cls(**values)


# --------------------------------------------------------------------------- groups of one size for TRL


@dataclass
class GroupPlan:
    """The round's groups laid out for TRL: every slot is G sample indices, one TRL group."""

    group_size: int
    slots: list[list[int]]  # indices into SampleBatch.samples
    slot_group_ids: list[str]
    native: list[bool]  # slot = a whole captured group, one sequence per member: TRL's advantage must equal ours
    skipped: list[Skipped] = field(default_factory=list)


def plan_groups(batch: SampleBatch, *, group_size: int | None = None, policy: str = "bucket",
                seed: int = 0) -> GroupPlan:
    """Bucket (or trim) the batch's groups to one size G; never pad with invented samples.

    G defaults to the size that covers the most sequences (ties: the larger size). A group
    with a split member has more sequences than members, so it may land in another bucket.
    """
    assert policy in ("bucket", "trim"), policy
    by_group: dict[str, list[int]] = {}
    for i, sample in enumerate(batch.samples):
        by_group.setdefault(sample.group_id, []).append(i)
    if not by_group:
        return GroupPlan(group_size or 0, [], [], [])
    if group_size is None:
        coverage = Counter({n: 0 for n in map(len, by_group.values())})
        for indices in by_group.values():
            coverage[len(indices)] += len(indices)
        group_size = max(coverage, key=lambda n: (coverage[n], n))
    plan = GroupPlan(group_size, [], [], [])
    for group_id, indices in by_group.items():
        members = len({batch.samples[i].member_index for i in indices})
        if len(indices) == group_size:
            plan.slots.append(indices)
            plan.native.append(members == len(indices))
        elif len(indices) > group_size and policy == "trim":
            keep = sorted(random.Random(f"{seed}:{group_id}").sample(indices, group_size))
            plan.slots.append(keep)
            plan.native.append(False)
            plan.skipped.append(Skipped(group_id, "trimmed", len(indices) - group_size, trajectory_id="*"))
        else:
            plan.skipped.append(Skipped(group_id, "group_size", members))
            continue
        plan.slot_group_ids.append(group_id)
    return plan


# --------------------------------------------------------------------------- the rollout TRL calls


class CapturedRollout:
    """TRL's ``rollout_func``: returns captured samples instead of generating.

    TRL calls it with the prompts of a generation batch, each dataset row (one slot) already
    repeated G times in a row; the k-th repeat of a slot gets the slot's k-th sample. The
    trainer sets ``rows`` just before each call, since TRL passes the prompts only.
    """

    def __init__(self, samples: list[Sample], plan: GroupPlan) -> None:
        self.samples = samples
        self.plan = plan
        self.rows: list[dict[str, Any]] = []
        self.served: list[Sample] = []
        self.served_indices: list[int] = []
        self.served_native: list[bool] = []
        self.tokens = 0  # prompt + completion tokens served (what the forward/backward passes process)
        self.sampled_tokens = 0

    def sample_indices(self, rows: list[dict[str, Any]], process_index: int) -> list[int]:
        """Indices into ``samples`` of the sequences these rows get on this process."""
        g = self.plan.group_size
        # Global position of each row: accelerate hands process p the p-th contiguous slice of the batch.
        offset = process_index * len(rows)
        return [self.plan.slots[row["slot"]][(offset + j) % g] for j, row in enumerate(rows)]

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, Any]:
        if len(self.rows) != len(prompts):
            raise RuntimeError("CapturedRollout needs the batch rows: use it with CapturedGRPOTrainer")
        self.served_indices = self.sample_indices(self.rows, trainer.accelerator.process_index)
        served = [self.samples[i] for i in self.served_indices]
        self.served, self.served_native = served, [self.plan.native[row["slot"]] for row in self.rows]
        self.tokens += sum(len(s.prompt_ids) + len(s.completion_ids) for s in served)
        self.sampled_tokens += sum(s.sampled_tokens for s in served)
        logprobs = None
        if any(s.logprobs is not None for s in served):
            # None where unknown: TRL turns it into NaN, and the trainer falls back to its own logprob there.
            logprobs = [s.logprobs if s.logprobs is not None else [None] * len(s.completion_ids) for s in served]
        return {
            "prompt_ids": [s.prompt_ids for s in served],
            "completion_ids": [s.completion_ids for s in served],
            "logprobs": logprobs,
            "env_mask": [s.env_mask for s in served],
            "captured_reward": [s.reward for s in served],  # reaches the reward function as a keyword argument
        }


def passthrough_reward(prompts: list[Any], completions: list[Any], captured_reward: list[float],
                       **kwargs: Any) -> list[float]:
    """The reward function TRL sees: the reward the judge (or the client) gave each captured trajectory."""
    return [float(r) for r in captured_reward]


@functools.cache
def captured_trainer_class() -> type:
    """``CapturedGRPOTrainer``, defined on first use so that importing this module needs no torch or TRL."""
    import torch
    from trl import GRPOTrainer
    from trl.models.utils import disable_gradient_checkpointing

    class CapturedGRPOTrainer(GRPOTrainer):
        """TRL's GRPOTrainer, trained on captured samples served by a ``CapturedRollout``.

        ``max_tokens_per_micro_batch``: each micro-batch is trained in pieces of length-bucketed
        sequences of at most that many forwarded tokens (``token_budget_pieces``); None: whole.
        """

        _loss_logps: list[Any] | None = None  # collects the policy logprobs of TRL's forward inside _compute_loss

        def __init__(self, *args: Any, max_tokens_per_micro_batch: int | None = None, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.max_tokens_per_micro_batch = max_tokens_per_micro_batch
            self.advantage_diffs: list[float] = []
            self.reference_logps: dict[int, Any] = {}  # sample index -> log pi_ref of its completion, once a round
            self.forward_tokens = 0  # positions the forwards processed, padding included
            self.forward_real_tokens = 0  # the real (unpadded) tokens among them

        def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
            rollout = cast(CapturedRollout, self.rollout_func)
            rollout.rows = inputs  # TRL hands rollout_func the prompts only; it needs each row's slot
            # The reference policy is frozen: its logprobs of a sample are computed the first time it is served,
            # not again each epoch; TRL makes that forward only when beta != 0.
            indices = rollout.sample_indices(inputs, self.accelerator.process_index)
            known = self.beta != 0.0 and all(i in self.reference_logps for i in indices)
            beta, self.beta = self.beta, (0.0 if known else self.beta)
            try:
                output: dict[str, Any] = super()._generate_and_score_completions(inputs)
            finally:
                self.beta = beta
            if self.beta != 0.0:
                self._reuse_reference_logps(output, rollout.served_indices, known)
            mode = "train" if cast(Any, self.model).training else "eval"
            device = output["advantages"].device

            # Advantages: ours, computed over each whole captured group (a split or trimmed group, or
            # advantage_scale="batch" over the whole round, is not something TRL's view of G rows can see).
            # For whole groups TRL's own numbers, from the pass-through rewards, must be the same.
            b_advantages = torch.tensor([s.advantage for s in rollout.served], dtype=output["advantages"].dtype,
                                        device=device)
            native = torch.tensor(rollout.served_native, dtype=torch.bool, device=device)
            if native.any() and self.scale_rewards in ("group", "none"):
                diff = (output["advantages"] - b_advantages)[native].abs().max().item()
                self.advantage_diffs.append(diff)
                self._metrics[mode]["advantage/trl_max_abs_diff"].append(diff)
            output["advantages"] = b_advantages

            # Clip against the captured behaviour logprobs. TRL computes its ratio against
            # old_per_token_logps, which it fills (from the current policy) only when batches are
            # reused; the logprobs a rollout returns it uses only with its own vLLM
            # (vllm_importance_sampling_correction). Our samples were drawn by the serving engine,
            # possibly by an older adapter: the ratio must be taken against that behaviour policy.
            b_captured = output.get("sampling_per_token_logps")  # (B, C), NaN where not captured
            if b_captured is not None:
                b_mask = output["completion_mask"]
                if "tool_mask" in output:
                    b_mask = b_mask * output["tool_mask"]
                b_known = ~torch.isnan(b_captured)
                b_fallback = output.get("old_per_token_logps")
                if b_fallback is None and bool((b_mask.bool() & ~b_known).any()):
                    # Unknown behaviour logprobs: the policy's own, as TRL itself would use (ratio 1 at first).
                    b_fallback = self._policy_logps(output)
                if b_fallback is None:
                    b_fallback = torch.zeros_like(b_captured)  # only on masked positions: never reaches the loss
                output["old_per_token_logps"] = torch.where(b_known, b_captured, b_fallback)
                captured_frac = (b_known & b_mask.bool()).sum() / b_mask.sum().clamp(min=1)
                self._metrics[mode]["behaviour/captured_logprob_frac"].append(captured_frac.item())
            else:
                self._metrics[mode]["behaviour/captured_logprob_frac"].append(0.0)
            return output

        def _reuse_reference_logps(self, output: dict[str, Any], indices: list[int], known: bool) -> None:
            """Keep the reference logprobs TRL just computed, or put the kept ones back (0 on padding, as TRL's)."""
            lengths = output["completion_mask"].sum(1).tolist()
            if not known:
                for row, (i, n) in enumerate(zip(indices, lengths, strict=True)):
                    self.reference_logps.setdefault(i, output["ref_per_token_logps"][row, :n].clone())
                return
            b_ref_logps = torch.zeros(output["completion_mask"].shape, dtype=self.reference_logps[indices[0]].dtype,
                                      device=output["completion_mask"].device)
            for row, (i, n) in enumerate(zip(indices, lengths, strict=True)):
                b_ref_logps[row, :n] = self.reference_logps[i]
            output["ref_per_token_logps"] = b_ref_logps

        def compute_loss(self, model: Any, inputs: dict[str, Any], return_outputs: bool = False,
                         num_items_in_batch: Any = None) -> Any:
            budget = self.max_tokens_per_micro_batch
            if budget is None or return_outputs:
                return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            if self.is_deepspeed_enabled:  # its backward also steps the optimizer: one backward per micro-batch
                raise ValueError("max_tokens_per_micro_batch does not work under DeepSpeed")
            b_mask = inputs["completion_mask"] * inputs.get("tool_mask", 1)
            pieces = token_budget_pieces(inputs["prompt_mask"].sum(1).tolist(),
                                         inputs["completion_mask"].sum(1).tolist(), budget)
            done = torch.zeros((), device=b_mask.device)
            for k, rows in enumerate(pieces):
                piece = take_rows(inputs, rows)
                weight = piece_weight(self.loss_type, len(rows), float(b_mask[rows].sum()), b_mask.size(0),
                                      float(b_mask.sum()))
                if k == len(pieces) - 1:  # the trainer backpropagates the last; the others are already done
                    return super().compute_loss(model, piece) * weight + done
                with self.accelerator.no_sync(model):  # gradients are reduced across processes once, at the last
                    loss = super().compute_loss(model, piece) * weight
                    self.accelerator.backward(loss)
                done = done + loss.detach()
            raise AssertionError("a micro-batch has at least one sequence")

        def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> Any:
            # approx_kl beside TRL's loss, from the policy logprobs of TRL's own forward (no second forward)
            self._loss_logps = []
            try:
                loss = super()._compute_loss(model, inputs)
                logps = self._loss_logps
            finally:
                self._loss_logps = None
            if len(logps) != 1:
                raise RuntimeError(f"TRL's _compute_loss made {len(logps)} policy forwards, not 1: approx_kl cannot "
                                   "be computed (tests/test_trl_contract.py)")
            b_logps = logps[0]  # (B, C)
            b_mask = inputs["completion_mask"]
            if "tool_mask" in inputs:
                b_mask = b_mask * inputs["tool_mask"]
            b_old_logps = inputs.get("old_per_token_logps")
            b_logratio = b_logps - (b_logps if b_old_logps is None else b_old_logps)  # TRL: no old logps, ratio 1
            # a token mean over every process, as TRL reduces its own token means
            tokens = b_mask.sum().float()
            totals = self.accelerator.reduce(torch.stack([approx_kl(b_logratio, b_mask) * tokens, tokens]),
                                             reduction="sum")
            mode = "train" if cast(Any, self.model).training else "eval"
            self._metrics[mode]["approx_kl"].append((totals[0] / totals[1].clamp(min=1.0)).item())
            return loss

        def _get_per_token_logps_and_entropies(self, model: Any, input_ids: Any, attention_mask: Any,
                                               logits_to_keep: int, *args: Any, **kwargs: Any) -> Any:
            budget = self.max_tokens_per_micro_batch
            text_only = not args and all(v is None for k, v in kwargs.items() if k not in _FORWARD_OPTIONS)
            if budget is None or input_ids.numel() <= budget or not text_only:
                output = self._forward_logps(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
            else:  # TRL's forwards outside the loss (reference, old logprobs) take whole batches: piece them too
                output = self._forward_pieces(model, input_ids, attention_mask, logits_to_keep, budget, **kwargs)
            if self._loss_logps is not None:
                self._loss_logps.append(output[0].detach())
            return output

        def _forward_logps(self, model: Any, input_ids: Any, attention_mask: Any, logits_to_keep: int, *args: Any,
                           **kwargs: Any) -> Any:
            self.forward_tokens += input_ids.numel()
            self.forward_real_tokens += int(attention_mask.sum())
            return super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep,
                                                              *args, **kwargs)

        def _forward_pieces(self, model: Any, input_ids: Any, attention_mask: Any, logits_to_keep: int, budget: int,
                            **kwargs: Any) -> Any:
            """TRL's forward on token-budget pieces of the rows, reassembled in the rows' order and width."""
            p = input_ids.size(1) - logits_to_keep
            prompt_lens = attention_mask[:, :p].sum(1).tolist()
            completion_lens = attention_mask[:, p:].sum(1).tolist()
            kwargs.pop("batch_size", None)
            parts: list[tuple[Any, ...]] = []
            order: list[int] = []
            for rows in token_budget_pieces(prompt_lens, completion_lens, budget):
                width_p, width_c = max(prompt_lens[i] for i in rows), max(completion_lens[i] for i in rows)
                columns = slice(p - width_p, p + width_c)  # left-padded prompts, right-padded completions
                logps, entropies, aux_loss = self._forward_logps(
                    model, input_ids[rows, columns], attention_mask[rows, columns], width_c, **kwargs)
                pad = (0, logits_to_keep - width_c)  # TRL's logprobs and entropies are 0 on padding
                parts.append((torch.nn.functional.pad(logps, pad),
                              None if entropies is None else torch.nn.functional.pad(entropies, pad), aux_loss))
                order += rows
            back = torch.tensor(order, device=input_ids.device).argsort()
            logps = torch.cat([part[0] for part in parts])[back]
            entropies = None if parts[0][1] is None else torch.cat([part[1] for part in parts])[back]
            aux_loss = None if parts[0][2] is None else torch.stack([part[2] for part in parts]).mean()
            return logps, entropies, aux_loss

        def _policy_logps(self, output: dict[str, Any]) -> Any:
            """Per-token logprobs of the batch's completions under the current policy, no gradient."""
            input_ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
            attention_mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
            model: Any = self.model
            checkpointing = cast(Any, self.args).gradient_checkpointing_kwargs
            with torch.no_grad(), disable_gradient_checkpointing(model, checkpointing):
                logps, _, _ = self._get_per_token_logps_and_entropies(
                    self.model, input_ids, attention_mask, output["completion_ids"].size(1),
                    batch_size=self.args.per_device_train_batch_size)
            return logps

    return CapturedGRPOTrainer


# --------------------------------------------------------------------------- token-budget pieces


# The per-token keys of TRL's batch, by side: prompts are left-padded, completions right-padded.
PROMPT_KEYS = ("prompt_ids", "prompt_mask")
COMPLETION_KEYS = ("completion_ids", "completion_mask", "tool_mask", "old_per_token_logps", "sampling_per_token_logps",
                   "ref_per_token_logps")


_FORWARD_OPTIONS = ("batch_size", "compute_entropy", "compute_aux_loss")  # the rest: multimodal tensors


def token_budget_pieces(prompt_lens: list[int], completion_lens: list[int], budget: int) -> list[list[int]]:
    """Rows grouped by length into pieces of at most ``budget`` forwarded tokens (rows x padded width).

    Rows are taken longest first, so a piece holds sequences of similar length; its width is its
    longest prompt plus its longest completion, the padding beyond them trimmed. A sequence
    longer than the budget is a piece alone.
    """
    order = sorted(range(len(prompt_lens)), key=lambda i: prompt_lens[i] + completion_lens[i], reverse=True)
    pieces: list[list[int]] = []
    piece: list[int] = []
    width_p = width_c = 0
    for i in order:
        p, c = max(width_p, prompt_lens[i]), max(width_c, completion_lens[i])
        if piece and (len(piece) + 1) * (p + c) > budget:
            pieces.append(piece)
            piece, p, c = [], prompt_lens[i], completion_lens[i]
        piece.append(i)
        width_p, width_c = p, c
    if piece:
        pieces.append(piece)
    return pieces


def take_rows(inputs: dict[str, Any], rows: list[int]) -> dict[str, Any]:
    """The rows of a TRL batch, with the padding columns that none of them needs trimmed."""
    import torch

    index = torch.tensor(rows, device=inputs["prompt_ids"].device)
    width_p = int(inputs["prompt_mask"][index].sum(1).max())
    width_c = int(inputs["completion_mask"][index].sum(1).max())
    size = inputs["prompt_ids"].size(0)
    piece: dict[str, Any] = {}
    for key, value in inputs.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.size(0) == size:
            value = value[index]
            if key in PROMPT_KEYS:
                value = value[:, value.size(1) - width_p:]
            elif key in COMPLETION_KEYS:
                value = value[:, :width_c]
        piece[key] = value
    return piece


# --------------------------------------------------------------------------- one round


def _utcnow() -> datetime:
    return datetime.now(UTC)


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        items = [_jsonable(v) for v in value]
        return sorted(items, key=str) if isinstance(value, set | frozenset) else items
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    return str(value)


def _target_modules(model: Any, spec: list[str] | str) -> list[str] | str:
    """Resolve ``all-linear`` to the short names of the linear layers (``q_proj``, ...), lm_head excluded.

    PEFT would resolve it itself, but writes full paths (``model.layers.0.mlp.up_proj``, in set
    order) into adapter_config.json; short names are what vLLM and people expect to read there.
    """
    if spec != "all-linear":
        return spec
    import torch

    output = model.get_output_embeddings()
    names = {name.rsplit(".", 1)[-1] for name, module in model.named_modules()
             if isinstance(module, torch.nn.Linear) and module is not output}
    return sorted(names)


def _micro_batches(args: GRPOArgs, per_device: int, accumulation: int) -> dict[str, Any]:
    if args.max_tokens_per_micro_batch is None:
        return {"per_device_train_batch_size": per_device, "gradient_accumulation_steps": accumulation}
    # Under a token budget TRL's micro-batch is the whole step, which the trainer cuts into length-bucketed pieces:
    # the same sequences per optimizer step, grouped by length across all of them instead of at random.
    return {"per_device_train_batch_size": per_device * accumulation, "gradient_accumulation_steps": 1}


def _checkpointing(args: GRPOArgs) -> dict[str, Any]:
    # transformers 5 warns that gradient_checkpointing is deprecated whenever it is passed: pass it only when on.
    return {"gradient_checkpointing": True} if args.gradient_checkpointing else {}


def _optimizer_param_names(trainer: Any) -> list[list[str]]:
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    return [[names.get(id(p), "?") for p in group["params"]] for group in trainer.optimizer.param_groups]


def _load_optimizer_state(trainer: Any, path: str | Path | None) -> str:
    """Create the optimizer now and load ``path`` into it when it was saved for the same parameters."""
    if path is None or not Path(path).is_file():
        return "fresh"
    import torch

    trainer.create_optimizer()
    saved = torch.load(path, map_location="cpu", weights_only=True)  # tensors and plain values: no code
    if saved.get("param_names") != _optimizer_param_names(trainer):
        warnings.warn(f"optimizer state {path} was saved for other parameters: starting fresh", stacklevel=2)
        return "mismatch"
    trainer.optimizer.load_state_dict(saved["optimizer"])
    return "resumed"


def _round_metrics(log_history: list[dict[str, Any]], global_step: int, batch: SampleBatch, plan: GroupPlan,
                   rollout: CapturedRollout, args: GRPOArgs) -> tuple[dict[str, float], list[dict[str, float]]]:
    steps = [{k: float(v) for k, v in h.items() if isinstance(v, int | float) and math.isfinite(v)}
             for h in log_history if "loss" in h and "train_runtime" not in h]
    final: dict[str, Any] = next((h for h in reversed(log_history) if "train_runtime" in h), {})

    def mean(key: str) -> float:
        values = [s[key] for s in steps if key in s]
        return sum(values) / len(values) if values else float("nan")

    seconds = float(final.get("train_runtime", float("nan")))
    metrics: dict[str, float] = {
        "losses/loss": mean("loss"),
        "losses/loss_last": steps[-1]["loss"] if steps else float("nan"),
        "losses/approx_kl": mean("approx_kl"),
        "losses/clipfrac": mean("cispo_clip_ratio" if args.loss_type == "cispo" else "clip_ratio/region_mean"),
        "losses/clipfrac_low": mean("clip_ratio/low_mean"),
        "losses/clipfrac_high": mean("clip_ratio/high_mean"),
        "losses/entropy": mean("entropy"),
        "losses/grad_norm": mean("grad_norm"),
        "behaviour/captured_logprob_frac": mean("behaviour/captured_logprob_frac"),
        "charts/steps": float(global_step),
        "charts/train_seconds": seconds,
        "charts/tokens_per_s": rollout.tokens * args.num_iterations / seconds if seconds > 0 else float("nan"),
        "charts/sampled_tokens_per_s": (rollout.sampled_tokens * args.num_iterations / seconds
                                        if seconds > 0 else float("nan")),
        "charts/learning_rate": steps[-1].get("learning_rate", float("nan")) if steps else float("nan"),
        "samples/group_size": float(plan.group_size),
        "samples/groups_trained": float(len(plan.slots)),
    }
    if args.beta > 0:
        metrics["losses/kl"] = mean("kl")
    diffs = [s["advantage/trl_max_abs_diff"] for s in steps if "advantage/trl_max_abs_diff" in s]
    if diffs:
        metrics["advantage/trl_max_abs_diff"] = max(diffs)
    metrics.update({k: float(v) for k, v in batch.stats().items()})
    for skip in plan.skipped:
        key = f"samples/skipped_groups/{skip.reason}"
        metrics[key] = metrics.get(key, 0.0) + (0 if skip.reason == "trimmed" else 1)
        key = f"samples/skipped_members/{skip.reason}"
        metrics[key] = metrics.get(key, 0.0) + skip.members
    # Unknown stays absent: NaN is not JSON, and the store's JSON columns must take these.
    return {k: v for k, v in metrics.items() if math.isfinite(v)}, steps


def _padding_metrics(trainer: Any) -> dict[str, float]:
    """Tokens the policy and reference forwards processed, padding included, and the real ones among them."""
    forwarded, real = trainer.forward_tokens, trainer.forward_real_tokens
    return {"samples/forward_tokens": float(forwarded), "samples/forward_real_tokens": float(real),
            "samples/padding_frac": 1.0 - real / forwarded if forwarded else 0.0}


def _skip_counts(skipped: list[Skipped]) -> dict[str, dict[str, int]]:
    counts: dict[str, dict[str, int]] = {}
    for skip in skipped:
        entry = counts.setdefault(skip.reason, {"groups": 0, "members": 0})
        entry["members"] += skip.members
        entry["groups"] += skip.trajectory_id is None
    return counts


def _provenance(groups: list[TrainingGroup], batch: SampleBatch, plan: GroupPlan) -> dict[str, Any]:
    trained = set(plan.slot_group_ids)
    by_group: dict[str, list[Sample]] = {}
    for slot in plan.slots:
        for i in slot:
            by_group.setdefault(batch.samples[i].group_id, []).append(batch.samples[i])
    return {
        "groups": [{"group_id": g.group_id, "source": g.source, "alias": g.alias, "members": len(g.members),
                    "sequences": len(by_group[g.group_id]),
                    "trajectory_ids": sorted({s.trajectory_id for s in by_group[g.group_id]}),
                    "rewards": [m.reward for m in g.members]}
                   for g in groups if g.group_id in trained],
        "skipped": [asdict(s) for s in batch.skipped + plan.skipped],
        "counts": {"groups_in": batch.groups_in, "members_in": batch.members_in,
                   "groups_trained": len(plan.slots), "sequences_trained": sum(map(len, plan.slots))},
    }


def train_round(base_model_path: str | Path, groups: list[TrainingGroup], args: GRPOArgs, *,
                init_adapter: str | Path | None = None, out_dir: str | Path,
                optimizer_state: str | Path | None = None) -> RoundResult:
    """Train one GRPO round on captured ``groups`` and write the adapter to ``out_dir`` (absent or empty).

    ``init_adapter`` (a PEFT directory, e.g. the alias's current version) is trained further;
    without it a fresh LoRA starts from the base model. ``optimizer_state`` (``optimizer.pt``
    beside that adapter) resumes AdamW's moments. Writes ``out_dir`` only when something was
    trained; with nothing trainable the result has ``status="skipped"`` and no adapter.
    """
    import torch
    import transformers
    from datasets import Dataset

    started_at = _utcnow()
    base = str(base_model_path)
    tokenizer = model_cache.tokenizer(base)  # kept between rounds of this process

    # 1. groups -> samples (masks, behaviour logprobs, advantages), then groups of one size for TRL
    batch = build_samples(groups, tokenizer, max_prompt_tokens=args.max_prompt_tokens,
                          max_completion_tokens=args.max_completion_tokens, truncation=args.truncation,
                          advantage_scale=args.advantage_scale, min_group_size=args.min_group_size,
                          temperature=args.temperature)
    plan = plan_groups(batch, group_size=args.num_generations, policy=args.group_size_policy, seed=args.seed)
    skipped = _skip_counts(batch.skipped + plan.skipped)

    # 2. derived sizes (cleanrl: "to be filled in runtime")
    cuda = torch.cuda.is_available()
    bf16 = args.precision == "bf16" or (args.precision == "auto" and cuda and torch.cuda.is_bf16_supported())
    tf32 = cuda and torch.cuda.get_device_capability()[0] >= 8  # Ampere and later: float32 matmuls on tensor cores
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    g = plan.group_size
    per_device = args.per_device_train_batch_size or g
    micro_batches = (len(plan.slots) * g) // (per_device * world_size) if g else 0
    accumulation = min(args.gradient_accumulation_steps, max(1, micro_batches))
    derived = {"group_size": g, "per_device_train_batch_size": per_device, "gradient_accumulation_steps": accumulation,
               "world_size": world_size, "device": "cuda" if cuda else "cpu", "dtype": "bf16" if bf16 else "fp32",
               "tf32": tf32,
               "groups_per_step": per_device * accumulation * world_size // g if g else 0}
    config: dict[str, Any] = {"args": _jsonable(asdict(args)), "derived": derived, "base_model": base,
                              "init_adapter": str(init_adapter) if init_adapter else None}

    if micro_batches < 1:
        if plan.slots:  # groups left, but fewer sequences than one micro-batch across the devices
            skipped["batch_too_small"] = {"groups": len(plan.slots), "members": sum(map(len, plan.slots))}
        finished = _utcnow()
        metrics = {k: float(v) for k, v in batch.stats().items()}
        return RoundResult("skipped", None, None, metrics, [], config, [], skipped, base,
                           config["init_adapter"], started_at, finished)
    if (per_device * accumulation * world_size) % g:
        raise ValueError(f"per_device_train_batch_size x gradient_accumulation_steps x world size "
                         f"({per_device} x {accumulation} x {world_size}) must be a multiple of the group size {g}")

    # 3. the policy: base model + LoRA (fresh, or the alias's current adapter trained further)
    from peft import LoraConfig, PeftModel
    from trl import GRPOConfig

    loaded = model_cache.borrow(base, torch.bfloat16 if bf16 else torch.float32)  # kept from the last round, if any
    config["derived"]["base_model_cached"] = loaded.cached
    transformers.set_seed(args.seed)  # after the load: a cold load may draw random numbers, a kept model does not
    model: Any = loaded.model
    peft_config = None
    if init_adapter is not None:
        model = PeftModel.from_pretrained(model, str(init_adapter), is_trainable=True)
    else:
        peft_config = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                                 target_modules=_target_modules(model, args.lora_target_modules),
                                 task_type="CAUSAL_LM")

    dataset = Dataset.from_list([{"prompt": group_id, "slot": i} for i, group_id in enumerate(plan.slot_group_ids)])
    rollout = CapturedRollout(batch.samples, plan)
    with tempfile.TemporaryDirectory(prefix="flywheel-grpo-") as scratch:
        trl_config = GRPOConfig(
            output_dir=scratch, report_to="none", save_strategy="no", logging_steps=args.logging_steps,
            disable_tqdm=not args.progress, seed=args.seed, bf16=bf16, tf32=tf32 or None, use_cpu=not cuda,
            learning_rate=args.learning_rate, lr_scheduler_type=args.lr_scheduler_type,
            warmup_steps=args.warmup_steps, weight_decay=args.weight_decay, max_grad_norm=args.max_grad_norm,
            max_steps=args.max_steps, num_train_epochs=args.num_train_epochs,
            **_micro_batches(args, per_device, accumulation), **_checkpointing(args),
            num_generations=g, max_completion_length=args.max_completion_tokens, temperature=args.temperature,
            loss_type=args.loss_type, importance_sampling_level=args.importance_sampling_level,
            epsilon=args.epsilon, epsilon_high=args.epsilon_high, beta=args.beta, num_iterations=args.num_iterations,
            scale_rewards=args.advantage_scale,
            # A capture that hit max_tokens still says something about what the model did (and a random
            # tiny model never emits eos at all): keep truncated completions in the loss.
            mask_truncated_completions=False,
            remove_unused_columns=False, dataloader_num_workers=0, log_completions=False,
        )
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*rollout_func.*experimental", category=UserWarning)
            trainer = captured_trainer_class()(
                model=model, reward_funcs=[passthrough_reward], args=trl_config, train_dataset=dataset,
                processing_class=tokenizer, peft_config=peft_config, rollout_func=rollout,
                max_tokens_per_micro_batch=args.max_tokens_per_micro_batch)
        if not args.progress:  # without a progress bar the HF Trainer prints every log dict instead
            from transformers import PrinterCallback

            trainer.remove_callback(PrinterCallback)
        optimizer_status = _load_optimizer_state(trainer, optimizer_state)

        # 4. train
        trainer.train()

        # 5. metrics, resolved config, provenance; then the adapter directory
        metrics, steps = _round_metrics(trainer.state.log_history, trainer.state.global_step, batch, plan, rollout,
                                        args)
        metrics.update(_padding_metrics(trainer))
        metrics["charts/optimizer_resumed"] = float(optimizer_status == "resumed")
        metrics["charts/model_load_seconds"] = loaded.seconds
        policy = trainer.accelerator.unwrap_model(trainer.model)
        config["derived"]["optimizer_state"] = optimizer_status
        config["lora"] = _jsonable(policy.peft_config["default"].to_dict())
        config["trl"] = _jsonable({f.name: getattr(trl_config, f.name) for f in fields(trl_config)
                                   if f.name in _TRL_KEYS})
        config["versions"] = _versions()
        finished_at = _utcnow()
        out = Path(out_dir)
        result = RoundResult("finished", out, out / adapters.OPTIMIZER_FILE, metrics, steps, config,
                             list(plan.slot_group_ids), skipped, base, config["init_adapter"], started_at,
                             finished_at)
        trainer.accelerator.wait_for_everyone()
        if trainer.accelerator.is_main_process:
            staging = adapters.staging_dir(out)
            try:
                policy.save_pretrained(staging, selected_adapters=["default"])  # not TRL's frozen "ref" copy
                (staging / "README.md").unlink(missing_ok=True)  # PEFT's generic model card template
                torch.save({"param_names": _optimizer_param_names(trainer),
                            "optimizer": trainer.optimizer.state_dict(),
                            "global_step": trainer.state.global_step}, staging / adapters.OPTIMIZER_FILE)
                adapters.write_round_file(staging, _round_record(result, groups, batch, plan, out))
                adapters.publish(staging, out)
            finally:
                adapters.discard(staging)
        trainer.accelerator.wait_for_everyone()
        model_cache.give_back(policy)  # unwrapped, for the next round of this process
    if args.progress:
        _print_summary(result)
    return result


_TRL_KEYS = {"learning_rate", "lr_scheduler_type", "warmup_steps", "weight_decay", "max_grad_norm", "max_steps",
             "num_train_epochs", "per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation",
             "generation_batch_size", "num_generations", "max_completion_length", "temperature", "loss_type",
             "importance_sampling_level", "epsilon", "epsilon_high", "beta", "num_iterations", "scale_rewards",
             "mask_truncated_completions", "bf16", "tf32", "use_cpu", "seed", "gradient_checkpointing", "optim"}


def _versions() -> dict[str, str]:
    import peft
    import torch
    import transformers
    import trl

    return {"torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__,
            "peft": peft.__version__}


def _round_record(result: RoundResult, groups: list[TrainingGroup], batch: SampleBatch, plan: GroupPlan,
                  out: Path) -> dict[str, Any]:
    aliases = sorted({g.alias for g in groups})
    return {
        "format": 1,
        "alias": aliases[0] if len(aliases) == 1 else aliases,
        "version": int(out.name) if out.name.isdigit() else None,
        "base_model": result.base_model,
        "init_adapter": result.init_adapter,
        "started_at": result.started_at.isoformat(),
        "finished_at": result.finished_at.isoformat(),
        "config": result.config,
        "data": _provenance(groups, batch, plan),
        "metrics": result.metrics,
        "steps": result.steps,
    }


def _print_summary(result: RoundResult) -> None:
    from rich.console import Console

    m = result.metrics
    Console(stderr=True).print(
        f"[bold]round {result.status}[/bold] -> {result.adapter_dir}: {int(m.get('charts/steps', 0))} steps, "
        f"{int(m.get('samples/groups_trained', 0))} groups, loss {m.get('losses/loss', float('nan')):.4f}, "
        f"reward {m.get('reward/mean', float('nan')):.3f} ± {m.get('reward/std', float('nan')):.3f}, "
        f"clipfrac {m.get('losses/clipfrac', float('nan')):.3f}, "
        f"{m.get('charts/tokens_per_s', float('nan')):.0f} tokens/s, skipped {result.skipped or 'nothing'}")


def _parse_field(annotation: str, raw: str) -> Any:
    """A command-line string as the type a GRPOArgs field is annotated with."""
    if raw.lower() == "none" and "None" in annotation:
        return None
    if annotation.startswith("bool"):
        return raw.lower() in ("1", "true", "yes")
    if annotation.startswith("int"):
        return int(raw)
    if annotation.startswith("float"):
        return float(raw)
    if annotation.startswith("list[str]") and raw != "all-linear":
        return raw.split(",")
    return raw


def main(argv: list[str] | None = None) -> None:
    """``python -m flywheel.trainer.grpo``: one round on groups read from a JSON-lines file (see module docstring)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m flywheel.trainer.grpo", description=__doc__.split("\n")[0])
    parser.add_argument("--base", required=True, help="base model directory or Hugging Face id (from the cache)")
    parser.add_argument("--groups", required=True, help="JSON lines, one TrainingGroup.to_json() per line")
    parser.add_argument("--out", required=True, help="adapter directory to write (absent or empty)")
    parser.add_argument("--init-adapter", default=None)
    parser.add_argument("--optimizer-state", default=None)
    parser.add_argument("--tiny", action="store_true", help="start from GRPOArgs.tiny() (CPU, random tiny model)")
    parser.add_argument("--args-json", default=None, help="a JSON file of GRPOArgs fields (the flags below win)")
    parser.add_argument("--result-json", default=None, help="write the RoundResult here as JSON (the main process)")
    for f in fields(GRPOArgs):
        parser.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, default=None, help=f"GRPOArgs.{f.name}")
    ns = parser.parse_args(argv)
    defaults = GRPOArgs.tiny() if ns.tiny else GRPOArgs()
    overrides = {f.name: _parse_field(str(f.type), raw) for f in fields(GRPOArgs)
                 if (raw := getattr(ns, f.name)) is not None}
    given = json.loads(Path(ns.args_json).read_text()) if ns.args_json else {}
    args = GRPOArgs(**{**asdict(defaults), **given, **overrides})
    groups = [TrainingGroup.from_json(json.loads(line)) for line in Path(ns.groups).read_text().splitlines()
              if line.strip()]
    started = time.perf_counter()
    result = train_round(ns.base, groups, args, init_adapter=ns.init_adapter, out_dir=ns.out,
                         optimizer_state=ns.optimizer_state)
    if ns.result_json and int(os.environ.get("RANK", "0")) == 0:  # under accelerate every rank returns the same
        Path(ns.result_json).write_text(json.dumps(result.to_json()))
    print(json.dumps({"status": result.status, "adapter_dir": str(result.adapter_dir), "metrics": result.metrics,
                      "seconds": time.perf_counter() - started}, indent=2, default=str))


if __name__ == "__main__":
    main()
