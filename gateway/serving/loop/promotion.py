"""Switching which version serves an alias: the store decides, then the engines follow.

Every switch — the gate, the monitor's rollback, ``flywheel promote`` / ``rollback``, the admin
API, ``flywheel train --promote`` — goes through :func:`promote_version`: the store records the
new serving version (``adapter_versions``), then the router loads it as ``alias@N``, confirms the
engine lists it and answers with it, swaps, drains and unloads the old one. If the engine refuses
the new version, the store is put back as it was, so the store and the engines never disagree for
longer than the swap.
"""

from __future__ import annotations

import logging

from flywheel.gateway.core.store_api import AliasVersions, Version
from flywheel.gateway.serving.gateway_state import GatewayState
from flywheel.gateway.serving.served_model import ServedModel

log = logging.getLogger("flywheel.loop")


async def promote_version(state: GatewayState, alias: str, version: int, *, reason: str,
                          replaced_status: str = "retired") -> ServedModel:
    """Make ``version`` (0: the base model) serve ``alias``, in the store and on the engine."""
    state.router.get(alias)  # 404 for an unknown alias before anything changes
    result = await state.store.promote(alias, version, reason, replaced_status)
    target, previous = result.serving, result.previous
    try:
        served = await state.router.switch(alias, version, target.path if target else None)
    except Exception as exc:
        back = previous.version if previous else 0
        log.error("%s: the engine refused version %d (%s); the store returns to version %d", alias, version, exc, back)
        await state.store.promote(alias, back, f"version {version} failed to load")
        if version:
            await state.store.decide(alias, version, "rejected", f"the engine refused it: {exc}")
        raise
    log.info("%s: version %d serves (%s)", alias, version, reason)
    return served


async def restore_serving(state: GatewayState) -> dict[str, AliasVersions]:
    """At start-up: load what the store says serves each alias.

    A configured ``aliases.X.adapter`` is registered as a version (and promoted) the first time it
    is seen; after that the store decides, so a restart never undoes a promotion.
    """
    for alias, cfg in state.settings.aliases.items():
        if cfg.adapter:
            known = await state.store.versions(alias)
            if not any(row.path == cfg.adapter for row in known):
                row = await register_adapter(state, alias, cfg.adapter, source="config")
                await state.store.promote(alias, row.version, "aliases.adapter in the configuration")
    serving = await state.store.serving()
    for alias in state.settings.aliases:
        current = serving[alias].serving if alias in serving else None
        if current is not None:
            await state.router.switch(alias, current.version, current.path)
    return serving


async def register_adapter(state: GatewayState, alias: str, path: str, *, source: str) -> Version:
    """A new version number for an adapter directory that was not trained here (a manual switch, the config)."""
    served = state.router.get(alias)
    return await state.store.reserve_version(alias, served.base_model, source=source, status="candidate", path=path)
