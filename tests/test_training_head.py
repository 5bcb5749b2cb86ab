"""Which version the next round continues from: its own line of candidates, never one a gate showed worse."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlmodel import Session, col, select

from flywheel.capture.models import AdapterVersion
from flywheel.capture.store import Store
from flywheel.gateway.storeproc import versions

NOT_SHOWN_BETTER = {"online": {"decision": "max_pairs"}}
TIED = {"offline": {"decision": "inconclusive"}, "online": {"decision": "max_pairs"}}
WORSE_ONLINE = {"offline": {"decision": "inconclusive"}, "online": {"decision": "worse"}}
FAILED_OFFLINE = {"offline": {"decision": "failed"}}
NOT_BETTER_LEVEL = {"online": {"decision": "not_better", "mean_difference": -0.05, "standard_error": 0.03}}
NOT_BETTER_BELOW = {"online": {"decision": "not_better", "mean_difference": -0.07, "standard_error": 0.03}}


@pytest.fixture
def session(store: Store) -> Iterator[Session]:
    """A session on a new store, DuckDB and PostgreSQL (the head is one statement with a subquery on each)."""
    with store.session() as session:
        yield session


def trained(session: Session, tmp_path: Path, parent: int | None, status: str, gate: dict[str, Any] | None = None,
            *, files: bool = True) -> int:
    """A trained version continuing from ``parent``, decided ``status`` with these gate results."""
    row = versions.reserve(session, "agent", path_of=lambda n: tmp_path / "adapters" / str(n), base_model="tiny",
                           parent_version=parent, status="candidate")
    if files:
        Path(row.path).mkdir(parents=True)
    if status == "promoted":
        versions.promote(session, "agent", row.version, reason="gate")
    else:
        versions.decide(session, "agent", row.version, status, reason="gate", gate=gate)
    return row.version


def head(session: Session) -> int:
    row = versions.training_head(session, "agent")
    return row.version if row is not None else 0


def test_a_round_continues_the_line_of_undecided_candidates_and_drops_what_was_shown_worse(
        session: Session, tmp_path: Path) -> None:
    assert head(session) == 0  # nothing trained: the base model
    v1 = trained(session, tmp_path, None, "rejected", NOT_SHOWN_BETTER)
    assert head(session) == v1  # not shown better is not shown worse: the next round builds on it
    v2 = trained(session, tmp_path, v1, "rejected", TIED)
    assert head(session) == v2
    trained(session, tmp_path, v2, "rejected", WORSE_ONLINE)
    assert head(session) == v2  # the canary showed version 3 worse
    trained(session, tmp_path, v2, "rejected", FAILED_OFFLINE)
    assert head(session) == v2  # version 4 lost the held-out contexts
    v5 = trained(session, tmp_path, v2, "promoted")
    assert head(session) == v5
    v6 = trained(session, tmp_path, v5, "rejected", NOT_SHOWN_BETTER)
    assert head(session) == v6
    versions.promote(session, "agent", 0, reason="rollback", replaced_status="rolled_back")
    assert head(session) == v2  # back to the base model: the newest line from it that avoids version 5


def test_a_version_rejected_not_better_stays_on_the_line_unless_measured_below_what_served(
        session: Session, tmp_path: Path) -> None:
    v1 = trained(session, tmp_path, None, "promoted")
    v2 = trained(session, tmp_path, v1, "rejected", NOT_BETTER_LEVEL)
    assert head(session) == v2  # within two standard errors of what served: the line builds on it
    trained(session, tmp_path, v2, "rejected", NOT_BETTER_BELOW)
    assert head(session) == v2  # more than two standard errors below: cut
    v4 = trained(session, tmp_path, v2, "rejected", {"online": {"decision": "not_better", "mean_difference": -0.1,
                                                                "standard_error": None}})
    assert head(session) == v4  # a canary of one pair measured nothing


def test_a_version_shown_worse_takes_with_it_the_ancestors_no_gate_saw(session: Session, tmp_path: Path) -> None:
    v1 = trained(session, tmp_path, None, "rejected", NOT_BETTER_LEVEL)  # gated: level with what served
    v2 = trained(session, tmp_path, v1, "rejected")  # superseded before its gate
    v3 = trained(session, tmp_path, v2, "rejected")  # superseded too
    assert head(session) == v3
    v4 = trained(session, tmp_path, v3, "rejected", FAILED_OFFLINE)
    assert head(session) == v1  # versions 2 and 3 were never judged: the failure of their child cuts them too
    v5 = trained(session, tmp_path, v1, "canary", {"offline": {"decision": "inconclusive"}})
    trained(session, tmp_path, v5, "rejected", WORSE_ONLINE)
    assert head(session) == v5  # a version on canary has been judged offline: the cut stops there
    assert versions.get(session, "agent", v4).parent_version == v3


def test_a_line_through_a_rolled_back_or_missing_version_ends_there(session: Session, tmp_path: Path) -> None:
    v1 = trained(session, tmp_path, None, "promoted")
    v2 = trained(session, tmp_path, v1, "promoted")
    versions.promote(session, "agent", v1, reason="monitor", replaced_status="rolled_back")
    assert head(session) == v1  # version 2 dropped after its promotion
    trained(session, tmp_path, v1, "rejected", NOT_SHOWN_BETTER, files=False)
    assert head(session) == v1  # its files are gone: nothing to continue from
    assert versions.get(session, "agent", v2).status == "rolled_back"


def test_the_versions_read_at_a_glance_are_those_of_the_single_queries(session: Session, tmp_path: Path) -> None:
    def glance() -> dict[str, int | None]:
        rows = versions.at_a_glance(session, ["agent", "other"])
        assert rows["other"] == {"serving": None, "in_flight": None, "training": None, "waiting": None}
        return {key: row.version if row else None for key, row in rows["agent"].items()}

    def single() -> dict[str, int | None]:  # each asked on its own: the oracle
        def first(*where: Any, newest: bool = False) -> AdapterVersion | None:
            order = col(AdapterVersion.version).desc() if newest else col(AdapterVersion.version)
            return session.exec(select(AdapterVersion).where(AdapterVersion.alias == "agent", *where)
                                .order_by(order).limit(1)).first()

        rows = {"serving": versions.serving(session, "agent"),
                "in_flight": first(col(AdapterVersion.status).in_(versions.IN_FLIGHT)),
                "training": first(AdapterVersion.status == "training"),
                "waiting": first(AdapterVersion.status == "candidate", newest=True)}
        return {key: row.version if row else None for key, row in rows.items()}

    assert glance() == single() == {"serving": None, "in_flight": None, "training": None, "waiting": None}
    v1 = trained(session, tmp_path, None, "promoted")
    assert glance() == single() == {"serving": v1, "in_flight": None, "training": None, "waiting": None}
    for _ in range(2):  # two candidates waiting, then one training
        versions.reserve(session, "agent", path_of=lambda n: tmp_path / "adapters" / str(n), base_model="tiny",
                         parent_version=v1, status="candidate")
    versions.reserve(session, "agent", path_of=lambda n: tmp_path / "adapters" / str(n), base_model="tiny",
                     parent_version=v1)
    assert glance() == single() == {"serving": v1, "in_flight": v1 + 1, "training": v1 + 3, "waiting": v1 + 2}
    versions.promote(session, "agent", v1 + 2, reason="gate")
    assert glance() == single() and glance()["serving"] == v1 + 2
