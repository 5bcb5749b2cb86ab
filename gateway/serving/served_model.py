"""What one alias resolves to: the engine, and the name it serves the version under."""

from __future__ import annotations

from dataclasses import dataclass, field

from flywheel.gateway.serving.engines.base import Engine


@dataclass
class ServedModel:
    """What one alias resolves to at this moment (the version serving it, or its canary candidate)."""

    alias: str
    engine_name: str
    engine: Engine = field(repr=False)
    base_model: str
    adapter: str | None = None  # engine name of the loaded adapter (alias@N), None for the base model
    adapter_path: str | None = None
    version: int = 0  # the store's version number; 0 is the base model
    in_flight: int = field(default=0, compare=False)

    @property
    def engine_model(self) -> str:
        """The ``model`` field the engine expects."""
        return self.adapter or self.base_model
