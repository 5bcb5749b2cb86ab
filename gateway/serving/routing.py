"""Which engine, and which model name on it, serves a request.

Clients keep sending the model name they always sent; ``RoutingConfig`` maps it to an
alias, and the alias table here maps the alias to what serves it right now: an engine
and the name the engine knows (the base model, or an adapter loaded as ``alias@N``, N
being the store's version number — never reused for other weights). While the loop runs
a canary, a share of the alias's conversations goes to the candidate version instead
(``gateway/serving/canary.py`` keeps each conversation on the version it started with).

A switch loads the new version, confirms the engine lists it and answers with it, then
swaps the alias in one assignment — every request sees the old or the new version, never
a mix — and unloads the old adapter once its in-flight requests have drained.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from typing import TYPE_CHECKING

from flywheel.gateway.core.config import RoutingConfig
from flywheel.gateway.core.errors import NotFound, OpenAIError, UpstreamError
from flywheel.gateway.serving.served_model import ServedModel

if TYPE_CHECKING:
    from flywheel.gateway.serving.canary import CanarySplit

log = logging.getLogger("flywheel.routing")


class SwapError(UpstreamError):
    """The engine did not load, list or answer with a new adapter version: nothing was switched."""


class ModelRouter:
    """Resolves requested model names, switches aliases between versions, and holds their canaries."""

    def __init__(self, routing: RoutingConfig, served: dict[str, ServedModel], *, retire_after_s: float = 0.0) -> None:
        self._routing = routing
        self._served = served
        self.canaries: dict[str, CanarySplit] = {}
        self.explorers: dict[str, ServedModel] = {}  # the training head, answering forks' siblings (fork_from)
        self._locks = {alias: asyncio.Lock() for alias in served}
        self.generation = 0  # counts switches and canary changes (a reader of the store can tell it went stale)
        # Replicas sharing an engine: a replaced adapter stays loaded this long, as the others may still route to it.
        self.retire_after_s = retire_after_s
        self._retiring: set[asyncio.Task[None]] = set()

    def alias_of(self, requested: str) -> str:
        alias = self._routing.resolve(requested, self._served)
        if alias is None:
            raise NotFound(f"The model '{requested}' does not exist or you do not have access to it.",
                           param="model")
        return alias

    def resolve(self, requested: str) -> ServedModel:
        return self._served[self.alias_of(requested)]

    def get(self, alias: str) -> ServedModel:
        if alias not in self._served:
            raise NotFound(f"No alias named '{alias}'.", param="alias", code="alias_not_found")
        return self._served[alias]

    def all(self) -> list[ServedModel]:
        return list(self._served.values())

    def version_model(self, alias: str, version: int, path: str | None) -> ServedModel:
        """What serving ``version`` of ``alias`` would look like (not loaded by this call)."""
        current = self.get(alias)
        return replace(current, adapter=f"{alias}@{version}" if version else None,
                       adapter_path=path if version else None, version=version, in_flight=0)

    async def load(self, candidate: ServedModel) -> None:
        """Load ``candidate``'s adapter, confirm the engine lists it, and check it answers (one token)."""
        if candidate.adapter is None:
            return
        assert candidate.adapter_path is not None
        engine = candidate.engine
        if candidate.adapter not in await engine.adapters():
            try:
                await engine.load_adapter(candidate.adapter, candidate.adapter_path)
            except OpenAIError:
                if candidate.adapter not in await engine.adapters():
                    raise
                # another replica sharing this engine loaded it meanwhile (vLLM refuses a name it has)
        listed = await engine.adapters()
        if candidate.adapter not in listed:
            raise SwapError(f"the engine did not list {candidate.adapter} after loading it (it lists {listed})")
        try:
            await engine.chat({"model": candidate.adapter, "messages": [{"role": "user", "content": "ping"}],
                               "max_tokens": 1, "temperature": 0})
        except OpenAIError as exc:
            raise SwapError(f"{candidate.adapter} was loaded but does not answer: {exc.message}") from None

    async def switch(self, alias: str, version: int, path: str | None, *,
                     drain_timeout_s: float = 30.0) -> ServedModel:
        """Serve ``alias`` from ``version`` (0: the base model): load and check it, swap, drain and unload the old.

        When the version is the alias's canary, its loaded adapter is taken over as it is.
        """
        async with self._locks[alias]:
            old = self.get(alias)
            if old.version == version:
                return old
            canary = self.canaries.get(alias)
            if canary is not None and canary.served.version == version:
                new = canary.served
                del self.canaries[alias]
            else:
                new = self.version_model(alias, version, path)
                await self.load(new)
            self._served[alias] = new
            self.generation += 1
            log.info("alias %s now served by %s (version %d)", alias, new.engine_model, version)
        await self._retire_soon(old)
        return new

    async def start_canary(self, split: CanarySplit) -> None:
        """Load the candidate and route a share of new conversations to it."""
        async with self._locks[split.served.alias]:
            await self.load(split.served)
            self.canaries[split.served.alias] = split
            self.generation += 1
        log.info("canary: %.0f%% of %s's new conversations go to %s", split.fraction * 100, split.served.alias,
                 split.served.engine_model)

    async def stop_canary(self, alias: str, *, drain_timeout_s: float = 30.0) -> None:
        """Stop routing to the candidate (rejected), then unload it once its requests have drained."""
        async with self._locks[alias]:
            split = self.canaries.pop(alias, None)
            self.generation += 1
        if split is not None:
            await self._retire_soon(split.served, drain_timeout_s)

    async def explore(self, alias: str, version: int, path: str | None) -> None:
        """Answer forked turns' siblings from ``version`` (the training head; 0: as the serving version does)."""
        async with self._locks[alias]:
            old = self.explorers.pop(alias, None)
            if version:
                new = old if old is not None and old.version == version else self.version_model(alias, version, path)
                if new is not old:
                    await self.load(new)
                self.explorers[alias] = new
        if old is not None and self.explorers.get(alias) is not old:
            log.info("alias %s: forks' siblings now from version %d", alias, version)
            await self._retire_soon(old)

    def in_use(self, adapter: str | None) -> bool:
        """Whether an alias, a canary or an explorer still answers with ``adapter``."""
        return adapter in ({s.adapter for s in self.all()} | {c.served.adapter for c in self.canaries.values()}
                           | {e.adapter for e in self.explorers.values()})

    async def _retire_soon(self, served: ServedModel, drain_timeout_s: float = 30.0) -> None:
        """Retire ``served`` now, or (``retire_after_s``) in the background once the other replicas followed."""
        if self.retire_after_s <= 0:
            await self.retire(served, drain_timeout_s)
            return
        task = asyncio.create_task(self._retire_later(served, drain_timeout_s))
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    async def _retire_later(self, served: ServedModel, drain_timeout_s: float) -> None:
        await asyncio.sleep(self.retire_after_s)
        try:
            await self.retire(served, drain_timeout_s)  # not if it answers here again meanwhile (a rollback to it)
        except OpenAIError as exc:  # another replica unloaded it first
            log.info("%s was not unloaded (%s)", served.adapter, exc.message)

    async def retire(self, served: ServedModel, drain_timeout_s: float = 30.0) -> None:
        """Unload ``served``'s adapter after its in-flight requests finished (bounded wait), unless it answers on."""
        if served.adapter is None or self.in_use(served.adapter):
            return
        deadline = asyncio.get_running_loop().time() + drain_timeout_s
        while served.in_flight > 0 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)
        if served.in_flight > 0:
            log.warning("%s still had %d requests in flight after %.0f s; unloading it anyway", served.adapter,
                        served.in_flight, drain_timeout_s)
        await served.engine.unload_adapter(served.adapter)
