"""The one way tests wait: poll a condition until it holds, and fail naming it after a bounded time."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(probe: Callable[[], T | None], what: str = "a condition", timeout_s: float = 60.0) -> T:
    """Poll ``probe`` until it returns something truthy, and return that; fail naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := probe():
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
