"""The dashboard without an admin key: the admin API's rule (loopback clients only), said on the page.

A real gateway process on loopback, asked over HTTP. (A non-loopback client cannot be made here:
tests only reach loopback addresses; the refusal is the admin API's own check, ``gateway/core/auth.py``.)
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.gateway_process import GatewayProcess
from tests.scripted_openai import ScriptedOpenAI


@pytest.fixture
def upstream() -> Iterator[ScriptedOpenAI]:
    with ScriptedOpenAI() as server:
        yield server


def test_without_an_admin_key_loopback_clients_get_a_session_and_forms_still_need_its_token(
        tmp_path: Path, upstream: ScriptedOpenAI) -> None:
    gateway = GatewayProcess(tmp_path, f"""
[engines.up]
base_url = "{upstream.base_url}"
[aliases.agent]
engine = "up"
base_model = "scripted"
""").start()
    ui = f"{gateway.url}/flywheel/ui"
    with httpx.Client(timeout=30) as browser:  # keeps cookies, as a browser does
        overview = browser.get(ui)
        assert overview.status_code == 200
        assert "answers loopback clients only" in overview.text and "Log out" not in overview.text
        cookie = overview.headers["set-cookie"].lower()
        assert "flywheel_dashboard=" in cookie and "httponly" in cookie and "samesite=strict" in cookie
        assert browser.get(f"{ui}/login").headers["location"] == "/flywheel/ui"  # nothing to log in to
        versions = browser.get(f"{ui}/versions/agent")
        token = re.search(r'name="csrf" value="([^"]+)"', browser.get(f"{ui}/versions/agent/promote?version=0").text)
        assert versions.status_code == 200 and token is not None
        forged = browser.post(f"{ui}/versions/agent/promote", data={"version": "0", "csrf": "forged"})
        assert forged.status_code == 403
        answered = browser.post(f"{ui}/versions/agent/promote", data={"version": "0", "csrf": token.group(1)})
        assert (answered.status_code, answered.headers["location"]) == (303, "/flywheel/ui/versions/agent?done=promote")
        nothing = browser.get(f"{ui}/versions/agent/rollback")
        assert nothing.status_code == 400 and "nothing to roll back" in nothing.text  # readable, not a 5xx
    no_session = httpx.post(f"{ui}/versions/agent/promote", data={"version": "0", "csrf": token.group(1)},
                            timeout=30)
    assert no_session.status_code == 403 and "No dashboard session" in no_session.text
    gateway.stop()
