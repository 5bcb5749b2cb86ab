"""The base model a process keeps between rounds (trainer/model_cache.py): a round gives it back as loaded, so a
warm round trains exactly what a cold one does. Real rounds on the tiny model through TRL."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from flywheel.trainer import adapters, model_cache
from flywheel.trainer.grpo import GRPOArgs, RoundResult, train_round
from tests.test_grpo import QUESTIONS, answer_group, load, lora_tensors


@pytest.fixture
def own_tiny(tiny_model: Path, tmp_path: Path) -> Path:
    """The tiny model under a path of this test's own: no earlier test's round left it kept."""
    return Path(shutil.copytree(tiny_model, tmp_path / "tiny"))


def groups_of(tiny: Path) -> list[Any]:
    from transformers import AutoTokenizer

    tokenizer, base = AutoTokenizer.from_pretrained(tiny), load(tiny)
    return [answer_group(tokenizer, base, q, f"q{i}") for i, q in enumerate(QUESTIONS)]


def a_round(tiny: Path, out: Path, **overrides: Any) -> RoundResult:
    return train_round(tiny, groups_of(tiny), GRPOArgs.tiny(max_steps=2, progress=False, **overrides), out_dir=out)


def test_a_warm_round_trains_the_same_adapter_as_a_cold_one(own_tiny: Path, tmp_path: Path) -> None:
    cold = a_round(own_tiny, tmp_path / "1")
    assert cold.adapter_dir is not None
    # Between them a round that changes the most: continues an adapter, TRL's "ref" copy for the KL, checkpointing.
    between = train_round(own_tiny, groups_of(own_tiny), GRPOArgs.tiny(max_steps=1, beta=0.04, progress=False,
                                                                        gradient_checkpointing=True),
                          init_adapter=cold.adapter_dir, out_dir=tmp_path / "2",
                          optimizer_state=adapters.optimizer_state_of(cold.adapter_dir))
    warm = a_round(own_tiny, tmp_path / "3")
    assert warm.adapter_dir is not None
    assert [r.config["derived"]["base_model_cached"] for r in (cold, between, warm)] == [False, True, True]
    assert cold.metrics["charts/model_load_seconds"] > 0 and warm.metrics["charts/model_load_seconds"] == 0
    first, again = lora_tensors(cold.adapter_dir), lora_tensors(warm.adapter_dir)
    assert first.keys() == again.keys()
    assert all(first[k].equal(again[k]) for k in first), "a warm round trained other weights than a cold one"
    assert [s["loss"] for s in cold.steps] == [s["loss"] for s in warm.steps]


def test_the_kept_model_is_given_back_as_loaded(own_tiny: Path, tmp_path: Path) -> None:
    import torch

    a_round(own_tiny, tmp_path / "1", beta=0.04, gradient_checkpointing=True)
    kept = model_cache.borrow(str(own_tiny), torch.float32)
    fresh = load(own_tiny)
    assert kept.cached and kept.seconds == 0
    model = kept.model
    assert [type(m) for m in model.modules()] == [type(m) for m in fresh.modules()]  # no LoRA layer left
    ours, theirs = model.state_dict(), fresh.state_dict()
    assert ours.keys() == theirs.keys() and all(ours[k].equal(theirs[k]) for k in ours)  # bit for bit
    assert all(p.requires_grad for p in model.parameters())
    assert not model.training and not model.is_activation_checkpointing
    assert not hasattr(model, "_require_grads_hook")


def test_a_model_that_was_not_given_back_is_loaded_again(own_tiny: Path) -> None:
    import torch

    lent = model_cache.borrow(str(own_tiny), torch.float32)
    again = model_cache.borrow(str(own_tiny), torch.float32)  # as after a round that raised while holding it
    assert not again.cached and again.model is not lent.model
