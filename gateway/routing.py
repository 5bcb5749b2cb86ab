"""Which engine, and which model name on it, serves a request.

Clients keep sending the model name they always sent; ``RoutingConfig`` maps it to an
alias, and the alias table here maps the alias to what serves it right now: an engine
and the name the engine knows (the base model, or an adapter loaded as ``alias@N``).
Switching an alias to a new adapter is one dict assignment, so every request sees
either the old or the new version, never a mix; the old adapter is unloaded only
after its in-flight requests have drained.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field, replace

from gateway.config import RoutingConfig
from gateway.engines.base import Engine
from gateway.errors import NotFound

log = logging.getLogger("flywheel.routing")


@dataclass
class ServedModel:
    """What one alias resolves to at this moment."""

    alias: str
    engine_name: str
    engine: Engine = field(repr=False)
    base_model: str
    adapter: str | None = None  # engine name of the loaded adapter (alias@N), None for the base model
    adapter_path: str | None = None
    version: int = 0  # bumped on every switch; the N in alias@N
    in_flight: int = field(default=0, compare=False)

    @property
    def engine_model(self) -> str:
        """The ``model`` field the engine expects."""
        return self.adapter or self.base_model


class ModelRouter:
    """Resolves requested model names and switches aliases between adapters."""

    def __init__(self, routing: RoutingConfig, served: dict[str, ServedModel]) -> None:
        self._routing = routing
        self._served = served
        self._switch_lock = asyncio.Lock()

    def resolve(self, requested: str) -> ServedModel:
        alias = self._routing.resolve(requested, self._served)
        if alias is None:
            raise NotFound(f"The model '{requested}' does not exist or you do not have access to it.",
                           param="model")
        return self._served[alias]

    def get(self, alias: str) -> ServedModel:
        if alias not in self._served:
            raise NotFound(f"No alias named '{alias}'.", param="alias", code="alias_not_found")
        return self._served[alias]

    def all(self) -> list[ServedModel]:
        return list(self._served.values())

    async def switch_adapter(self, alias: str, adapter_path: str | None, *, version: int | None = None,
                             drain_timeout_s: float = 30.0) -> ServedModel:
        """Serve ``alias`` from ``adapter_path`` (None: the base model), then unload the old adapter.

        The adapter is loaded under a new engine name, ``alias@N``: ``version`` (an
        ``adapter_versions`` number) when given, else one more than the current version.
        """
        async with self._switch_lock:
            old = self.get(alias)
            version = version if version is not None else old.version + 1
            new_adapter = f"{alias}@{version}" if adapter_path else None
            if new_adapter is not None and new_adapter == old.adapter:
                return old  # already served
            if adapter_path and new_adapter:
                await old.engine.load_adapter(new_adapter, adapter_path)
            new = replace(old, adapter=new_adapter, adapter_path=adapter_path, version=version, in_flight=0)
            self._served[alias] = new
            log.info("alias %s now served by %s", alias, new.engine_model)
        if old.adapter:
            await _drain(old, drain_timeout_s)
            await old.engine.unload_adapter(old.adapter)
        return new


async def _drain(served: ServedModel, timeout_s: float) -> None:
    """Wait for requests still using ``served`` to finish (bounded)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while served.in_flight > 0 and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.02)
