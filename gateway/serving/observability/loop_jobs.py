"""The gateway process's observability: a span per loop job run, the tracker's cue, the counters in /metrics.

:class:`Observability` is built in the gateway's lifespan and handed to the loop
(``gateway/serving/loop/scheduler.py``), which runs every job through :meth:`Observability.run_job`. With
tracing and tracking both off it only runs the job.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from flywheel.gateway.core.config import Settings
from flywheel.gateway.core.store_api import StoreApi
from flywheel.gateway.core.tracing import Tracing
from flywheel.gateway.serving.observability.tracking import Tracker, numbers

log = logging.getLogger("flywheel.telemetry")

JobResult = dict[str, Any]  # Loop.run's answer: job, alias, status, detail, counts, error


class Observability:
    """Tracing and tracking of the gateway process (either may be off)."""

    def __init__(self, tracing: Tracing | None = None, tracker: Tracker | None = None) -> None:
        self.tracing = tracing
        self.tracker = tracker
        self.store_spans: dict[str, int] = {}  # the store process's span counts, as of the last /metrics

    @classmethod
    def start(cls, settings: Settings, store: StoreApi) -> Observability:
        """``store``: where the tracker reads versions and rewards."""
        return cls(Tracing.start(settings.telemetry, process="gateway"), Tracker.start(settings, store))

    async def run_job(self, job: str, alias: str | None, run: Callable[[], Awaitable[JobResult]]) -> JobResult:
        """Run one loop job; then its span, and the tracker's cue when it did something."""
        start = time.time_ns()
        result = await run()
        if self.tracing is not None:
            self.tracing.emit(f"loop {job}", start, time.time_ns(), job_attributes(result), error=result.get("error"))
        if self.tracker is not None and result.get("status") not in ("idle", "busy"):
            self.tracker.notice(alias)
        return result

    async def refresh(self, store: Any) -> None:
        """Fetch the store process's span counts (``StoreLink``), for the next /metrics."""
        if self.tracing is None:
            return
        try:
            self.store_spans = await store.call("GET", "/internal/telemetry-stats")
        except Exception as exc:  # restarting: the last counts stand
            log.debug("no span counts from the store process (%s)", exc)

    async def close(self) -> None:
        if self.tracker is not None:
            await self.tracker.close()
        if self.tracing is not None:
            self.tracing.shutdown()

    def collector(self) -> Collector:
        return _Counters(self)


def job_attributes(result: JobResult) -> dict[str, Any]:
    attributes: dict[str, Any] = {"flywheel.job": result["job"], "flywheel.job.status": result["status"]}
    if result.get("alias"):
        attributes["flywheel.alias"] = result["alias"]
    if result.get("detail"):
        attributes["flywheel.job.detail"] = result["detail"]
    if result.get("error"):
        attributes["error.type"] = str(result["error"]).split(":", 1)[0]
    return attributes | numbers("flywheel.job.counts.", result.get("counts") or {})


class _Counters(Collector):
    """``flywheel_telemetry_spans_*`` per process and ``flywheel_tracking_records`` by outcome."""

    def __init__(self, observability: Observability) -> None:
        self.observability = observability

    def collect(self) -> Iterator[CounterMetricFamily]:
        exported = CounterMetricFamily("flywheel_telemetry_spans_exported", "Spans the OTLP collector accepted.",
                                       labels=["process"])
        dropped = CounterMetricFamily("flywheel_telemetry_spans_dropped",
                                      "Spans dropped: the export queue was full, or the collector did not take them.",
                                      labels=["process", "reason"])
        tracing = self.observability.tracing
        spans = {"gateway": tracing.counts.snapshot() if tracing is not None else {},
                 "store": self.observability.store_spans}
        for process, counts in spans.items():
            exported.add_metric([process], counts.get("exported", 0))
            for reason in ("queue_full", "export_failed"):
                dropped.add_metric([process, reason], counts.get(f"dropped_{reason}", 0))
        yield exported
        yield dropped
        records = CounterMetricFamily("flywheel_tracking_records", "Experiment-tracking records, by outcome.",
                                      labels=["outcome"])
        tracker = self.observability.tracker
        for outcome in ("logged", "dropped", "failed"):
            records.add_metric([outcome], tracker.counts[outcome] if tracker is not None else 0)
        yield records
