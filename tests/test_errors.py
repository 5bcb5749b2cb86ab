"""Every error the API reports has OpenAI's shape and a fitting status (one helper checks them all)."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from tests.conftest import ADMIN_KEY, CLIENT_KEY, MAX_BODY
from tests.gateway_process import GatewayProcess

HI = [{"role": "user", "content": "hi"}]


def assert_openai_error(response: httpx.Response, status: int, *, param: str | None = None,
                        code: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param
        assert param in error["message"]  # the message names the field too
    if code is not None:
        assert error["code"] == code
    return error


@pytest.fixture(scope="module")
def post(local_gateway: GatewayProcess) -> Any:
    def send(body: Any, *, key: str | None = CLIENT_KEY, path: str = "/v1/chat/completions",
             raw: bytes | None = None) -> httpx.Response:
        headers = {"content-type": "application/json"}
        if key is not None:
            headers["authorization"] = f"Bearer {key}"
        return httpx.post(local_gateway.url + path, json=None if raw is not None else body, content=raw,
                          headers=headers, timeout=60)
    return send


@pytest.mark.parametrize(("body", "param"), [
    ({"model": "gpt-4o"}, "messages"),
    ({"model": "gpt-4o", "messages": []}, "messages"),
    ({"model": "gpt-4o", "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"model": "gpt-4o", "messages": HI, "temperature": 7}, "temperature"),
    ({"model": "gpt-4o", "messages": HI, "n": 0}, "n"),
    ({"model": "gpt-4o", "messages": HI, "max_tokens": -1}, "max_tokens"),
    ({"model": "gpt-4o", "messages": HI, "top_logprobs": 50}, "top_logprobs"),
    ({"model": "gpt-4o", "messages": HI, "tools": [{"type": "function"}]}, "tools[0].function"),
    ({"messages": HI}, "model"),
])
def test_bad_parameters_are_400_naming_the_field(post: Any, body: dict[str, Any], param: str) -> None:
    assert_openai_error(post(body), 400, param=param)


def test_unsupported_response_format_is_400(post: Any) -> None:
    body = {"model": "gpt-4o", "messages": HI, "response_format": {"type": "json_object"}}
    assert_openai_error(post(body), 400, param="response_format")


def test_body_that_is_not_json_is_400(post: Any) -> None:
    error = assert_openai_error(post(None, raw=b"{not json"), 400)
    assert "JSON" in error["message"]


def test_missing_and_wrong_keys_are_401(post: Any) -> None:
    assert_openai_error(post({"model": "gpt-4o", "messages": HI}, key=None), 401, code="invalid_api_key")
    error = assert_openai_error(post({"model": "gpt-4o", "messages": HI}, key="sk-wrong"), 401)
    assert "sk-wrong" not in error["message"]  # keys are never echoed


def test_admin_api_needs_the_admin_key(local_gateway: GatewayProcess) -> None:
    url = f"{local_gateway.url}/flywheel/v1/aliases"
    assert_openai_error(httpx.get(url, headers={"authorization": f"Bearer {CLIENT_KEY}"}), 401)
    ok = httpx.get(url, headers={"authorization": f"Bearer {ADMIN_KEY}"})
    assert ok.status_code == 200 and ok.json()["data"][0]["alias"] == "agent"


def test_unknown_model_is_404(post: Any, local_gateway: GatewayProcess) -> None:
    assert_openai_error(post({"model": "claude-3", "messages": HI}), 404, param="model", code="model_not_found")
    client = openai.OpenAI(base_url=f"{local_gateway.url}/v1", api_key=CLIENT_KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="claude-3", messages=HI)  # type: ignore[arg-type]


def test_unknown_path_is_404_in_openai_shape(local_gateway: GatewayProcess) -> None:
    assert_openai_error(httpx.get(f"{local_gateway.url}/v1/nothing-here"), 404)


def test_body_too_large_is_413(post: Any) -> None:
    big = {"model": "gpt-4o", "messages": [{"role": "user", "content": "x" * (MAX_BODY + 10)}]}
    assert_openai_error(post(big), 413)


def test_bad_adapter_path_is_400(local_gateway: GatewayProcess, tmp_path: Any) -> None:
    response = httpx.put(f"{local_gateway.url}/flywheel/v1/aliases/agent/adapter", json={"path": str(tmp_path)},
                         headers={"authorization": f"Bearer {ADMIN_KEY}"})
    assert_openai_error(response, 400, param="path")


def test_upstream_failures_are_502_and_504(relay_gateway: GatewayProcess) -> None:
    down = httpx.post(f"{relay_gateway.url}/v1/chat/completions", json={"model": "down", "messages": HI}, timeout=30)
    assert_openai_error(down, 502)
    slow = httpx.post(f"{relay_gateway.url}/v1/chat/completions",
                      json={"model": "impatient", "messages": HI, "max_tokens": 1500, "ignore_eos": True},
                      timeout=30)
    assert_openai_error(slow, 504, code="timeout")
