"""What the serving process and its warm training child say to each other: one JSON line each way per round.

The serving process opens the round (its batch read and its version reserved, one store call) and writes it
whole as a :class:`RoundRequest` line on the child's stdin (``flywheel train --alias A --stdio``, started by
``serving/loop/training_child.py``); the child trains it (``training/rounds.py``) and writes one
:class:`RoundReply` line on its stdout, asking nothing back. Everything else it prints goes to its log.
:class:`RoundSummary` is also what ``flywheel train --json`` prints last. :class:`RoundReport` is a finished
round's record: what a worker posts to ``/flywheel/v1/training/rounds``, and what the warm child's reply
carries for the serving process to write.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class RoundRequest(BaseModel):
    """A round the serving process opened: everything the child trains it with."""

    model_config = ConfigDict(extra="forbid")

    alias: str
    version: int = Field(ge=1)  # reserved for this round
    out_dir: str  # the reserved version's directory: the adapter is written there
    base_model: str
    current: dict[str, Any] | None  # {"version", "path"} of the adapter the round continues from; None: the base
    groups: list[dict[str, Any]]  # TrainingGroup.to_json() each
    args: dict[str, Any]  # the GRPOArgs the gateway's configuration resolves to for this alias
    overrides: dict[str, Any] = Field(default_factory=dict)  # GRPOArgs fields for this round


class RoundSummary(BaseModel):
    """A round's report, from the process that trained it."""

    status: str  # "finished" | "skipped" (nothing trainable) | "nothing" (no scored group waited)
    version: int | None
    groups: int
    adapter_path: str | None
    metrics: dict[str, float] = Field(default_factory=dict)
    round_s: float  # the whole round: batch, reserve, train_round, publish, record (by the serving process: warm)
    train_s: float | None = None  # trainer.train() alone (TRL's train_runtime); None when nothing trained
    model_load_s: float | None = None  # loading the base model; 0 when kept from this process's last round
    warm: bool = False  # the base model was kept from this process's last round


class RoundReport(BaseModel):
    alias: str
    version: int = Field(ge=1)
    parent_version: int | None = None
    promote: bool = False
    result: dict[str, object]
    batch_group_ids: list[str] = Field(default_factory=list)  # every group the round was given


class RoundReply(BaseModel):
    ok: bool
    summary: RoundSummary | None = None  # when ok
    report: RoundReport | None = None  # when it trained or skipped: the serving process records it
    error: str | None = None  # when not: why, in one line (the traceback is in the child's log)
    param: str | None = None  # "args" when the overrides named no GRPOArgs field
