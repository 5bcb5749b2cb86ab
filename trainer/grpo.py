"""One GRPO round on captured trajectory groups (``train_round``): TRL's GRPOTrainer, fed from the store.

``python -m flywheel.trainer.grpo`` runs one round from the command line (``trainer/grpo_cli.py``).

The math, top to bottom (what one round does; ``trainer/grpo_loss.py`` computes steps 3-6, the
loss that trains, tested equal to TRL's own loss and gradients):

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

The modules: ``grpo_args`` (``GRPOArgs``, ``RoundResult``), ``sample_plan`` (groups of one size for
TRL, the rollout that serves captured samples, token-budget pieces), ``trl_adapter``
(``CapturedGRPOTrainer``: the rows of the batch are handed to the rollout, the advantages are ours
(computed over each whole captured group; TRL's own equal them for whole groups, which is checked
and logged), the captured behaviour logprobs become ``old_per_token_logps`` so that step 3 clips
against the policy that actually sampled, and the loss is ``grpo_loss``), and this one: the round.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, fields
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from flywheel.capture.batches import TrainingGroup
from flywheel.trainer import adapters, model_cache, round_trainer
from flywheel.trainer.grpo_args import GRPOArgs, RoundResult
from flywheel.trainer.grpo_cli import parse_command, report
from flywheel.trainer.sample_plan import CapturedRollout, GroupPlan, plan_groups
from flywheel.trainer.samples import Sample, SampleBatch, Skipped, build_samples


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
        "behaviour/kl": mean("behaviour/kl"),
        "behaviour/weight_truncated_frac": mean("behaviour/weight_truncated_frac"),
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
                init_adapter: str | Path | None = None, out_dir: str | Path | Callable[[], str | Path],
                optimizer_state: str | Path | None = None) -> RoundResult:
    """Train one GRPO round on captured ``groups`` and write the adapter to ``out_dir`` (absent or empty).

    ``out_dir`` may be a function that names it, called once just before training starts (the caller
    reserves the version meanwhile; an exception from it ends the round before anything is trained).

    ``init_adapter`` (a PEFT directory, e.g. the alias's current version) is trained further;
    without it a fresh LoRA starts from the base model. ``optimizer_state`` (``optimizer.pt``
    beside that adapter) resumes AdamW's moments. Writes ``out_dir`` only when something was
    trained; with nothing trainable the result has ``status="skipped"`` and no adapter.
    """
    import pyarrow
    import torch
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

    # 3. the policy (base model + LoRA, fresh or the alias's current adapter trained further) and its trainer:
    # built now, or built ahead by this process after its last round (round_trainer.prepare_next)
    spec = round_trainer.TrainerSpec(
        base, str(init_adapter) if init_adapter else None, str(optimizer_state) if optimizer_state else None, args,
        g, per_device, accumulation, micro_batches, bf16, tf32, cuda)
    slots = {"prompt": list(plan.slot_group_ids), "slot": list(range(len(plan.slot_group_ids)))}
    # fingerprinted from the slots: datasets would otherwise hash the table by pickling it, most of its cost here
    dataset = Dataset(pyarrow.table(slots), fingerprint=hashlib.sha256(json.dumps(slots).encode()).hexdigest()[:16])
    rollout = CapturedRollout(batch.samples, plan)
    built = round_trainer.take(spec, dataset, rollout) or round_trainer.build(spec, tokenizer, dataset, rollout)
    trainer, trl_config, loaded = built.trainer, built.trl_config, built.loaded
    config["derived"]["base_model_cached"] = loaded.cached
    config["derived"]["adapter_load"] = loaded.adapter
    config["derived"]["trainer_prepared"] = built.spec is not spec
    try:
        optimizer_status = built.optimizer_status
        out = Path(out_dir() if callable(out_dir) else out_dir)

        # 4. train
        train_started = time.perf_counter()
        trainer.train()
        train_call_s = time.perf_counter() - train_started

        # 5. metrics, resolved config, provenance; then the adapter directory
        metrics, steps = _round_metrics(trainer.state.log_history, trainer.state.global_step, batch, plan, rollout,
                                        args)
        metrics["charts/train_call_seconds"] = train_call_s  # train_seconds starts after train()'s own setup
        metrics.update(_padding_metrics(trainer))
        metrics["charts/optimizer_resumed"] = float(optimizer_status == "resumed")
        metrics["charts/model_load_seconds"] = loaded.seconds
        policy = trainer.accelerator.unwrap_model(trainer.model, keep_fp32_wrapper=False)  # kept: not wrapped twice
        config["derived"]["optimizer_state"] = optimizer_status
        config["lora"] = _jsonable(policy.peft_config["default"].to_dict())
        config["trl"] = _jsonable({f.name: getattr(trl_config, f.name) for f in fields(trl_config)
                                   if f.name in _TRL_KEYS})
        config["versions"] = _versions()
        finished_at = _utcnow()
        result = RoundResult("finished", out, out / adapters.OPTIMIZER_FILE, metrics, steps, config,
                             list(plan.slot_group_ids), skipped, base, config["init_adapter"], started_at,
                             finished_at)
        trainer.accelerator.wait_for_everyone()
        if trainer.accelerator.is_main_process:
            staging = adapters.staging_dir(out)
            try:
                adapters.write_lora(policy, staging)  # the round's LoRA, not TRL's frozen "ref" copy
                optimizer = {"param_names": round_trainer.optimizer_param_names(trainer),
                             "optimizer": trainer.optimizer.state_dict(), "global_step": trainer.state.global_step}
                torch.save(optimizer, staging / adapters.OPTIMIZER_FILE)
                adapters.write_round_file(staging, _round_record(result, groups, batch, plan, out))
                adapters.publish(staging, out)
            finally:
                adapters.discard(staging)
            model_cache.give_back(policy, out, optimizer)  # for the next round of this process
        else:
            model_cache.give_back(policy)
        trainer.accelerator.wait_for_everyone()
        round_trainer.finished(spec)
    finally:
        built.close()
    if args.progress:
        _print_summary(result)
    return result


_TRL_KEYS = {"learning_rate", "lr_scheduler_type", "warmup_steps", "weight_decay", "max_grad_norm", "max_steps",
             "num_train_epochs", "per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation",
             "generation_batch_size", "num_generations", "max_completion_length", "temperature", "loss_type",
             "importance_sampling_level", "epsilon", "epsilon_high", "beta", "num_iterations", "scale_rewards",
             "mask_truncated_completions", "bf16", "tf32", "use_cpu", "seed", "activation_checkpointing", "optim"}


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


def main(argv: list[str] | None = None) -> None:
    """``python -m flywheel.trainer.grpo``: one round from the command line (``trainer/grpo_cli.py``)."""
    command = parse_command(argv)
    started = time.perf_counter()
    result = train_round(command.base, command.groups, command.args, init_adapter=command.init_adapter,
                         out_dir=command.out, optimizer_state=command.optimizer_state)
    report(command, result, time.perf_counter() - started)


if __name__ == "__main__":
    main()
