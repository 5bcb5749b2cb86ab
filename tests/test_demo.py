"""`flywheel demo`, end to end in its shortened mode: warm start, gateway, unmodified agent, the loop promotes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from flywheel.gateway.cli.demo import CANARY_ENDS, REPO, canary_decision

pytestmark = pytest.mark.slow


def test_the_demo_trains_and_its_canary_decides_on_its_own(tmp_path: Path) -> None:
    shown = subprocess.run(
        [sys.executable, "-m", "flywheel.gateway",
         "demo", "--data-dir", str(tmp_path), "--minutes", "8", "--min-groups", "4",
         "--canary-pairs", "20", "--decisions", "1"],
        capture_output=True, text=True, timeout=900, cwd=REPO)
    assert shown.returncode == 0, shown.stderr[-3000:]
    summary = json.loads((tmp_path / "demo" / "summary.json").read_text())
    assert summary["agent_errors"] == 0
    served = summary["reward_by_version"]["versions"]
    assert served["0"]["n"] > 0 and summary["episodes"] >= served["0"]["n"]
    decided = [v for v in summary["versions"] if canary_decision(v) in CANARY_ENDS]
    assert decided, (summary["versions"], shown.stderr[-3000:])
    version = decided[0]
    assert version["source"] == "trained" and version["status"] in ("promoted", "rejected"), version
    online = version["gate"]["online"]
    assert online["pairs"] >= 1, online
    # on_max = "reject" (the small-model configuration): only the test's own "better" promotes
    assert (version["status"] == "promoted") == (online["decision"] == "better"), version
    assert (tmp_path / "demo" / "reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "reward per version" in shown.stdout
    assert (tmp_path / "models" / "demo-warm-start" / "config.json").is_file()  # cached for the next run
