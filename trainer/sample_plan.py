"""The round's samples laid out for TRL: groups of one size, the rollout that serves them, token-budget pieces.

``plan_groups`` buckets the captured groups into TRL groups of G sequences; ``CapturedRollout`` is
TRL's ``rollout_func`` and returns those samples instead of generating; ``token_budget_pieces`` and
``take_rows`` cut a TRL batch into length-bucketed pieces (``GRPOArgs.max_tokens_per_micro_batch``).
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from flywheel.trainer.samples import Sample, SampleBatch, Skipped


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
            plan.native.append(members == len(indices) and group_id not in batch.weighted)
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


# --------------------------------------------------------------------------- token-budget pieces


# The per-token keys of TRL's batch, by side: prompts are left-padded, completions right-padded.
PROMPT_KEYS = ("prompt_ids", "prompt_mask")
COMPLETION_KEYS = ("completion_ids", "completion_mask", "tool_mask", "old_per_token_logps", "sampling_per_token_logps",
                   "ref_per_token_logps", "importance_sampling_ratio")


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

