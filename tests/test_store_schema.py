"""The store's schema version guard, and exact reassembly of streamed responses."""

from __future__ import annotations

from pathlib import Path

import duckdb
import pytest

from capture.assembler import StreamAssembler
from capture.models import SCHEMA_VERSION, AdapterVersion, EvalMetric, JobRun, SchemaMeta
from capture.store import SchemaError, Store


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


def test_a_version_1_store_is_migrated_to_2_and_keeps_its_rows(tmp_path: Path) -> None:
    """The loop's migration: job_runs appears, adapter_versions gains its decision columns, rows survive."""
    path = tmp_path / "s.duckdb"
    Store(path).close()
    with duckdb.connect(str(path)) as connection:  # take the file back to what schema 1 had
        connection.execute("DROP TABLE job_runs")
        connection.execute("DROP TABLE eval_metrics")  # schema 3's
        for index in ("uq_adapter_versions_alias_version", "ix_adapter_versions_alias", "ix_adapter_versions_status"):
            connection.execute(f"DROP INDEX {index}")  # DuckDB drops no column of an indexed table
        for column in ("source", "previous_version", "decided_at", "reason", "gate"):
            connection.execute(f"ALTER TABLE adapter_versions DROP COLUMN {column}")
        connection.execute("CREATE INDEX ix_adapter_versions_alias ON adapter_versions (alias)")
        connection.execute("CREATE INDEX ix_adapter_versions_status ON adapter_versions (status)")
        connection.execute("INSERT INTO adapter_versions (id, alias, version, path, base_model, status, created_at) "
                           "VALUES ('adv_1', 'agent', 1, '/a/1', 'tiny', 'promoted', now())")
        connection.execute("UPDATE schema_meta SET value = '1' WHERE key = 'schema_version'")
    store = Store(path)
    try:
        assert store.schema_version() == SCHEMA_VERSION
        with store.session() as session:
            row = session.get(AdapterVersion, "adv_1")
            assert row is not None and (row.version, row.status, row.source) == (1, "promoted", "trained")
            session.add(JobRun(id="job_1", job="train", alias="agent"))
            session.commit()
            assert session.get(SchemaMeta, "migration:2") is not None
    finally:
        store.close()


def test_a_version_2_store_gains_the_eval_metrics_table(tmp_path: Path) -> None:
    """The SDK's migration: eval_metrics appears (model.log writes there), nothing else changes."""
    path = tmp_path / "s.duckdb"
    Store(path).close()
    with duckdb.connect(str(path)) as connection:
        connection.execute("DROP TABLE eval_metrics")
        connection.execute("UPDATE schema_meta SET value = '2' WHERE key = 'schema_version'")
    store = Store(path)
    try:
        assert store.schema_version() == 3
        with store.session() as session:
            session.add(EvalMetric(id="eval_1", alias="agent", version=1, split="val", metric="reward", value=0.5,
                                   n=4))
            session.commit()
            meta = session.get(SchemaMeta, "migration:3")
            assert meta is not None and meta.value == "sdk: eval_metrics"
    finally:
        store.close()
