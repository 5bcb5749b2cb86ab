"""Flywheel client SDK: talk to a Flywheel gateway with the plain ``openai`` client.

An agent needs no SDK to be captured: pointing ``base_url`` at the gateway is enough.
This package holds the optional helpers: the ``X-Flywheel-*`` headers the gateway reads
(docs/capture.md). The ART-style training API is not here yet.

    from openai import OpenAI
    import flywheel

    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="sk-...")
    client.chat.completions.create(model="gpt-4o", messages=[...],
                                   extra_headers=flywheel.headers(group_id="run-7"))
"""

from __future__ import annotations

__all__ = ["headers"]


def headers(*, trajectory_id: str | None = None, group_id: str | None = None, task: str | None = None,
            capture: bool | None = None, fork: int | None = None) -> dict[str, str]:
    """The ``X-Flywheel-*`` request headers for the tags given (None leaves a tag out)."""
    out: dict[str, str] = {}
    if trajectory_id is not None:
        out["X-Flywheel-Trajectory-Id"] = trajectory_id
    if group_id is not None:
        out["X-Flywheel-Group-Id"] = group_id
    if task is not None:
        out["X-Flywheel-Task"] = task
    if capture is not None:
        out["X-Flywheel-Capture"] = "on" if capture else "off"
    if fork is not None:
        out["X-Flywheel-Fork"] = str(fork)
    return out
