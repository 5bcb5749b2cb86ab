"""Observability: OpenTelemetry traces (OTLP) and experiment tracking (W&B), both off by default.

- :mod:`gateway.observability.tracing`: one tracer provider per process, batched and bounded export,
  every dropped span counted for ``/metrics``.
- :mod:`gateway.observability.completions`: a span per captured chat completion, built in the store
  process from the turns it has just written (nothing is added to the request path).
- :mod:`gateway.observability.loop_jobs`: a span per loop job run and the tracker's cue, in the gateway.
- :mod:`gateway.observability.tracking`: training rounds, gate results and reward per version to W&B,
  from a thread of its own.

docs/observability.md has the span names, attributes, configuration and metric names.
"""
