"""The store's schema version guard, and exact reassembly of streamed responses."""

from __future__ import annotations

import math
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import duckdb
import pytest
from sqlalchemy import Column, MetaData, Table, UniqueConstraint, create_engine
from sqlmodel import SQLModel, select

from flywheel.capture.assembler import StreamAssembler
from flywheel.capture.canonical import prefix_hashes
from flywheel.capture.models import SCHEMA_VERSION, AdapterVersion, EvalMetric, JobRun, SchemaMeta, Turn
from flywheel.capture.store import SchemaError, Store
from flywheel.capture.turns import CapturedExchange, prepare_turns


def test_new_store_records_its_schema_version(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.duckdb")
    try:
        assert store.schema_version() == SCHEMA_VERSION
    finally:
        store.close()


def test_a_newer_store_is_refused_and_left_untouched(tmp_path: Path) -> None:
    path = tmp_path / "s.duckdb"
    Store(path).close()
    with duckdb.connect(str(path)) as connection:
        connection.execute("UPDATE schema_meta SET value = '99' WHERE key = 'schema_version'")
        connection.execute("CHECKPOINT")
    before = path.read_bytes()
    with pytest.raises(SchemaError, match="schema version 99"):
        Store(path)
    assert path.read_bytes() == before


def test_unversioned_tables_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "s.duckdb"
    with duckdb.connect(str(path)) as connection:
        connection.execute("CREATE TABLE turns (id VARCHAR)")
        connection.execute("INSERT INTO turns VALUES ('mine')")
    with pytest.raises(SchemaError, match="without a schema version"):
        Store(path)
    with duckdb.connect(str(path)) as connection:
        assert connection.execute("SELECT id FROM turns").fetchall() == [("mine",)]


def test_stream_reassembly_joins_tool_call_fragments_by_index() -> None:
    base = {"id": "chatcmpl-1", "created": 1, "model": "m", "object": "chat.completion.chunk"}
    def call(index: int, arguments: str, **first: str) -> dict[str, object]:
        """One tool-call delta; ``first`` (id, type, name) only on a call's first fragment."""
        function = {"arguments": arguments, **({"name": first.pop("name")} if "name" in first else {})}
        return {"tool_calls": [{"index": index, **first, "function": function}]}

    deltas = [
        {"role": "assistant", "content": ""},
        {"content": "Let me check. "},
        call(0, "", id="call_a", type="function", name="get_weather"),
        call(1, '{"tz"', id="call_b", type="function", name="get_time"),  # interleaved with call 0
        call(0, '{"city": '),
        call(1, ': "UTC"}'),
        call(0, '"Oslo"}'),
    ]
    assembler = StreamAssembler("chat.completions")
    for i, delta in enumerate(deltas):
        assembler.add({**base, "choices": [{"index": 0, "delta": delta, "token_ids": [i], "finish_reason": None}]})
    assembler.add({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]})
    assembler.add({**base, "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 7, "total_tokens": 10}})
    response = assembler.response()
    message = response["choices"][0]["message"]
    assert message["content"] == "Let me check. "
    assert [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [
        ("call_a", "get_weather", '{"city": "Oslo"}'), ("call_b", "get_time", '{"tz": "UTC"}')]
    assert response["choices"][0]["finish_reason"] == "tool_calls"
    assert response["choices"][0]["token_ids"] == list(range(7))
    assert response["usage"]["total_tokens"] == 10


T0 = datetime(2026, 11, 1, tzinfo=UTC)
# What each migration added (tables, columns, unique constraints, column indexes): a test makes the file an older
# version wrote.
ADDED_BY: dict[int, dict[str, Any]] = {
    2: {"tables": {"job_runs"}, "unique": {"uq_adapter_versions_alias_version"},
        "columns": {"adapter_versions": {"source", "previous_version", "decided_at", "reason", "gate"}}},
    3: {"tables": {"eval_metrics"}},
    4: {"columns": {"turns": {"h_answer", "h_replied_to", "link_rule", "parent_message_index", "history_edits"},
                    "trajectories": {"parent_trajectory_id"}}},
    6: {"columns": {"turns": {"inclusion_logprob"}}},
    7: {"columns": {"turns": {"canary_pair"}}},
    8: {"indexes": {("group_members", "trajectory_id")}},
}


def older_store(path: Path, version: int, rows: dict[str, list[dict[str, Any]]]) -> None:
    """A store file as schema ``version`` had it (today's tables without what later migrations added), holding
    ``rows``. DuckDB drops no column of an indexed table, so the file is built, not cut down."""
    later = [added for v, added in ADDED_BY.items() if v > version]
    tables = set().union(*(added.get("tables", set()) for added in later))
    unique = set().union(*(added.get("unique", set()) for added in later))
    indexes = set().union(*(added.get("indexes", set()) for added in later))
    columns = {name: set().union(*(added.get("columns", {}).get(name, set()) for added in later))
               for name in SQLModel.metadata.tables}
    old = MetaData()
    for table in SQLModel.metadata.sorted_tables:
        if table.name in tables:
            continue
        kept = [Column(c.name, c.type, primary_key=c.primary_key, nullable=c.nullable,
                       index=c.index and (table.name, c.name) not in indexes)
                for c in table.columns if c.name not in columns[table.name]]
        constraints = [UniqueConstraint(*c.columns.keys(), name=c.name) for c in table.constraints
                       if isinstance(c, UniqueConstraint) and c.name not in unique]
        Table(table.name, old, *kept, *constraints)
    engine = create_engine(f"duckdb:///{path}")
    old.create_all(engine)
    with engine.begin() as connection:
        connection.execute(old.tables["schema_meta"].insert(), [{"key": "schema_version", "value": str(version)}])
        for name, values in rows.items():
            connection.execute(old.tables[name].insert(), values)
    engine.dispose()


def test_a_version_1_store_is_migrated_to_the_latest_and_keeps_its_rows(tmp_path: Path) -> None:
    """The loop's migration: job_runs appears, adapter_versions gains its decision columns, rows survive."""
    path = tmp_path / "s.duckdb"
    older_store(path, 1, {"adapter_versions": [{"id": "adv_1", "alias": "agent", "version": 1, "path": "/a/1",
                                                "base_model": "tiny", "status": "promoted", "created_at": T0}]})
    store = Store(path)
    try:
        assert store.schema_version() == SCHEMA_VERSION
        with store.session() as session:
            row = session.get(AdapterVersion, "adv_1")
            assert row is not None and (row.version, row.status, row.source) == (1, "promoted", "trained")
            session.add(JobRun(id="job_1", job="train", alias="agent", status="ok"))
            session.commit()
            assert session.get(SchemaMeta, "migration:2") is not None
    finally:
        store.close()


def test_a_version_2_store_gains_the_eval_metrics_table(tmp_path: Path) -> None:
    """The SDK's migration: eval_metrics appears (model.log writes there), nothing else changes."""
    path = tmp_path / "s.duckdb"
    older_store(path, 2, {})
    store = Store(path)
    try:
        assert store.schema_version() == SCHEMA_VERSION
        with store.session() as session:
            session.add(EvalMetric(id="eval_1", alias="agent", version=1, split="val", metric="reward", value=0.5,
                                   n=4))
            session.commit()
            meta = session.get(SchemaMeta, "migration:3")
            assert meta is not None and meta.value == "sdk: eval_metrics"
    finally:
        store.close()


OLD_QUESTION = {"role": "user", "content": "Plan a trip."}
OLD_ANSWER = {"role": "assistant", "content": "Where would you like to go this time?"}
OLD_TURN = {"id": "turn_old", "trajectory_id": "traj_old", "depth": 0, "choice_index": 0, "completion_id": "c-old",
            "source": "client", "endpoint": "chat.completions", "created_at": T0, "latency_ms": 1.0,
            "requested_model": "m", "alias": "a", "engine_model": "m", "adapter_version": 0,
            "request_messages": [OLD_QUESTION], "response_message": OLD_ANSWER, "prompt_tokens": 0,
            "completion_tokens": 0, "h_ctx": prefix_hashes([OLD_QUESTION])[-1],
            "h_out": prefix_hashes([OLD_QUESTION, OLD_ANSWER])[-1], "redacted": False}
OLD_TRAJECTORY = {"id": "traj_old", "alias": "a", "status": "open", "explicit": False, "created_at": T0,
                  "updated_at": T0, "turn_count": 1, "branch_count": 1, "latest_turn_id": "turn_old"}


def test_the_tail_link_migration_keeps_every_row_and_links_what_comes_next(tmp_path: Path) -> None:
    path = tmp_path / "s.duckdb"
    older_store(path, 3, {"trajectories": [OLD_TRAJECTORY], "turns": [OLD_TURN]})
    store = Store(path)
    try:
        assert store.schema_version() == SCHEMA_VERSION
        with store.session() as session:
            migrations = {m.key: m.value for m in session.exec(select(SchemaMeta)).all()}
            old = session.get(Turn, "turn_old")
        assert migrations["migration:4"] == "linker: tail links, history edits, sub-agent parents"
        assert old is not None and (old.h_answer, old.link_rule, old.request_messages) == (None, None, [OLD_QUESTION])
        follow = [OLD_QUESTION, OLD_ANSWER, {"role": "user", "content": "Lisbon."}]
        response = {"id": "c-new", "choices": [{"index": 0, "message": {"role": "assistant", "content": "Booked."}}]}
        store.write_turns(prepare_turns(CapturedExchange(
            completion_id="c-new", endpoint="chat.completions", requested_model="m", alias="a", engine_model="m",
            adapter_version=0, client_key_id=None, request={"model": "m", "messages": follow}, response=response,
            created_at=T0, latency_ms=1.0), None))
        with store.session() as session:
            new = session.exec(select(Turn).where(Turn.completion_id == "c-new")).one()
        assert (new.trajectory_id, new.parent_turn_id, new.link_rule) == ("traj_old", "turn_old", "prefix")
    finally:
        store.close()
    with duckdb.connect(str(path), read_only=True) as connection:
        indexes = {row[0] for row in connection.execute("SELECT index_name FROM duckdb_indexes()").fetchall()}
    assert {"ix_turns_h_answer", "ix_trajectories_parent_trajectory_id"} <= indexes  # as a new store has them


def test_json_columns_read_back_what_any_writer_stored(tmp_path: Path) -> None:
    """The store reads JSON with orjson and falls back to the standard library for text orjson refuses (NaN, as
    an older writer's ``json.dumps`` wrote it)."""
    path = tmp_path / "s.duckdb"
    store = Store(path)
    try:
        with store.session() as session:
            for version in (1, 2):
                session.add(AdapterVersion(id=f"adv-{version}", alias="a", version=version, path=f"/v/{version}",
                                           base_model="m", metrics={"steps": 3, "loss": 0.25, "tags": ["x", None]}))
            session.commit()
        with store.engine.connect() as connection:
            raw = connection.connection.dbapi_connection
            assert raw is not None
            raw.execute("""UPDATE adapter_versions SET metrics = '{"loss": NaN, "steps": 3}' WHERE id = 'adv-2'""")
        with store.session() as session:
            by_id = {row.id: row.metrics for row in session.exec(select(AdapterVersion))}
        assert by_id["adv-1"] == {"steps": 3, "loss": 0.25, "tags": ["x", None]}
        older = by_id["adv-2"]
        assert older is not None and older["steps"] == 3 and math.isnan(older["loss"])
    finally:
        store.close()
