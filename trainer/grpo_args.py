"""One GRPO round's configuration (``GRPOArgs``) and what it produced (``RoundResult``).

Plain dataclasses, importable without torch or TRL: the gateway reads and writes them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from flywheel.trainer.grpo_loss import LOSS_TYPES, LossType
from flywheel.trainer.samples import AdvantageScale, Truncation


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
    proximal_policy: Literal["round", "behaviour"] = "round"
    """the policy PPO's ratio and clip are taken against. round: the policy at the round's start, with the
    behaviour policy's distance from it corrected by a truncated importance weight (decoupled PPO, Hilton et al.
    2022): a round still moves when its samples came from an older version. behaviour: the engine's captured
    logprobs (PPO's own ratio), which stops a policy 1 +- epsilon away from whoever sampled"""
    behaviour_weight_cap: float = 3.0
    """the truncation of pi_prox / mu, the decoupled objective's behaviour weight (TRL's vLLM correction: 3.0)"""

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
    share_prompt_prefix: bool = True
    """forward the prompt tokens a micro-batch's rows all begin with once, not once per row (same logprobs and
    gradients up to rounding: trainer/shared_prefix.py)"""

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
        if self.proximal_policy not in ("round", "behaviour"):
            raise ValueError(f"proximal_policy must be round or behaviour, not {self.proximal_policy!r}")
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
