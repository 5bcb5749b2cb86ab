""":class:`StoreClient`: the store interface (``core/store_api.py``) sent to the store process.

Each method posts its arguments to ``/internal/store/{method}`` through the :class:`StoreLink` (which
first hands over the turns captured before the call, so the answer sees them) and reads the answer into
the Protocol's return type. A method names itself by the Protocol's function (``StoreApi.serving``), so
its wire name and its types come from one place. Inside :func:`as_it_is` (the loop's scheduled runs, the
status a screen polls) calls read the store as it is: they do not make the store process write its batch
of turns early, which cut batches short several times a second.

Where this gateway is the store's one writer (DuckDB), the answers about versions (``serving``, ``versions``,
``training_head``: every loop tick and status poll asks) are kept here while the store process's answers show
no write of ``adapter_versions`` since: each answer carries its count of them, and every such write is made
in answer to a call from this process (the interface's methods, the forwarded routes), so the change is seen
before the caller that made it hears back.
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


class StoreClient:
    """:class:`StoreApi` in the store process, over ``link``; ``keep_versions``: this gateway is the store's one
    writer, so its version reads are kept while no answer shows a write of versions."""

    def __init__(self, link: StoreLink, *, keep_versions: bool = False) -> None:
        self.link = link
        self.keep_versions = keep_versions
        self._kept: dict[tuple[str, str], tuple[int, Any]] = {}  # (method, arguments) -> (changes seen, answer)

    async def _call(self, method: Callable[..., Coroutine[Any, Any, T]], **arguments: Any) -> T:
        name = method.__name__
        body = to_jsonable_python(arguments)
        keep = self.keep_versions and name in VERSION_READS
        key = (name, repr(sorted(body.items())))
        if keep and (kept := self._kept.get(key)) is not None and kept[0] == self.link.versions_changes:
            answer: T = kept[1]
            return answer
        raw, seen = await self.link.call_seen("POST", f"/internal/store/{name}", json=body,
                                              fresh=not _AS_IT_IS.get())
        result: T = _result(method).validate_python(raw)
        if keep and seen is not None:
            self._kept[key] = (seen, result)
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
                              alone: bool = False, one_round: bool = False) -> Version:
        return await self._call(StoreApi.reserve_version, alias=alias,
                                base_model=base_model, source=source, status=status, path=path,
                                parent_version=parent_version, alone=alone, one_round=one_round)

    async def open_round(self, alias: str, base_model: str, max_groups: int,
                         group_ids: list[str] | None = None) -> OpenedRound:
        return await self._call(StoreApi.open_round, alias=alias, base_model=base_model, max_groups=max_groups,
                                group_ids=group_ids)

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
