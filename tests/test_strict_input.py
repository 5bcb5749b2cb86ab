"""Input the gateway refuses, and input it takes, as OpenAI does: strict types, bounds, one depth limit,
nothing a client sends becomes code, a template, a path or a model the gateway loads; never a 5xx.

Three gateways: the local engine (``local_gateway``), the upstream engine relaying to it
(``relay_gateway``), and an upstream engine in front of a scripted server that shows what was forwarded.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import ADMIN_KEY, CLIENT_KEY
from tests.gateway_process import GatewayProcess
from tests.scripted_openai import ScriptedOpenAI
from tests.test_disconnect import local_engine
from tests.test_errors import assert_openai_error
from tests.waiting import wait_for

HI = [{"role": "user", "content": "hi"}]
AUTH = {"authorization": f"Bearer {CLIENT_KEY}"}


@pytest.fixture(scope="module")
def scripted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[GatewayProcess, ScriptedOpenAI]]:
    with ScriptedOpenAI() as upstream:
        gateway = GatewayProcess(tmp_path_factory.mktemp("gw"), f"""
[engines.up]
base_url = "{upstream.base_url}"
[aliases.agent]
engine = "up"
base_model = "scripted"
""", name="scripted").start()
        yield gateway, upstream
        gateway.stop()


def post(gateway: GatewayProcess, body: Any, path: str = "/v1/chat/completions", timeout: float = 60) -> httpx.Response:
    return httpx.post(gateway.url + path, json=body, headers=AUTH, timeout=timeout)


def nested(levels: int) -> Any:
    """A JSON value nesting ``levels`` arrays and objects deep."""
    value: Any = []
    for level in range(levels - 1):
        value = [value] if level % 2 else {"k": value}
    return value


# --------------------------------------------------------------------------- strict types and bounds

STRICT_CASES = [
    ({"stream": "yes"}, "stream"),
    ({"n": "2"}, "n"),
    ({"max_tokens": "10"}, "max_tokens"),
    ({"temperature": "0.5"}, "temperature"),
    ({"logprobs": "true"}, "logprobs"),
    ({"return_token_ids": 1}, "return_token_ids"),
    ({"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({"seed": 10**20}, "seed"),  # parsed as a float: JSON has no bigger integers here
    ({"seed": 2**63}, "seed"),
    ({"max_tokens": 10**20}, "max_tokens"),
    ({"top_logprobs": -1, "logprobs": True}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs
    ({"stop": ["x"] * 17}, "stop"),
    ({"stop": "x" * 257}, "stop"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {}}}, "tool_choice.function.name"),
    ({"response_format": {"type": "grammar"}}, "response_format.type"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"type": "function", "function": {"arguments": "{}"}}]}]},
     "messages[0].tool_calls[0].function.name"),
]


@pytest.mark.parametrize(("extra", "param"), STRICT_CASES, ids=[str(p) for _, p in STRICT_CASES])
def test_wrong_types_and_bounds_are_400s_on_both_engines(local_gateway: GatewayProcess,
                                                         relay_gateway: GatewayProcess,
                                                         extra: dict[str, Any], param: str) -> None:
    for gateway, model in ((local_gateway, "gpt-4o"), (relay_gateway, "relay")):
        assert_openai_error(post(gateway, {"model": model, "messages": HI, **extra}), 400, param=param)


@pytest.mark.parametrize(("extra", "param"), [
    ({"prompt": ""}, "prompt"), ({"prompt": []}, "prompt"), ({"prompt": [-1]}, "prompt[0]"),
    ({"prompt": [[1], []]}, "prompt[1]"), ({"prompt": {"text": "x"}}, "prompt"),
    ({"prompt": "x", "logprobs": True}, "logprobs"), ({"prompt": "x", "echo": "no"}, "echo")])
def test_bad_completion_requests_are_400s(local_gateway: GatewayProcess, extra: dict[str, Any], param: str) -> None:
    body = {"model": "gpt-4o", "max_tokens": 2, **extra}
    assert_openai_error(post(local_gateway, body, "/v1/completions"), 400, param=param)


def test_valid_edge_values_are_answered_on_both_engines(local_gateway: GatewayProcess,
                                                        relay_gateway: GatewayProcess) -> None:
    edges: list[dict[str, Any]] = [
        {"stop": []}, {"stop": ""}, {"seed": -(2**63)}, {"seed": 2**63 - 1}, {"temperature": 2}, {"top_p": 1},
        {"n": 2, "stream": True}, {"logprobs": True, "top_logprobs": 0}, {"tool_choice": "none"},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
    ]
    for gateway, model in ((local_gateway, "gpt-4o"), (relay_gateway, "relay")):
        for extra in edges:
            response = post(gateway, {"model": model, "messages": HI, "max_tokens": 3, **extra})
            assert response.status_code == 200, (extra, response.text)
            if extra.get("stream"):
                assert response.text.rstrip().endswith("data: [DONE]") and '"error"' not in response.text


def test_the_engine_limits_stay_400s(local_gateway: GatewayProcess, relay_gateway: GatewayProcess) -> None:
    # The local engine's own limits (context, max_batch_n), relayed with their status by the upstream engine.
    for gateway, model in ((local_gateway, "gpt-4o"), (relay_gateway, "relay")):
        assert_openai_error(post(gateway, {"model": model, "messages": HI, "max_tokens": 10**9}), 400,
                            param="max_tokens")
        assert_openai_error(post(gateway, {"model": model, "messages": HI, "n": 100}), 400, param="n")


# --------------------------------------------------------------------------- nothing a client sends is loaded

REFUSED = ["chat_template", "lora_request", "logits_processors", "guided_json", "guided_regex", "guided_grammar",
           "guided_choice", "guided_decoding_backend", "structured_outputs", "mm_processor_kwargs",
           "kv_transfer_params", "vllm_xargs"]
A_TEMPLATE = "{% for m in messages %}{{ raise_exception('the client template ran') }}{% endfor %}"


@pytest.mark.parametrize("field", REFUSED)
def test_fields_that_would_load_or_run_something_are_refused(local_gateway: GatewayProcess,
                                                             scripted: tuple[GatewayProcess, ScriptedOpenAI],
                                                             field: str) -> None:
    gateway, upstream = scripted
    value = A_TEMPLATE if field == "chat_template" else {"name": "x", "path": "/tmp/x"}
    sent = len(upstream.requests)
    assert_openai_error(post(gateway, {"model": "m", "messages": HI, field: value}), 400, param=field)
    assert len(upstream.requests) == sent  # never forwarded
    error = assert_openai_error(post(local_gateway, {"model": "gpt-4o", "messages": HI, field: value}), 400,
                                param=field)
    assert "client template" not in error["message"]


@pytest.mark.parametrize("kwargs", [{"chat_template": A_TEMPLATE}, {"tokenize": True}, {"tools": "x"},
                                    {"messages": "x"}, {"enable_thinking": {"nested": 1}}, {"not an identifier": 1}])
def test_template_kwargs_may_only_set_template_variables(local_gateway: GatewayProcess,
                                                         kwargs: dict[str, Any]) -> None:
    body = {"model": "gpt-4o", "messages": HI, "max_tokens": 2, "chat_template_kwargs": kwargs}
    error = assert_openai_error(post(local_gateway, body), 400)
    assert error["param"].startswith("chat_template_kwargs") and "client template" not in error["message"]


def test_template_variables_and_unknown_openai_parameters_pass(local_gateway: GatewayProcess,
                                                               scripted: tuple[GatewayProcess, ScriptedOpenAI]) -> None:
    body = {"messages": HI, "max_tokens": 2, "chat_template_kwargs": {"enable_thinking": False},
            "user": "u-1", "store": True, "service_tier": "auto", "parallel_tool_calls": False}
    assert post(local_gateway, {"model": "gpt-4o", **body}).status_code == 200
    gateway, upstream = scripted
    assert post(gateway, {"model": "m", **body}).status_code == 200
    forwarded = upstream.requests[-1]
    assert {k: forwarded[k] for k in ("user", "store", "service_tier", "chat_template_kwargs")} == {
        "user": "u-1", "store": True, "service_tier": "auto", "chat_template_kwargs": {"enable_thinking": False}}


# --------------------------------------------------------------------------- one depth limit at the door

def test_one_depth_limit_for_every_route(local_gateway: GatewayProcess,
                                         scripted: tuple[GatewayProcess, ScriptedOpenAI]) -> None:
    gateway, upstream = scripted
    too_deep = {"model": "m", "messages": HI, "metadata": {"deep": nested(63)}}  # 65 levels with the body's
    sent = len(upstream.requests)
    for target in (gateway, local_gateway):
        error = assert_openai_error(post(target, too_deep), 400)
        assert "64" in error["message"]
        error = assert_openai_error(post(target, {"model": "m", "prompt": "x", "extra": nested(300)},
                                         "/v1/completions"), 400)
        assert "64" in error["message"]
    assert len(upstream.requests) == sent  # refused at the door, never re-encoded for the upstream
    admin = httpx.put(f"{local_gateway.url}/flywheel/v1/aliases/agent/adapter", json={"path": nested(100)},
                      headers={"authorization": f"Bearer {ADMIN_KEY}"})
    assert "64" in assert_openai_error(admin, 400)["message"]
    feedback = post(local_gateway, {"completion_id": "x", "reward": 1, "comment": nested(100)},
                    "/flywheel/v1/feedback")  # a store-backed route, parsed in the store process
    assert "64" in assert_openai_error(feedback, 400)["message"]


def test_deep_but_allowed_bodies_are_forwarded_and_captured(scripted: tuple[GatewayProcess, ScriptedOpenAI]) -> None:
    gateway, upstream = scripted
    with httpx.Client(base_url=gateway.url, timeout=60) as client:  # one keep-alive connection throughout
        refused = client.post("/v1/chat/completions", json={"model": "m", "messages": HI, "metadata": nested(300)})
        assert_openai_error(refused, 400)
        deep = {"model": "m", "messages": HI, "tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "properties": {"x": nested(58)}}}}]}  # 64 levels
        answered = client.post("/v1/chat/completions", json=deep)
        assert answered.status_code == 200
        assert upstream.requests[-1]["tools"] == deep["tools"]
        stored = client.get(f"/v1/chat/completions/{answered.json()['id']}")  # store-backed: caught up first
        assert stored.status_code == 200 and stored.json()["choices"][0]["message"]["content"] == "ok"


# --------------------------------------------------------------------------- big inputs off the event loop

@pytest.fixture(scope="module")
def roomy_gateway(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    """The local engine with the default 8 MiB body limit."""
    gateway = GatewayProcess(tmp_path_factory.mktemp("gw"), f"""
[engines.local]
model = "{tiny_model}"
default_max_tokens = 4
[aliases.tiny]
engine = "local"
""", name="roomy").start()
    yield gateway
    gateway.stop()


def test_a_huge_prompt_does_not_stall_other_requests(roomy_gateway: GatewayProcess) -> None:
    words = " ".join(f"w{i}" for i in range(300_000))  # ~2.2 MB of distinct words: seconds of tokenizing
    huge = {"model": "tiny", "messages": [{"role": "user", "content": words}]}
    small = {"model": "tiny", "messages": HI, "max_tokens": 2}
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(post, roomy_gateway, huge, timeout=600)
        wait_for(lambda: local_engine(roomy_gateway)["active_requests"] == 1, "the huge prompt in preparation")
        assert post(roomy_gateway, small).status_code == 200
        assert local_engine(roomy_gateway)["active_requests"] == 1
        assert not pending.done()  # /healthz and a small chat were answered while the huge prompt was tokenized
        refused = pending.result()
    error = assert_openai_error(refused, 400, param="messages")
    assert "context" in error["message"]


def test_a_big_exchange_is_captured_before_the_next_read(scripted: tuple[GatewayProcess, ScriptedOpenAI]) -> None:
    gateway, upstream = scripted
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
    big = "many words " * 200_000  # 2.2 MB: parsed, validated and serialized off the event loop
    answer = client.chat.completions.create(model="m", messages=[{"role": "user", "content": big}])
    after = client.chat.completions.create(model="m", messages=HI)
    stored = client.chat.completions.messages.list(answer.id)  # read at once: the store has it already
    assert stored.data[0].content == big
    assert client.chat.completions.retrieve(after.id).choices[0].message.content == "ok"
    assert upstream.requests[-2]["messages"][0]["content"] == big
