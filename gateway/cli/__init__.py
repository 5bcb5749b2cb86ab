"""The ``flywheel`` command (``gateway.cli.main``), one module per group of commands."""

from gateway.cli.main import app, main

__all__ = ["app", "main"]
