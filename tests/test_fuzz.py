"""Fuzzing the HTTP API with schemathesis: no input makes the gateway answer 5xx, and every 4xx is an
OpenAI error object that names the field at fault.

Two documents drive it, each in positive mode (what the document says is valid) and negative mode
(what it says is not):

- OpenAI's own description of ``POST /chat/completions`` (``tests/fixtures/openai/``, MIT licensed):
  the gateway must take what OpenAI documents, and refuse the rest the way OpenAI does;
- the gateway's own ``/openapi.json`` (admin key) for the admin, feedback, loop, training,
  trajectories and Stored Completions APIs, store-backed routes included.

The engine is a scripted upstream (the gateway is what is tested, not a model). Examples per
operation are bounded so the module runs in a few minutes.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from flywheel.capture.redaction import Redactor
from flywheel.capture.turns import CapturedExchange, prepare_lines
from flywheel.gateway.core.config import Settings
from flywheel.gateway.core.openapi import openapi_document
from flywheel.gateway.serving.app import build_app
from flywheel.gateway.storeproc.routes import STORE_ROUTERS
from tests.gateway_process import GatewayProcess
from tests.scripted_openai import ScriptedOpenAI

ADMIN = {"authorization": "Bearer fuzz-admin"}
OPENAI_CHAT = Path(__file__).parent / "fixtures" / "openai" / "chat_completions.openapi.json"
MODES = [GenerationMode.POSITIVE, GenerationMode.NEGATIVE]
# What is not fuzzed here: the chat and legacy completions routes are fuzzed with OpenAI's document
# (below); a training round starts a child process that trains for seconds (tests/test_loop_learning.py).
NOT_FUZZED_HERE = ("POST /v1/chat/completions", "POST /v1/completions", "POST /flywheel/v1/aliases/{alias}/train")


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    with ScriptedOpenAI() as upstream:
        started = GatewayProcess(tmp_path_factory.mktemp("fuzz"), f"""
[engines.up]
base_url = "{upstream.base_url}"
[aliases.agent]
engine = "up"
[auth]
admin_key = "fuzz-admin"
[judge]
enabled = false  # scoring runs on feedback alone: no judge to wait for when the fuzzer scores groups
""").start()
        client = openai.OpenAI(base_url=f"{started.url}/v1", api_key="x", max_retries=0)
        for i in range(3):  # something to list, show, rate and delete
            client.chat.completions.create(model="agent", messages=[{"role": "user", "content": f"hi {i}"}],
                                           metadata={"run": "fuzz"})
        try:
            yield started
            if started.url in CHAT_FUZZED:  # here, not in a test of its own: xdist may run that on another worker
                check_both_kinds_answered(started)
        finally:
            started.stop()


CHAT_FUZZED: set[str] = set()  # the gateways of this worker that OpenAI's document was fuzzed against


def check_both_kinds_answered(gateway: GatewayProcess) -> None:
    """The chat fuzzer reached the route: valid requests were answered, invalid ones refused (not all one way)."""
    counts: dict[str, float] = {}
    for line in httpx.get(f"{gateway.url}/metrics").text.splitlines():
        if line.startswith("flywheel_requests_total{") and 'endpoint="chat.completions"' in line:
            status = line.split('status="')[1].split('"')[0]
            counts[status] = counts.get(status, 0) + float(line.rsplit(" ", 1)[1])
    assert counts.get("200", 0) >= 10 and counts.get("400", 0) >= 10, counts


def check_openai_error(response: Any, case: schemathesis.Case) -> None:
    """A 4xx is ``{"error": {"message", "type", "param", "code"}}``; a 400 for a JSON object names the field."""
    if not 400 <= response.status_code < 500:
        return
    body = json.loads(response.content)
    assert set(body) == {"error"}, body
    error = body["error"]
    assert {"message", "type", "param", "code"} <= set(error) and error["message"], body
    if response.status_code == 400 and isinstance(case.body, dict) and case.body:
        assert error["param"], f"a 400 for a JSON object must name the field: {body}"


@schemathesis.check
def openai_error_object(ctx: schemathesis.CheckContext, response: schemathesis.Response,
                        case: schemathesis.Case) -> bool | None:
    check_openai_error(response, case)
    return None


openai_chat = schemathesis.openapi.from_dict(json.loads(OPENAI_CHAT.read_text()))
openai_chat.config.generation.update(modes=MODES, max_examples=200)


@openai_chat.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck))
@pytest.mark.timeout(600)
def test_openai_chat_completions_document(case: schemathesis.Case, gateway: GatewayProcess) -> None:
    CHAT_FUZZED.add(gateway.url)
    case.call_and_validate(base_url=f"{gateway.url}/v1", checks=[not_a_server_error, openai_error_object],
                           timeout=60)


def gateway_openapi() -> dict[str, Any]:
    """The document ``/openapi.json`` serves, built the way the gateway builds it (the routes, not a run)."""
    return openapi_document(build_app(Settings()), STORE_ROUTERS)


gateway_document = schemathesis.openapi.from_dict(gateway_openapi()).exclude(
    func=lambda ctx: f"{ctx.operation.method.upper()} {ctx.operation.path}" in NOT_FUZZED_HERE)
gateway_document.config.generation.update(modes=MODES, max_examples=50)


@gateway_document.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck))
@pytest.mark.timeout(600)  # every operation of the document runs inside this one test
def test_gateway_document(case: schemathesis.Case, gateway: GatewayProcess) -> None:
    case.call_and_validate(base_url=gateway.url, headers=ADMIN, checks=[not_a_server_error, openai_error_object],
                           timeout=60)


def test_the_document_describes_every_body_and_query(gateway: GatewayProcess) -> None:
    """Every route that reads a body or query parameters declares them (the fuzzer can only send what is)."""
    served = httpx.get(f"{gateway.url}/openapi.json", headers=ADMIN).json()
    assert served == json.loads(json.dumps(gateway_openapi()))  # what was fuzzed is what is served
    paths = served["paths"]
    operations = {f"{method.upper()} {path}": op for path, item in paths.items() for method, op in item.items()}
    bodies = {name for name, op in operations.items() if "requestBody" in op}
    assert bodies == {
        "POST /v1/chat/completions", "POST /v1/completions", "PUT /flywheel/v1/aliases/{alias}/adapter",
        "POST /flywheel/v1/aliases/{alias}/promote", "POST /flywheel/v1/aliases/{alias}/rollback",
        "POST /flywheel/v1/aliases/{alias}/candidates", "POST /flywheel/v1/aliases/{alias}/train",
        "POST /flywheel/v1/loop/run", "POST /flywheel/v1/training/versions",
        "POST /flywheel/v1/training/rounds",
        "POST /flywheel/v1/training/failures", "POST /flywheel/v1/feedback",
        "POST /v1/chat/completions/{completion_id}", "POST /flywheel/v1/trajectories/{trajectory_id}/close"}
    queries = {name: sorted(p["name"] for p in op.get("parameters", ()) if p["in"] == "query")
               for name, op in operations.items()}
    assert queries["GET /v1/chat/completions"] == ["after", "limit", "metadata", "model", "order"]
    assert queries["GET /flywheel/v1/trajectories"] == ["after", "alias", "client_key_id", "has_reward", "limit",
                                                        "order", "since", "status", "task", "until"]
    assert queries["GET /flywheel/v1/training/batch"] == ["alias", "group_ids", "max_groups"]
    schema = operations["POST /flywheel/v1/feedback"]["requestBody"]["content"]["application/json"]["schema"]
    assert set(schema["properties"]) == {"trajectory_id", "completion_id", "reward", "label", "comment"}


@pytest.mark.parametrize("moment", ["1e308", "-1e20", "inf", "99999999999999999d", "9" * 40])
def test_found_by_fuzzing_times_no_datetime_holds_are_400(gateway: GatewayProcess, moment: str) -> None:
    response = httpx.get(f"{gateway.url}/flywheel/v1/trajectories", params={"since": moment}, headers=ADMIN)
    assert response.status_code == 400 and response.json()["error"]["param"] == "since"


def test_found_by_fuzzing_any_metadata_key_can_be_filtered_on(gateway: GatewayProcess) -> None:
    keys = {"$Å7": "1", "a.b": "2", 'q"x': "3", "/slash": "4", "b\\s": "5"}
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
    made = client.chat.completions.create(model="agent", messages=[{"role": "user", "content": "keys"}],
                                          metadata=keys)
    for key, value in keys.items():
        found = httpx.get(f"{gateway.url}/v1/chat/completions", params={f"metadata[{key}]": value}).json()
        assert [c["id"] for c in found["data"]] == [made.id], key
    every = httpx.get(f"{gateway.url}/v1/chat/completions", params={"metadata[*]": "1"})
    assert every.status_code == 400 and every.json()["error"]["param"] == "metadata[*]"


def test_found_by_fuzzing_an_exchange_capture_cannot_read_costs_itself_only() -> None:
    """A text part whose text is a number (OpenAI says string) once stopped the store process's writer task,
    leaving every later turn queued: now it is counted failed and the batch goes on."""
    def line(content: Any) -> bytes:
        return CapturedExchange(completion_id="chatcmpl-x", endpoint="chat.completions", requested_model="m",
                                alias="agent", engine_model="agent", adapter_version=0, client_key_id=None,
                                request={"model": "m", "messages": [{"role": "user", "content": content}]},
                                response={"choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}]},
                                created_at=datetime.now(UTC), latency_ms=1.0).to_line()

    outcome: Counter[str] = Counter()
    prepared = prepare_lines([line("a"), b"{not json", line([{"type": "text", "text": 7}]), line("b")], Redactor(),
                             outcome)
    assert [t.row["request_messages"][0]["content"] for t in prepared] == ["a", [{"type": "text", "text": 7}], "b"]
    assert outcome["failed"] == 1  # the unreadable line, and only it


def test_found_by_fuzzing_capture_goes_on_after_odd_content(gateway: GatewayProcess) -> None:
    odd = {"model": "agent", "messages": [{"role": "user", "content": [{"type": "text", "text": 7}]}]}
    assert httpx.post(f"{gateway.url}/v1/chat/completions", json=odd).status_code in (200, 400)
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
    made = client.chat.completions.create(model="agent", messages=[{"role": "user", "content": "after the odd one"}])
    found = httpx.get(f"{gateway.url}/v1/chat/completions/{made.id}")  # the store is caught up before it answers
    assert found.status_code == 200 and found.json()["id"] == made.id
