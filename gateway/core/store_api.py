"""The one interface to the store: what the loop, the admin routes and the dashboard ask of it, typed.

:class:`StoreApi` is a Protocol of async methods that take and return the models below. Two
implementations speak it: ``gateway/storeproc/store_api_local.py`` runs each method on the open store
(the store process, the CLI on a store file, tests), and ``gateway/serving/store_client.py`` sends it
to the store process (``POST /internal/store/{method}``, the arguments and the answer as JSON,
validated against these annotations at both ends). A reader follows ``store.serving()`` to the
Protocol and from there to the one function that runs it.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field

from flywheel.capture.batches import TrainingGroup


class Record(BaseModel):
    """A row as the store hands it out: read from the ORM object's attributes, no extra fields."""

    model_config = ConfigDict(from_attributes=True, extra="forbid")


class Version(Record):
    """An adapter version of an alias and what became of it (the ``adapter_versions`` row, docs/storage.md)."""

    id: str
    alias: str
    version: int
    path: str
    base_model: str
    parent_version: int | None = None
    training_run_id: str | None = None
    status: str
    created_at: datetime
    promoted_at: datetime | None = None
    metrics: dict[str, Any] | None = None
    source: str = "trained"
    previous_version: int | None = None
    decided_at: datetime | None = None
    reason: str | None = None
    gate: dict[str, Any] | None = None


QUIET_STATUSES = ("idle", "waiting")
"""A job run's outcomes that did nothing: nothing to do, or work not ready yet."""


class JobRunRecord(Record):
    """One run of a loop job and its outcome (the ``job_runs`` row)."""

    id: str
    job: str
    alias: str | None = None
    status: str
    started_at: datetime
    finished_at: datetime | None = None
    counts: dict[str, Any] | None = None
    detail: str | None = None
    error: str | None = None


class AliasVersions(BaseModel):
    """Where an alias's versions stand: each None when there is none (docs/loop.md)."""

    serving: Version | None  # promoted: what clients get (None: the base model)
    in_flight: Version | None  # the oldest training, candidate or canary one
    training: Version | None  # a round is training it now
    waiting: Version | None  # the newest candidate waiting for its gate


class FormedGroup(BaseModel):
    id: str
    source: str
    key: str
    alias: str
    size: int


class ScoreCounts(BaseModel):
    """What one scoring run did (``judge/scoring.py``)."""

    groups: int = 0
    scored: int = 0
    failed: int = 0
    trajectories: int = 0
    seconds: float = 0.0
    failed_group_ids: list[str] = Field(default_factory=list)
    fork_taught: list[tuple[str, int, bool]] = Field(default_factory=list)  # per fork group: alias, turn, untied


class Pending(BaseModel):
    """What waits for the loop: open trajectories, groups by status, when the alias last trained."""

    open_trajectories: int
    groups: dict[str, int]
    scored_groups: int
    last_trained_at: datetime | None


class OpenedRound(BaseModel):
    """A round's start, in one call: its batch, the version it continues from, the version it trains."""

    groups: list[TrainingGroup]
    head: Version | None = None  # the version the round continues from; None: the base model
    reserved: Version | None = None  # None when no scored group waits: nothing is reserved


class Promoted(BaseModel):
    serving: Version | None
    previous: Version | None


class Recovered(BaseModel):
    rounds_failed: int


class RewardRow(BaseModel):
    trajectory_id: str
    closed_at: datetime | None
    version: int
    reward: float


class Rewards(BaseModel):
    """Rewarded, closed trajectories in the order they closed; ``mixed``: left out, served by two versions."""

    rewards: list[RewardRow]
    mixed: int


class CanaryReward(BaseModel):
    """One reward the canary may pair: ``context`` (a task key, ``fork:<key>``, or None), known at ``at``."""

    at: float  # epoch seconds
    version: int
    context: str | None
    reward: float
    order: str  # ties within a context, in a stable order


class VersionSummary(BaseModel):
    """Mean reward, n and (n > 1) a 95% interval of one version."""

    n: int
    mean: float
    low: float | None = None
    high: float | None = None


class RewardByVersion(BaseModel):
    versions: dict[str, VersionSummary]  # keyed by the version number as text, as JSON must
    mixed: int


class HeldoutContext(BaseModel):
    """The first request of a held-out conversation: what the offline gate replays."""

    trajectory_id: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None


class TrafficBucket(BaseModel):
    start: int  # epoch seconds
    version: int
    turns: int


class StoreApi(Protocol):
    """Everything the serving process, the CLI and the training routes ask of the store (docs/architecture.md)."""

    # -- the pipeline's jobs
    async def close_idle(self) -> int: ...

    async def form_groups(self) -> list[FormedGroup]: ...

    async def score(self, alias: str | None = None) -> ScoreCounts: ...

    async def pending(self, alias: str) -> Pending: ...

    async def recover(self, rounds: bool = True) -> Recovered: ...

    async def record_runs(self, runs: list[JobRunRecord]) -> None: ...

    async def last_runs(self, alias: str, jobs: list[str]) -> dict[str, JobRunRecord]: ...

    # -- training rounds
    async def training_batch(self, alias: str, max_groups: int,
                             group_ids: list[str] | None = None) -> list[TrainingGroup]: ...

    async def reserve_version(self, alias: str, base_model: str, source: str = "trained", status: str = "training",
                              path: str | None = None, parent_version: int | None = None,
                              alone: bool = False, one_round: bool = False) -> Version: ...

    async def open_round(self, alias: str, base_model: str, max_groups: int,
                         group_ids: list[str] | None = None) -> OpenedRound: ...

    async def record_round(self, alias: str, version: int, parent_version: int | None, promote: bool,
                           result: dict[str, Any], batch_group_ids: list[str] | None = None) -> Version | None: ...

    async def record_failed_round(self, alias: str, version: int, error: str,
                                  group_ids: list[str] | None = None) -> Version: ...

    # -- versions
    async def versions(self, alias: str) -> list[Version]: ...

    async def serving(self) -> dict[str, AliasVersions]: ...

    async def training_head(self, alias: str) -> Version | None: ...

    async def promote(self, alias: str, version: int, reason: str, replaced_status: str = "retired") -> Promoted: ...

    async def rollback_target(self, alias: str) -> int: ...

    async def decide(self, alias: str, version: int, status: str, reason: str,
                     gate: dict[str, Any] | None = None) -> Version: ...

    async def record_gate(self, alias: str, version: int, gate: dict[str, Any]) -> Version: ...

    # -- rewards per version, the gate's contexts
    async def rewards(self, alias: str, since: datetime | None = None, until: datetime | None = None,
                      versions_in: list[int] | None = None) -> Rewards: ...

    async def canary_rewards(self, alias: str, since: datetime, versions_in: list[int]) -> list[CanaryReward]: ...

    async def reward_by_version(self, alias: str) -> RewardByVersion: ...

    async def heldout_contexts(self, alias: str, count: int) -> list[HeldoutContext]: ...

    # -- the dashboard's reads (JSON documents its templates render)
    async def ui_trajectories(self, filters: dict[str, Any], limit: int = 50,
                              after: str | None = None) -> dict[str, Any]: ...

    async def ui_trajectory(self, trajectory_id: str) -> dict[str, Any] | None: ...

    async def ui_groups(self, alias: str | None = None, status: str | None = None,
                        limit: int = 100) -> list[dict[str, Any]]: ...

    async def ui_group(self, group_id: str) -> dict[str, Any] | None: ...

    async def ui_traffic(self, alias: str, since: datetime, bucket_s: int) -> list[TrafficBucket]: ...

    async def ui_failed_jobs(self, alias: str, limit: int = 10) -> list[JobRunRecord]: ...


METHODS: tuple[str, ...] = tuple(name for name in vars(StoreApi) if not name.startswith("_"))
"""The names the store process answers on ``/internal/store/{method}``: the Protocol's methods, no others."""
