"""Token-budget micro-batches and once-a-round reference logprobs, against TRL's own path.

A micro-batch trained in length-bucketed pieces under ``max_tokens_per_micro_batch`` must give
the loss and gradients of the whole micro-batch (``CapturedGRPOTrainer.compute_loss``, float64 on
the tiny model, every loss type); the reference logprobs of a sample are computed once, however
often it is served, and equal what TRL's own recomputation gives.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from flywheel.trainer.grpo_loss import LOSS_TYPES
from flywheel.trainer.sample_plan import CapturedRollout, passthrough_reward, plan_groups, token_budget_pieces
from flywheel.trainer.trl_adapter import captured_trainer_class
from tests.test_trl_contract import captured_batch

# (loss type, importance sampling level, prompts): "same", one prompt length (a group's prompt, G times);
# "ragged", prompts of different lengths, left-padded
CASES = [(loss_type, "token", "same") for loss_type in LOSS_TYPES] + [("grpo", "sequence", "same")]
CASES += [("dapo", "token", "ragged"), ("grpo", "sequence", "ragged")]
PROMPT_LENS = [6, 3, 5, 2, 6, 4, 1, 6]  # left-padded to 6
COMPLETION_LENS = [8, 8, 7, 5, 2, 3, 6, 1]  # right-padded to 8
BUDGET = 30  # forwarded tokens per piece: the 8 sequences (14 wide padded) go in several pieces


def make_trainer(tiny_model: Path, loss_type: str = "dapo", level: str = "token", beta: float = 0.0,
                 budget: int | None = None, zero_lora_b: bool = False, wrapped: bool = False) -> Any:
    """``wrapped``: the model comes as a PEFT model with its LoRA, as a round that trains an adapter further gets it."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig

    torch.manual_seed(0)
    batch = captured_batch()
    # float64, as in tests/test_grpo_loss.py: LoRA gradient entries that nearly cancel are compared one by one
    config = GRPOConfig(output_dir=str(tiny_model.parent / "micro-batch-scratch"), report_to="none", use_cpu=True,
                        bf16=False, disable_tqdm=True, per_device_train_batch_size=4, num_generations=4,
                        gradient_accumulation_steps=1, max_completion_length=8, mask_truncated_completions=False,
                        temperature=0.7, loss_type=loss_type, importance_sampling_level=level, beta=beta,
                        epsilon_high=1.1 if loss_type == "cispo" else 0.28, remove_unused_columns=False,
                        activation_checkpointing=False)  # as train_round passes it
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], task_type="CAUSAL_LM",
                      init_lora_weights=zero_lora_b)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*rollout_func.*experimental", category=UserWarning)
        trainer = captured_trainer_class()(
            model=get_peft_model(model, lora) if wrapped else model,
            reward_funcs=[passthrough_reward], args=config,
            train_dataset=Dataset.from_list([{"prompt": "g", "slot": 0}]),
            processing_class=AutoTokenizer.from_pretrained(tiny_model),
            rollout_func=CapturedRollout(batch.samples, plan_groups(batch)),
            peft_config=None if wrapped else lora, max_tokens_per_micro_batch=budget)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop
    return trainer


def ragged_batch(trainer: Any, prompt_lens: list[int]) -> dict[str, Any]:
    """8 sequences of different completion lengths, TRL's layout, moved logprobs on both sides of the clip."""
    import torch

    generator = torch.Generator().manual_seed(0)
    prompt_mask = (torch.arange(6)[None, :] >= 6 - torch.tensor(prompt_lens)[:, None]).long()  # (B, P) left padding
    completion_mask = (torch.arange(8)[None, :] < torch.tensor(COMPLETION_LENS)[:, None]).long()  # (B, C)
    tool_mask = torch.ones(8, 8, dtype=torch.long)
    tool_mask[1, 2:4] = tool_mask[6, 1:3] = 0  # a tool result between two sampled turns
    ids = torch.randint(10, 1000, (8, 14), generator=generator)
    inputs = {"prompt_ids": ids[:, :6] * prompt_mask, "prompt_mask": prompt_mask,
              "completion_ids": ids[:, 6:] * completion_mask, "completion_mask": completion_mask,
              "tool_mask": tool_mask,
              "advantages": torch.tensor([1.2, -0.4, 0.3, -1.1, 0.8, -0.2, 0.5, -1.0], dtype=torch.float64),
              "num_items_in_batch": (completion_mask * tool_mask).sum().double()}
    with torch.no_grad():
        b_logps = trainer._get_per_token_logps_and_entropies(
            trainer.model, torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
            torch.cat([prompt_mask, completion_mask], 1), 8)[0]
    noise = torch.randn(2, 8, 8, generator=generator, dtype=torch.float64)
    inputs["old_per_token_logps"] = b_logps + 0.3 * noise[0]
    inputs["ref_per_token_logps"] = b_logps + 0.3 * noise[1]
    return inputs


def lora_grads(model: Any) -> dict[str, Any]:
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def test_pieces_hold_similar_lengths_within_the_budget() -> None:
    pieces = token_budget_pieces(PROMPT_LENS, COMPLETION_LENS, BUDGET)
    assert sorted(i for piece in pieces for i in piece) == list(range(8))
    for piece in pieces:
        width = max(PROMPT_LENS[i] for i in piece) + max(COMPLETION_LENS[i] for i in piece)
        assert len(piece) * width <= BUDGET
    assert pieces[0] == [0, 2]  # the longest first (14 and 12 tokens: 2 x 14 = 28)
    assert token_budget_pieces([100], [100], BUDGET) == [[0]]  # longer than the budget: a piece alone
    assert token_budget_pieces(PROMPT_LENS, COMPLETION_LENS, 10**6) == [[0, 2, 1, 4, 3, 5, 6, 7]]


@pytest.mark.parametrize(("loss_type", "level", "prompts"), CASES, ids=["-".join(case) for case in CASES])
def test_a_micro_batch_in_budget_pieces_has_the_loss_and_gradients_of_the_whole(tiny_model: Path, loss_type: str,
                                                                                  level: str, prompts: str) -> None:
    import torch

    trainer = make_trainer(tiny_model, loss_type, level, beta=0.04)
    model = trainer.model
    prompt_lens = PROMPT_LENS if prompts == "ragged" else [6] * 8
    inputs = ragged_batch(trainer, prompt_lens)

    whole = trainer.compute_loss(model, inputs)  # today's path: one forward of the padded micro-batch
    whole.backward()
    whole_grads = lora_grads(model)
    forwarded = trainer.forward_tokens

    trainer.max_tokens_per_micro_batch = BUDGET
    pieces = trainer.compute_loss(model, inputs)  # backpropagates every piece but the last, returned
    pieces.backward()
    grads = lora_grads(model)

    assert len(token_budget_pieces(prompt_lens, COMPLETION_LENS, BUDGET)) > 2
    assert trainer.forward_tokens - forwarded < 8 * 14  # padding trimmed: fewer positions than the padded batch
    # float64 model, but TRL's fused head rounds the logprobs to float32: wherever the pieces' sums run in another
    # order than the whole's, ~1e-16 becomes ~1e-7 relative. Ragged prompts always do (trimming a piece's left
    # padding moves its tokens, and the RoPE angles are float32); same prompts do where BLAS picks its kernel by the
    # batch's shape (a 16-core CPU did; a 2-core one gives the same bits).
    torch.testing.assert_close(pieces.detach(), whole.detach(), rtol=1e-5, atol=1e-7)
    assert_same_grads(grads, whole_grads)


def assert_same_grads(grads: dict[str, Any], expected: dict[str, Any]) -> None:
    """Equal LoRA gradients, each entry within 1e-4 of its tensor's largest: entries that nearly cancel keep only
    the float32 rounding of the fused head's logprobs (a 2-core CPU saw 1.4e-7 on an entry of 2.8e-4)."""
    import torch

    assert grads.keys() == expected.keys() and len(grads) == 2 * 3 * 2
    for name, grad in grads.items():
        scale = float(expected[name].abs().max())
        assert float(grad.abs().max()) > 0 and scale > 0, name
        torch.testing.assert_close(grad, expected[name], rtol=1e-4, atol=1e-4 * scale,
                                   msg=lambda message, name=name: f"{name}: {message}")


@contextmanager
def reference_rows(adapter_off: bool = True) -> Iterator[Counter[int]]:
    """Counts the sequences that pass each LoRA layer with its adapter off (the reference forward), per layer;
    with ``adapter_off=False``, those that pass it with its adapter on (a forward of the policy)."""
    import torch
    from peft.tuners.tuners_utils import BaseTunerLayer

    counts: Counter[int] = Counter()

    def hook(module: Any, args: tuple[Any, ...], output: Any) -> None:
        if isinstance(module, BaseTunerLayer) and module.disable_adapters == adapter_off:
            counts[id(module)] += args[0].size(0)

    handle = torch.nn.modules.module.register_module_forward_hook(hook)
    try:
        yield counts
    finally:
        handle.remove()


def test_reference_logprobs_are_computed_once_per_sample_and_equal_trls(tiny_model: Path) -> None:
    import torch
    from trl import GRPOTrainer

    trainer = make_trainer(tiny_model, beta=0.04)
    rows = [{"prompt": "g", "slot": 0} for _ in range(4)]
    with reference_rows() as counts:
        first = trainer._generate_and_score_completions(rows)
        second = trainer._generate_and_score_completions(rows)  # the next epoch serves the same samples
    assert set(counts.values()) == {4}  # every LoRA layer saw the 4 sequences with its adapter off: once
    assert trainer.beta == 0.04  # restored after TRL skipped the forward
    with reference_rows() as counts:
        trainer.rollout_func.rows = rows
        trl = GRPOTrainer._generate_and_score_completions(trainer, rows)  # TRL's own: recomputes them
    assert set(counts.values()) == {4}
    torch.testing.assert_close(second["ref_per_token_logps"], trl["ref_per_token_logps"], rtol=0, atol=0)
    torch.testing.assert_close(first["ref_per_token_logps"], trl["ref_per_token_logps"], rtol=0, atol=0)
    trl["old_per_token_logps"] = second["old_per_token_logps"]  # the captured behaviour logprobs: ours
    trl["advantages"] = second["advantages"]
    assert float(trainer.compute_loss(trainer.model, second)) == float(trainer.compute_loss(trainer.model, trl))


def test_when_the_reference_is_the_round_start_pi_prox_is_its_forward_not_another(tiny_model: Path) -> None:
    import torch

    rows = [{"prompt": "g", "slot": 0} for _ in range(4)]
    fresh = make_trainer(tiny_model, beta=0.04, zero_lora_b=True)  # a new LoRA: B = 0, the policy is the base
    assert fresh.reference_is_round_start and fresh.proximal_policy == "round"
    with reference_rows(adapter_off=False) as policy_forwards:
        output = fresh._generate_and_score_completions(rows)
    assert not policy_forwards  # the reference forward (adapter off) was the only one
    torch.testing.assert_close(output["old_per_token_logps"], fresh._policy_logps(output), rtol=0, atol=1e-12)
    moved = make_trainer(tiny_model, beta=0.04)  # B != 0: the base is not the round's start
    assert not moved.reference_is_round_start
    with reference_rows(adapter_off=False) as policy_forwards:
        output = moved._generate_and_score_completions(rows)
    assert set(policy_forwards.values()) == {4}  # pi_prox: a forward of the policy's own
    assert not torch.allclose(output["old_per_token_logps"], output["ref_per_token_logps"])
    further = make_trainer(tiny_model, beta=0.04, wrapped=True)  # an adapter trained further: TRL copies it as "ref"
    assert further.reference_is_round_start
    with reference_rows(adapter_off=False) as policy_forwards:
        output = further._generate_and_score_completions(rows)
    assert set(policy_forwards.values()) == {4}  # the one forward with an adapter on: the "ref" copy's
    torch.testing.assert_close(output["old_per_token_logps"], further._policy_logps(output), rtol=0, atol=1e-12)


def test_without_a_kl_term_there_is_no_reference_forward(tiny_model: Path) -> None:
    trainer = make_trainer(tiny_model, beta=0.0)
    rows = [{"prompt": "g", "slot": 0} for _ in range(4)]
    with reference_rows() as counts:
        output = trainer._generate_and_score_completions(rows)
        trainer._generate_and_score_completions(rows)
    assert not counts and "ref_per_token_logps" not in output and not trainer.reference_logps
