"""One training round for an alias: scored groups in, a new adapter version out.

The gateway is the composition root (architecture §2): it reads the batch from the store, hands
it to the trainer (which knows nothing of serving), records the result and, when asked,
hot-loads the new adapter. ``flywheel train`` runs a round in its own process — through
the running gateway's admin API (``/flywheel/v1/training/...``) or on the store file when
no gateway runs — so the serving process never holds torch's training memory.

Promotion here is by hand (``--promote``); otherwise the new version is a candidate and the
loop's gate decides (docs/loop.md).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

from sqlalchemy import case, update
from sqlmodel import Session, col, select

from flywheel.capture.batches import TrainingGroup
from flywheel.capture.groups import training_groups
from flywheel.capture.models import AdapterVersion, Group, utcnow
from flywheel.capture.store import Store
from flywheel.gateway.storeproc import versions

log = logging.getLogger("flywheel.training")


def training_batch(store: Store, alias: str, max_groups: int, group_ids: list[str] | None = None,
                   order: Literal["newest", "oldest"] = "newest") -> list[TrainingGroup]:
    """Up to ``max_groups`` scored groups of ``alias`` not trained on yet — the newest or the oldest of them
    (``train.batch_order``) — in the order they were formed (only ``group_ids`` when given)."""
    formed = col(Group.created_at)
    query = (select(col(Group.id), col(Group.source), col(Group.alias), formed)  # rows: no entity is hydrated
             .where(col(Group.alias) == alias, col(Group.status) == "scored"))
    if group_ids is not None:
        query = query.where(col(Group.id).in_(group_ids))
    with store.session() as session:
        groups = list(session.execute(query.order_by(formed.desc() if order == "newest" else formed)
                                      .limit(max_groups)).all())
        groups.sort(key=lambda group: group.created_at)
        return training_groups(session, groups)


def record_training(store: Store, alias: str, result: Any, *, version: int, parent_version: int | None,
                    promote: bool, batch_group_ids: list[str]) -> AdapterVersion | None:
    """Store the round (run row; the reserved version becomes a candidate), settle its batch, promote if asked.

    Every group of the batch is settled: ``trained`` when the round used it, ``untrainable`` when the
    trainer skipped it (equal rewards, wrong size, too long) — so no group is trained twice and none
    is fetched again forever. A skipped round (nothing trainable) fails its reserved version. A new
    candidate supersedes the older ones still waiting for their gate (the gate takes the newest of the
    line), in the same transaction.
    """
    from flywheel.trainer.adapters import OPTIMIZER_FILE, is_complete, record_round

    with Session(store.engine, expire_on_commit=False) as session:
        reserved = versions.get(session, alias, version)  # read once: the check, the record and a skipped round's
        if result.adapter_dir is not None:  # the files are where the gateway reserved them, whatever the report says
            written = Path(reserved.path)
            if not is_complete(written):
                raise versions.VersionError(f"{alias} version {version} has no adapter in its directory: write it "
                                            "there or upload it first (PUT /flywheel/v1/training/adapters/...)")
            result = replace(result, adapter_dir=written, optimizer_state=written / OPTIMIZER_FILE)
        _, adapter = record_round(session, result, alias=alias, base_model=result.base_model, version=version,
                                  parent_version=parent_version, reserved=reserved, commit=False)
        trained = set(result.group_ids)
        settled = set(batch_group_ids) | trained
        if settled:  # one statement for the batch, not a read and a write per group; no Group is loaded here
            session.execute(update(Group).where(col(Group.id).in_(settled), col(Group.status) == "scored")
                            .values(status=case((col(Group.id).in_(trained), "trained"), else_="untrainable"))
                            .execution_options(synchronize_session=False))
        if adapter is None:  # skipped: the number stays used, never reassigned
            reserved.status, reserved.decided_at = "failed", utcnow()
            reserved.reason = f"nothing trainable: {result.skipped}"
            session.add(reserved)
        elif not promote:
            versions.supersede(session, alias, version)
        session.commit()
        if promote and adapter is not None:
            versions.promote(session, alias, version, reason="promoted by hand (--promote)")
        return adapter


def record_failed_round(store: Store, alias: str, version: int, error: str, group_ids: list[str]) -> AdapterVersion:
    """A round that raised or whose process died: the run row and the reserved version say so; its groups
    stay ``scored`` and the next round takes them again."""
    from flywheel.trainer.adapters import record_failure

    with Session(store.engine, expire_on_commit=False) as session:
        record_failure(session, alias=alias, error=error, group_ids=group_ids, commit=False)
        row = versions.get(session, alias, version)
        if row.status == "training":
            row.status, row.reason, row.decided_at = "failed", error[-2000:], utcnow()
            session.add(row)
        session.commit()
        return row
