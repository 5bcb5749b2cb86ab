""":class:`LocalStore`: the store interface (``core/store_api.py``) run on an open store, in this process.

The store process answers the serving process with it (``/internal/store/{method}``: :func:`answer`),
and tests and tools use it directly. Blocking reads and writes run on a worker thread, so the event
loop keeps taking captured turns meanwhile.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Callable, Hashable
from datetime import datetime
from typing import Any, TypeVar, get_type_hints

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError, create_model

from flywheel.capture.batches import TrainingGroup
from flywheel.capture.store import Store
from flywheel.gateway.core.config import Settings
from flywheel.gateway.core.errors import BadRequest
from flywheel.gateway.core.store_api import (
    METHODS,
    AliasVersions,
    CanaryReward,
    FormedGroup,
    HeldoutContext,
    JobRunRecord,
    OpenedRound,
    Pending,
    Promoted,
    Recovered,
    RewardByVersion,
    Rewards,
    ScoreCounts,
    StoreApi,
    TrafficBucket,
    Version,
)
from flywheel.gateway.storeproc import dashboard_ops, store_ops
from flywheel.gateway.storeproc.kept_reads import (
    PENDING_TABLES,
    REWARD_TABLES,
    RUN_TABLES,
    SCORING_TABLES,
    VERSION_TABLES,
    kept_reads,
)

T = TypeVar("T")


class LocalStore:
    """:class:`StoreApi` on ``store`` with ``settings``."""

    def __init__(self, store: Store, settings: Settings) -> None:
        self.store, self.settings = store, settings

    async def _run(self, function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return await asyncio.to_thread(function, self.store, self.settings, *args, **kwargs)

    async def _kept(self, key: Hashable, tables: tuple[str, ...], function: Callable[..., T], *args: Any) -> T:
        """``function``'s answer, kept until one of ``tables`` is written (``kept_reads.py``); a kept one is given
        without a thread."""
        kept = kept_reads(self.store)
        hit, answer = kept.kept(key, tables)
        if hit:
            return answer
        return await asyncio.to_thread(kept.read, key, tables, lambda: function(self.store, self.settings, *args))

    async def close_idle(self) -> int:
        return await self._run(store_ops.close_idle)

    async def form_groups(self) -> list[FormedGroup]:
        return await self._run(store_ops.run_group_formation)

    async def score(self, alias: str | None = None) -> ScoreCounts:
        kept = kept_reads(self.store)
        key = ("score", alias)
        hit, _ = kept.kept(key, SCORING_TABLES)
        if hit:  # no group was written since a run that found none to score
            return ScoreCounts()
        stamp = kept.stamp(SCORING_TABLES)
        summary = await store_ops.score(self.store, self.settings, alias)
        kept.keep(key, stamp if summary.groups == 0 else None, None)
        return summary

    async def pending(self, alias: str) -> Pending:
        return await self._kept(("pending", alias), PENDING_TABLES, store_ops.pending, alias)

    async def recover(self, rounds: bool = True) -> Recovered:
        return await self._run(store_ops.recover, rounds)

    async def record_runs(self, runs: list[JobRunRecord]) -> None:
        await self._run(store_ops.record_runs, runs)

    async def last_runs(self, alias: str, jobs: list[str]) -> dict[str, JobRunRecord]:
        return await self._kept(("last_runs", alias, tuple(jobs)), RUN_TABLES, store_ops.last_runs, alias, jobs)

    async def training_batch(self, alias: str, max_groups: int,
                             group_ids: list[str] | None = None) -> list[TrainingGroup]:
        return await self._run(store_ops.batch, alias, max_groups, group_ids)

    async def reserve_version(self, alias: str, base_model: str, source: str = "trained", status: str = "training",
                              path: str | None = None, parent_version: int | None = None,
                              alone: bool = False, one_round: bool = False) -> Version:
        return await self._run(store_ops.reserve_version, alias, base_model, source, status, path, parent_version,
                               alone, one_round)

    async def open_round(self, alias: str, base_model: str, max_groups: int,
                         group_ids: list[str] | None = None) -> OpenedRound:
        """The batch, the (kept) training head, and a version reserved as the admin API's reservation does: one
        round of the alias at a time; with trainer workers, only while no version is in flight."""
        groups, head = await asyncio.gather(self.training_batch(alias, max_groups, group_ids),
                                            self.training_head(alias))  # both at once: reads, on two threads
        if not groups:
            return OpenedRound(groups=[])
        reserved = await self.reserve_version(alias, base_model, parent_version=head.version if head else None,
                                              alone=self.settings.train.workers, one_round=True)
        return OpenedRound(groups=groups, head=head, reserved=reserved)

    async def record_round(self, alias: str, version: int, parent_version: int | None, promote: bool,
                           result: dict[str, Any], batch_group_ids: list[str] | None = None) -> Version | None:
        return await self._run(store_ops.record_round, alias, version, parent_version, promote, result,
                               batch_group_ids)

    async def record_failed_round(self, alias: str, version: int, error: str,
                                  group_ids: list[str] | None = None) -> Version:
        return await self._run(store_ops.failed_round, alias, version, error, group_ids)

    async def versions(self, alias: str) -> list[Version]:
        return await self._kept(("versions", alias), VERSION_TABLES, store_ops.list_versions, alias)

    async def serving(self) -> dict[str, AliasVersions]:
        return await self._kept(("serving",), VERSION_TABLES, store_ops.serving)

    async def training_head(self, alias: str) -> Version | None:
        return await self._kept(("training_head", alias), VERSION_TABLES, store_ops.training_head, alias)

    async def promote(self, alias: str, version: int, reason: str, replaced_status: str = "retired") -> Promoted:
        return await self._run(store_ops.promote, alias, version, reason, replaced_status)

    async def rollback_target(self, alias: str) -> int:
        return await self._run(store_ops.rollback_target, alias)

    async def decide(self, alias: str, version: int, status: str, reason: str,
                     gate: dict[str, Any] | None = None) -> Version:
        return await self._run(store_ops.decide, alias, version, status, reason, gate)

    async def record_gate(self, alias: str, version: int, gate: dict[str, Any]) -> Version:
        return await self._run(store_ops.record_gate, alias, version, gate)

    async def rewards(self, alias: str, since: datetime | None = None, until: datetime | None = None,
                      versions_in: list[int] | None = None) -> Rewards:
        key = ("rewards", alias, since, until, tuple(versions_in) if versions_in is not None else None)
        return await self._kept(key, REWARD_TABLES, store_ops.rewards, alias, since, until, versions_in)

    async def canary_rewards(self, alias: str, since: datetime, versions_in: list[int]) -> list[CanaryReward]:
        return await self._kept(("canary_rewards", alias, since, tuple(versions_in)), REWARD_TABLES,
                                store_ops.canary_rewards, alias, since, versions_in)

    async def reward_by_version(self, alias: str) -> RewardByVersion:
        return await self._kept(("reward_by_version", alias), REWARD_TABLES, store_ops.reward_by_version, alias)

    async def heldout_contexts(self, alias: str, count: int) -> list[HeldoutContext]:
        return await self._run(store_ops.heldout_contexts, alias, count)

    async def ui_trajectories(self, filters: dict[str, Any], limit: int = 50,
                              after: str | None = None) -> dict[str, Any]:
        return await self._run(dashboard_ops.trajectories, filters, limit, after)

    async def ui_trajectory(self, trajectory_id: str) -> dict[str, Any] | None:
        return await self._run(dashboard_ops.trajectory, trajectory_id)

    async def ui_groups(self, alias: str | None = None, status: str | None = None,
                        limit: int = 100) -> list[dict[str, Any]]:
        return await self._run(dashboard_ops.groups, alias, status, limit)

    async def ui_group(self, group_id: str) -> dict[str, Any] | None:
        return await self._run(dashboard_ops.group, group_id)

    async def ui_traffic(self, alias: str, since: datetime, bucket_s: int) -> list[TrafficBucket]:
        return await self._run(dashboard_ops.traffic, alias, since, bucket_s)

    async def ui_failed_jobs(self, alias: str, limit: int = 10) -> list[JobRunRecord]:
        return await self._run(dashboard_ops.failed_jobs, alias, limit)


def _implements(local: type[LocalStore]) -> type[StoreApi]:
    return local  # mypy checks here that LocalStore is a StoreApi


_implements(LocalStore)


@functools.cache
def _arguments(method: str) -> type[BaseModel]:
    """A model of ``method``'s parameters, from the Protocol: its types and defaults, nothing else admitted."""
    hints = get_type_hints(getattr(StoreApi, method))
    parameters = list(inspect.signature(getattr(StoreApi, method)).parameters.values())[1:]  # after self
    fields: dict[str, Any] = {p.name: (hints[p.name], ... if p.default is inspect.Parameter.empty else p.default)
                              for p in parameters}
    return create_model(f"{method}_arguments", __config__=ConfigDict(extra="forbid"), **fields)


@functools.cache
def _result(method: str) -> TypeAdapter[Any]:
    return TypeAdapter(get_type_hints(getattr(StoreApi, method))["return"])


async def answer(local: LocalStore, method: str, arguments: Any) -> Any:
    """``method``'s answer to ``arguments`` (JSON), as JSON: both checked against the Protocol's annotations."""
    if method not in METHODS:
        raise BadRequest(f"The store has no method {method!r}.", param="method")
    try:
        checked = _arguments(method).model_validate(arguments)
    except ValidationError as exc:
        error = exc.errors(include_url=False)[0]
        where = ".".join(str(part) for part in error["loc"]) or "arguments"
        raise BadRequest(f"{method}: {where}: {error['msg']}", param=where) from None
    result = await getattr(local, method)(**{name: getattr(checked, name) for name in type(checked).model_fields})
    return _result(method).dump_python(result, mode="json")
