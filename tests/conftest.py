"""Session fixtures: tiny models built once, real gateways on loopback ports.

``agent_model`` is the tiny model taught (in seconds, by a short supervised run) to
answer a weather question with a Hermes tool call and the tool's result with a
sentence, so tool-call round trips are tested on text a model really generated.
``adapter_dir`` is a LoRA adapter taught a different answer than the base model.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from flywheel.capture.store import Store
from tests.gateway_process import GatewayProcess
from tests.postgres import postgres, postgres_url  # noqa: F401  (fixtures)
from tests.vllm_standin import vllm  # noqa: F401  (fixture)

CLIENT_KEY = "sk-test-client-key"
ADMIN_KEY = "test-admin-key"
MAX_BODY = 64 * 1024

WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Current weather for a city.",
                 "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                "required": ["city"]}},
}
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER_CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER_ANSWER = "It is sunny in Paris."
ADAPTER_QUESTION = [{"role": "user", "content": "Who are you?"}]
ADAPTER_ANSWER = "I am the adapter."


def weather_followup(call_id: str) -> list[dict[str, Any]]:
    """The conversation after the model called the tool and the tool answered."""
    return [*WEATHER_QUESTION,
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": call_id, "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": call_id, "content": '{"sky": "sunny"}'}]


BACKENDS = ["duckdb", "postgresql"]


@pytest.fixture(params=BACKENDS)
def database(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A new store's location on each backend: a DuckDB file (the default) and a database on the session's
    PostgreSQL server (tests/postgres.py)."""
    if request.param == "duckdb":
        return str(tmp_path / "s.duckdb")
    url: str = request.getfixturevalue("postgres_url")
    return url


@pytest.fixture
def store(database: str) -> Iterator[Store]:
    """An open store on each backend (``database``)."""
    opened = Store(database)
    yield opened
    opened.close()


@pytest.fixture(autouse=True)
def _stop_gateways_a_test_left_running() -> Iterator[None]:
    """Gateways a test started and did not stop (an assertion failed first) are stopped after it."""
    before = set(GatewayProcess.running)  # session and module gateways are already up: they stay
    yield
    for gateway in GatewayProcess.running - before:
        gateway.stop()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from flywheel.trainer.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny", seed=0)


@pytest.fixture(scope="session")
def agent_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.support import memorize

    examples = [(WEATHER_QUESTION, WEATHER_CALL_TEXT), (weather_followup("call_0"), WEATHER_ANSWER)]
    return memorize(tiny_model, tmp_path_factory.mktemp("models") / "agent", examples, tools=[WEATHER_TOOL])


@pytest.fixture(scope="session")
def adapter_dir(agent_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.support import memorize

    return memorize(agent_model, tmp_path_factory.mktemp("adapters") / "who", [(ADAPTER_QUESTION, ADAPTER_ANSWER)],
                    lora=True)


@pytest.fixture(scope="session")
def local_gateway(agent_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    """Local engine on ``agent_model``: keys on, glob routes, no default route, a small body limit."""
    gateway = GatewayProcess(tmp_path_factory.mktemp("gw"), f"""
max_body_bytes = {MAX_BODY}
adapter_dirs = ["{tmp_path_factory.getbasetemp()}"]  # the session's adapters are built in temporary directories
[engines.local]
model = "{agent_model}"
default_max_tokens = 16
[aliases.agent]
engine = "local"
[routing]
routes = {{ "gpt-4o" = "agent", "gpt-4*" = "agent" }}
default = ""
[auth]
api_keys = ["{CLIENT_KEY}"]
admin_key = "{ADMIN_KEY}"
""", name="local").start()
    yield gateway
    gateway.stop()


@pytest.fixture(scope="session")
def relay_gateway(local_gateway: GatewayProcess, tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[GatewayProcess]:
    """Upstream engine pointed at ``local_gateway``; plus an impatient engine and one whose upstream is down."""
    from flywheel.gateway.core.processes import free_port

    upstream = f"{local_gateway.url}/v1"
    gateway = GatewayProcess(tmp_path_factory.mktemp("gw"), f"""
[engines.upstream]
base_url = "{upstream}"
api_key = "{CLIENT_KEY}"
[engines.impatient]
base_url = "{upstream}"
api_key = "{CLIENT_KEY}"
timeout_s = 0.3
[engines.down]
base_url = "http://127.0.0.1:{free_port()}/v1"
connect_timeout_s = 1
[aliases.relay]
engine = "upstream"
base_model = "agent"
[aliases.impatient]
engine = "impatient"
base_model = "agent"
[aliases.down]
engine = "down"
base_model = "agent"
""", name="relay").start()
    yield gateway
    gateway.stop()
