"""The model owner: weights, tokenizer, device and dtype, and the LoRA adapters loaded into the model.

A :class:`Runtime` is built once (:func:`load_runtime`, off the event loop) and then mutated
only on the engine's worker thread: PyTorch modules and PEFT's adapter switching are not
safe to drive from several threads, and one owner serialises adapter loads with forwards.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from flywheel.gateway.core.config import TINY_MODEL, LocalEngineConfig
from flywheel.gateway.core.errors import BadRequest, NotFound, UpstreamError
from flywheel.gateway.serving.engines.local.vocabulary import Vocabulary

log = logging.getLogger(__name__)


class Runtime:
    """Model, tokenizer and adapter state. Mutated only on the worker thread."""

    def __init__(self, model: Any, tokenizer: Any, device: torch.device, path: Path) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.device = device
        self.path = path
        vocab_size = int(getattr(model.config, "vocab_size", len(tokenizer)))
        self.vocab = Vocabulary(tokenizer, vocab_size)
        self.eos_ids = self._eos_ids()
        self.context = int(getattr(model.config, "max_position_embeddings", 0) or tokenizer.model_max_length)
        self.adapters: set[str] = set()
        self._active_adapter: str | None = None  # what PEFT currently has set

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        configured = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        for source in (configured, self.tokenizer.eos_token_id):
            if isinstance(source, int):
                ids.add(source)
            elif isinstance(source, list):
                ids.update(int(i) for i in source)
        im_end = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        if isinstance(im_end, int) and im_end != self.tokenizer.unk_token_id:
            ids.add(im_end)  # ChatML turn end, even if a config forgot it
        return ids

    @contextlib.contextmanager
    def _adapter(self, name: str | None) -> Iterator[None]:
        if not self.adapters:
            if name is not None:
                raise NotFound(f"adapter {name!r} is not loaded")
            yield
            return
        if name is None:
            with self.model.disable_adapter():
                yield
            return
        if name not in self.adapters:
            raise NotFound(f"adapter {name!r} is not loaded")
        if self._active_adapter != name:  # set_adapter walks every module: skip when unchanged
            self.model.set_adapter(name, inference_mode=True)
            self._active_adapter = name
        yield

    def forward(self, input_ids: torch.Tensor, cache: Any, adapter: str | None) -> tuple[torch.Tensor, Any]:
        """Last-position logits (rows x vocab, float32) and the updated KV cache."""
        with torch.no_grad(), self._adapter(adapter):
            out = self.model(input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1, :].float(), out.cache

    def load_adapter(self, name: str, path: str) -> None:
        from peft import PeftModel

        if name in self.adapters:
            raise BadRequest(f"an adapter named {name!r} is already loaded", param="name")
        try:
            with warnings.catch_warnings():
                # peft 0.21 calls a deprecated transformers-5 alias on every load: not actionable.
                warnings.filterwarnings("ignore", ".*is_gradient_checkpointing", FutureWarning)
                if not self.adapters:
                    self.model = PeftModel.from_pretrained(self.model, path, adapter_name=name,
                                                           is_trainable=False)
                else:
                    self.model.load_adapter(path, adapter_name=name, is_trainable=False)
        except Exception as exc:  # peft raises assorted types for incompatible adapters
            raise BadRequest(f"could not load adapter from {path}: {exc}", param="path") from exc
        self.model.eval()
        self.adapters.add(name)
        self._active_adapter = None if len(self.adapters) > 1 else name

    def unload_adapter(self, name: str) -> None:
        if name not in self.adapters:
            raise NotFound(f"adapter {name!r} is not loaded")
        if len(self.adapters) == 1:
            # PEFT leaves a PeftModel with zero adapters unusable: serve the plain base model again
            self.model = self.model.unload()
        else:
            if name in self.model.active_adapters:  # PEFT warns when deleting the active one: move off it
                other = next(a for a in sorted(self.adapters) if a != name)
                self.model.set_adapter(other, inference_mode=True)
            self.model.delete_adapter(name)
        self.adapters.discard(name)
        self._active_adapter = None


def model_source(config: LocalEngineConfig, data_dir: Path) -> Path | str:
    """The directory (or cached Hugging Face id) the configured model loads from."""
    from flywheel.trainer.tiny_model import ensure_tiny_model

    if config.model == TINY_MODEL:
        return ensure_tiny_model(data_dir / "models" / "tiny")
    local = Path(config.model).expanduser()
    return local if local.is_dir() else config.model  # else an HF id, from the cache only


def device_and_dtype(config: LocalEngineConfig) -> tuple[torch.device, torch.dtype]:
    name = config.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if config.dtype == "auto":
        return device, (torch.bfloat16 if device.type == "cuda" else torch.float32)
    dtype = getattr(torch, config.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise UpstreamError(f"unknown dtype {config.dtype!r} for the local engine")
    return device, dtype


def load_runtime(config: LocalEngineConfig, data_dir: Path) -> Runtime:
    """Load the configured model and tokenizer (blocking: call it off the event loop)."""
    import peft  # noqa: F401  (now, not at the first adapter load, whose import would stall every request's decoding)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = model_source(config, data_dir)
    device, dtype = device_and_dtype(config)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
        model: Any = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise UpstreamError(
            f"model {config.model!r} is neither a local directory nor in the Hugging Face cache "
            f"(nothing is downloaded): {exc}") from exc
    tokenizer.padding_side = "left"  # not saved with tokenizers; batched generation needs it
    model.to(device).eval()
    log.info("local engine: %s on %s (%s)", source, device, dtype)
    return Runtime(model, tokenizer, device, Path(str(source)))


def set_threads(count: int) -> None:
    """Torch's intra-op threads for the calling thread's work (call it on the thread that decodes)."""
    torch.set_num_threads(count)
