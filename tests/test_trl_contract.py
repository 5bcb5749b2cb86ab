"""What trainer/trl_adapter.py relies on in TRL's GRPOTrainer, checked on a real trainer.

``CapturedGRPOTrainer`` overrides two public hooks of the HF Trainer: ``compute_loss`` (one policy
forward, then trainer/grpo_loss.py's loss, piece by piece under a token budget) and ``log`` (our
per-step diagnostics into TRL's log line). It overrides two private GRPOTrainer methods:
``_generate_and_score_completions`` (reads and replaces keys of its output; sets ``beta`` to 0
around it to skip the reference forward of samples it already has) and
``_get_per_token_logps_and_entropies`` (the policy forward: TRL's fused LM head, whose logprobs
never materialize the [tokens, vocab] logits; counts forwarded tokens, and runs TRL's whole-batch
forwards on token-budget pieces). ``_compute_loss`` is no longer overridden nor called in training:
only tests/test_grpo_loss.py calls it, as the reference our loss must equal. None of the private
methods is TRL's public API: pyproject.toml pins TRL to the minor version these tests pass on, and
each failure says what changed.
"""

from __future__ import annotations

import inspect
import math
import tomllib
import warnings
from pathlib import Path
from typing import Any

import pytest

from flywheel.trainer.sample_plan import CapturedRollout, passthrough_reward, plan_groups
from flywheel.trainer.samples import Sample, SampleBatch
from flywheel.trainer.trl_adapter import captured_trainer_class, unsupported_loss_options

ROOT = Path(__file__).resolve().parent.parent
CHANGED = "TRL changed what trainer/trl_adapter.py's CapturedGRPOTrainer relies on: "


def test_the_installed_trl_is_the_one_pyproject_pins() -> None:
    import trl
    from packaging.requirements import Requirement

    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["train"]
    pin = next(Requirement(r) for r in extra if Requirement(r).name == "trl")
    assert pin.specifier.contains(trl.__version__), (
        f"trl {trl.__version__} is installed, pyproject.toml pins {pin}: run tests/test_trl_contract.py and "
        "tests/test_grpo_loss.py on the new version, then move the pin")


@pytest.mark.parametrize(("method", "leading"), [
    ("_generate_and_score_completions", ["self", "inputs"]),
    ("_get_per_token_logps_and_entropies", ["self", "model", "input_ids", "attention_mask", "logits_to_keep",
                                            "batch_size", "compute_entropy"]),
    ("_compute_loss", ["self", "model", "inputs"]),  # not overridden: tests/test_grpo_loss.py's reference
    ("compute_loss", ["self", "model", "inputs", "return_outputs", "num_items_in_batch"]),
    ("log", ["self", "logs", "start_time"]),
])
def test_the_wrapped_methods_keep_their_signatures(method: str, leading: list[str]) -> None:
    from trl import GRPOTrainer

    assert hasattr(GRPOTrainer, method), CHANGED + f"GRPOTrainer.{method} is gone"
    params = list(inspect.signature(getattr(GRPOTrainer, method)).parameters)
    assert params[:len(leading)] == leading, CHANGED + f"GRPOTrainer.{method}{params} no longer starts with {leading}"


def captured_batch() -> SampleBatch:
    """One group of 4 sequences: env tokens (mask 0) inside one, unknown behaviour logprobs in another."""
    samples = []
    for i in range(4):
        completion = [20 + i, 30, 40, 50, 60][:5 - i % 2]
        env_mask = [1, 0, 0, 1, 1][:len(completion)] if i == 1 else [1] * len(completion)
        logprobs = None if i == 3 else [-1.0 - 0.1 * t if m else None for t, m in enumerate(env_mask)]
        samples.append(Sample("g", f"t{i}", i, 0, [11, 12, 13], completion, env_mask, logprobs, float(i == 0)))
    return SampleBatch(samples, ["g"], [], "group", 1, 4)


@pytest.fixture(scope="module")
def trainer(tiny_model: Path) -> Any:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig

    batch = captured_batch()
    config = GRPOConfig(output_dir=str(tiny_model.parent / "trl-contract-scratch"), report_to="none", use_cpu=True,
                        bf16=False, disable_tqdm=True, per_device_train_batch_size=4, num_generations=4,
                        gradient_accumulation_steps=1, max_completion_length=8, mask_truncated_completions=False,
                        num_iterations=2,  # batches reused: TRL computes old_per_token_logps itself
                        remove_unused_columns=False)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*rollout_func.*experimental", category=UserWarning)
        trainer = captured_trainer_class()(
            model=AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32),
            reward_funcs=[passthrough_reward], args=config,
            train_dataset=Dataset.from_list([{"prompt": "g", "slot": 0}]),
            processing_class=AutoTokenizer.from_pretrained(tiny_model),
            rollout_func=CapturedRollout(batch.samples, plan_groups(batch)),
            peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    trainer.advantage_diffs = []
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop
    return trainer


def test_generate_and_score_returns_the_keys_the_wrapper_reads(trainer: Any) -> None:
    import torch
    from trl import GRPOTrainer

    rows = [{"prompt": "g", "slot": 0} for _ in range(4)]  # the sampler repeats a row G times (distinct dicts)
    trainer.rollout_func.rows = rows
    output = GRPOTrainer._generate_and_score_completions(trainer, rows)  # TRL's own, not our wrapper
    read = ["prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "tool_mask", "advantages",
            "sampling_per_token_logps", "old_per_token_logps", "num_items_in_batch"]
    missing = [key for key in read if key not in output]
    assert not missing, CHANGED + f"_generate_and_score_completions no longer returns {missing}"
    b, c = 4, 5
    for key in ["completion_ids", "completion_mask", "tool_mask", "sampling_per_token_logps", "old_per_token_logps"]:
        assert tuple(output[key].shape) == (b, c), CHANGED + f"{key} is {tuple(output[key].shape)}, not (B, C)"
    assert tuple(output["advantages"].shape) == (b,), CHANGED + "advantages are no longer one per sequence"
    # env_mask comes back as tool_mask (padding: 1, under completion_mask 0)
    assert output["tool_mask"][1].tolist() == [1, 0, 0, 1, 1], CHANGED + "the rollout's env_mask is not tool_mask"
    # the rollout's logprobs come back as sampling_per_token_logps, NaN where the rollout said None
    captured = output["sampling_per_token_logps"]
    assert captured[0, :5].tolist() == pytest.approx([-1.0, -1.1, -1.2, -1.3, -1.4]), (
        CHANGED + "the rollout's logprobs are not sampling_per_token_logps")
    assert torch.isnan(captured[1, 1]) and torch.isnan(captured[3, :4]).all(), (
        CHANGED + "unknown logprobs (None) no longer come back as NaN")
    # advantages of the pass-through rewards [1, 0, 0, 0], grouped by G = 4
    assert output["advantages"].tolist() == pytest.approx([0.75 / (0.5 + 1e-4), *[-0.25 / (0.5 + 1e-4)] * 3]), (
        CHANGED + "TRL's advantages no longer come from the rewards the rollout returned")


def test_decoupled_the_wrapper_takes_the_ratio_against_the_round_start_and_weighs_the_sampler(trainer: Any) -> None:
    import torch

    rows = [{"prompt": "g", "slot": 0} for _ in range(4)]
    trainer.proximal_logps.clear()
    assert trainer.proximal_policy == "round"  # the default
    output = trainer._generate_and_score_completions(rows)
    again = trainer._generate_and_score_completions(rows)  # the next epoch: pi_prox is kept, not recomputed
    b_mask = (output["completion_mask"] * output["tool_mask"]).bool()
    prox = output["old_per_token_logps"]  # the policy's own at first sight (~ -7 on the random tiny model)
    assert float(prox[b_mask].max()) < -3.0
    weights = output["importance_sampling_ratio"]
    captured = output["sampling_per_token_logps"]
    known = ~torch.isnan(captured) & b_mask
    # the sampler gave its tokens ~ -1: the policy finds them far less likely, pi_prox / mu is small but not 0
    expected = torch.exp(prox[known] - captured[known]).clamp(max=3.0)
    assert torch.allclose(weights[known], expected) and float(weights[known].max()) < 0.1
    assert (weights[b_mask & ~known] == 1.0).all()  # unknown sampler: the proximal policy's own, weight 1
    assert torch.equal(again["old_per_token_logps"], prox)
    trainer.step_metrics.clear()
    loss = trainer.compute_loss(trainer.model, output)
    assert math.isfinite(loss.item()) and trainer.step_metrics["approx_kl"][0] < 1e-6  # the policy is pi_prox


def test_proximal_behaviour_clips_against_the_captured_logprobs_and_logs_approx_kl(trainer: Any) -> None:
    import torch

    rows = [{"prompt": "g", "slot": 0} for _ in range(4)]
    trainer.proximal_policy = "behaviour"
    try:
        output = trainer._generate_and_score_completions(rows)
    finally:
        trainer.proximal_policy = "round"  # the default
    old = output["old_per_token_logps"]
    assert old[0, :5].tolist() == pytest.approx([-1.0, -1.1, -1.2, -1.3, -1.4])
    assert not torch.isnan(old).any()  # unknown: TRL's own old logprobs, never NaN
    trainer.step_metrics.clear()
    loss = trainer.compute_loss(trainer.model, output)
    assert math.isfinite(loss.item())
    logged = trainer.step_metrics
    assert len(logged["approx_kl"]) == 1
    # the captured logprobs (-1.0 ...) are far from the random policy's (~ -7): the policy is not the sampler
    assert logged["approx_kl"][0] > 1.0
    assert {"clip_ratio/region_mean", "clip_ratio/low_mean", "clip_ratio/high_mean", "entropy"} <= set(logged)


def test_the_log_line_carries_our_diagnostics_beside_trls(trainer: Any) -> None:
    trainer.step_metrics.clear()
    trainer.step_metrics["approx_kl"] += [0.5, 1.5]  # two micro-batches of the step
    history = len(trainer.state.log_history)
    trainer.log({"loss": 1.0})
    line = trainer.state.log_history[history]
    assert line["approx_kl"] == 1.0 and line["loss"] == 1.0, (
        CHANGED + f"GRPOTrainer.log no longer writes the metrics it is handed: {line}")
    assert not trainer.step_metrics  # a step's means, not a running mean


def test_the_options_grpo_loss_does_not_write_out_are_refused(trainer: Any) -> None:
    from types import SimpleNamespace

    assert unsupported_loss_options(trainer.args) == []
    changed = SimpleNamespace(**{**vars(trainer.args), "delta": 1.5, "entropy_coef": 0.01, "loss_type": "vespo"})
    assert unsupported_loss_options(changed) == ["loss_type", "delta", "entropy_coef"]


def test_the_reference_forward_runs_only_when_beta_is_not_zero() -> None:
    from trl import GRPOTrainer

    source = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    assert "if self.beta != 0.0:" in source and "ref_per_token_logps = None" in source, (
        CHANGED + "the reference forward is no longer gated on self.beta: the trainer cannot skip it for samples "
        "whose reference logprobs it already has")


def test_the_loss_forward_never_materializes_the_logits(trainer: Any) -> None:
    # TRL's fused LM head projects the hidden states through lm_head's weight in tiles and keeps only the
    # sampled tokens' logprobs: lm_head itself (the [tokens, vocab] logits) is never called
    calls: list[tuple[int, ...]] = []
    lm_head = trainer.model.get_output_embeddings()
    handle = lm_head.register_forward_hook(lambda module, args, output: calls.append(tuple(output.shape)))
    try:
        output = trainer._generate_and_score_completions([{"prompt": "g", "slot": 0} for _ in range(4)])
        trainer.compute_loss(trainer.model, output)
    finally:
        handle.remove()
    assert calls == [], CHANGED + f"the logprob forwards compute the full logits {calls}: add_fused_lm_head is gone"
