"""What a training round trains, from the configuration: the base weights of an alias and its GRPO arguments.

Read by the serving process (it hands both to a trainer worker) and by the training child.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flywheel.gateway.core.config import TINY_MODEL, LocalEngineConfig, Settings


def base_model_path(settings: Settings, alias: str) -> str:
    """The base weights to train for an alias: its ``train_model``, else its local engine's model."""
    config = settings.aliases[alias]
    if config.train_model:
        return config.train_model
    engine = settings.engines[config.engine]
    if not isinstance(engine, LocalEngineConfig):
        raise ValueError(f"aliases.{alias}.train_model: the alias is served by an upstream engine; say which "
                         "local base weights to train (a directory or a cached HF id)")
    if engine.model == TINY_MODEL:
        from flywheel.trainer.tiny_model import ensure_tiny_model

        return str(ensure_tiny_model(settings.data_dir / "models" / "tiny"))
    return engine.model


def grpo_args(settings: Settings, base_model: str, overrides: dict[str, Any] | None = None) -> Any:
    """``GRPOArgs`` from ``[train] args`` (+ overrides); the tiny model starts from its CPU settings."""
    from flywheel.trainer.grpo_args import GRPOArgs

    values = {**settings.train.args, **(overrides or {})}
    tiny = settings.train.tiny_defaults and Path(base_model).resolve() == (
        settings.data_dir / "models" / "tiny").resolve()
    return GRPOArgs.tiny(**values) if tiny else GRPOArgs(**values)
