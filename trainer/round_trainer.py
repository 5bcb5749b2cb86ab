"""The round's TRL trainer: built for the round (:func:`build`), or built ahead between rounds (:func:`prepare_next`).

A trainer is never trained twice: each round gets a fresh one. What a process that runs round after round (the
loop's warm child) can do is build the next round's trainer while it waits for that round — the same
policy model, arguments and batch sizes as the round it just finished, continuing the adapter that round
wrote, which is what the loop's next round asks for when nothing else changed. The round takes it when it
asks for exactly that (:func:`take`) and swaps in its own dataset and rollout; otherwise the prepared one is
released (its model given back to ``model_cache`` as it was) and the round builds its own. Either way the
round trains bit for bit the same (tests/test_model_cache.py).
"""

from __future__ import annotations

import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flywheel.trainer import model_cache
from flywheel.trainer.grpo_args import GRPOArgs
from flywheel.trainer.sample_plan import passthrough_reward
from flywheel.trainer.trl_adapter import captured_trainer_class


@dataclass(frozen=True)
class TrainerSpec:
    """Everything a round's trainer is built from except its batch (dataset and rollout)."""

    base: str
    init_adapter: str | None  # the PEFT directory the round continues; None: a fresh LoRA
    optimizer_state: str | None  # AdamW's moments saved beside it
    args: GRPOArgs
    group_size: int
    per_device: int
    accumulation: int
    micro_batches: int
    bf16: bool
    tf32: bool
    cuda: bool


@dataclass
class BuiltTrainer:
    spec: TrainerSpec
    loaded: model_cache.Loaded
    trainer: Any  # CapturedGRPOTrainer
    trl_config: Any  # its GRPOConfig
    optimizer_status: str  # fresh | resumed | mismatch
    scratch: tempfile.TemporaryDirectory[str]  # TRL's output_dir (it saves nothing there: save_strategy "no")

    def close(self) -> None:
        self.scratch.cleanup()


_prepared: BuiltTrainer | None = None
_last: TrainerSpec | None = None  # the spec of the last round this process finished


def build(spec: TrainerSpec, tokenizer: Any, dataset: Any, rollout: Any) -> BuiltTrainer:
    """The policy (base model + LoRA, fresh or ``spec.init_adapter`` trained further) and a trainer around it."""
    import torch
    import transformers
    from peft import LoraConfig
    from trl import GRPOConfig

    args = spec.args
    dtype = torch.bfloat16 if spec.bf16 else torch.float32
    # kept from the last round, if any; the adapter's LoRA layers too when they have its configuration
    loaded = model_cache.borrow(spec.base, dtype) if spec.init_adapter is None else \
        model_cache.borrow_adapter(spec.base, dtype, spec.init_adapter)
    transformers.set_seed(args.seed)  # after the load: a cold load draws random numbers (LoRA init), a kept one not
    peft_config = None
    if spec.init_adapter is None:
        peft_config = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                                 target_modules=target_modules(loaded.model, args.lora_target_modules),
                                 task_type="CAUSAL_LM")
    scratch = tempfile.TemporaryDirectory(prefix="flywheel-grpo-")
    trl_config = GRPOConfig(
        output_dir=scratch.name, report_to="none", save_strategy="no", logging_steps=args.logging_steps,
        disable_tqdm=not args.progress, seed=args.seed, bf16=spec.bf16, tf32=spec.tf32 or None, use_cpu=not spec.cuda,
        learning_rate=args.learning_rate, lr_scheduler_type=args.lr_scheduler_type,
        warmup_steps=args.warmup_steps, weight_decay=args.weight_decay, max_grad_norm=args.max_grad_norm,
        max_steps=args.max_steps, num_train_epochs=args.num_train_epochs,
        **_micro_batches(args, spec.per_device, spec.accumulation),
        **_generation_steps(args, spec.micro_batches, spec.accumulation),
        activation_checkpointing=args.gradient_checkpointing,  # TRL's GRPOConfig defaults it to on
        num_generations=spec.group_size, max_completion_length=args.max_completion_tokens,
        temperature=args.temperature, loss_type=args.loss_type,
        importance_sampling_level=args.importance_sampling_level,
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
            model=loaded.model, reward_funcs=[passthrough_reward], args=trl_config, train_dataset=dataset,
            processing_class=tokenizer, peft_config=peft_config, rollout_func=rollout,
            max_tokens_per_micro_batch=args.max_tokens_per_micro_batch, proximal_policy=args.proximal_policy,
            behaviour_weight_cap=args.behaviour_weight_cap, share_prompt_prefix=args.share_prompt_prefix)
    if not args.progress:  # without a progress bar the HF Trainer prints every log dict instead
        from transformers import PrinterCallback

        trainer.remove_callback(PrinterCallback)
    optimizer_status = _load_optimizer_state(trainer, spec.optimizer_state)
    return BuiltTrainer(spec, loaded, trainer, trl_config, optimizer_status, scratch)


def take(spec: TrainerSpec, dataset: Any, rollout: Any) -> BuiltTrainer | None:
    """The prepared trainer when it was built for ``spec``, with the round's dataset and rollout; else None
    (a prepared one for another spec is released first, so the round's own build finds the model kept)."""
    global _prepared
    prepared, _prepared = _prepared, None
    if prepared is None:
        return None
    if prepared.spec != spec:
        _release(prepared)
        return None
    import transformers

    prepared.trainer.train_dataset = dataset  # read when train() builds its dataloader
    prepared.trainer.rollout_func = rollout
    transformers.set_seed(spec.args.seed)  # as a trainer built now would leave the random state
    return prepared


def finished(spec: TrainerSpec) -> None:
    """The round of ``spec`` finished and gave its model back: the next one may be prepared from it."""
    global _last
    _last = spec


def prepare_next(out_dir: str | Path) -> bool:
    """Build the trainer of a round like the last finished one that continues ``out_dir`` (the adapter it wrote);
    False when no round finished since the last prepare, or the files are not there."""
    global _prepared, _last
    from datasets import Dataset

    from flywheel.trainer.adapters import OPTIMIZER_FILE, is_complete

    last, _last = _last, None
    out = Path(out_dir)
    if last is None or _prepared is not None or not is_complete(out):
        return False
    optimizer = out / OPTIMIZER_FILE
    spec = TrainerSpec(**{**last.__dict__, "init_adapter": str(out),
                          "optimizer_state": str(optimizer) if optimizer.is_file() else None})
    placeholder = Dataset.from_list([{"prompt": "", "slot": 0}])  # the round's own replaces it
    _prepared = build(spec, model_cache.tokenizer(spec.base), placeholder, None)
    return True


def _release(prepared: BuiltTrainer) -> None:
    """A prepared trainer that no round takes: its policy back to ``model_cache`` as borrowed (never trained, it
    still holds the weights of the adapter it was built from), its scratch directory removed."""
    policy = prepared.trainer.accelerator.unwrap_model(prepared.trainer.model, keep_fp32_wrapper=False)
    held = Path(prepared.spec.init_adapter) if prepared.spec.init_adapter else None
    model_cache.give_back(policy, held)
    prepared.close()


def target_modules(model: Any, spec: list[str] | str) -> list[str] | str:
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


def _generation_steps(args: GRPOArgs, micro_batches: int, accumulation: int) -> dict[str, Any]:
    """TRL's steps_per_generation. Under the round's proximal policy the generation batch is the whole epoch, so every
    sample's pi_prox is taken before the round's first optimizer step: the clip then bounds the round's move from its
    start, not only each step's (with one step per generation batch a sample first trained in step k would have the
    policy after k - 1 steps as its pi_prox, and a round of one epoch no clip at all)."""
    if args.proximal_policy != "round":
        return {}  # TRL's default: one optimizer step's micro-batches
    per_step = 1 if args.max_tokens_per_micro_batch is not None else accumulation  # TRL's micro-batches a step
    return {"steps_per_generation": per_step * (micro_batches // accumulation)}


def optimizer_param_names(trainer: Any) -> list[list[str]]:
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    return [[names.get(id(p), "?") for p in group["params"]] for group in trainer.optimizer.param_groups]


def _load_optimizer_state(trainer: Any, path: str | Path | None) -> str:
    """Create the optimizer now and load ``path`` into it when it was saved for the same parameters."""
    if path is None or not Path(path).is_file():
        return "fresh"
    import torch

    trainer.create_optimizer()
    saved = model_cache.optimizer_state(path) or \
        torch.load(path, map_location="cpu", weights_only=True)  # tensors and plain values: no code
    if saved.get("param_names") != optimizer_param_names(trainer):
        warnings.warn(f"optimizer state {path} was saved for other parameters: starting fresh", stacklevel=2)
        return "mismatch"
    trainer.optimizer.load_state_dict(saved["optimizer"])
    return "resumed"
