"""Secure defaults: an exposed gateway needs keys, the OpenAPI document needs the admin key, adapters load only
from allowed directories, and a version is a non-negative integer wherever one is taken.

The engine is the vLLM stand-in (``tests/vllm_standin.py``): it records the path of every adapter the
gateway asks it to load, so a test sees exactly what would have been loaded.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.gateway_process import GatewayProcess
from tests.test_loop_versions import fake_adapter
from tests.vllm_standin import BASE, VllmStandIn

ADMIN = {"authorization": "Bearer admin-key"}


@pytest.fixture(scope="module")
def vllm() -> Iterator[VllmStandIn]:
    with VllmStandIn() as server:
        yield server


@pytest.fixture(scope="module")
def exposed(vllm: VllmStandIn, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    """Listening on every interface, which the admin key allows; ``allowed/`` is an extra adapter directory."""
    root = tmp_path_factory.mktemp("secure")
    gateway = GatewayProcess(root, f"""
host = "0.0.0.0"
adapter_dirs = ["{root / 'allowed'}"]
[engines.vllm]
base_url = "{vllm.base_url}"
[aliases.agent]
engine = "vllm"
base_model = "{BASE}"
[auth]
admin_key = "admin-key"
""").start()
    yield gateway
    gateway.stop()


def put_adapter(gateway: GatewayProcess, body: dict[str, Any]) -> httpx.Response:
    return httpx.put(f"{gateway.url}/flywheel/v1/aliases/agent/adapter", json=body, headers=ADMIN, timeout=60)


def assert_bad_param(response: httpx.Response, param: str) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    return str(error["message"])


def test_the_openapi_document_needs_the_admin_key_when_one_is_set(exposed: GatewayProcess) -> None:
    refused = httpx.get(f"{exposed.url}/openapi.json")
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    document = httpx.get(f"{exposed.url}/openapi.json", headers=ADMIN).json()
    assert "/v1/chat/completions" in document["paths"] and "/flywheel/v1/feedback" in document["paths"]


def test_an_open_server_must_be_asked_for_and_then_shows_its_document(tmp_path: Path, vllm: VllmStandIn) -> None:
    gateway = GatewayProcess(tmp_path, f"""
host = "0.0.0.0"
[engines.vllm]
base_url = "{vllm.base_url}"
[aliases.agent]
engine = "vllm"
[auth]
allow_unauthenticated = true
""").start()
    try:
        assert httpx.get(f"{gateway.url}/openapi.json").status_code == 200  # no admin key: nothing to hide it behind
        assert httpx.get(f"{gateway.url}/flywheel/v1/aliases").json()["data"][0]["base_model"] == BASE
    finally:
        gateway.stop()


def test_adapters_load_from_the_adapters_directory_and_the_allowed_ones(exposed: GatewayProcess,
                                                                        vllm: VllmStandIn) -> None:
    data = exposed.dir / "data"
    own = fake_adapter(data / "adapters" / "imported", "a")
    allowed = fake_adapter(exposed.dir.parent / "allowed", "b")
    for path in (own, allowed):
        switched = put_adapter(exposed, {"path": path})
        assert switched.status_code == 200, switched.text
        assert vllm.loras[switched.json()["adapter"]] == path
    assert put_adapter(exposed, {"path": None}).json()["version"] == 0


def test_adapters_elsewhere_are_refused_however_the_path_is_spelled(exposed: GatewayProcess,
                                                                    vllm: VllmStandIn) -> None:
    outside = fake_adapter(exposed.dir, "outside")
    adapters = exposed.dir / "data" / "adapters"
    adapters.mkdir(parents=True, exist_ok=True)
    (adapters / "link").symlink_to(outside)  # inside by name, outside once resolved
    loaded = dict(vllm.loras)
    for path in (outside, str(adapters / ".." / ".." / "outside"), str(adapters / "link"), "/etc"):
        message = assert_bad_param(put_adapter(exposed, {"path": path}), "path")
        assert "outside the directories adapters are loaded from" in message
        candidate = httpx.post(f"{exposed.url}/flywheel/v1/aliases/agent/candidates", json={"path": path},
                               headers=ADMIN, timeout=60)
        assert_bad_param(candidate, "path")
    assert vllm.loras == loaded  # nothing was loaded


@pytest.mark.parametrize("version", [-1, True, 1.5, "1", 2**31, 10**30])
def test_a_version_is_a_non_negative_integer_everywhere(exposed: GatewayProcess, version: Any) -> None:
    assert_bad_param(put_adapter(exposed, {"version": version}), "version")
    for route in ("promote", "rollback"):
        response = httpx.post(f"{exposed.url}/flywheel/v1/aliases/agent/{route}", json={"version": version},
                              headers=ADMIN, timeout=60)
        assert_bad_param(response, "version")
