"""What crosses between the serving process and the store process besides the routes: headers, the keep-alive
rule, and the redaction both sides apply (the gateway to what it spools itself, the store to what it writes)."""

from __future__ import annotations

from flywheel.capture.redaction import Redactor
from flywheel.gateway.core.config import Settings

INGEST_SEQ_HEADER = "x-flywheel-ingest-seq"  # exchanges the gateway had streamed when it forwarded a request
CLIENT_HOST_HEADER = "x-flywheel-client-host"  # the forwarded request's client address
# On every answer of the store process: its count of committed writes of adapter_versions ("": one is committing)
VERSIONS_STAMP_HEADER = "x-flywheel-versions-stamp"
STORE_KEEPALIVE_S = 15.0  # how long the gateway keeps an idle connection to the store process (its server: 4x)


def redactor_for(settings: Settings) -> Redactor | None:
    redaction = settings.capture.redaction
    return Redactor(builtin=redaction.builtin, patterns=redaction.patterns) \
        if redaction.builtin or redaction.patterns else None
