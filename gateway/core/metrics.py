"""Prometheus metrics, on a registry owned by one app (tests run several apps per process)."""

from __future__ import annotations

from collections import Counter as TallyCounter
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class GatewayMetrics:
    """Requests, latency, time to first chunk, tokens and errors."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("flywheel_requests", "Requests served, by endpoint, alias and status.",
                                ["endpoint", "alias", "status"], registry=self.registry)
        self.latency = Histogram("flywheel_request_latency_seconds",
                                 "Time from request to last byte, by endpoint and alias.",
                                 ["endpoint", "alias"], buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.first_chunk = Histogram("flywheel_time_to_first_chunk_seconds",
                                     "Streaming: time from request to the first chunk.",
                                     ["endpoint", "alias"], buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.tokens = Counter("flywheel_tokens", "Tokens processed, by alias and kind (prompt/completion).",
                              ["alias", "kind"], registry=self.registry)
        self.errors = Counter("flywheel_errors", "Error responses by HTTP status and error code.",
                              ["status", "code"], registry=self.registry)

    def count_usage(self, alias: str, usage: dict[str, int] | None) -> None:
        if usage:
            self.tokens.labels(alias, "prompt").inc(usage.get("prompt_tokens") or 0)
            self.tokens.labels(alias, "completion").inc(usage.get("completion_tokens") or 0)

    def watch_capture(self, stats: TallyCounter[str]) -> None:
        """Export the recorder's counters: turns by state (queued, written, spooled, reingested, failed), written
        turns by link rule, and the tails the linker refused as ambiguous (docs/capture.md)."""
        self.registry.register(_CaptureCollector(stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _CaptureCollector(Collector):
    def __init__(self, stats: TallyCounter[str]) -> None:
        self.stats = stats

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily("flywheel_capture_turns", "Captured turns by state.", labels=["state"])
        for state in ("queued", "written", "spooled", "reingested", "failed"):
            family.add_metric([state], self.stats[state])
        yield family
        links = CounterMetricFamily("flywheel_capture_links", "Written turns by the rule that linked them.",
                                    labels=["rule"])
        for rule in ("prefix", "tail", "summary", "explicit", "new"):
            links.add_metric([rule], self.stats[f"link_{rule}"])
        yield links
        yield CounterMetricFamily("flywheel_capture_batches",
                                  "Write transactions of captured turns, and of the feedback that rode them.",
                                  value=self.stats["batches"])
        yield CounterMetricFamily("flywheel_capture_feedback", "Client feedback recorded (each with its batch).",
                                  value=self.stats["feedback"])
        yield CounterMetricFamily("flywheel_capture_tail_ambiguous",
                                  "Requests whose last answer the linker refused to link by its tail (ambiguous).",
                                  value=self.stats["tail_ambiguous"])
