"""The store's tables (SQLModel). One schema for DuckDB (default) and PostgreSQL.

Every table and column is documented in ``docs/storage.md``; a test fails when a
column is missing there. Ids are application-generated strings (``turn_<hex>``, ...):
no autoincrement keys, so the same DDL runs on both backends and ids can be made before
a row is written. JSON columns hold lists/dicts exactly as the API carried them.
Keep this module free of backend-specific SQL.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import JSON, Column, DateTime, Index
from sqlmodel import Field, SQLModel

SCHEMA_VERSION = 8  # bump with a named migration in capture/store.py


def utcnow() -> datetime:
    return datetime.now(UTC)


def epoch(moment: datetime) -> float:
    """Seconds since the epoch of a stored moment (a naive one is UTC: the store writes UTC)."""
    return (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).timestamp()


def _json(nullable: bool = True) -> Any:
    return Field(default=None, sa_column=Column(JSON, nullable=nullable))


def _ts(index: bool = False, nullable: bool = False) -> Any:
    column = Column(DateTime(timezone=True), index=index, nullable=nullable)
    if nullable:
        return Field(default=None, sa_column=column)
    return Field(default_factory=utcnow, sa_column=column)


class SchemaMeta(SQLModel, table=True):
    """Key/value facts about the store itself (``schema_version``, applied migrations)."""

    __tablename__ = "schema_meta"
    key: str = Field(primary_key=True)
    value: str


class Turn(SQLModel, table=True):
    """One sampled answer to one request: a node in a trajectory's tree of turns."""

    __tablename__ = "turns"
    # The tail rule's agreeing lookup: an answer after the same message, read without the others that gave it
    __table_args__ = (Index("ix_turns_h_answer_h_replied_to", "h_answer", "h_replied_to"),)
    id: str = Field(primary_key=True)
    trajectory_id: str = Field(index=True)
    parent_turn_id: str | None = Field(default=None, index=True)
    depth: int = 0
    choice_index: int = 0
    completion_id: str = Field(index=True)
    source: str = "client"
    endpoint: str = "chat.completions"
    created_at: datetime = _ts(index=True)
    latency_ms: float = 0.0
    requested_model: str
    alias: str
    engine_model: str
    adapter_version: int = 0
    client_key_id: str | None = None
    request_messages: list[dict[str, Any]] | None = _json()
    tools: list[dict[str, Any]] | None = _json()
    params: dict[str, Any] | None = _json()
    request_metadata: dict[str, Any] | None = _json()
    response_message: dict[str, Any] | None = _json()
    finish_reason: str | None = None
    prompt_token_ids: list[int] | None = _json()
    completion_token_ids: list[int] | None = _json()
    completion_logprobs: list[float] | None = _json()
    inclusion_logprob: float | None = None  # a sibling drawn without replacement: log of its inclusion probability
    canary_pair: bool | None = None  # a canary's other arm on a forked turn: scored and paired, never trained on
    prompt_tokens: int = 0
    completion_tokens: int = 0
    h_ctx: str
    h_out: str = Field(index=True)  # the linker's lookup
    task_key: str | None = None
    group_key: str | None = None
    redacted: bool = False
    h_answer: str | None = Field(default=None, index=True)  # the tail linker's lookup
    h_replied_to: str | None = None
    link_rule: str | None = None  # prefix | tail | explicit | new
    parent_message_index: int | None = None
    history_edits: dict[str, Any] | None = _json()


class Trajectory(SQLModel, table=True):
    """A conversation: the turns linked by prefix hashes or an explicit id; a tree when branched."""

    __tablename__ = "trajectories"
    id: str = Field(primary_key=True)
    alias: str = Field(index=True)
    status: str = Field(default="open", index=True)
    explicit: bool = False
    client_key_id: str | None = Field(default=None, index=True)
    task_key: str | None = Field(default=None, index=True)
    group_key: str | None = Field(default=None, index=True)
    created_at: datetime = _ts(index=True)
    updated_at: datetime = _ts()
    closed_at: datetime | None = _ts(nullable=True)
    close_reason: str | None = None
    turn_count: int = 0
    branch_count: int = 1
    latest_turn_id: str | None = None
    extra_metadata: dict[str, Any] | None = _json()
    parent_trajectory_id: str | None = Field(default=None, index=True)  # the agent this sub-agent worked for


class Group(SQLModel, table=True):
    """Trajectories that pursued the same task and are compared with each other (GRPO, RULER)."""

    __tablename__ = "groups"
    id: str = Field(primary_key=True)
    source: str = Field(index=True)
    key: str = Field(index=True)
    alias: str = Field(index=True)
    status: str = Field(default="open", index=True)
    size: int = 0
    created_at: datetime = _ts(index=True)
    closed_at: datetime | None = _ts(nullable=True)


class GroupMember(SQLModel, table=True):
    """Which trajectories (or which branch of one, by its leaf turn) belong to a group."""

    __tablename__ = "group_members"
    group_id: str = Field(primary_key=True)
    trajectory_id: str = Field(primary_key=True, index=True)
    leaf_turn_id: str | None = None
    added_at: datetime = _ts()


class Score(SQLModel, table=True):
    """A reward for a trajectory, with where it came from so a person can audit it."""

    __tablename__ = "scores"
    id: str = Field(primary_key=True)
    trajectory_id: str = Field(index=True)
    group_id: str | None = Field(default=None, index=True)
    source: str = Field(index=True)
    value: float
    explanation: str | None = None
    judge_model: str | None = None
    rubric_hash: str | None = None
    prompt_version: str | None = None
    cache_key: str | None = Field(default=None, index=True)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float | None = None
    created_at: datetime = _ts(index=True)


class Feedback(SQLModel, table=True):
    """What a client said about a trajectory: a reward, a label, a comment."""

    __tablename__ = "feedback"
    id: str = Field(primary_key=True)
    trajectory_id: str = Field(index=True)
    completion_id: str | None = None
    reward: float | None = None
    label: str | None = None
    comment: str | None = None
    client_key_id: str | None = None
    created_at: datetime = _ts(index=True)


class AdapterVersion(SQLModel, table=True):
    """A LoRA adapter version of an alias and what became of it: the one source of version numbers.

    ``status``: ``training`` (number reserved by a round in progress), ``failed``, ``candidate``
    (trained, waiting for the gate), ``canary`` (on live A/B), ``promoted`` (serving; at most one
    per alias), ``retired`` (served before, replaced), ``rejected``, ``rolled_back``, ``deleted``.
    """

    __tablename__ = "adapter_versions"
    __table_args__ = (Index("uq_adapter_versions_alias_version", "alias", "version", unique=True),)
    id: str = Field(primary_key=True)
    alias: str = Field(index=True)
    version: int
    path: str
    base_model: str
    parent_version: int | None = None
    training_run_id: str | None = None
    status: str = Field(default="candidate", index=True)
    created_at: datetime = _ts()
    promoted_at: datetime | None = _ts(nullable=True)
    metrics: dict[str, Any] | None = _json()
    source: str = "trained"
    previous_version: int | None = None
    decided_at: datetime | None = _ts(nullable=True)
    reason: str | None = None
    gate: dict[str, Any] | None = _json()


class TrainingRun(SQLModel, table=True):
    """One training round: its config, the groups it used, its metrics and the adapter it made."""

    __tablename__ = "training_runs"
    id: str = Field(primary_key=True)
    alias: str = Field(index=True)
    status: str = Field(default="running", index=True)
    started_at: datetime = _ts()
    finished_at: datetime | None = _ts(nullable=True)
    config: dict[str, Any] | None = _json()
    group_ids: list[str] | None = _json()
    metrics: dict[str, Any] | None = _json()
    adapter_version_id: str | None = None
    error: str | None = None


class JobRun(SQLModel, table=True):
    """One run of a loop job (close idle, form groups, score, train, gate, canary, monitor) and its outcome."""

    __tablename__ = "job_runs"
    id: str = Field(primary_key=True)
    job: str = Field(index=True)
    alias: str | None = Field(default=None, index=True)
    status: str = Field(index=True)
    started_at: datetime = _ts(index=True)
    finished_at: datetime | None = _ts(nullable=True)
    counts: dict[str, Any] | None = _json()
    detail: str | None = None
    error: str | None = None


class EvalMetric(SQLModel, table=True):
    """An evaluation result a client logged for one version of an alias (the SDK's ``model.log``)."""

    __tablename__ = "eval_metrics"
    id: str = Field(primary_key=True)
    alias: str = Field(index=True)
    version: int = Field(index=True)
    split: str
    metric: str
    value: float
    n: int = 0
    created_at: datetime = _ts(index=True)
