"""Logging for both processes: one format, and every record redacted before any handler writes it.

uvicorn's own loggers (errors, the access log with its query strings) go through the same root
handler (``log_config=None`` to uvicorn), so nothing reaches the log unredacted: the capture
rules (``[capture.redaction]``, the built-in ones always) plus the configured keys, matched
literally wherever they appear.
"""

from __future__ import annotations

import logging

from flywheel.capture.redaction import RedactingFilter, Redactor
from flywheel.gateway.core.config import Settings

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def known_secrets(settings: Settings) -> list[str]:
    """Every key the configuration holds: client keys, the admin key, upstream and judge keys."""
    keys = [*settings.auth.api_keys, settings.auth.admin_key, settings.judge.api_key,
            *(getattr(engine, "api_key", None) for engine in settings.engines.values())]
    return [key.get_secret_value() for key in keys if key is not None]


def log_redactor(settings: Settings) -> Redactor:
    return Redactor(builtin=True, patterns=settings.capture.redaction.patterns, secrets=known_secrets(settings))


def configure_logging(settings: Settings) -> None:
    """The root handler, with the redacting filter; call before uvicorn starts (and pass it ``log_config=None``)."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(FORMAT))
    handler.addFilter(RedactingFilter(log_redactor(settings)))
    logging.basicConfig(level=settings.log_level.upper(), handlers=[handler], force=True)
