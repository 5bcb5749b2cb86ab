"""One OpenTelemetry tracer provider per process, exporting over OTLP/HTTP in bounded batches.

Tracing is on when ``[telemetry] endpoint`` or the standard ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) is set, and ``OTEL_SDK_DISABLED`` is not ``true``. Spans go
through the SDK's batch processor: a worker thread sends them ``batch_size`` at a time every
``export_every_s``. Nothing waits for the collector: when ``queue_size`` spans already wait, a new
span is dropped, and a batch the collector did not take (down, refusing, past ``timeout_s``) is
dropped too — both counted (:class:`SpanCounts`) and shown in ``/metrics``.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import threading
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from flywheel.gateway.core.config import TelemetryConfig

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

log = logging.getLogger("flywheel.telemetry")

ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
Attributes = Mapping[str, Any]


def require(module: str, extra: str) -> None:
    """Refuse to start, saying which extra to install, when an observability package is missing."""
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        found = False
    if not found:
        raise RuntimeError(f"{module} is not installed: pip install 'flywheel-rl[{extra}]' (docs/observability.md)")


def tracing_enabled(config: TelemetryConfig) -> bool:
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    return bool(config.endpoint or any(os.environ.get(name) for name in ENDPOINT_VARIABLES))


class SpanCounts:
    """What became of the spans: waiting, exported, dropped (``queue_full``, ``export_failed``); thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.handed = 0  # given to the batch processor's queue
        self.taken = 0  # taken from the queue by an export
        self.exported = 0
        self.dropped: Counter[str] = Counter()

    def admit(self, capacity: int) -> bool:
        """Whether one more span fits in the queue; counted as dropped when it does not."""
        with self._lock:
            if self.handed - self.taken >= capacity:
                self.dropped["queue_full"] += 1
                return False
            self.handed += 1
            return True

    def take(self, count: int) -> None:
        with self._lock:
            self.taken += count

    def settle(self, count: int, exported: bool) -> None:
        with self._lock:
            if exported:
                self.exported += count
            else:
                self.dropped["export_failed"] += count

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {"queued": self.handed - self.taken, "exported": self.exported,
                    "dropped_queue_full": self.dropped["queue_full"],
                    "dropped_export_failed": self.dropped["export_failed"]}


def counting_exporter(inner: SpanExporter, counts: SpanCounts) -> SpanExporter:
    """``inner``, with every batch it is given counted as exported or dropped."""
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    class CountingExporter(SpanExporter):
        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            counts.take(len(spans))
            try:
                result = inner.export(spans)
            except Exception:  # the exporter's own bug must not end the export thread
                log.exception("exporting %d spans failed", len(spans))
                result = SpanExportResult.FAILURE
            counts.settle(len(spans), result is SpanExportResult.SUCCESS)
            return result

        def shutdown(self) -> None:
            inner.shutdown()

        def force_flush(self, timeout_millis: int = 30000) -> bool:
            return inner.force_flush(timeout_millis)

    return CountingExporter()


def bounded_processor(exporter: SpanExporter, counts: SpanCounts, config: TelemetryConfig) -> Any:
    """The SDK's batch processor, refusing (and counting) a span once ``queue_size`` wait for export."""
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    class BoundedBatchProcessor(BatchSpanProcessor):
        def on_end(self, span: ReadableSpan) -> None:
            if counts.admit(config.queue_size):
                super().on_end(span)

    batch = min(config.batch_size, config.queue_size)
    # The SDK's own queue is never the bound (it would drop silently): ours admits at most queue_size.
    return BoundedBatchProcessor(exporter, max_queue_size=config.queue_size + batch,
                                 schedule_delay_millis=config.export_every_s * 1000, max_export_batch_size=batch)


class Tracing:
    """A process's tracer provider, its span counts, and :meth:`emit` for spans whose times are known."""

    def __init__(self, provider: TracerProvider, counts: SpanCounts) -> None:
        self.provider = provider
        self.tracer = provider.get_tracer("flywheel")
        self.counts = counts

    @classmethod
    def start(cls, config: TelemetryConfig, process: str) -> Tracing | None:
        """The process's tracing, or None when no OTLP endpoint is configured."""
        if not tracing_enabled(config):
            return None
        require("opentelemetry.exporter.otlp.proto.http", "telemetry")
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider

        endpoint = config.endpoint.rstrip("/") + "/v1/traces" if config.endpoint else None  # None: OTEL_ variables
        headers = {name: value.get_secret_value() for name, value in config.headers.items()} or None
        counts = SpanCounts()
        exporter = counting_exporter(OTLPSpanExporter(endpoint=endpoint, headers=headers, timeout=config.timeout_s),
                                     counts)
        named = {} if os.environ.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: config.service_name}
        provider = TracerProvider(resource=Resource.create({**named, "flywheel.process": process}))
        provider.add_span_processor(bounded_processor(exporter, counts, config))
        log.info("tracing: OTLP/HTTP export to %s", endpoint or "the OTEL_EXPORTER_OTLP_* endpoint")
        return cls(provider, counts)

    def emit(self, name: str, start_ns: int, end_ns: int, attributes: Attributes, *, client: bool = False,
             error: str | None = None) -> None:
        """A finished root span with the given times (a captured exchange, a job run)."""
        from opentelemetry.context import Context
        from opentelemetry.trace import SpanKind, Status, StatusCode

        span = self.tracer.start_span(name, context=Context(), kind=SpanKind.CLIENT if client else SpanKind.INTERNAL,
                                      attributes=attributes, start_time=start_ns)
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=end_ns)

    def shutdown(self) -> None:
        """Export what is queued (bounded by the exporter's timeout), then stop the export thread."""
        self.provider.shutdown()
