"""A common prompt prefix forwarded once gives the loss, gradients and logprobs of the whole-batch forward.

``CapturedGRPOTrainer`` with ``share_prompt_prefix`` runs the tokens every row of a chunk begins
with once and each row's suffix against their cache (``trainer/shared_prefix.py``); the same
trainer without it is TRL's forward. Rows here share a 40-token system prompt, then differ, left
padded to different lengths, with tool tokens masked inside the completions: what a round of an
agent's groups looks like.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from flywheel.trainer.shared_prefix import MIN_SHARED_TOKENS, shared_prefix_length
from tests.test_grpo_micro_batches import assert_same_grads, lora_grads, make_trainer

COMMON = 40  # the system prompt every row starts with
OWN = [3, 0, 5, 1, 6, 2, 4, 6]  # each row's own prompt tokens after it: prompts 40-46 long, left-padded to 46
COMPLETION_LENS = [8, 8, 7, 5, 2, 3, 6, 1]  # right-padded to 8
WIDTH = COMMON + max(OWN)


def agent_batch(trainer: Any) -> dict[str, Any]:
    """8 sequences in TRL's layout whose prompts share ``COMMON`` tokens; logprobs moved on both sides of the clip."""
    import torch

    generator = torch.Generator().manual_seed(0)
    common = torch.randint(10, 1000, (COMMON,), generator=generator)
    prompt_lens = torch.tensor([COMMON + n for n in OWN])
    prompt_mask = (torch.arange(WIDTH)[None, :] >= WIDTH - prompt_lens[:, None]).long()
    prompt_ids = torch.zeros(8, WIDTH, dtype=torch.long)
    for row, n in enumerate(OWN):
        own = torch.randint(10, 1000, (n,), generator=generator)
        prompt_ids[row, WIDTH - COMMON - n:] = torch.cat([common, own])
    completion_mask = (torch.arange(8)[None, :] < torch.tensor(COMPLETION_LENS)[:, None]).long()
    tool_mask = torch.ones(8, 8, dtype=torch.long)
    tool_mask[1, 2:4] = tool_mask[6, 1:3] = 0  # a tool result between two sampled turns
    inputs = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask,
              "completion_ids": torch.randint(10, 1000, (8, 8), generator=generator) * completion_mask,
              "completion_mask": completion_mask, "tool_mask": tool_mask,
              "advantages": torch.tensor([1.2, -0.4, 0.3, -1.1, 0.8, -0.2, 0.5, -1.0], dtype=torch.float64),
              "num_items_in_batch": (completion_mask * tool_mask).sum().double()}
    with torch.no_grad():
        b_logps = trainer._get_per_token_logps_and_entropies(trainer.model, *joined(inputs), 8)[0]
    noise = torch.randn(2, 8, 8, generator=generator, dtype=torch.float64)
    inputs["old_per_token_logps"] = b_logps + 0.3 * noise[0]
    inputs["ref_per_token_logps"] = b_logps + 0.3 * noise[1]
    return inputs


def joined(inputs: dict[str, Any]) -> tuple[Any, Any]:
    import torch

    return (torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1))


def test_the_shared_prefix_is_what_every_prompt_starts_with_and_leaves_each_its_last_token() -> None:
    import torch

    ids = torch.tensor([[0, 0, 5, 6, 7, 8, 1, 2], [5, 6, 7, 9, 9, 9, 3, 0], [0, 5, 6, 7, 8, 4, 1, 1]])
    mask = (ids != 0).long()
    assert shared_prefix_length(ids, mask, 2) == 3  # 5 6 7, then 8 / 9 / 8
    assert shared_prefix_length(ids[[0, 0]], mask[[0, 0]], 2) == 3  # the same prompt twice: all but its last token
    assert shared_prefix_length(torch.tensor([[1, 2, 3], [4, 2, 3]]), torch.ones(2, 3, dtype=torch.long), 1) == 0


@pytest.mark.parametrize(("loss_type", "level", "budget"), [("dapo", "token", None), ("grpo", "sequence", None),
                                                             ("dapo", "token", 120)])
def test_a_shared_prefix_gives_the_loss_and_gradients_of_the_whole_forward(tiny_model: Path, loss_type: str,
                                                                           level: str, budget: int | None) -> None:
    import torch

    trainer = make_trainer(tiny_model, loss_type, level, beta=0.04, budget=budget)
    model = trainer.model
    inputs = agent_batch(trainer)
    # all of the system prompt but its last token, which row 1 (no tokens of its own) needs for its first logit
    assert shared_prefix_length(*joined(inputs), 8) == COMMON - 1 >= MIN_SHARED_TOKENS

    whole = trainer.compute_loss(model, inputs)
    whole.backward()
    whole_grads = lora_grads(model)
    forwarded = trainer.forward_tokens

    trainer.share_prompt_prefix = True
    shared = trainer.compute_loss(model, inputs)
    shared.backward()
    grads = lora_grads(model)

    assert trainer.forward_tokens - forwarded < forwarded / 2  # the 40 tokens once, not 8 times
    # float64 model; TRL's fused head rounds logprobs to float32 (tests/test_grpo_micro_batches.py says where)
    torch.testing.assert_close(shared.detach(), whole.detach(), rtol=1e-5, atol=1e-7)
    assert_same_grads(grads, whole_grads)


def test_reference_and_old_logprobs_in_chunks_equal_the_whole_forwards(tiny_model: Path) -> None:
    import torch

    trainer = make_trainer(tiny_model, beta=0.04)
    inputs = agent_batch(trainer)
    model: Any = trainer.model
    with torch.no_grad(), model.disable_adapter():  # TRL's reference forward: the adapter off, chunks of 4 rows
        reference = trainer._get_per_token_logps_and_entropies(model, *joined(inputs), 8, batch_size=4)
        trainer.share_prompt_prefix = True
        shared = trainer._get_per_token_logps_and_entropies(model, *joined(inputs), 8, batch_size=4)
    b_mask = inputs["completion_mask"].bool()
    torch.testing.assert_close(shared[0][b_mask], reference[0][b_mask], rtol=1e-5, atol=1e-6)
    assert shared[1] is None and shared[2] is None
