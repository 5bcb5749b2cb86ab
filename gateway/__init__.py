"""Flywheel gateway: OpenAI-compatible serving, routing, engines, admin API and CLI."""
