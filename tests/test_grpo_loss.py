"""The loss that trains (``CapturedGRPOTrainer.compute_loss``: trainer/grpo_loss.py) equals TRL's reference.

For every loss type and importance sampling level we expose, our trainer on the tiny model (LoRA,
temperature 0.7, asymmetric clipping, a KL term, two micro-batches per step out of a generation
batch of four) computes the loss of one fixed batch, and so does TRL's own
``GRPOTrainer._compute_loss`` on the same trainer: the two are compared in value, in their
gradients with respect to the LoRA weights, and in their diagnostics (``clip_ratio/*``, ``kl``,
``entropy``). The policy logprobs of the forward both use are checked against the model's own
logits / temperature, log-softmax. The comparison runs in float64: in float32 the backward's
round-off alone (each side's gradient against float64's) exceeds the tolerance on LoRA gradient
entries that nearly cancel.

The trainer runs on the GPU when there is one. TRL's fused LM head keeps its log-softmax
statistics and its logits gradient in float32 whatever the model's dtype, on CUDA in Triton
kernels whose reduction order differs from the CPU's torch tiles (and each side makes its own
forward): there the gradients are compared to 1e-4 relative plus 1e-5 of the tensor's largest
entry (``TOLERANCES``; the CPU's absolute 1e-7 failed on a ``lora_A`` entry that nearly cancels,
on an H100).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, cast

import pytest

from flywheel.trainer.grpo_loss import LOSS_TYPES
from flywheel.trainer.samples import group_advantages
from flywheel.trainer.trl_adapter import captured_trainer_class

TEMPERATURE = 0.7
MAX_COMPLETION_LENGTH = 8
EPSILON_LOW, EPSILON_HIGH = 0.2, 0.28
CISPO_EPSILON_MAX = 1.1  # cispo's epsilon_high is an absolute cap on the ratio (ScaleRL recommends 5.0)
REWARDS = [[1.0, 0.0, 0.5, 0.0], [0.2, 0.9, 0.4, 0.4]]  # two groups of four attempts

# (rtol, atol) of the policy logprobs, the loss and the gradients; on CUDA the gradients' atol is relative to
# the largest entry of each tensor (float32 folds in another order: entries near 0 differ by ~1e-6 of the largest)
TOLERANCES = {"cpu": {"logps": (1.3e-6, 1e-5), "loss": (1e-5, 1e-7), "grad": (1e-4, 1e-7)},
              "cuda": {"logps": (1e-5, 1e-5), "loss": (1e-4, 1e-7), "grad": (1e-4, 1e-5)}}

CASES = [(loss_type, level, 0.04, False) for loss_type in LOSS_TYPES for level in ("token", "sequence")]
CASES += [("dapo", "token", 0.0, False), ("grpo", "sequence", 0.0, False)]
# decoupled PPO: the ratio against a proximal policy, each token weighted by min(pi_prox / mu, 3) (TRL: vLLM's)
CASES += [("dapo", "token", 0.04, True), ("grpo", "sequence", 0.0, True), ("cispo", "token", 0.0, True)]
MICRO_BATCHES, STEPS_PER_GENERATION = 2, 4  # a step of two micro-batches; the generation batch spans four


def make_trainer(tiny_model: Path, loss_type: str, level: str, beta: float) -> Any:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig

    torch.manual_seed(0)
    # float64: the gradients are compared entry by entry at rtol=1e-4, atol=1e-7; in float32 the backward's
    # round-off on entries that nearly cancel (~3e-7) is above that, whichever loss it differentiates
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float64)
    config = GRPOConfig(
        output_dir=str(tiny_model.parent / "grpo-loss-scratch"), report_to="none",
        use_cpu=not torch.cuda.is_available(), bf16=False,
        disable_tqdm=True,
        per_device_train_batch_size=4, num_generations=4, gradient_accumulation_steps=MICRO_BATCHES,
        steps_per_generation=STEPS_PER_GENERATION,
        max_completion_length=MAX_COMPLETION_LENGTH, temperature=TEMPERATURE, loss_type=loss_type,
        importance_sampling_level=level, beta=beta, epsilon=EPSILON_LOW,
        epsilon_high=CISPO_EPSILON_MAX if loss_type == "cispo" else EPSILON_HIGH)
    # init_lora_weights=False: random A and B, so the adapter changes the logprobs and every LoRA weight gets a gradient
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], task_type="CAUSAL_LM",
                      init_lora_weights=False)
    trainer = captured_trainer_class()(
        model=model, reward_funcs=[lambda completions, **kw: [0.0] * len(completions)], args=config,
        train_dataset=Dataset.from_list([{"prompt": "x"}] * 16),
        processing_class=AutoTokenizer.from_pretrained(tiny_model), peft_config=lora)
    cast(Any, trainer.model).train()
    trainer.current_gradient_accumulation_steps = MICRO_BATCHES  # set by the training loop
    return trainer


def fixed_batch() -> dict[str, Any]:
    """8 completions of 8 tokens after 6 prompt tokens: padding, env tokens, both signs of advantage, moved logprobs."""
    import torch

    generator = torch.Generator().manual_seed(0)
    b_ids = torch.randint(10, 1000, (8, 6 + MAX_COMPLETION_LENGTH), generator=generator)  # (B, P + T)
    lengths = torch.tensor([8, 8, 7, 5, 8, 3, 6, 8])
    completion_mask = (torch.arange(MAX_COMPLETION_LENGTH)[None, :] < lengths[:, None]).long()  # (B, T) right padding
    tool_mask = torch.ones(8, MAX_COMPLETION_LENGTH, dtype=torch.long)
    tool_mask[1, 2:4] = tool_mask[6, 1:3] = 0  # a tool result between two sampled turns
    b_advantages = torch.tensor([a for group in group_advantages(REWARDS) for a in group])  # (B,)
    return {"prompt_ids": b_ids[:, :6], "prompt_mask": torch.ones(8, 6, dtype=torch.long),
            "completion_ids": b_ids[:, 6:], "completion_mask": completion_mask, "tool_mask": tool_mask,
            "advantages": b_advantages, "num_items_in_batch": (completion_mask * tool_mask).sum() * 2.0,
            "noise": torch.randn(3, 8, MAX_COMPLETION_LENGTH, generator=generator)}


def policy_logps(model: Any, batch: dict[str, Any]) -> Any:
    """log pi_theta of each completion token at TEMPERATURE, from the model's own logits (with gradient)."""
    import torch

    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)  # (B, P + T)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits  # (B, P + T, V)
    logits = logits[:, -MAX_COMPLETION_LENGTH - 1:-1] / TEMPERATURE  # (B, T, V): position t predicts token t + 1
    return logits.log_softmax(-1).gather(-1, batch["completion_ids"][..., None]).squeeze(-1)  # (B, T)


def lora_grads(model: Any) -> dict[str, Any]:
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize(("loss_type", "level", "beta", "decoupled"), CASES,
                         ids=[f"{t}-{lv}-beta{b}" + ("-decoupled" if d else "") for t, lv, b, d in CASES])
def test_the_loss_that_trains_equals_trl_in_value_gradient_and_diagnostics(tiny_model: Path, loss_type: str,
                                                                           level: str, beta: float,
                                                                           decoupled: bool) -> None:
    import torch
    from trl import GRPOTrainer

    trainer = make_trainer(tiny_model, loss_type, level, beta)
    model = trainer.model
    device = trainer.accelerator.device
    tolerance = TOLERANCES[device.type]
    batch = {k: v.to(device) for k, v in fixed_batch().items()}
    with torch.no_grad():
        b_logps = policy_logps(model, batch)
    # The sampler and the reference differ from the policy by ~0.3 nats per token: ratios on both sides of the clip.
    inputs = {k: v for k, v in batch.items() if k != "noise"}
    inputs["old_per_token_logps"] = b_logps + 0.3 * batch["noise"][0]  # (B, T)
    if beta:
        inputs["ref_per_token_logps"] = b_logps + 0.3 * batch["noise"][1]  # (B, T)
    if decoupled:  # behaviour weights around 1, some above the cap
        inputs["importance_sampling_ratio"] = torch.exp(0.6 * batch["noise"][2]).clamp(max=3.0)  # (B, T)
        assert float(inputs["importance_sampling_ratio"].max()) == 3.0

    # TRL applies the weights only with its own vLLM sampling, whose correction they are
    trainer.use_vllm = trainer.vllm_importance_sampling_correction = decoupled
    trl_loss = GRPOTrainer._compute_loss(trainer, model, inputs)  # TRL's reference: no longer what trains
    trainer.use_vllm = False
    trl_loss.backward()
    trl_grads = lora_grads(model)
    trl_metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}

    loss = trainer.compute_loss(model, inputs)  # the loss that trains: grpo_loss on one forward of the policy
    loss.backward()
    grads = lora_grads(model)
    ours = {k: v[-1] for k, v in trainer.step_metrics.items()}

    torch.testing.assert_close(loss.detach(), trl_loss.detach(), rtol=tolerance["loss"][0], atol=tolerance["loss"][1])
    assert grads.keys() == trl_grads.keys() and len(grads) == 2 * 3 * 2  # 2 layers x 3 modules x (A, B)
    for name, grad in grads.items():
        assert float(grad.abs().max()) > 0, name
        rtol, atol = tolerance["grad"]
        scale = float(grad.abs().max()) if device.type == "cuda" else 1.0
        torch.testing.assert_close(grad, trl_grads[name], rtol=rtol, atol=atol * scale, msg=name)

    # every diagnostic TRL logs, but its per-sequence extremes; approx_kl is ours alone
    assert set(ours) - {"approx_kl"} == set(trl_metrics) - {"clip_ratio/low_min", "clip_ratio/high_max"}
    for key in set(ours) - {"approx_kl"}:
        assert ours[key] == pytest.approx(trl_metrics[key], rel=1e-5, abs=1e-7), key
    if loss_type in ("grpo", "dapo") and level == "token":  # the batch reaches both sides of the clip range
        assert ours["clip_ratio/low_mean"] > 0 and ours["clip_ratio/high_mean"] > 0
    assert ours["approx_kl"] > 0.01  # ~0.3 nats of noise per token: the policy is not the sampler


def test_the_forward_both_losses_use_gives_the_models_own_logprobs(tiny_model: Path) -> None:
    """TRL's fused LM head (what the loss's forward uses) against the model's logits / temperature, log-softmax."""
    import torch

    trainer = make_trainer(tiny_model, "dapo", "token", 0.0)
    device = trainer.accelerator.device
    batch = {k: v.to(device) for k, v in fixed_batch().items()}
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    with torch.no_grad():
        fused, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, input_ids, attention_mask,
                                                                 MAX_COMPLETION_LENGTH)
        full = policy_logps(trainer.model, batch)
    sampled = batch["completion_mask"].bool()  # TRL's logprobs are 0 on padding
    rtol, atol = TOLERANCES[device.type]["logps"]
    torch.testing.assert_close(fused[sampled], full[sampled].float(), rtol=rtol, atol=atol)


def test_approx_kl_is_zero_on_policy_and_grows_with_the_distance() -> None:
    import torch

    from flywheel.trainer.grpo_loss import approx_kl

    mask = torch.tensor([[1.0, 1.0, 0.0]])
    assert float(approx_kl(torch.zeros(1, 3), mask)) == 0.0
    near, far = approx_kl(torch.tensor([[0.1, -0.1, 9.0]]), mask), approx_kl(torch.tensor([[0.5, -0.5, 0.0]]), mask)
    assert 0 < float(near) < float(far)  # the masked 9.0 is not counted
    # k3 = r - 1 - log r, averaged over the two sampled tokens
    assert float(far) == pytest.approx(((math.exp(0.5) - 1 - 0.5) + (math.exp(-0.5) - 1 + 0.5)) / 2)


def test_the_chunked_logprobs_equal_the_full_log_softmax_in_value_and_gradient(tiny_model: Path) -> None:
    """TRL's fused LM head (what every training forward uses) against log_softmax over the full logits.

    4,400 positions of the tiny model's hidden states through its lm_head in 256-row vocabulary
    chunks: more than one tile of tokens (4,096) and 7 chunks of the vocabulary, the full
    [tokens, vocab] logits never formed. The kernel keeps its statistics in float32 (TRL: bf16 sums
    drift), so against float64 it agrees to float32's precision, not to the bit.
    """
    import torch
    from transformers import AutoModelForCausalLM
    from trl.kernels import ChunkedLogProbFunction

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float64)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(10, 1000, (2, 2201), generator=generator)
    with torch.no_grad():
        b_hidden = model.model(input_ids=ids[:, :-1]).last_hidden_state.reshape(-1, model.config.hidden_size)
    b_hidden.requires_grad_()
    weight = model.lm_head.weight.detach().clone().requires_grad_()
    b_targets = ids[:, 1:].reshape(-1)  # position t predicts token t + 1
    upstream = torch.randn(b_targets.numel(), generator=generator, dtype=torch.float64)  # any loss of the logprobs

    chunked, entropy, *_ = ChunkedLogProbFunction.apply(b_hidden, weight, None, b_targets, TEMPERATURE, 256, None,
                                                       1.0, ("entropy",))
    (chunked * upstream).sum().backward()
    grads = b_hidden.grad.clone(), weight.grad.clone()
    b_hidden.grad = weight.grad = None
    full = (b_hidden @ weight.T / TEMPERATURE).log_softmax(-1)  # (N, V): what the chunks avoid
    b_logps = full.gather(1, b_targets[:, None]).squeeze(1)
    (b_logps * upstream).sum().backward()

    assert chunked.shape == (4400,) and weight.size(0) > 6 * 256  # 1,540 rows: 7 chunks
    torch.testing.assert_close(chunked.double(), b_logps.detach(), rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(entropy.double(), -(full.exp() * full).sum(-1).detach(), rtol=1e-6, atol=1e-5)
    for grad, full_grad in zip(grads, (b_hidden.grad, weight.grad), strict=True):
        torch.testing.assert_close(grad, full_grad, rtol=1e-5, atol=1e-6 * float(full_grad.abs().max()))
