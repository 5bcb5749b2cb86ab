"""The SDK's header helper: the names the gateway reads (gateway/store/capture_plan.py)."""

from __future__ import annotations

import flywheel


def test_headers_names_only_what_is_given() -> None:
    assert flywheel.headers() == {}
    assert flywheel.headers(trajectory_id="run-1", group_id="g", task="t", capture=False, fork=3) == {
        "X-Flywheel-Trajectory-Id": "run-1", "X-Flywheel-Group-Id": "g", "X-Flywheel-Task": "t",
        "X-Flywheel-Capture": "off", "X-Flywheel-Fork": "3"}
    assert flywheel.headers(capture=True) == {"X-Flywheel-Capture": "on"}
