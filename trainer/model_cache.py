"""The base model and tokenizer a process keeps loaded between training rounds (the loop's warm child, a
``flywheel trainer`` worker), and the last round's LoRA around the model: a round borrows the model bare
(:func:`borrow`) or wrapped in the adapter it continues (:func:`borrow_adapter`), and gives the wrapper back.

LoRA never writes the base weights (they are frozen; only the adapter trains), so what a round changes is
the model's structure and flags: PEFT's injected layers, frozen ``requires_grad``, gradient checkpointing,
the input-gradient hook, train mode. ``give_back`` undoes the flags; the LoRA layers stay injected when the
round's LoRA was the only adapter, so the next round that continues an adapter of the same configuration
loads its weights into them instead of injecting new ones — and loads nothing when that adapter is the one
this process wrote last round (the layers hold its weights; ``optimizer_state`` holds its optimizer state).
:func:`borrow` unloads them, leaving the model a cold load gives (tests/test_model_cache.py checks the
weights bit for bit and warm rounds equal to cold ones). A round that raised never gives the model back:
the next borrow loads it afresh.

One model and one tokenizer are kept (the last base asked for): a process trains one base model.
"""

from __future__ import annotations

import copy
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from flywheel.trainer.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS, OPTIMIZER_FILE

Stamp = tuple[str, int, int, int]  # a file's resolved path, inode, size, mtime: the same bytes as when stamped


@dataclass
class Loaded:
    model: Any
    cached: bool  # kept from an earlier round of this process
    seconds: float  # spent loading it now (0 when cached)
    # borrow_adapter: its weights were held by the kept LoRA layers, read into them, or injected with new ones
    adapter: Literal["held", "read", "injected"] | None = None


@dataclass
class _Kept:
    key: tuple[str, str]
    model: Any  # the base model, as loaded (inside ``policy`` while that is kept)
    trainable: set[str]  # names of the parameters that required gradients as loaded
    use_cache: Any
    lent: bool = False
    policy: Any = None  # the last round's PeftModel around ``model``, its LoRA layers injected; None: bare
    lora: dict[str, Any] | None = None  # the adapter_config.json ``policy`` wrote
    holds: Stamp | None = None  # the weights file ``policy``'s LoRA layers equal (written from them)
    optimizer: tuple[Stamp, dict[str, Any]] | None = None  # the optimizer state written beside it, and its file


_model: _Kept | None = None
_tokenizer: tuple[str, Any] | None = None


def tokenizer(base: str) -> Any:
    """``base``'s tokenizer, kept; a copy when it has no pad token: TRL's trainer sets one, which the next round
    must not see (and changes nothing else of it, tests/test_model_cache.py checks)."""
    global _tokenizer
    if _tokenizer is None or _tokenizer[0] != base:
        from transformers import AutoTokenizer

        _tokenizer = (base, AutoTokenizer.from_pretrained(base))
    kept = _tokenizer[1]
    return kept if kept.pad_token is not None else copy.deepcopy(kept)


def borrow(base: str, dtype: Any) -> Loaded:
    """``base``'s causal LM in ``dtype``, bare: the one kept from the last round when it was given back whole."""
    global _model
    kept = _available(base, dtype)
    if kept is not None:
        if kept.policy is not None:
            _unwrap(kept)
        kept.lent = True
        return Loaded(kept.model, True, 0.0)
    _model = None  # another base, or a round that raised while holding it: its state is unknown
    from transformers import AutoModelForCausalLM

    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype)
    _model = _Kept(key=(base, str(dtype)), model=model, use_cache=getattr(model.config, "use_cache", None),
                   trainable={n for n, p in model.named_parameters() if p.requires_grad}, lent=True)
    return Loaded(model, False, time.perf_counter() - started)


def borrow_adapter(base: str, dtype: Any, adapter_dir: str | Path) -> Loaded:
    """``base`` with the LoRA in ``adapter_dir``, trainable: ``PeftModel.from_pretrained(..., is_trainable=True)``,
    or the kept wrapper when that LoRA has its configuration (its weights loaded into it, unless it holds them)."""
    from peft import PeftModel

    directory = Path(adapter_dir)
    kept = _available(base, dtype)
    if kept is not None and kept.lora is not None and kept.lora == _read_json(directory / ADAPTER_CONFIG):
        held = kept.holds is not None and kept.holds == _stamp(directory / ADAPTER_WEIGHTS)
        if held or _load_weights(kept.policy, directory):
            kept.lent, kept.holds = True, None  # its weights train now: they hold no file
            return Loaded(kept.policy, True, 0.0, "held" if held else "read")
    loaded = borrow(base, dtype)
    return Loaded(PeftModel.from_pretrained(loaded.model, str(directory), is_trainable=True), loaded.cached,
                  loaded.seconds, "injected")


def optimizer_state(path: str | Path) -> dict[str, Any] | None:
    """What ``torch.load(path)`` would return when this process wrote ``path`` last round (once); else None."""
    kept = _model
    if kept is None or kept.optimizer is None:
        return None
    stamp, state = kept.optimizer
    kept.optimizer = None  # the optimizer that loads it updates its tensors in place
    return state if stamp == _stamp(Path(path)) else None


def give_back(policy: Any, written: Path | None = None, optimizer: dict[str, Any] | None = None) -> None:
    """The round's PEFT model, with its flags as loaded: kept wrapped when its only adapter is the round's LoRA,
    with ``written`` (the version directory its weights were just saved to) and ``optimizer`` (the state saved
    there); else unwrapped into the kept base model (TRL's ``ref`` copy of an adapter dropped with it)."""
    global _model
    kept = _model
    if kept is None or policy.get_base_model() is not kept.model:
        _model = None
        return
    base = policy.get_base_model()
    if base.is_activation_checkpointing:
        base.activation_checkpointing_disable()
    if hasattr(base, "_require_grads_hook"):
        base.disable_input_require_grads()
    if kept.use_cache is not None:
        base.config.use_cache = kept.use_cache
    policy.eval()
    kept.policy, kept.lent = policy, False
    if list(policy.peft_config) != ["default"] or written is None:
        _unwrap(kept)
        return
    for parameter in policy.parameters():
        parameter.grad = None
    kept.lora, kept.holds = _read_json(written / ADAPTER_CONFIG), _stamp(written / ADAPTER_WEIGHTS)
    stamp = _stamp(written / OPTIMIZER_FILE)
    kept.optimizer = (stamp, optimizer) if optimizer is not None and stamp is not None else None


def _available(base: str, dtype: Any) -> _Kept | None:
    kept = _model
    return kept if kept is not None and kept.key == (base, str(dtype)) and not kept.lent else None


def _unwrap(kept: _Kept) -> None:
    """The kept wrapper's LoRA layers removed (not merged: the base weights stay as loaded), the flags as loaded."""
    base = kept.policy.unload()
    for name, parameter in base.named_parameters():
        parameter.requires_grad_(name in kept.trainable)
    base.eval()
    kept.policy, kept.lora, kept.holds, kept.optimizer = None, None, None, None


def _load_weights(policy: Any, directory: Path) -> bool:
    """``directory``'s LoRA weights into ``policy``'s layers as ``from_pretrained`` loads them; False when the
    file lacks some of them (``from_pretrained`` would leave those at their random initialization)."""
    from peft import get_peft_model_state_dict, load_peft_weights, set_peft_model_state_dict

    weights = load_peft_weights(str(directory))
    if weights.keys() != get_peft_model_state_dict(policy).keys():
        return False
    set_peft_model_state_dict(policy, weights, adapter_name="default")
    return True


def _stamp(path: Path) -> Stamp | None:
    try:
        status = path.stat()
    except OSError:
        return None
    return str(path.resolve()), status.st_ino, status.st_size, status.st_mtime_ns


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data
