"""The serving process stays light: it never imports torch (training runs in a child, the local engine loads it
only when one is configured) nor duckdb (the store process owns the database)."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ["torch", "transformers", "trl", "peft", "duckdb", "duckdb_engine", "litellm", "wandb", "matplotlib"]

PROBE = f"""
import json, sys
from flywheel.gateway.serving.app import build_app
from flywheel.gateway.core.config import Settings

settings = Settings(engines={{"up": {{"kind": "openai", "base_url": "http://127.0.0.1:9/v1"}}}},
                    aliases={{"agent": {{"engine": "up", "base_model": "m"}}}})
build_app(settings)
print(json.dumps(sorted({{name.split(".")[0] for name in sys.modules}} & set({HEAVY!r}))))
"""


def test_building_the_http_app_imports_no_torch_and_no_duckdb() -> None:
    probe = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr[-2000:]
    assert json.loads(probe.stdout.strip().splitlines()[-1]) == []
