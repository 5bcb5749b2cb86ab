"""Export: captured trajectories as training data for other tools.

Three formats (``docs/storage.md`` "Export formats")::

    openai   JSON Lines, one {"messages": [...], "tools": [...]} per branch: OpenAI chat fine-tuning
    art      JSON Lines, one ART-style trajectory per branch (loads into flywheel.capture.trajectory.Trajectory)
    parquet  turns.parquet + trajectories.parquet, written by DuckDB's COPY (a DuckDB store only)

The JSON formats are built from a trajectory *detail* (the dict :func:`flywheel.capture.queries.trajectory_detail`
returns, and the admin API serves), so the CLI makes the same files whether it reads the
file or a running gateway. A branch's conversation is read back from its turns
(:func:`flywheel.capture.history.branch_conversation`): the leaf's request and answer when every
request repeated the history, the conversation as it happened when some rewrote it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

from sqlalchemy.exc import DBAPIError
from sqlmodel import select

from flywheel.capture.history import branch_conversation
from flywheel.capture.models import Trajectory as TrajectoryRow
from flywheel.capture.queries import TrajectoryFilter, openai_finish
from flywheel.capture.store import Store
from flywheel.capture.trajectory import Trajectory

Format = Literal["openai", "art", "parquet"]
FORMATS: tuple[str, ...] = ("openai", "art", "parquet")
_MESSAGE_KEYS = ("role", "content", "name", "tool_calls", "tool_call_id")


class ExportError(RuntimeError):
    """An export that cannot be made (wrong backend, unwritable path)."""


def check_destination(out: Path, fmt: str) -> None:
    """Raise :class:`ExportError` unless ``out`` can take a ``fmt`` export: checked before any work is done."""
    if fmt == "parquet" and out.exists() and not out.is_dir():
        raise ExportError(f"{out} is a file; parquet export writes a directory (trajectories.parquet, turns.parquet)")
    if fmt != "parquet" and out.is_dir():
        raise ExportError(f"{out} is a directory; {fmt} export writes one JSON Lines file")
    existing = out if fmt == "parquet" else out.parent
    while not existing.exists():  # the directories still to be made
        existing = existing.parent
    if not existing.is_dir():
        raise ExportError(f"cannot write {out}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ExportError(f"cannot write {out}: {existing} is not writable")


def branch_messages(detail: dict[str, Any], leaf_turn_id: str) -> list[dict[str, Any]]:
    """The whole conversation of the branch ending at ``leaf_turn_id`` (``history.branch_conversation``)."""
    branch = next(b for b in detail["branches"] if b[-1] == leaf_turn_id)
    return _conversation(detail, branch)[0]


def _conversation(detail: dict[str, Any], branch: list[str]) -> tuple[list[dict[str, Any]], list[int]]:
    """A branch of a detail read back as one conversation, and where each of its turns' answers sits."""
    turns = _turns_by_id(detail)
    return branch_conversation([SimpleNamespace(  # details from before schema version 4 lack the link columns
        request_messages=turns[i]["request_messages"], response_message=turns[i]["response_message"],
        parent_message_index=turns[i].get("parent_message_index"), history_edits=turns[i].get("history_edits"))
        for i in branch])


def openai_examples(detail: dict[str, Any]) -> list[dict[str, Any]]:
    """One OpenAI chat fine-tuning example per branch (``tools`` only when the requests had tools)."""
    out = []
    turns = _turns_by_id(detail)
    for branch in detail["branches"]:
        leaf = turns[branch[-1]]
        example: dict[str, Any] = {"messages": [fine_tuning_message(m) for m in branch_messages(detail, leaf["id"])]}
        if leaf["tools"]:
            example["tools"] = leaf["tools"]
        out.append(example)
    return out


def fine_tuning_message(message: dict[str, Any]) -> dict[str, Any]:
    """The fields OpenAI's fine-tuning format knows, nulls dropped, tool-call arguments as JSON strings."""
    out = {k: message[k] for k in _MESSAGE_KEYS if message.get(k) is not None}
    if out.get("role") == "assistant" and "content" not in out and "tool_calls" not in out:
        out["content"] = ""
    if "tool_calls" in out:
        out["tool_calls"] = [_string_arguments(call) for call in out["tool_calls"]]
    return out


def _string_arguments(call: dict[str, Any]) -> dict[str, Any]:
    function = dict(call.get("function") or {})
    if not isinstance(function.get("arguments"), str):
        function["arguments"] = json.dumps(function.get("arguments") or {})
    return {"id": call.get("id"), "type": call.get("type") or "function", "function": function}


def art_trajectories(detail: dict[str, Any]) -> list[Trajectory]:
    """One ART-style :class:`Trajectory` per branch.

    Answers the model gave inside this trajectory appear as *choices*
    (``{"finish_reason", "index", "logprobs", "message"}``, as ART serializes them), the rest
    (system, user, tool messages, and history from before the trajectory) as plain messages.
    ``reward`` is the latest score, 0 when there is none.
    """
    turns = _turns_by_id(detail)
    reward = detail["scores"][-1]["value"] if detail.get("scores") else 0.0
    out = []
    for branch in detail["branches"]:
        leaf = turns[branch[-1]]
        items, answers = _conversation(detail, branch)
        for turn_id, position in zip(branch, answers, strict=True):
            turn = turns[turn_id]
            items[position] = {**openai_finish(turn["finish_reason"]), "index": turn["choice_index"],
                               "logprobs": None, "message": turn["response_message"]}
        metadata: dict[str, Any] = {k: v for k, v in (leaf["request_metadata"] or {}).items()
                                    if isinstance(v, str | int | float | bool)}
        metadata.update({"trajectory_id": detail["id"], "leaf_turn_id": leaf["id"], "alias": detail["alias"],
                         "status": detail["status"], "task_key": detail["task_key"],
                         "group_key": detail["group_key"], "model": leaf["requested_model"],
                         "adapter_version": leaf["adapter_version"]})
        metrics: dict[str, float | int | bool] = {
            "turns": len(branch),
            "prompt_tokens": sum(turns[t]["prompt_tokens"] for t in branch),
            "completion_tokens": sum(turns[t]["completion_tokens"] for t in branch),
            "redacted": any(turns[t]["redacted"] for t in branch)}
        out.append(Trajectory(messages_and_choices=items, tools=leaf["tools"], reward=float(reward),
                              metrics=metrics, metadata=metadata, id=detail["id"], leaf_turn_id=leaf["id"]))
    return out


def records(detail: dict[str, Any], fmt: Format) -> list[dict[str, Any]]:
    """The JSON Lines records of one trajectory in ``fmt`` ("openai" or "art")."""
    if fmt == "openai":
        return openai_examples(detail)
    if fmt == "art":
        return [t.model_dump(mode="json") for t in art_trajectories(detail)]
    raise ExportError(f"{fmt} is not a JSON Lines format")


def jsonl(items: Iterable[dict[str, Any]]) -> str:
    return "".join(json.dumps(item, ensure_ascii=False) + "\n" for item in items)


def _turns_by_id(detail: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {t["id"]: t for t in detail["turns"]}


# -- Parquet ------------------------------------------------------------------------------------------------

@dataclass
class ParquetExport:
    """Where the Parquet files went and how many rows each holds."""

    trajectories_path: Path
    turns_path: Path
    trajectories: int
    turns: int


def export_parquet(store: Store, out_dir: Path, flt: TrajectoryFilter | None = None) -> ParquetExport:
    """``trajectories.parquet`` and ``turns.parquet`` under ``out_dir`` via DuckDB's ``COPY ... TO``.

    DuckDB-only SQL lives here and nowhere else: the selection is built with SQLAlchemy and
    rendered with literal values (COPY takes no bound parameters), then wrapped in COPY.
    """
    if not store.url.startswith("duckdb:"):
        raise ExportError(f"Parquet export reads the DuckDB file directly; this store is "
                          f"{store.url.split('://')[0]}. Export JSON Lines (openai, art) instead.")
    check_destination(out_dir, "parquet")
    out_dir.mkdir(parents=True, exist_ok=True)
    chosen = select(TrajectoryRow.id).where(*(flt or TrajectoryFilter()).conditions())
    ids_sql = str(chosen.compile(store.engine, compile_kwargs={"literal_binds": True}))
    trajectories_path, turns_path = out_dir / "trajectories.parquet", out_dir / "turns.parquet"
    try:
        with store.engine.connect() as connection:
            trajectories = connection.exec_driver_sql(
                f"COPY (SELECT * FROM trajectories WHERE id IN ({ids_sql}) ORDER BY created_at, id) "
                f"TO {_sql_string(trajectories_path)} (FORMAT parquet)").scalar()
            turns = connection.exec_driver_sql(
                f"COPY (SELECT * FROM turns WHERE trajectory_id IN ({ids_sql}) "
                f"ORDER BY trajectory_id, created_at, depth, choice_index, id) "
                f"TO {_sql_string(turns_path)} (FORMAT parquet)").scalar()
    except DBAPIError as exc:  # DuckDB's own write failures (disk full, a file in the way)
        raise ExportError(f"cannot write the Parquet files in {out_dir}: {str(exc.orig).splitlines()[0]}") from None
    return ParquetExport(trajectories_path, turns_path, int(trajectories or 0), int(turns or 0))


def _sql_string(path: Path) -> str:
    return "'" + str(path.resolve()).replace("'", "''") + "'"


def load_details(store: Store, details: Iterable[dict[str, Any]]) -> int:
    """Insert trajectory details (from the admin API) into ``store``, so a scratch DuckDB file can be
    exported to Parquet with the same schema as the gateway's own file. Returns turns inserted."""
    from flywheel.capture.models import Turn

    written = 0
    with store.session() as session:
        for detail in details:
            row = {k: v for k, v in detail.items() if k in TrajectoryRow.model_fields}
            session.add(TrajectoryRow.model_validate(row))
            for turn in detail["turns"]:
                session.add(Turn.model_validate(turn))
                written += 1
        session.commit()
    return written
