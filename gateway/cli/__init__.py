"""The ``flywheel`` command (``flywheel.gateway.cli.main``), one module per group of commands."""

from flywheel.gateway.cli.main import app, main

__all__ = ["app", "main"]
