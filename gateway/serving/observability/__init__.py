"""The serving process's observability: a span per loop job (OTLP) and experiment tracking (W&B), both off by
default (docs/observability.md). The shared tracer provider is ``core/tracing.py``."""
