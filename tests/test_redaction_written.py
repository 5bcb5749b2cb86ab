"""Nothing a client sends or an engine answers reaches the store or the log unredacted, whatever field it is in.

A real gateway in front of a scripted upstream that answers with a key and an e-mail address. The
client puts secrets everywhere the OpenAI API lets it — ``user``, ``metadata`` (keys and values), an
unknown body field, a tool description, a tool result, a trajectory id — and into the store-backed
routes (feedback, a metadata update, a close reason) and a query string. Then every row of every
table, and the log of both processes, is searched for them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from sqlalchemy import text

from flywheel.capture.store import Store
from tests.gateway_process import GatewayProcess
from tests.scripted_openai import Reply, ScriptedOpenAI

KEY = "sk-proj-abcdefghijklmnopqrstuvwx"
MAIL = "alice.liddell@example.com"
ADMIN_KEY = "flywheel-admin-8f3c2a"  # no pattern matches it: only the literal rule of the log keeps it out
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
TOOLS: list[Any] = [{"type": "function", "function": {"name": "mail", "description": f"writes to {MAIL}",
                                                      "parameters": {"type": "object"}}}]


def leaky_reply(body: dict[str, Any]) -> Reply:
    call = {"id": "call_1", "type": "function", "function": {"name": "mail", "arguments": json.dumps({"to": MAIL})}}
    return Reply(content=f"here is your key: {KEY}", tool_calls=[call], finish_reason="tool_calls")


def every_row(database: Path) -> str:
    """Every row of every table, as text."""
    store = Store(database)
    try:
        with store.engine.connect() as connection:
            tables = [row[0] for row in connection.execute(text("SELECT table_name FROM information_schema.tables"))]
            return "\n".join(str(row) for table in tables
                             for row in connection.execute(text(f'SELECT * FROM "{table}"')))
    finally:
        store.close()


@pytest.mark.timeout(600)
def test_no_secret_is_written_anywhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLYWHEEL_LOG_LEVEL", "info")  # the access log too
    with ScriptedOpenAI(reply=leaky_reply) as upstream:
        gateway = GatewayProcess(tmp_path, f"""
[engines.up]
base_url = "{upstream.base_url}"
[aliases.agent]
engine = "up"
[auth]
admin_key = "{ADMIN_KEY}"
""").start()
        try:
            client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
            messages: list[Any] = [{"role": "user", "content": f"mail {MAIL} please"}]
            first = client.chat.completions.create(
                model="gpt-4o", messages=messages, tools=TOOLS, user=KEY, metadata={"owner": MAIL, "note": "n"},
                extra_body={"x_vendor": {KEY: [MAIL]}}, extra_headers={"X-Flywheel-Trajectory-Id": f"for {MAIL}"})
            call = first.choices[0].message.model_dump(exclude_none=True)
            messages += [call, {"role": "tool", "tool_call_id": "call_1", "content": f"sent, receipt {KEY}"}]
            chunks = list(client.chat.completions.create(model="gpt-4o", messages=messages, tools=TOOLS, stream=True,
                                                         extra_headers={"X-Flywheel-Task": f"task {KEY}"}))
            assert chunks and first.choices[0].message.content == f"here is your key: {KEY}"  # the client's copy

            store_routes = [
                httpx.post(f"{gateway.url}/v1/chat/completions/{first.id}", json={"metadata": {"note": KEY}}),
                httpx.post(f"{gateway.url}/flywheel/v1/trajectories/for {MAIL}/close", json={"reason": KEY}),
                httpx.post(f"{gateway.url}/flywheel/v1/trajectories/for [REDACTED:EMAIL]/close", json={"reason": KEY}),
                httpx.post(f"{gateway.url}/flywheel/v1/feedback",
                           json={"completion_id": first.id, "label": "good", "comment": f"from {MAIL}"}),
                httpx.get(f"{gateway.url}/v1/chat/completions", params={"metadata[owner]": MAIL}),
                httpx.get(f"{gateway.url}/healthz", params={"token": ADMIN_KEY}),
            ]
            # The id was stored redacted: the client's own spelling finds nothing, the stored one does.
            assert [r.status_code for r in store_routes] == [200, 404, 200, 200, 200, 200]
            assert store_routes[2].json()["close_reason"] == "[REDACTED:API_KEY]"
        finally:
            gateway.stop()
    rows = every_row(gateway.dir / "data" / "flywheel.duckdb")
    assert "[REDACTED:API_KEY]" in rows and "[REDACTED:EMAIL]" in rows and first.id in rows
    assert KEY not in rows and MAIL not in rows
    log = gateway.log_file.read_text()
    assert "GET /healthz?token=[REDACTED:SECRET]" in log  # the access log went through the filter
    for secret in (KEY, MAIL, MAIL.replace("@", "%40"), ADMIN_KEY):
        assert secret not in log
