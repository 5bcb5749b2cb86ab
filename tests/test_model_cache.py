"""The base model a process keeps between rounds (trainer/model_cache.py): a round gives it back as loaded, and its
LoRA layers kept for the next round that continues an adapter, so a warm round trains exactly what a cold one does.
Real rounds on the tiny model through TRL."""

from __future__ import annotations

import json
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


def continued(tiny: Path, adapter: Path, out: Path, checkpointing: bool = True) -> RoundResult:
    """A round that continues ``adapter`` and its optimizer state (with gradient checkpointing: a hook, a flag)."""
    args = GRPOArgs.tiny(max_steps=2, progress=False, gradient_checkpointing=checkpointing)
    return train_round(tiny, groups_of(tiny), args, init_adapter=adapter, out_dir=out,
                       optimizer_state=adapters.optimizer_state_of(adapter))


def same_training(one: RoundResult, other: RoundResult) -> bool:
    """The same adapter and optimizer moments, bit for bit, and the same losses."""
    import torch

    assert one.adapter_dir is not None and other.adapter_dir is not None
    ours, theirs = lora_tensors(one.adapter_dir), lora_tensors(other.adapter_dir)
    moments = [torch.load(r.adapter_dir / adapters.OPTIMIZER_FILE, weights_only=True)["optimizer"]["state"]
               for r in (one, other) if r.adapter_dir is not None]
    return (ours.keys() == theirs.keys() and all(ours[k].equal(theirs[k]) for k in ours)
            and moments[0].keys() == moments[1].keys()
            and all(moments[0][i][k].equal(moments[1][i][k]) for i in moments[0] for k in moments[0][i])
            and [s["loss"] for s in one.steps] == [s["loss"] for s in other.steps])


def test_rounds_that_continue_an_adapter_in_the_kept_lora_train_what_a_cold_one_does(own_tiny: Path,
                                                                                     tmp_path: Path) -> None:
    first = a_round(own_tiny, tmp_path / "1")
    assert first.adapter_dir is not None
    held = continued(own_tiny, first.adapter_dir, tmp_path / "2")  # the kept layers hold what round 1 wrote
    # They hold round 2's now: round 1's are read into them, whose checkpointing must not stay on.
    read = continued(own_tiny, first.adapter_dir, tmp_path / "3", checkpointing=False)
    # Cold: each on a base path of its own, for which nothing is kept.
    cold = continued(Path(shutil.copytree(own_tiny, tmp_path / "a")), first.adapter_dir, tmp_path / "4")
    cold_plain = continued(Path(shutil.copytree(own_tiny, tmp_path / "b")), first.adapter_dir, tmp_path / "5",
                           checkpointing=False)
    rounds = (held, read, cold, cold_plain)
    assert [r.config["derived"]["adapter_load"] for r in rounds] == ["held", "read", "injected", "injected"]
    assert [r.config["derived"]["optimizer_state"] for r in rounds] == ["resumed"] * 4
    assert [r.config["derived"]["base_model_cached"] for r in rounds] == [True, True, False, False]
    assert same_training(held, cold) and same_training(read, cold_plain)
    assert held.adapter_dir is not None and not same_training(first, held)  # it trained


def test_rounds_on_a_trainer_built_ahead_train_what_a_cold_one_does(own_tiny: Path, tmp_path: Path) -> None:
    """The warm child builds the next round's trainer after each round (trainer/round_trainer.py); a round takes it
    when it asks for the same trainer, else releases it and builds its own. Dropout on: the random state counts."""
    from flywheel.trainer import round_trainer

    def after(tiny: Path, adapter: Path, out: Path, **overrides: Any) -> RoundResult:
        args = GRPOArgs.tiny(max_steps=2, progress=False, lora_dropout=0.1, **overrides)
        return train_round(tiny, groups_of(tiny), args, init_adapter=adapter, out_dir=out,
                           optimizer_state=adapters.optimizer_state_of(adapter))

    first = a_round(own_tiny, tmp_path / "1", lora_dropout=0.1)
    assert first.adapter_dir is not None
    assert round_trainer.prepare_next(first.adapter_dir)  # as a round like the first one, continuing it
    taken = after(own_tiny, first.adapter_dir, tmp_path / "2")
    assert taken.adapter_dir is not None and round_trainer.prepare_next(taken.adapter_dir)
    refused = after(own_tiny, taken.adapter_dir, tmp_path / "3", seed=1)  # another trainer: built for the round
    cold = [after(Path(shutil.copytree(own_tiny, tmp_path / name)), adapter, tmp_path / f"cold-{name}", **overrides)
            for name, adapter, overrides in (("a", first.adapter_dir, {}), ("b", taken.adapter_dir, {"seed": 1}))]
    assert [r.config["derived"]["trainer_prepared"] for r in (taken, refused, *cold)] == [True, False, False, False]
    # the released trainer gave the kept layers back holding what the round before wrote
    assert [r.config["derived"]["adapter_load"] for r in (taken, refused)] == ["held", "held"]
    assert same_training(taken, cold[0]) and same_training(refused, cold[1])
    assert not same_training(first, taken)  # it trained


def test_files_replaced_under_the_path_the_kept_layers_were_saved_to_are_read(own_tiny: Path, tmp_path: Path) -> None:
    first = a_round(own_tiny, tmp_path / "1")
    second = a_round(own_tiny, tmp_path / "2", seed=1)  # the kept layers hold what it wrote to 2/
    assert first.adapter_dir is not None and second.adapter_dir is not None
    second.adapter_dir.rename(tmp_path / "moved")
    shutil.copytree(first.adapter_dir, second.adapter_dir)  # round 1's files where round 2's were
    assert continued(own_tiny, second.adapter_dir, tmp_path / "3").config["derived"]["adapter_load"] == "read"


def saved(tokenizer: Any, out: Path) -> dict[str, bytes]:
    tokenizer.save_pretrained(out)
    return {p.name: p.read_bytes() for p in out.iterdir()}


def test_the_kept_tokenizer_is_as_loaded_after_a_round(own_tiny: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    kept = model_cache.tokenizer(str(own_tiny))
    a_round(own_tiny, tmp_path / "1", beta=0.04)
    assert model_cache.tokenizer(str(own_tiny)) is kept  # it has a pad token: TRL leaves it alone
    assert saved(kept, tmp_path / "kept") == saved(AutoTokenizer.from_pretrained(own_tiny), tmp_path / "fresh")
    unpadded = Path(shutil.copytree(own_tiny, tmp_path / "unpadded"))
    config = unpadded / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "pad_token": None}))
    assert a_round(unpadded, tmp_path / "2").status == "finished"
    assert model_cache.tokenizer(str(unpadded)).pad_token is None  # TRL set one on the round's copy


def test_the_kept_model_is_given_back_as_loaded(own_tiny: Path, tmp_path: Path) -> None:
    import torch

    a_round(own_tiny, tmp_path / "1", beta=0.04, gradient_checkpointing=True)
    kept = model_cache.borrow(str(own_tiny), torch.float32)
    fresh = load(own_tiny)
    assert kept.cached and kept.seconds == 0
    model = kept.model
    assert [type(m) for m in model.modules()] == [type(m) for m in fresh.modules()]  # no LoRA layer left
    ours, theirs = model.state_dict(), fresh.state_dict()
    assert ours.keys() == theirs.keys() and all(ours[k].cpu().equal(theirs[k]) for k in ours)  # bit for bit
    assert all(p.requires_grad for p in model.parameters())
    assert not model.training and not model.is_activation_checkpointing
    assert not hasattr(model, "_require_grads_hook")


def test_a_model_that_was_not_given_back_is_loaded_again(own_tiny: Path) -> None:
    import torch

    lent = model_cache.borrow(str(own_tiny), torch.float32)
    again = model_cache.borrow(str(own_tiny), torch.float32)  # as after a round that raised while holding it
    assert not again.cached and again.model is not lent.model
