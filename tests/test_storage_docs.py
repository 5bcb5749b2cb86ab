"""``docs/storage.md`` documents every table and column of the store (datasette's test_docs habit).

Each table has a ``### tablename`` heading followed by a markdown table whose rows start
with the column name in backticks. A column added to ``capture/models.py`` without a row
here fails; so does a documented column or table that no longer exists.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from sqlmodel import SQLModel

import flywheel.capture.models
from flywheel.capture.models import SCHEMA_VERSION
from flywheel.gateway.cli.trajectories import trajectories_app

DOC = Path(__file__).resolve().parents[1] / "docs" / "storage.md"
_HEADING = re.compile(r"^### (\S+)\s*$")
_ROW = re.compile(r"^\|\s*`([^`]+)`\s*\|")


def documented_rows(text: str) -> dict[str, dict[str, str]]:
    """Table name -> column -> its row, from ``### name`` sections holding a ``| column | ...`` table."""
    tables: dict[str, dict[str, str]] = {}
    current: str | None = None
    in_table = False
    for line in text.splitlines():
        if line.startswith("#"):  # any heading ends the previous section
            heading = _HEADING.match(line)
            current, in_table = (heading.group(1) if heading else None), False
        elif current is not None and line.startswith("| column |"):
            in_table = True
            tables[current] = {}
        elif in_table and current is not None and (row := _ROW.match(line)):
            tables[current][row.group(1)] = line
    return tables


def documented_tables(text: str) -> dict[str, list[str]]:
    return {name: list(rows) for name, rows in documented_rows(text).items()}


def store_tables() -> dict[str, list[str]]:
    assert flywheel.capture.models  # imported for its tables
    return {name: [c.name for c in table.columns] for name, table in SQLModel.metadata.tables.items()}


@pytest.fixture(scope="module")
def doc() -> str:
    return DOC.read_text(encoding="utf-8")


@pytest.mark.parametrize("table", sorted(store_tables()))
def test_every_table_and_column_is_documented(doc: str, table: str) -> None:
    documented = documented_tables(doc)
    assert table in documented, f"docs/storage.md has no '### {table}' section with a column table"
    missing = [c for c in store_tables()[table] if c not in documented[table]]
    assert not missing, f"docs/storage.md: table {table} lacks rows for columns {missing}"


def test_nothing_documented_that_does_not_exist(doc: str) -> None:
    tables = store_tables()
    for table, columns in documented_tables(doc).items():
        assert table in tables, f"docs/storage.md documents a table {table!r} the store does not have"
        stale = [c for c in columns if c not in tables[table]]
        assert not stale, f"docs/storage.md: {table} documents columns that do not exist: {stale}"


def test_every_column_row_says_how_stable_it_is(doc: str) -> None:
    for table, rows in documented_rows(doc).items():
        for column, line in rows.items():
            cells = [cell.strip() for cell in line.strip("|").split("|")]
            assert len(cells) == 4 and cells[2] in ("stable", "internal"), f"{table}.{column}: {line}"
            assert cells[3], f"{table}.{column} says nothing about what it holds"


def test_schema_version_is_the_current_one(doc: str) -> None:
    assert f"currently **{SCHEMA_VERSION}**" in doc


def test_every_cli_command_is_documented_with_an_example(doc: str) -> None:
    for command in trajectories_app.registered_commands:
        name = command.name or ""
        assert f"`{name}" in doc, f"docs/storage.md does not mention `flywheel trajectories {name}`"
        assert "Example: flywheel trajectories " + name in (command.callback.__doc__ or ""), name
