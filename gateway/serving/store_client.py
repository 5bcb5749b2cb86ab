""":class:`StoreClient`: the store interface (``core/store_api.py``) sent to the store process.

Each method posts its arguments to ``/internal/store/{method}`` through the :class:`StoreLink` (which
first hands over the turns captured before the call, so the answer sees them) and reads the answer into
the Protocol's return type. A method names itself by the Protocol's function (``StoreApi.serving``), so
its wire name and its types come from one place. Inside :func:`as_it_is` (the loop's scheduled runs, the
status a screen polls) calls read the store as it is: they do not make the store process write its batch
of turns early, which cut batches short several times a second.

Where this gateway is the store's one writer (DuckDB), the answers about versions (``serving``, ``versions``,
``training_head``: every loop tick and status poll asks) are kept here until this client sends a method that may
change a version: every write of ``adapter_versions`` goes through it (the training child's and the workers'
rounds come through the admin API), so a kept answer is never stale.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Coroutine, Iterator
from contextvars import ContextVar
from datetime import datetime
from typing import Any, TypeVar, get_type_hints

from pydantic import TypeAdapter
from pydantic_core import to_jsonable_python

from flywheel.capture.batches import TrainingGroup
from flywheel.gateway.core.store_api import (
    AliasVersions,
    CanaryReward,
    FormedGroup,
    HeldoutContext,
    JobRunRecord,
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
from flywheel.gateway.serving.store_link import StoreLink

T = TypeVar("T")
_AS_IT_IS: ContextVar[bool] = ContextVar("flywheel_store_as_it_is", default=False)


@contextlib.contextmanager
def as_it_is() -> Iterator[None]:
    """Store calls made inside do not wait for the turns answered just before them to be written."""
    token = _AS_IT_IS.set(True)
    try:
        yield
    finally:
        _AS_IT_IS.reset(token)


@functools.cache
def _result(method: Callable[..., Any]) -> TypeAdapter[Any]:
    return TypeAdapter(get_type_hints(method)["return"])


VERSION_READS = frozenset({"serving", "versions", "training_head"})
# Methods that never write adapter_versions; any other (a new one too) forgets the kept version reads.
LEAVE_VERSIONS = VERSION_READS | {
    "close_idle", "form_groups", "score", "pending", "record_runs", "last_runs", "training_batch", "rewards",
    "canary_rewards", "reward_by_version", "heldout_contexts", "ui_trajectories", "ui_trajectory", "ui_groups",
    "ui_group", "ui_traffic", "ui_failed_jobs"}


class StoreClient:
    """:class:`StoreApi` in the store process, over ``link``; ``keep_versions``: this gateway is the store's one
    writer, so version reads are kept until it may change a version."""

    def __init__(self, link: StoreLink, *, keep_versions: bool = False) -> None:
        self.link = link
        self.keep_versions = keep_versions
        self._kept: dict[tuple[str, str], Any] = {}  # (method, its arguments as JSON) -> the answer
        self._generation = 0  # counts the calls that may have changed a version

    async def _call(self, method: Callable[..., Coroutine[Any, Any, T]], **arguments: Any) -> T:
        name = method.__name__
        body = to_jsonable_python(arguments)
        key = (name, repr(sorted(body.items())))
        if name not in LEAVE_VERSIONS:
            self._generation += 1
            self._kept.clear()
        elif self.keep_versions and name in VERSION_READS and key in self._kept:
            kept: T = self._kept[key]
            return kept
        generation = self._generation
        answer = await self.link.call("POST", f"/internal/store/{name}", json=body, fresh=not _AS_IT_IS.get())
        result: T = _result(method).validate_python(answer)
        if name not in LEAVE_VERSIONS:
            self._generation += 1  # and after: a read sent meanwhile may have seen the version before the write
            self._kept.clear()
        elif self.keep_versions and name in VERSION_READS and generation == self._generation:
            self._kept[key] = result
        return result

    async def close_idle(self) -> int:
        return await self._call(StoreApi.close_idle)

    async def form_groups(self) -> list[FormedGroup]:
        return await self._call(StoreApi.form_groups)

    async def score(self, alias: str | None = None) -> ScoreCounts:
        return await self._call(StoreApi.score, alias=alias)

    async def pending(self, alias: str) -> Pending:
        return await self._call(StoreApi.pending, alias=alias)

    async def recover(self, rounds: bool = True) -> Recovered:
        return await self._call(StoreApi.recover, rounds=rounds)

    async def record_runs(self, runs: list[JobRunRecord]) -> None:
        await self._call(StoreApi.record_runs, runs=runs)

    async def last_runs(self, alias: str, jobs: list[str]) -> dict[str, JobRunRecord]:
        return await self._call(StoreApi.last_runs, alias=alias, jobs=jobs)

    async def training_batch(self, alias: str, max_groups: int,
                             group_ids: list[str] | None = None) -> list[TrainingGroup]:
        return await self._call(StoreApi.training_batch, alias=alias,
                                max_groups=max_groups, group_ids=group_ids)

    async def reserve_version(self, alias: str, base_model: str, source: str = "trained", status: str = "training",
                              path: str | None = None, parent_version: int | None = None,
                              alone: bool = False) -> Version:
        return await self._call(StoreApi.reserve_version, alias=alias,
                                base_model=base_model, source=source, status=status, path=path,
                                parent_version=parent_version, alone=alone)

    async def record_round(self, alias: str, version: int, parent_version: int | None, promote: bool,
                           result: dict[str, Any], batch_group_ids: list[str] | None = None) -> Version | None:
        return await self._call(StoreApi.record_round, alias=alias,
                                version=version, parent_version=parent_version, promote=promote, result=result,
                                batch_group_ids=batch_group_ids)

    async def record_failed_round(self, alias: str, version: int, error: str,
                                  group_ids: list[str] | None = None) -> Version:
        return await self._call(StoreApi.record_failed_round, alias=alias,
                                version=version, error=error, group_ids=group_ids)

    async def versions(self, alias: str) -> list[Version]:
        return await self._call(StoreApi.versions, alias=alias)

    async def serving(self) -> dict[str, AliasVersions]:
        return await self._call(StoreApi.serving)

    async def training_head(self, alias: str) -> Version | None:
        return await self._call(StoreApi.training_head, alias=alias)

    async def promote(self, alias: str, version: int, reason: str, replaced_status: str = "retired") -> Promoted:
        return await self._call(StoreApi.promote, alias=alias,
                                version=version, reason=reason, replaced_status=replaced_status)

    async def rollback_target(self, alias: str) -> int:
        return await self._call(StoreApi.rollback_target, alias=alias)

    async def decide(self, alias: str, version: int, status: str, reason: str,
                     gate: dict[str, Any] | None = None) -> Version:
        return await self._call(StoreApi.decide, alias=alias,
                                version=version, status=status, reason=reason, gate=gate)

    async def record_gate(self, alias: str, version: int, gate: dict[str, Any]) -> Version:
        return await self._call(StoreApi.record_gate, alias=alias,
                                version=version, gate=gate)

    async def rewards(self, alias: str, since: datetime | None = None, until: datetime | None = None,
                      versions_in: list[int] | None = None) -> Rewards:
        return await self._call(StoreApi.rewards, alias=alias,
                                since=since, until=until, versions_in=versions_in)

    async def canary_rewards(self, alias: str, since: datetime, versions_in: list[int]) -> list[CanaryReward]:
        return await self._call(StoreApi.canary_rewards, alias=alias,
                                since=since, versions_in=versions_in)

    async def reward_by_version(self, alias: str) -> RewardByVersion:
        return await self._call(StoreApi.reward_by_version, alias=alias)

    async def heldout_contexts(self, alias: str, count: int) -> list[HeldoutContext]:
        return await self._call(StoreApi.heldout_contexts, alias=alias,
                                count=count)

    async def ui_trajectories(self, filters: dict[str, Any], limit: int = 50,
                              after: str | None = None) -> dict[str, Any]:
        return await self._call(StoreApi.ui_trajectories, filters=filters,
                                limit=limit, after=after)

    async def ui_trajectory(self, trajectory_id: str) -> dict[str, Any] | None:
        return await self._call(StoreApi.ui_trajectory, trajectory_id=trajectory_id)

    async def ui_groups(self, alias: str | None = None, status: str | None = None,
                        limit: int = 100) -> list[dict[str, Any]]:
        return await self._call(StoreApi.ui_groups, alias=alias,
                                status=status, limit=limit)

    async def ui_group(self, group_id: str) -> dict[str, Any] | None:
        return await self._call(StoreApi.ui_group, group_id=group_id)

    async def ui_traffic(self, alias: str, since: datetime, bucket_s: int) -> list[TrafficBucket]:
        return await self._call(StoreApi.ui_traffic, alias=alias,
                                since=since, bucket_s=bucket_s)

    async def ui_failed_jobs(self, alias: str, limit: int = 10) -> list[JobRunRecord]:
        return await self._call(StoreApi.ui_failed_jobs, alias=alias, limit=limit)


def _implements(client: type[StoreClient]) -> type[StoreApi]:
    return client  # mypy checks here that StoreClient is a StoreApi


_implements(StoreClient)
