"""``CapturedGRPOTrainer``: TRL's GRPOTrainer trained on captured samples, with our loss.

TRL keeps the training loop, the optimizer, logging and the reference / old-logprob forwards. What
we add, as overrides of its methods (wrappers, nothing copied):

- ``compute_loss`` (the HF Trainer's public hook): one policy forward through TRL's fused LM head,
  then ``trainer/grpo_loss.py``'s ``grpo_loss``: the loss that trains is ours. A micro-batch is
  trained in token-budget pieces when ``max_tokens_per_micro_batch`` is set.
- ``log`` (public): merges our per-step diagnostics (``approx_kl``, clip fractions, ``entropy``,
  ``kl``, ...; TRL's names, which the round report reads) into TRL's log line.
- ``_generate_and_score_completions`` (private): hands the rollout its rows, puts our advantages
  and the captured behaviour logprobs into the batch, keeps the reference logprobs once a round.
- ``_get_per_token_logps_and_entropies`` (private): counts forwarded tokens, pieces TRL's own
  whole-batch forwards under the token budget, and forwards the prompt prefix a chunk's rows share
  once (``trainer/shared_prefix.py``).

tests/test_trl_contract.py fails, saying what changed, when TRL's private methods stop being what
these overrides expect; tests/test_grpo_loss.py holds our loss equal to TRL's ``_compute_loss``.
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from typing import Any, cast

from flywheel.trainer.grpo_loss import LOSS_TYPES, approx_kl, diagnostic_weights, grpo_loss, masked_mean, piece_weight
from flywheel.trainer.sample_plan import CapturedRollout, take_rows, token_budget_pieces
from flywheel.trainer.shared_prefix import MIN_SHARED_TOKENS, shared_prefix_forward, shared_prefix_length

_FORWARD_OPTIONS = ("batch_size", "compute_entropy", "compute_aux_loss")  # the rest: multimodal tensors

# grpo_loss's diagnostics -> the names of TRL's log line (the round report's steps and metrics read these)
LOG_NAMES = {"losses/approx_kl": "approx_kl", "losses/kl": "kl", "losses/entropy": "entropy",
             "losses/clipfrac_low": "clip_ratio/low_mean", "losses/clipfrac_high": "clip_ratio/high_mean",
             "losses/clipfrac": "clip_ratio/region_mean"}


def log_name(key: str, loss_type: str) -> str:
    """The log-line name of a ``grpo_loss`` diagnostic (cispo's clip fraction: TRL's ``cispo_clip_ratio``)."""
    return "cispo_clip_ratio" if key == "losses/clipfrac" and loss_type == "cispo" else LOG_NAMES[key]


def unsupported_loss_options(args: Any) -> list[str]:
    """The options of a GRPOConfig that ``grpo_loss`` does not write out (TRL would apply them; we refuse)."""
    refused = {
        "loss_type": args.loss_type not in LOSS_TYPES,
        "delta": args.delta is not None,
        "top_entropy_quantile": args.top_entropy_quantile < 1.0,
        "off_policy_mask_threshold": args.off_policy_mask_threshold is not None,
        "entropy_coef": args.entropy_coef != 0.0 or args.use_adaptive_entropy,
        "use_vllm": args.use_vllm,
        "use_bias_correction_kl": not args.use_bias_correction_kl,
    }
    return [name for name, on in refused.items() if on]


def keep_rows(kept: dict[int, Any], indices: list[int], completion_mask: Any, b_values: Any) -> None:
    """Keep each sample's per-token values (its completion's, padding cut) under its index, the first time only."""
    for row, (i, n) in enumerate(zip(indices, completion_mask.sum(1).tolist(), strict=True)):
        kept.setdefault(i, b_values[row, :n].clone())


def kept_rows(kept: dict[int, Any], indices: list[int], completion_mask: Any) -> Any:
    """The kept values of the batch's samples as one (B, C) tensor, 0 on padding as TRL's."""
    b_values = completion_mask.new_zeros(completion_mask.shape, dtype=kept[indices[0]].dtype)
    for row, (i, n) in enumerate(zip(indices, completion_mask.sum(1).tolist(), strict=True)):
        b_values[row, :n] = kept[i]
    return b_values


@functools.cache
def captured_trainer_class() -> type:
    """``CapturedGRPOTrainer``, defined on first use so that importing this module needs no torch or TRL."""
    import torch
    from trl import GRPOTrainer
    from trl.models.utils import disable_gradient_checkpointing

    class CapturedGRPOTrainer(GRPOTrainer):
        """TRL's GRPOTrainer, trained on captured samples served by a ``CapturedRollout``, with ``grpo_loss``.

        ``max_tokens_per_micro_batch``: each micro-batch is trained in pieces of length-bucketed
        sequences of at most that many forwarded tokens (``token_budget_pieces``); None: whole.
        """

        def __init__(self, *args: Any, max_tokens_per_micro_batch: int | None = None,
                     proximal_policy: str = "round", behaviour_weight_cap: float = 3.0,
                     share_prompt_prefix: bool = False, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            refused = unsupported_loss_options(self.args)
            if refused:
                raise ValueError(f"trainer/grpo_loss.py does not implement these GRPOConfig options: {refused}")
            self.max_tokens_per_micro_batch = max_tokens_per_micro_batch
            self.share_prompt_prefix = share_prompt_prefix
            self.advantage_diffs: list[float] = []
            self.reference_logps: dict[int, Any] = {}  # sample index -> log pi_ref of its completion, once a round
            self.proximal_policy = proximal_policy  # round | behaviour: what the ratio is taken against (GRPOArgs)
            self.behaviour_weight_cap = behaviour_weight_cap
            self.proximal_logps: dict[int, Any] = {}  # sample index -> log pi_prox of its completion, once a round
            self.forward_tokens = 0  # positions the forwards processed, padding included
            self.forward_real_tokens = 0  # the real (unpadded) tokens among them
            self.step_metrics: defaultdict[str, list[float]] = defaultdict(list)  # ours, averaged into each log line
            # TRL's reference is the round's start when it is a frozen copy ("ref") of the adapter trained on, or
            # the base model under a fresh LoRA whose B starts at 0 (PEFT's default): pi_prox needs no forward then
            fresh = kwargs.get("peft_config")
            adapters = getattr(self.accelerator.unwrap_model(self.model), "peft_config", {})
            self.reference_is_round_start = self.ref_model is None and (
                "ref" in adapters or (fresh is not None and fresh.init_lora_weights is True))

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
                self.step_metrics["advantage/trl_max_abs_diff"].append(diff)
            output["advantages"] = b_advantages

            b_captured = output.get("sampling_per_token_logps")  # (B, C), NaN where not captured
            if self.proximal_policy == "round":
                self._decouple(output, rollout.served_indices, b_captured)
                return output
            # Clip against the captured behaviour logprobs. TRL computes its ratio against
            # old_per_token_logps, which it fills (from the current policy) only when batches are
            # reused; the logprobs a rollout returns it uses only with its own vLLM
            # (vllm_importance_sampling_correction). Our samples were drawn by the serving engine,
            # possibly by an older adapter: the ratio must be taken against that behaviour policy.
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
                self.step_metrics["behaviour/captured_logprob_frac"].append(captured_frac.item())
            else:
                self.step_metrics["behaviour/captured_logprob_frac"].append(0.0)
            return output

        def _decouple(self, output: dict[str, Any], indices: list[int], b_captured: Any) -> None:
            """Decoupled PPO's inputs: the ratio against pi_prox, the sampler mu's distance as a truncated weight.

            pi_prox is the policy at the round's start (the generation batch is the whole epoch: grpo.py), kept for
            the round's later epochs: the clip bounds how far one round moves from where it began, whoever sampled.
            The weight min(pi_prox / mu, cap) corrects for samples drawn by an older version than the one trained
            (the serving version while the training line runs ahead); 1 where mu is unknown.
            """
            if not all(i in self.proximal_logps for i in indices):
                # TRL's old logprobs, when it took them (more than one step per generation batch), or its reference
                # logprobs, when the reference is the round's start, are the same forward
                b_now = output.get("old_per_token_logps")
                if b_now is None and self.beta != 0.0 and self.reference_is_round_start:
                    b_now = output["ref_per_token_logps"]
                keep_rows(self.proximal_logps, indices, output["completion_mask"],
                          self._policy_logps(output) if b_now is None else b_now)
            b_prox = kept_rows(self.proximal_logps, indices, output["completion_mask"])  # (B, C)
            b_mask = output["completion_mask"] * output.get("tool_mask", 1)
            b_known = torch.zeros_like(b_mask, dtype=torch.bool) if b_captured is None else ~torch.isnan(b_captured)
            b_behaviour = b_prox if b_captured is None else torch.where(b_known, b_captured.to(b_prox.dtype), b_prox)
            b_log_weight = b_prox - b_behaviour  # log pi_prox / mu
            output["old_per_token_logps"] = b_prox
            output["importance_sampling_ratio"] = torch.exp(b_log_weight).clamp(max=self.behaviour_weight_cap)
            tokens = b_mask.sum().clamp(min=1)
            captured_frac = (b_known & b_mask.bool()).sum() / tokens
            self.step_metrics["behaviour/captured_logprob_frac"].append(captured_frac.item())
            self.step_metrics["behaviour/kl"].append(approx_kl(b_log_weight, b_mask).item())  # KL(mu || pi_prox)
            truncated = (b_log_weight > math.log(self.behaviour_weight_cap)) & b_mask.bool()
            self.step_metrics["behaviour/weight_truncated_frac"].append((truncated.sum() / tokens).item())

        def _reuse_reference_logps(self, output: dict[str, Any], indices: list[int], known: bool) -> None:
            """Keep the reference logprobs TRL just computed, or put the kept ones back (0 on padding, as TRL's)."""
            if known:
                output["ref_per_token_logps"] = kept_rows(self.reference_logps, indices, output["completion_mask"])
            else:
                keep_rows(self.reference_logps, indices, output["completion_mask"], output["ref_per_token_logps"])

        def compute_loss(self, model: Any, inputs: dict[str, Any], return_outputs: bool = False,
                         num_items_in_batch: Any = None) -> Any:
            if return_outputs:
                raise ValueError("GRPO has no model outputs to return")
            budget = self.max_tokens_per_micro_batch
            if budget is None:
                return self.batch_loss(model, inputs)
            if self.is_deepspeed_enabled:  # its backward also steps the optimizer: one backward per micro-batch
                raise ValueError("max_tokens_per_micro_batch does not work under DeepSpeed")
            loss_type = cast(Any, self.args).loss_type
            b_mask = inputs["completion_mask"] * inputs.get("tool_mask", 1)
            pieces = token_budget_pieces(inputs["prompt_mask"].sum(1).tolist(),
                                         inputs["completion_mask"].sum(1).tolist(), budget)
            done = torch.zeros((), device=b_mask.device)
            for k, rows in enumerate(pieces):
                piece = take_rows(inputs, rows)
                weight = piece_weight(loss_type, len(rows), float(b_mask[rows].sum()), b_mask.size(0),
                                      float(b_mask.sum()))
                if k == len(pieces) - 1:  # the trainer backpropagates the last; the others are already done
                    return self.batch_loss(model, piece) * weight + done
                with self.accelerator.no_sync(model):  # gradients are reduced across processes once, at the last
                    loss = self.batch_loss(model, piece) * weight
                    self.accelerator.backward(loss)
                done = done + loss.detach()
            raise AssertionError("a micro-batch has at least one sequence")

        def batch_loss(self, model: Any, inputs: dict[str, Any]) -> Any:
            """``grpo_loss`` of a batch of TRL's layout, from one policy forward; records its diagnostics."""
            args = cast(Any, self.args)
            b_mask = inputs["completion_mask"] * inputs.get("tool_mask", 1)  # (B, C): the sampled tokens
            input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
            attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
            b_logps, b_entropies, aux_loss = self._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, inputs["completion_ids"].size(1), compute_entropy=True,
                compute_aux_loss=self.aux_loss_enabled)
            b_old_logps = inputs.get("old_per_token_logps")  # None: TRL did not need them, the policy sampled
            # The step, as TRL defines it: its micro-batches (1 in evaluation), and its sampled tokens per process,
            # from num_items_in_batch, which spans the generation batch on all processes
            training = cast(Any, self.model).training
            micro_batches = self.current_gradient_accumulation_steps if training else 1
            step_tokens = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            if training:
                step_tokens = step_tokens * micro_batches / args.steps_per_generation
            loss, stats = grpo_loss(
                b_logps, b_logps.detach() if b_old_logps is None else b_old_logps, inputs["advantages"], b_mask,
                loss_type=args.loss_type, importance_sampling_level=args.importance_sampling_level,
                epsilon_low=args.epsilon, epsilon_high=args.epsilon if args.epsilon_high is None else args.epsilon_high,
                beta=args.beta, b_ref_logps=inputs.get("ref_per_token_logps"),
                b_behaviour_weights=inputs.get("importance_sampling_ratio"),
                max_completion_length=args.max_completion_length, num_items_in_batch=step_tokens,
                micro_batches=micro_batches, sapo_temperature_pos=args.sapo_temperature_pos,
                sapo_temperature_neg=args.sapo_temperature_neg)
            stats["losses/entropy"] = masked_mean(b_entropies.detach(), b_mask)
            self._record(stats, diagnostic_weights(stats, b_mask, args.importance_sampling_level))
            if self.aux_loss_enabled:  # a mixture-of-experts model's router balance loss, as TRL adds it
                loss = loss + self.router_aux_loss_coef * aux_loss / micro_batches
                self.step_metrics["aux_loss"].append(self.accelerator.gather_for_metrics(aux_loss).mean().item())
            return loss

        def _record(self, stats: dict[str, Any], weights: Any) -> None:
            """Each diagnostic's mean over every process (weighted as it was averaged), for this step's log line."""
            values = torch.stack([stats[key].float() for key in stats])
            totals = self.accelerator.reduce(torch.stack([values * weights, weights]), reduction="sum")
            means = (totals[0] / totals[1].clamp(min=1.0)).tolist()
            for key, mean in zip(stats, means, strict=True):
                self.step_metrics[log_name(key, cast(Any, self.args).loss_type)].append(mean)

        def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
            prefix = "" if cast(Any, self.model).training else "eval_"  # as TRL names its evaluation metrics
            logs.update({prefix + key: sum(values) / len(values) for key, values in self.step_metrics.items()
                         if values})
            self.step_metrics.clear()
            super().log(logs, start_time)

        def _get_per_token_logps_and_entropies(self, model: Any, input_ids: Any, attention_mask: Any,
                                               logits_to_keep: int, *args: Any, **kwargs: Any) -> Any:
            budget = self.max_tokens_per_micro_batch
            text_only = not args and all(v is None for k, v in kwargs.items() if k not in _FORWARD_OPTIONS)
            if not text_only or kwargs.get("compute_aux_loss"):
                return self._forward_logps(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
            if budget is None or input_ids.numel() <= budget:
                return self._forward_text(model, input_ids, attention_mask, logits_to_keep, **kwargs)
            # TRL's forwards outside the loss (reference, old logprobs) take whole batches: piece them too
            return self._forward_pieces(model, input_ids, attention_mask, logits_to_keep, budget, **kwargs)

        def _forward_text(self, model: Any, input_ids: Any, attention_mask: Any, logits_to_keep: int,
                          batch_size: int | None = None, compute_entropy: bool = False, **kwargs: Any) -> Any:
            """TRL's forward, each chunk of ``batch_size`` rows with its common prompt prefix forwarded once."""
            checkpointing = torch.is_grad_enabled() and cast(Any, self.args).activation_checkpointing
            if not self.share_prompt_prefix or checkpointing:  # recomputed layers keep no cache for the suffix
                return self._forward_logps(model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                                           compute_entropy=compute_entropy, **kwargs)
            rows = batch_size or input_ids.size(0)
            parts: list[tuple[Any, Any]] = []
            for start in range(0, input_ids.size(0), rows):
                b_ids, b_mask = input_ids[start:start + rows], attention_mask[start:start + rows]
                prefix = shared_prefix_length(b_ids, b_mask, logits_to_keep)
                if prefix < MIN_SHARED_TOKENS or b_ids.size(0) == 1:
                    logps, entropies, _ = self._forward_logps(model, b_ids, b_mask, logits_to_keep,
                                                              compute_entropy=compute_entropy, **kwargs)
                    parts.append((logps, entropies))
                    continue
                with self.accelerator.autocast():
                    outputs = shared_prefix_forward(model, b_ids, b_mask, logits_to_keep, prefix)
                self.forward_tokens += prefix + b_ids.size(0) * (outputs.log_probs.size(1) + 1)  # + the suffix
                self.forward_real_tokens += int(b_mask.sum()) - (b_ids.size(0) - 1) * prefix
                parts.append((outputs.log_probs[:, -logits_to_keep:],
                              outputs.entropy[:, -logits_to_keep:] if compute_entropy else None))
            logps = torch.cat([part[0] for part in parts])
            entropies = torch.cat([part[1] for part in parts]) if compute_entropy else None
            return logps, entropies, None

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
                logps, entropies, aux_loss = self._forward_text(
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
