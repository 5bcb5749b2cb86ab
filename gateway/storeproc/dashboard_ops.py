"""The dashboard's reads (``gateway/serving/ui``): the ``ui_*`` methods of the store interface (``core/store_api.py``).

They run in the store process like every store method (the serving process never opens the
store). Arguments arrive validated by the page that asks; what the store alone can refuse (an
unknown ``after`` cursor) is a :class:`BadRequest` naming the parameter.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, String, cast, exists, func, literal_column
from sqlmodel import col, select

from flywheel.capture import queries
from flywheel.capture.models import Group as GroupRow
from flywheel.capture.models import GroupMember, JobRun, Score, Trajectory, Turn
from flywheel.capture.queries import QueryError, TrajectoryFilter, iso
from flywheel.capture.store import Store
from flywheel.gateway.core.config import Settings
from flywheel.gateway.core.errors import BadRequest
from flywheel.gateway.core.store_api import JobRunRecord, TrafficBucket


@dataclass(frozen=True)
class DashboardFilter(TrajectoryFilter):
    """The admin API's trajectory filters plus the dashboard's: a version that served it, a reward range
    (of its latest score, the reward the lists show) and a text search over its id and messages."""

    version: int | None = None
    min_reward: float | None = None
    max_reward: float | None = None
    text: str | None = None

    def conditions(self) -> list[ColumnElement[bool]]:
        out = super().conditions()
        if self.version is not None:
            out.append(exists().where(col(Turn.trajectory_id) == col(Trajectory.id),
                                      col(Turn.adapter_version) == self.version))
        latest = (select(Score.value).where(col(Score.trajectory_id) == col(Trajectory.id))
                  .order_by(col(Score.created_at).desc(), col(Score.id).desc()).limit(1).scalar_subquery())
        if self.min_reward is not None:
            out.append(latest >= self.min_reward)
        if self.max_reward is not None:
            out.append(latest <= self.max_reward)
        if self.text:
            needle = self.text.lower()
            said = exists().where(col(Turn.trajectory_id) == col(Trajectory.id),
                                  func.lower(cast(Turn.request_messages, String)).contains(needle, autoescape=True)
                                  | func.lower(cast(Turn.response_message, String)).contains(needle, autoescape=True))
            out.append(func.lower(col(Trajectory.id)).contains(needle, autoescape=True) | said)
        return out

    @classmethod
    def of(cls, values: dict[str, Any]) -> DashboardFilter:
        fields: dict[str, Any] = dict(values)
        for key in ("since", "until"):  # ISO 8601 on the wire
            fields[key] = datetime.fromisoformat(values[key]) if values.get(key) else None
        return cls(**fields)


def group_json(group: GroupRow) -> dict[str, Any]:
    return {"id": group.id, "source": group.source, "key": group.key, "alias": group.alias, "status": group.status,
            "size": group.size, "created_at": iso(group.created_at), "closed_at": iso(group.closed_at)}


def trajectories(store: Store, settings: Settings, filters: dict[str, Any], limit: int = 50,
                 after: str | None = None) -> dict[str, Any]:
    """One page of trajectories, newest first, each with the versions that served it."""
    try:
        page = queries.list_trajectories(store, DashboardFilter.of(filters), limit=limit, after=after, order="desc")
    except QueryError as exc:
        raise BadRequest(str(exc), param=exc.param) from None
    ids = [row["id"] for row in page.data]
    with store.session() as session:
        served = session.exec(select(Turn.trajectory_id, Turn.adapter_version).distinct()
                              .where(col(Turn.trajectory_id).in_(ids))).all() if ids else []
    versions: dict[str, list[int]] = {}
    for trajectory_id, version in served:
        versions.setdefault(trajectory_id, []).append(int(version))
    for row in page.data:
        row["versions"] = sorted(versions.get(row["id"], []))
    return page.to_json()


def trajectory(store: Store, settings: Settings, trajectory_id: str) -> dict[str, Any] | None:
    """The trajectory as the admin API shows it, plus the groups it belongs to."""
    detail = queries.trajectory_detail(store, trajectory_id)
    if detail is None:
        return None
    with store.session() as session:
        rows = session.exec(select(GroupRow).join(GroupMember, col(GroupMember.group_id) == col(GroupRow.id))
                            .where(GroupMember.trajectory_id == trajectory_id)).all()
        detail["groups"] = [group_json(group) for group in rows]
    return detail


def groups(store: Store, settings: Settings, alias: str | None = None, status: str | None = None,
           limit: int = 100) -> list[dict[str, Any]]:
    """Groups, newest first."""
    query = select(GroupRow).order_by(col(GroupRow.created_at).desc(), col(GroupRow.id).desc()).limit(limit)
    if alias:
        query = query.where(GroupRow.alias == alias)
    if status:
        query = query.where(GroupRow.status == status)
    with store.session() as session:
        return [group_json(group) for group in session.exec(query)]


def group(store: Store, settings: Settings, group_id: str) -> dict[str, Any] | None:
    """A group with each member trajectory (turns, branches, scores) and the scores it got in this group."""
    with store.session() as session:
        row = session.get(GroupRow, group_id)
        if row is None:
            return None
        members = session.exec(select(GroupMember).where(GroupMember.group_id == group_id)
                               .order_by(col(GroupMember.added_at), col(GroupMember.trajectory_id))).all()
        out: dict[str, Any] = {"group": group_json(row), "members": []}
        chosen = [(m.trajectory_id, m.leaf_turn_id) for m in members]
    for trajectory_id, leaf_turn_id in chosen:
        detail = queries.trajectory_detail(store, trajectory_id)
        if detail is not None:
            here = [s for s in detail["scores"] if s["group_id"] == group_id]
            out["members"].append({"trajectory": detail, "leaf_turn_id": leaf_turn_id, "scores": here})
    return out


def traffic(store: Store, settings: Settings, alias: str, since: datetime, bucket_s: int) -> list[TrafficBucket]:
    """Turns the clients were answered with, per time bucket (``bucket_s`` wide) and version, since ``since``."""
    # A literal (of an int), not a parameter: SELECT and GROUP BY must be the same expression.
    width: ColumnElement[int] = literal_column(str(int(bucket_s)))
    bucket = func.floor(func.extract("epoch", col(Turn.created_at)) / width)
    with store.session() as session:
        rows = session.exec(select(bucket, Turn.adapter_version, func.count())
                            .where(Turn.alias == alias, col(Turn.source) != "fork",
                                   col(Turn.created_at) >= since)
                            .group_by(bucket, col(Turn.adapter_version))).all()
    return [TrafficBucket(start=int(b) * int(bucket_s), version=int(v), turns=int(n)) for b, v, n in rows]


def failed_jobs(store: Store, settings: Settings, alias: str, limit: int = 10) -> list[JobRunRecord]:
    """The latest failed or interrupted job runs of an alias (and of the jobs over all aliases)."""
    query = (select(JobRun).where(col(JobRun.status).in_(["failed", "interrupted"]),
                                  (col(JobRun.alias) == alias) | col(JobRun.alias).is_(None))
             .order_by(col(JobRun.started_at).desc()).limit(limit))
    with store.session() as session:
        return [JobRunRecord.model_validate(run) for run in session.exec(query)]
