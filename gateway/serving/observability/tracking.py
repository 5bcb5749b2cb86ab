"""Experiment tracking: training rounds, gate results and reward per version, logged to Weights & Biases.

The gateway process knows when these change: a loop job that acted (a round ended, a gate or the
A/B test decided, the scoring job gave rewards) cues :meth:`Tracker.notice`. The tracker then reads
the alias's versions and rewards from the store (one coalesced refresh per alias, on the event loop,
never on a request's path), works out what is new since it last logged (:class:`Changes`), and hands
each record to a thread of its own that owns the W&B runs — W&B's calls block, and its start takes
seconds. That thread's queue is bounded: a record that does not fit is dropped and counted.

One run per alias, named after it; every record carries ``version`` (the x axis) and flat
namespaced names: the round's own metrics as the trainer names them (``losses/loss``,
``reward/mean``, ... docs/trainer.md), ``gate/<offline|online|monitor>/<number>``,
``live_reward/{mean,n,low,high}`` and ``serving/version``. A new run (a restart) logs the history
the store holds first, so each run tells the whole story.
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import threading
from collections import Counter
from typing import Any

from flywheel.gateway.core.config import Settings
from flywheel.gateway.core.store_api import RewardByVersion, StoreApi, Version
from flywheel.gateway.core.tracing import require

log = logging.getLogger("flywheel.tracking")

Record = dict[str, float | int]
_STOP = None


def numbers(prefix: str, values: dict[str, Any]) -> Record:
    """The numeric leaves of ``values`` (nested dicts joined by ``/``; booleans as 0/1) under ``prefix``."""
    out: Record = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, bool):
            out[name] = int(value)
        elif isinstance(value, int | float):
            out[name] = value
        elif isinstance(value, dict):
            out |= numbers(f"{name}/", value)
    return out


class Changes:
    """What an alias's tracking has logged so far, and the records a fresh read of the store adds."""

    def __init__(self) -> None:
        self.seen: dict[tuple[str, int], str] = {}  # (what, version) -> fingerprint of what was logged
        self.serving: int | None = None

    def _new(self, what: str, version: int, value: Any) -> bool:
        fingerprint = json.dumps(value, sort_keys=True, default=str)
        if self.seen.get((what, version)) == fingerprint:
            return False
        self.seen[(what, version)] = fingerprint
        return True

    def records(self, versions: list[Version], rewards: RewardByVersion) -> list[Record]:
        """New records from the alias's versions (oldest first) and its reward per version."""
        out: list[Record] = []
        for row in sorted(versions, key=lambda r: r.version):
            version = row.version
            if row.metrics and self._new("round", version, row.metrics):
                out.append({"version": version, **numbers("", row.metrics)})
            for stage, result in (row.gate or {}).items():
                if isinstance(result, dict) and self._new(f"gate/{stage}", version, result):
                    out.append({"version": version, **numbers(f"gate/{stage}/", result)})
        for key, summary in sorted(rewards.versions.items(), key=lambda item: int(item[0])):
            shown = summary.model_dump(exclude_none=True)
            if self._new("live_reward", int(key), shown):
                out.append({"version": int(key), **numbers("live_reward/", shown)})
        serving = next((r.version for r in versions if r.status == "promoted"), 0)
        if serving != self.serving:
            self.serving = serving
            out.append({"version": serving, "serving/version": serving})
        return out


class WandbWriter:
    """The thread that owns the W&B runs (one per alias) and logs the records it is handed."""

    def __init__(self, settings: Settings) -> None:
        self.config = settings.tracking
        self.dir = self.config.dir or settings.data_dir / "tracking"
        self.run_config = {"loop": settings.loop.model_dump(mode="json"),
                           "train": settings.train.model_dump(mode="json")}
        self.queue: queue.Queue[tuple[str, Record] | None] = queue.Queue(maxsize=self.config.queue_size)
        self.counts: Counter[str] = Counter()  # logged, dropped, failed (records)
        self.thread = threading.Thread(target=self._work, name="flywheel-tracking", daemon=True)

    def hand(self, alias: str, record: Record) -> None:
        try:
            self.queue.put_nowait((alias, record))
        except queue.Full:
            self.counts["dropped"] += 1

    def stop(self, timeout_s: float) -> None:
        """Log what is queued, finish the runs (their files are complete then), stop the thread."""
        self.queue.put(_STOP)
        self.thread.join(timeout_s)

    def _work(self) -> None:
        runs: dict[str, Any] = {}
        unstartable: set[str] = set()  # a run W&B refused to start (no key, no network): said once
        while (item := self.queue.get()) is not _STOP:
            alias, record = item
            if alias in unstartable:
                self.counts["failed"] += 1
                continue
            try:
                if alias not in runs:
                    runs[alias] = self._start_run(alias)
            except Exception:
                log.exception("tracking: W&B would not start a run for %s; its records are dropped", alias)
                unstartable.add(alias)
                self.counts["failed"] += 1
                continue
            try:
                runs[alias].log(record)
                self.counts["logged"] += 1
            except Exception:  # W&B's trouble costs a record, never the gateway
                log.exception("tracking: could not log to W&B for %s", alias)
                self.counts["failed"] += 1
        for run in runs.values():
            try:
                run.finish()
            except Exception:
                log.exception("tracking: could not finish the W&B run of %s", run.name)

    def _start_run(self, alias: str) -> Any:
        import wandb

        self.dir.mkdir(parents=True, exist_ok=True)
        run = wandb.init(project=self.config.project, entity=self.config.entity, name=alias, group="flywheel",
                         job_type="loop", dir=str(self.dir), mode=self.config.mode, reinit="create_new",
                         config={"alias": alias, **self.run_config},
                         settings=wandb.Settings(console="off", silent=True, x_disable_stats=True,
                                                 disable_git=True, save_code=False))
        run.define_metric("version")
        run.define_metric("*", step_metric="version")
        return run


class Tracker:
    """Cues from the loop in, records to W&B out; off (None from :meth:`start`) without ``[tracking] report_to``."""

    def __init__(self, settings: Settings, store: StoreApi) -> None:
        self.store = store
        self.aliases = list(settings.aliases)
        self.writer = WandbWriter(settings)
        self.changes = {alias: Changes() for alias in self.aliases}
        self._pending: set[str] = set()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @classmethod
    def start(cls, settings: Settings, store: StoreApi) -> Tracker | None:
        if not settings.tracking.report_to:
            return None
        require("wandb", "tracking")
        tracker = cls(settings, store)
        tracker.writer.thread.start()
        tracker._task = asyncio.create_task(tracker._refresh_loop(), name="flywheel-tracking")
        for alias in tracker.aliases:  # the history the store holds, first
            tracker.notice(alias)
        return tracker

    @property
    def counts(self) -> Counter[str]:
        return self.writer.counts

    def notice(self, alias: str | None) -> None:
        """Something may have changed for ``alias`` (None: every alias): refresh it soon."""
        self._pending.update([alias] if alias is not None else self.aliases)
        self._wake.set()

    async def close(self, timeout_s: float = 30.0) -> None:
        if self._task is not None:
            self._task.cancel()
            self._pending.update(self.aliases)  # what the last jobs changed, even if a refresh was cut short
            await self._refresh_pending()
        await asyncio.to_thread(self.writer.stop, timeout_s)

    async def _refresh_loop(self) -> None:
        while True:
            await self._wake.wait()
            await self._refresh_pending()

    async def _refresh_pending(self) -> None:
        self._wake.clear()
        while self._pending:
            alias = self._pending.pop()
            try:
                versions = await self.store.versions(alias)
                rewards = await self.store.reward_by_version(alias)
            except Exception as exc:  # the store process is restarting: the next cue tries again
                log.warning("tracking: could not read %s from the store (%s)", alias, exc)
                continue
            for record in self.changes[alias].records(versions, rewards):
                self.writer.hand(alias, record)
