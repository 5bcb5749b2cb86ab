"""The base model and tokenizer a process keeps loaded between training rounds (the loop's warm child, a
``flywheel trainer`` worker): a round borrows the model, wraps it in a LoRA, and gives it back unwrapped.

LoRA never writes the base weights (they are frozen; only the adapter trains), so what a round changes is
the model's structure and flags: PEFT's injected layers, frozen ``requires_grad``, gradient checkpointing,
the input-gradient hook, train mode. ``give_back`` undoes each of them, so the next round starts from the
model a cold load gives (tests/test_model_cache.py checks the weights bit for bit and a warm round equal to
a cold one). A round that raised never gives the model back: the next borrow loads it afresh.

One model and one tokenizer are kept (the last base asked for): a process trains one base model.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Any


@dataclass
class Loaded:
    model: Any
    cached: bool  # kept from an earlier round of this process
    seconds: float  # spent loading it now (0 when cached)


@dataclass
class _Kept:
    key: tuple[str, str]
    model: Any
    trainable: set[str]  # names of the parameters that required gradients as loaded
    use_cache: Any
    lent: bool = False


_model: _Kept | None = None
_tokenizer: tuple[str, Any] | None = None


def tokenizer(base: str) -> Any:
    """A copy of ``base``'s tokenizer: TRL's trainer sets its pad token, which the next round must not see."""
    global _tokenizer
    if _tokenizer is None or _tokenizer[0] != base:
        from transformers import AutoTokenizer

        _tokenizer = (base, AutoTokenizer.from_pretrained(base))
    return copy.deepcopy(_tokenizer[1])


def borrow(base: str, dtype: Any) -> Loaded:
    """``base``'s causal LM in ``dtype``: the one kept from the last round when it was given back whole."""
    global _model
    key = (base, str(dtype))
    if _model is not None and _model.key == key and not _model.lent:
        _model.lent = True
        return Loaded(_model.model, True, 0.0)
    _model = None  # another base, or a round that raised while holding it: its state is unknown
    from transformers import AutoModelForCausalLM

    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype)
    _model = _Kept(key, model, {n for n, p in model.named_parameters() if p.requires_grad},
                   getattr(model.config, "use_cache", None), lent=True)
    return Loaded(model, False, time.perf_counter() - started)


def give_back(policy: Any) -> None:
    """The round's PEFT model, unwrapped back into the kept base model (its LoRA and TRL's ``ref`` copy dropped)."""
    global _model
    kept = _model
    base = policy.unload()  # removes the LoRA layers without merging them: the base weights stay as loaded
    if kept is None or base is not kept.model:
        _model = None
        return
    if base.is_activation_checkpointing:
        base.activation_checkpointing_disable()
    if hasattr(base, "_require_grads_hook"):
        base.disable_input_require_grads()
    for name, parameter in base.named_parameters():
        parameter.requires_grad_(name in kept.trainable)
    if kept.use_cache is not None:
        base.config.use_cache = kept.use_cache
    base.eval()
    kept.lent = False
