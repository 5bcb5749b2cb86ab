"""Adapter versions in the store: the one source of version numbers and of which version serves an alias.

Runs where the store is (the store process, or the CLI on the file when no gateway runs). Every
switch — the gate, the monitor's rollback, ``flywheel promote`` / ``rollback``, the admin API,
a restart — reads or writes ``adapter_versions`` through these functions, and the gateway then
makes its engines match. A number is handed out once (``reserve``) and never again, also after
a failed round, so an engine name ``alias@N`` always means one set of weights.

Statuses: ``training`` -> ``candidate`` | ``failed``; ``candidate`` -> ``canary`` | ``promoted`` |
``rejected``; ``canary`` -> ``promoted`` | ``rejected``; ``promoted`` -> ``retired`` |
``rolled_back``; any non-serving one -> ``deleted``. Version 0 is the base model (no row).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from sqlalchemy import update
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, func, select

from flywheel.capture.models import AdapterVersion, utcnow
from flywheel.capture.turns import new_id

IN_FLIGHT = ("training", "candidate", "canary")  # an alias trains one candidate at a time


class VersionError(ValueError):
    """A version that does not exist, or a switch its status does not allow."""


def reserve(session: Session, alias: str, *, path_of: Any, base_model: str, source: str = "trained",
            status: str = "training", parent_version: int | None = None, path: str | None = None,
            refuse: tuple[str, ...] = (), attempts: int = 5) -> AdapterVersion:
    """A new row with the next number (max + 1, also above any directory already on disk), committed.

    ``path_of(N)`` gives the directory version N will live in (unless ``path`` is given: a manual
    adapter registered where it is). The (alias, version) unique constraint makes two concurrent
    reservations (two threads, or two gateway replicas on PostgreSQL) retry rather than share N.
    Refused (``VersionError``) while a version of the alias has a status in ``refuse``.
    """
    for _ in range(attempts):
        busy = func.min(AdapterVersion.version).filter(col(AdapterVersion.status).in_(refuse))
        highest, held = session.exec(select(func.max(AdapterVersion.version), busy)  # the check in the same read
                                     .where(AdapterVersion.alias == alias)).one()
        if held is not None:
            raise VersionError(f"{alias} already has version {held} in flight: one round at a time")
        number = max(highest or 0, _highest_on_disk(path_of(1))) + 1
        row = AdapterVersion(id=new_id("adv"), alias=alias, version=number, path=path or str(path_of(number)),
                             base_model=base_model, parent_version=parent_version, status=status, source=source)
        session.add(row)
        try:
            session.commit()
            return row
        except IntegrityError:
            session.rollback()
    raise VersionError(f"could not reserve a version number for {alias!r} after {attempts} attempts")


def _highest_on_disk(first: Path) -> int:
    """The highest numbered directory beside ``first`` (versions written before the store counted them)."""
    root = Path(first).parent
    if not root.is_dir():
        return 0
    return max((int(p.name) for p in root.iterdir() if p.name.isdigit()), default=0)


def get(session: Session, alias: str, version: int) -> AdapterVersion:
    row = session.exec(select(AdapterVersion).where(AdapterVersion.alias == alias,
                                                    AdapterVersion.version == version)).first()
    if row is None:
        raise VersionError(f"{alias} has no version {version}")
    return row


def _serving_query(alias: str, *columns: Any) -> Any:
    """The newest promoted row of ``alias`` (its ``columns``, or the whole row): the version that serves it."""
    return (select(*columns or (AdapterVersion,)).where(AdapterVersion.alias == alias,
                                                        AdapterVersion.status == "promoted")
            .order_by(col(AdapterVersion.promoted_at).desc()).limit(1))


def serving(session: Session, alias: str) -> AdapterVersion | None:
    """The version that serves ``alias`` (None: the base model)."""
    row: AdapterVersion | None = session.exec(_serving_query(alias)).first()
    return row


def _promoted_at(row: AdapterVersion) -> float:
    return row.promoted_at.timestamp() if row.promoted_at else -math.inf  # as ``serving``'s order: NULL last


def at_a_glance(session: Session, aliases: list[str]) -> dict[str, dict[str, AdapterVersion | None]]:
    """Of each alias, from one query (the loop's ticks and the status poll read them several times a second):
    ``serving``; ``in_flight``, the oldest version training, waiting for its gate or on canary; ``training``, the
    one a round trains now; ``waiting``, the newest candidate waiting for its gate."""
    rows = session.exec(select(AdapterVersion).where(col(AdapterVersion.alias).in_(aliases),
                                                     col(AdapterVersion.status).in_(("promoted", *IN_FLIGHT)))).all()
    out: dict[str, dict[str, AdapterVersion | None]] = {}
    for alias in aliases:
        mine = sorted((row for row in rows if row.alias == alias), key=lambda row: row.version)
        promoted = [row for row in mine if row.status == "promoted"]
        out[alias] = {"serving": max(promoted, key=_promoted_at, default=None),
                      "in_flight": next((row for row in mine if row.status in IN_FLIGHT), None),
                      "training": next((row for row in mine if row.status == "training"), None),
                      "waiting": next((row for row in reversed(mine) if row.status == "candidate"), None)}
    return out


def shown_worse(row: AdapterVersion) -> bool:
    """Whether a gate found ``row`` worse than what served: its offline gate failed, its canary's test said
    worse, the monitor rolled it back, or the canary, rejecting it as not better by min_gain, measured it below
    what served by more than two standard errors. Rejected for want of evidence ("not shown better") is not worse."""
    gate = row.gate or {}
    online = gate.get("online") or {}
    return (row.status == "rolled_back" or (gate.get("offline") or {}).get("decision") == "failed"
            or online.get("decision") == "worse" or measured_below(online))


def measured_below(online: dict[str, Any]) -> bool:
    """A canary that ended not_better with its mean paired difference below 0 by more than two standard errors:
    the test bounded the gain from above, the measurement says the version lost; no line builds on it."""
    error = online.get("standard_error")
    return (online.get("decision") == "not_better" and error is not None
            and online["mean_difference"] + 2 * error < 0)


def seen_by_a_gate(row: AdapterVersion) -> bool:
    """Whether a gate has judged ``row``: it holds a gate's results, or was promoted or put on canary."""
    return bool(row.gate) or row.status in ("promoted", "canary")


def training_head(session: Session, alias: str) -> AdapterVersion | None:
    """The version the next round continues from (None: the base model).

    Training keeps its own line: the newest trained version above the serving one which, like every
    ancestor back to the serving version, was never shown worse (one on canary counts); else the
    serving version. A candidate the canary could not yet tell apart is a step on that line, not a dead end:
    a round's update is smaller than the test can see, the sum of several is not. A version shown worse
    takes with it its ancestors no gate ever saw (superseded before theirs): nothing spoke for them, and
    its failure speaks against the path it came by. What serves is still only what a gate promoted.
    """
    serving_version = _serving_query(alias, AdapterVersion.version).scalar_subquery()
    # the serving version and those above it in one statement: this is read after every version written
    rows = session.exec(select(AdapterVersion).where(AdapterVersion.alias == alias,
                                                     AdapterVersion.version >= func.coalesce(serving_version, 0))
                        .order_by(col(AdapterVersion.version))).all()
    current = rows[0] if rows and rows[0].status == "promoted" else None
    base = current.version if current is not None else 0
    above = rows[1:] if current is not None else rows
    by_version = {row.version: row for row in above}
    cut = {row.version for row in above if shown_worse(row)}
    for version in list(cut):  # and the ancestors of each that no gate saw (a cut one's were walked, or will be)
        parent = by_version.get(by_version[version].parent_version or 0)
        while parent is not None and not seen_by_a_gate(parent) and parent.version not in cut:
            cut.add(parent.version)
            parent = by_version.get(parent.parent_version or 0)
    # parents are older than their children: one pass, each version judged once by its own row and its parent's
    on_the_line: dict[int, bool] = {base: True}
    for row in above:
        on_the_line[row.version] = (on_the_line.get(row.parent_version or 0, False) and row.source == "trained"
                                    and row.status not in ("training", "failed", "deleted")
                                    and row.version not in cut and Path(row.path).is_dir())
    newest = next((row for row in reversed(above) if on_the_line[row.version]), None)
    return newest if newest is not None else current


def supersede(session: Session, alias: str, version: int) -> None:
    """Candidates older than ``version`` that never reached their gate: rejected, superseded (not worse); one
    statement in the caller's transaction (it commits), which has none of them loaded (they are not refreshed)."""
    session.execute(update(AdapterVersion)
                    .where(col(AdapterVersion.alias) == alias, col(AdapterVersion.status) == "candidate",
                           col(AdapterVersion.version) < version)
                    .values(status="rejected", decided_at=utcnow(),
                            reason=f"superseded by version {version} before its gate")
                    .execution_options(synchronize_session=False))


def listing(session: Session, alias: str) -> list[AdapterVersion]:
    return list(session.exec(select(AdapterVersion).where(AdapterVersion.alias == alias)
                             .order_by(col(AdapterVersion.version))))


def promote(session: Session, alias: str, version: int, *, reason: str,
            replaced_status: str = "retired") -> tuple[AdapterVersion | None, AdapterVersion | None]:
    """Make ``version`` (0: the base model) the one serving ``alias``; returns (new, previous), committed.

    The previous serving version becomes ``replaced_status`` (``retired``, or ``rolled_back`` when
    it is being rolled back). Deleted, failed and still-training versions cannot serve.
    """
    previous = serving(session, alias)
    target = get(session, alias, version) if version else None
    if target is not None and target.status in ("deleted", "failed", "training"):
        raise VersionError(f"{alias} version {version} is {target.status}: it cannot serve")
    if previous is not None and target is not None and previous.id == target.id:
        return target, previous
    now = utcnow()
    if previous is not None:
        previous.status, previous.decided_at = replaced_status, now
        if replaced_status == "rolled_back":
            previous.reason = reason
        session.add(previous)
    if target is not None:
        target.status, target.promoted_at, target.decided_at, target.reason = "promoted", now, now, reason
        if replaced_status == "rolled_back":  # a restored version keeps its own predecessor; no need to watch it
            target.gate = {**(target.gate or {}), "monitor": {"finished": True, "restored_by_rollback": True}}
        else:
            target.previous_version = previous.version if previous is not None else 0
        session.add(target)
    session.commit()
    return target, previous


def rollback_target(session: Session, alias: str) -> int:
    """The version to return to: the one that served before the current one (0: the base model)."""
    current = serving(session, alias)
    if current is None:
        raise VersionError(f"{alias} serves the base model: there is nothing to roll back")
    return current.previous_version or 0


def decide(session: Session, alias: str, version: int, status: str, *, reason: str,
           gate: dict[str, Any] | None = None) -> AdapterVersion:
    """Record the gate's (or a person's) decision on a non-serving version; ``gate`` results are merged in."""
    row = get(session, alias, version)
    row.status, row.reason, row.decided_at = status, reason, utcnow()
    if gate:
        row.gate = {**(row.gate or {}), **gate}
    session.add(row)
    session.commit()
    return row


def record_gate(session: Session, alias: str, version: int, gate: dict[str, Any]) -> AdapterVersion:
    """Merge gate results (offline, online) into a version's ``gate`` column without deciding."""
    row = get(session, alias, version)
    row.gate = {**(row.gate or {}), **gate}
    session.add(row)
    session.commit()
    return row


def fail_stale(session: Session) -> int:
    """At start-up: rounds that were running when the gateway stopped never finished (their child died)."""
    rows = list(session.exec(select(AdapterVersion).where(AdapterVersion.status == "training")))
    for row in rows:
        row.status, row.reason, row.decided_at = "failed", "the gateway stopped while it was training", utcnow()
        session.add(row)
    session.commit()
    return len(rows)

