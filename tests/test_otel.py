"""OpenTelemetry traces: a span per captured completion and per loop job, exported over OTLP/HTTP.

The collector is a small real OTLP/HTTP receiver on loopback (``POST /v1/traces``, protobuf decoded
with ``opentelemetry-proto``); the gateway is a real process talking to a scripted upstream. With the
collector down, requests still succeed and ``/metrics`` counts the spans that could not be delivered.
"""

from __future__ import annotations

import gzip
import re
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from flywheel.gateway.core.processes import free_port
from flywheel.gateway.storeproc.traced_store import unix_ns
from tests.gateway_process import GatewayProcess
from tests.scripted_openai import LoopbackServer, Reply, ScriptedOpenAI
from tests.waiting import wait_for

ADMIN = {"authorization": "Bearer admin"}
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                                 "parameters": {"type": "object",
                                                                "properties": {"city": {"type": "string"}}}}}


def any_value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [any_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


class OtlpReceiver:
    """A collector's OTLP/HTTP traces endpoint: decodes every export and keeps the spans as dicts."""

    def __init__(self) -> None:
        self.port = free_port()
        self.spans: list[dict[str, Any]] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> OtlpReceiver:
        self._server = LoopbackServer(Starlette(routes=[Route("/v1/traces", self._traces, methods=["POST"])]),
                                      self.port)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.stop()

    async def _traces(self, request: Request) -> Response:
        body = await request.body()
        if request.headers.get("content-encoding") == "gzip":
            body = gzip.decompress(body)
        assert request.headers["content-type"] == "application/x-protobuf"
        export = ExportTraceServiceRequest()
        export.ParseFromString(body)
        for resource_spans in export.resource_spans:
            resource = {a.key: any_value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    self.spans.append({"name": span.name, "kind": span.kind, "resource": resource,
                                       "start": span.start_time_unix_nano, "end": span.end_time_unix_nano,
                                       "status": span.status.code, "status_message": span.status.message,
                                       "parent": span.parent_span_id,
                                       "attributes": {a.key: any_value(a.value) for a in span.attributes}})
        return Response(ExportTraceServiceResponse().SerializeToString(), media_type="application/x-protobuf")

    def named(self, pattern: str) -> list[dict[str, Any]]:
        return [s for s in self.spans if re.fullmatch(pattern, s["name"])]


def weather_agent(body: dict[str, Any]) -> Reply:
    """Calls the weather tool first; answers once the tool's result is in the conversation."""
    if body["messages"][-1]["role"] == "tool":
        return Reply(content="It is sunny in Paris.")
    return Reply(content=None, finish_reason="tool_calls", tool_calls=[
        {"id": "call_w1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}])


@pytest.fixture
def upstream() -> Iterator[ScriptedOpenAI]:
    with ScriptedOpenAI(reply=weather_agent) as server:
        yield server


def start(tmp_path: Path, upstream: ScriptedOpenAI, telemetry: str) -> GatewayProcess:
    return GatewayProcess(tmp_path, f"""
[engines.up]
base_url = "{upstream.base_url}"
[aliases.agent]
engine = "up"
base_model = "scripted"
[auth]
admin_key = "admin"
[telemetry]
export_every_s = 0.1
{telemetry}
""").start()


def metric(gateway: GatewayProcess, name: str, **labels: str) -> float:
    text = httpx.get(f"{gateway.url}/metrics", timeout=10).text
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith(f"{name}{{") and ",".join(sorted(line[line.index("{") + 1:line.index("}")]
                                                             .split(","))) == wanted:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name}{{{wanted}}} not in /metrics:\n{text}")


def test_each_completion_and_job_run_becomes_a_genai_span(tmp_path: Path, upstream: ScriptedOpenAI,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    with OtlpReceiver() as collector:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", collector.url)  # the standard variable turns it on
        monkeypatch.setenv("OTEL_SERVICE_NAME", "agent-gateway")
        gateway = start(tmp_path, upstream, "")
        client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
        messages: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
        first = client.chat.completions.create(model="gpt-4o", messages=messages, tools=[WEATHER_TOOL],
                                               temperature=0.5, max_tokens=64)
        call = first.choices[0].message.tool_calls[0]  # type: ignore[index]
        messages += [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "sunny, 24 C"}]
        second = client.chat.completions.create(model="gpt-4o", messages=messages, tools=[WEATHER_TOOL])
        spans = wait_for(lambda: len(collector.named("chat gpt-4o")) >= 2 and collector.named("chat gpt-4o"),
                         what="two completion spans")
        by_id = {s["attributes"]["gen_ai.response.id"]: s for s in spans}
        tool_span, answer_span = by_id[first.id], by_id[second.id]
        listed = httpx.get(f"{gateway.url}/flywheel/v1/trajectories", headers=ADMIN, timeout=10).json()["data"]
        assert len(listed) == 1  # one conversation: both turns linked into it
        trajectory = httpx.get(f"{gateway.url}/flywheel/v1/trajectories/{listed[0]['id']}", headers=ADMIN,
                               timeout=10).json()
        turns = {t["completion_id"]: t for t in trajectory["turns"]}
        for span, completion in ((tool_span, first), (answer_span, second)):
            attributes, turn = span["attributes"], turns[completion.id]
            assert attributes["gen_ai.operation.name"] == "chat"
            assert attributes["gen_ai.request.model"] == "gpt-4o"
            assert attributes["gen_ai.response.model"] == "scripted"  # the engine's name for what served it
            assert attributes["gen_ai.usage.input_tokens"] == 5 and attributes["gen_ai.usage.output_tokens"] == 3
            assert attributes["gen_ai.conversation.id"] == trajectory["id"] == attributes["session.id"]
            assert attributes["flywheel.alias"] == "agent" and attributes["flywheel.turn_ids"] == [turn["id"]]
            assert span["kind"] == 3 and span["parent"] == b""  # SPAN_KIND_CLIENT, a root span
            assert span["resource"]["service.name"] == "agent-gateway"
            start_ns = unix_ns(datetime.fromisoformat(turn["created_at"]))
            assert span["start"] == start_ns  # the request's arrival, as captured
            assert abs((span["end"] - span["start"]) - turn["latency_ms"] * 1e6) < 1_000  # its latency, to the µs
            assert "gen_ai.input.messages" not in attributes  # content is opt-in
        assert tool_span["attributes"]["gen_ai.response.finish_reasons"] == ["tool_calls"]
        assert answer_span["attributes"]["gen_ai.response.finish_reasons"] == ["stop"]
        assert tool_span["attributes"]["gen_ai.request.temperature"] == 0.5
        assert tool_span["attributes"]["gen_ai.request.max_tokens"] == 64
        # A loop job run is a span of the gateway process.
        ran = httpx.post(f"{gateway.url}/flywheel/v1/loop/run", headers=ADMIN, timeout=30,
                         json={"job": "form_groups"}).json()
        (job,) = wait_for(lambda: [s for s in collector.named("loop form_groups")
                                   if s["attributes"]["flywheel.job.status"] == ran["status"]], what="the job span")
        assert job["attributes"]["flywheel.job"] == "form_groups" and job["kind"] == 1  # INTERNAL
        assert job["resource"]["flywheel.process"] == "gateway" and tool_span["resource"]["flywheel.process"] == "store"
        assert job["end"] >= job["start"]
        wait_for(lambda: metric(gateway, "flywheel_telemetry_spans_exported_total", process="store") >= 2,
                 what="the store's exported spans in /metrics")
        assert metric(gateway, "flywheel_telemetry_spans_exported_total", process="gateway") >= 1
        assert metric(gateway, "flywheel_telemetry_spans_dropped_total", process="store", reason="export_failed") == 0
        gateway.stop()


def test_content_is_exported_only_when_asked_and_redacted(tmp_path: Path, upstream: ScriptedOpenAI) -> None:
    with OtlpReceiver() as collector:
        gateway = start(tmp_path, upstream, f'endpoint = "{collector.url}"\ncapture_content = true')
        client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
        client.chat.completions.create(model="agent", tools=[WEATHER_TOOL], messages=[
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Weather where alice@example.com lives?"}])
        (span,) = wait_for(lambda: collector.named("chat agent"), what="the completion span")
        attributes = span["attributes"]
        sent = attributes["gen_ai.input.messages"]
        assert '"role": "system"' in sent and "You are terse." in sent
        assert "alice@example.com" not in sent and "REDACTED" in sent  # the stored, redacted text
        assert '"type": "tool_call"' in attributes["gen_ai.output.messages"]
        assert '"get_weather"' in attributes["gen_ai.output.messages"]
        assert "get_weather" in attributes["gen_ai.tool.definitions"]
        gateway.stop()


def test_a_collector_that_is_down_costs_spans_never_requests(tmp_path: Path, upstream: ScriptedOpenAI) -> None:
    nobody = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    gateway = start(tmp_path, upstream, f'endpoint = "{nobody}"\ntimeout_s = 0.3\nqueue_size = 4\nbatch_size = 2')
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
    for n in range(12):
        reply = client.chat.completions.create(model="agent", messages=[{"role": "user", "content": f"q {n}"}])
        assert reply.choices[0].finish_reason == "tool_calls"  # answered as if nothing were wrong
    listed = httpx.get(f"{gateway.url}/flywheel/v1/trajectories", headers=ADMIN, timeout=10).json()["data"]
    assert len(listed) == 12  # capture is unaffected

    def dropped() -> float:
        return sum(metric(gateway, "flywheel_telemetry_spans_dropped_total", process="store", reason=reason)
                   for reason in ("queue_full", "export_failed"))

    wait_for(lambda: dropped() >= 1, what="dropped spans in /metrics")
    assert metric(gateway, "flywheel_telemetry_spans_exported_total", process="store") == 0
    wait_for(lambda: dropped() >= 12, what="every completion span counted as dropped")
    assert httpx.get(f"{gateway.url}/healthz", timeout=10).status_code == 200
    gateway.stop()
