"""Configuration: TOML + environment, routing, validation of every setting, and the CLI's one-line errors."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from flywheel.gateway.cli.demo import SMALL_MODEL_CONFIG
from flywheel.gateway.core.config import LocalEngineConfig, OpenAIEngineConfig, SettingsError, load_settings
from flywheel.gateway.core.processes import free_port
from tests.gateway_process import GatewayProcess
from tests.scripted_openai import LoopbackServer, ScriptedOpenAI

EXAMPLE = Path(__file__).parent.parent / "deploy" / "flywheel.example.toml"


def test_embedded_defaults_serve_the_tiny_model_under_one_alias() -> None:
    settings = load_settings()
    assert isinstance(settings.engines["local"], LocalEngineConfig)
    assert settings.engines["local"].model == "tiny"
    assert settings.routing.resolve("gpt-4o", settings.aliases) == "flywheel"
    assert settings.routing.resolve("anything", settings.aliases) == "flywheel"


def test_example_config_loads_and_routes() -> None:
    settings = load_settings(EXAMPLE)
    assert settings.routing.resolve("gpt-4o-mini", settings.aliases) == "flywheel"
    assert settings.routing.resolve("claude-3-opus", settings.aliases) == "flywheel"


def test_routes_exact_glob_then_default(tmp_path: Path) -> None:
    config = tmp_path / "f.toml"
    config.write_text("""
[engines.vllm]
base_url = "http://127.0.0.1:9/v1"
[aliases.a]
engine = "vllm"
[aliases.b]
engine = "vllm"
[routing]
routes = { "gpt-4o" = "b", "gpt-*" = "a" }
default = "b"
""")
    settings = load_settings(config)
    assert isinstance(settings.engines["vllm"], OpenAIEngineConfig)  # kind inferred from base_url
    resolve = settings.routing.resolve
    assert [resolve(n, settings.aliases) for n in ("a", "gpt-4o", "gpt-3.5", "other")] == ["a", "b", "a", "b"]


def test_environment_beats_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLYWHEEL_PORT", "9123")
    monkeypatch.setenv("FLYWHEEL_AUTH__ADMIN_KEY", "from-env")
    settings = load_settings(EXAMPLE)
    assert settings.port == 9123
    assert settings.auth.admin_key is not None and settings.auth.admin_key.get_secret_value() == "from-env"
    assert "from-env" not in repr(settings)  # secrets stay out of logs


def test_route_to_unknown_alias_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "f.toml"
    config.write_text('[routing]\nroutes = { "gpt-4o" = "missing" }\n')
    with pytest.raises(ValidationError, match="missing"):
        load_settings(config)


def test_config_files_layer_key_by_key_and_the_environment_beats_them(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    base, mine = tmp_path / "base.toml", tmp_path / "mine.toml"
    base.write_text("[loop.gate]\ncontexts = 24\nmin_contexts = 12\n[loop.canary]\nmax_pairs = 200\n"
                    "[train.args]\nlearning_rate = 3e-3\nlora_r = 16\n")
    mine.write_text('[loop.gate]\nreward_hook = "examples.demo.task:turn_reward"\nmin_contexts = 4\n'
                    "[train.args]\nlearning_rate = 2e-5\n")
    monkeypatch.setenv("FLYWHEEL_LOOP__CANARY__MAX_PAIRS", "50")
    settings = load_settings([base, mine])
    gate = settings.loop.gate
    assert (gate.contexts, gate.min_contexts, gate.reward_hook) == (24, 4, "examples.demo.task:turn_reward")
    assert settings.train.args == {"learning_rate": 2e-5, "lora_r": 16}
    assert settings.loop.canary.max_pairs == 50
    assert load_settings([mine, base]).train.args["learning_rate"] == 3e-3  # the last file wins


def test_the_small_model_configuration_names_no_task() -> None:
    settings = load_settings(SMALL_MODEL_CONFIG)
    assert settings.loop.canary.on_max == "reject" and settings.loop.gate.reward_hook is None
    assert not settings.train.tiny_defaults and settings.train.args["learning_rate"] > 0
    assert settings.engines == load_settings().engines  # what to serve comes from the layer above it


@pytest.mark.parametrize(("content", "expected"), [
    ("port = 'abc'\n", "invalid configuration: port"),
    ("this is not toml", "invalid configuration"),
    ("unknown_key = 1\n", "unknown_key"),
    ('[judge]\nreward_hook = "no_colon"\n', "judge.reward_hook 'no_colon': expected module:function"),
])
def test_cli_reports_bad_config_in_one_line(tmp_path: Path, content: str, expected: str) -> None:
    config = tmp_path / "bad.toml"
    config.write_text(content)
    result = subprocess.run([sys.executable, "-m", "flywheel.gateway", "serve", "--config", str(config)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0]


def test_cli_reports_missing_config_file(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "flywheel.gateway",
                             "serve", "--config", str(tmp_path / "none.toml")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "config file not found" in result.stderr


def one_line_error(args: list[str], env: dict[str, str] | None = None) -> str:
    """Run ``python -m flywheel.gateway ARGS``; it must fail with exactly one ``error: ...`` line. Returns that line."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    result = subprocess.run([sys.executable, "-m", "flywheel.gateway",
                             *args], capture_output=True, text=True, timeout=120,
                            env={**clean, **(env or {})})
    lines = result.stderr.strip().splitlines()
    assert result.returncode != 0 and len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def serve_error(tmp_path: Path, config: str, *args: str, env: dict[str, str] | None = None) -> str:
    file = tmp_path / "flywheel.toml"
    file.write_text(f'data_dir = "{tmp_path / "data"}"\n{config}')
    return one_line_error(["serve", "--config", str(file), "--port", str(free_port()), *args], env)


@pytest.mark.parametrize(("content", "expected"), [
    ("port = 99999\n", "port: Input should be less than or equal to 65535"),
    ("log_level = 'loud'\n", "log_level"),
    ("[capture.redaction]\npatterns = ['(unclosed']\n", "patterns[0] is not a valid regular expression"),
    ("[capture.redaction]\npatterns = ['x*']\n", "matches the empty string"),
    ("[engines.up]\nbase_url = 'localhost:8001'\n[aliases.a]\nengine = 'up'\n", "base_url"),
    ("[aliases.'../evil']\nengine = 'local'\n", "aliases"),
    ("[auth]\napi_keys = ['same']\nadmin_key = 'same'\n", "admin_key is also a client key"),
    ("[groups]\nmin_size = 5\nmax_size = 3\n", "min_size (5) is larger than groups.max_size (3)"),
    ("[judge]\ntimeout_s = 0\n", "judge.timeout_s"),
    ("[loop.canary]\nmin_gain = 1.5\n", "min_gain (1.5) must be below the reward range (1.0)"),
])
def test_every_setting_is_validated_when_read(tmp_path: Path, content: str, expected: str) -> None:
    config = tmp_path / "bad.toml"
    config.write_text(content)
    with pytest.raises(ValidationError) as failure:
        load_settings(config)
    errors = failure.value.errors()
    assert expected in " ".join(".".join(map(str, e["loc"])) + ": " + e["msg"] for e in errors)


def test_a_misspelled_variable_is_an_error_naming_the_close_match(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLYWHEEL_AUTH__ADMINKEY", "s3cret")
    monkeypatch.setenv("FLYWHEEL_ENGINES__UP__BASEURL", "http://127.0.0.1:9/v1")
    with pytest.raises(SettingsError) as failure:
        load_settings()
    message = str(failure.value)
    assert "FLYWHEEL_AUTH__ADMINKEY is not a setting (did you mean FLYWHEEL_AUTH__ADMIN_KEY?)" in message
    assert "FLYWHEEL_ENGINES__UP__BASEURL is not a setting (did you mean FLYWHEEL_ENGINES__<NAME>__BASE_URL?)" \
        in message
    assert "s3cret" not in message


def test_every_variable_that_names_a_setting_is_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {"FLYWHEEL_PORT": "9001", "FLYWHEEL_CAPTURE__REDACTION__BUILTIN": "false",
                        "FLYWHEEL_TRAIN__ARGS__LEARNING_RATE": "0.5", "FLYWHEEL_LOOP__CANARY__FRACTION": "0.2",
                        "FLYWHEEL_ADMIN_KEY": "for-the-cli"}.items():
        monkeypatch.setenv(name, value)
    settings = load_settings()
    assert (settings.port, settings.capture.redaction.builtin, settings.loop.canary.fraction) == (9001, False, 0.2)
    assert settings.train.args == {"learning_rate": 0.5}


def test_the_client_key_flywheel_autorl_reads_is_no_unknown_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """FLYWHEEL_API_KEY is `flywheel autorl --api-key`'s default (and the examples'): the commands that load the
    configuration beside it must not refuse it."""
    monkeypatch.setenv("FLYWHEEL_API_KEY", "client-key")
    assert load_settings().auth.api_keys == []


def test_an_engine_set_by_environment_joins_the_default_table(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLYWHEEL_ENGINES__UP__BASE_URL", "http://127.0.0.1:9/v1")
    settings = load_settings()
    assert set(settings.engines) == {"local", "up"} and settings.aliases["flywheel"].engine == "local"
    monkeypatch.setenv("FLYWHEEL_ALIASES__FLYWHEEL__ENGINE", "up")  # now nobody uses the default local engine
    settings = load_settings()
    assert set(settings.engines) == {"up"} and isinstance(settings.engines["up"], OpenAIEngineConfig)


def test_environment_changes_an_entry_of_the_files_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLYWHEEL_ENGINES__LOCAL__DEFAULT_MAX_TOKENS", "7")
    settings = load_settings(EXAMPLE)
    local = settings.engines["local"]
    assert isinstance(local, LocalEngineConfig) and (local.model, local.default_max_tokens) == ("tiny", 7)
    assert set(settings.engines) == {"local"} and set(settings.aliases) == {"flywheel"}


def test_every_key_the_example_shows_commented_out_is_a_setting(tmp_path: Path) -> None:
    """deploy/flywheel.example.toml stays true: with its commented-out keys switched on it still loads."""
    switched_on = re.sub(r"(?m)^# ?(\[[\w.]+\]|[a-z_]+ = .*)$", r"\1", EXAMPLE.read_text())
    config = tmp_path / "all.toml"
    config.write_text(switched_on)
    settings = load_settings(config)
    assert settings.auth.admin_key is not None and settings.loop.gate.reward_hook == "my_task.checks:reward"
    assert isinstance(settings.engines["vllm"], OpenAIEngineConfig)


@pytest.mark.parametrize(("config", "expected"), [
    ('[engines.local]\nmodel = "/no/such/model"\n', "engines.local.model: no model directory at /no/such/model"),
    ('[aliases.flywheel]\nadapter = "/no/such/adapter"\n', "aliases.flywheel.adapter: no PEFT adapter"),
    ('host = "0.0.0.0"\n', "--allow-unauthenticated"),
])
def test_serve_checks_what_needs_the_file_system_first(tmp_path: Path, config: str, expected: str) -> None:
    assert expected in serve_error(tmp_path, config)


def test_an_unwritable_data_directory_is_one_line(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    file = tmp_path / "flywheel.toml"
    file.write_text(f'data_dir = "{blocker / "data"}"\n')
    line = one_line_error(["serve", "--config", str(file), "--port", str(free_port())])
    assert f"data_dir: cannot write to {blocker / 'data'}" in line


def test_a_port_in_use_is_one_line(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        file = tmp_path / "flywheel.toml"
        file.write_text(f'data_dir = "{tmp_path / "data"}"\n')
        line = one_line_error(["serve", "--config", str(file), "--port", str(port)])
    assert f"cannot listen on 127.0.0.1:{port}" in line


def test_misspelled_variable_stops_serve(tmp_path: Path) -> None:
    line = serve_error(tmp_path, "", env={"FLYWHEEL_ADMINKEY": "s3cret"})
    assert "FLYWHEEL_ADMINKEY is not a setting (did you mean FLYWHEEL_ADMIN_KEY?)" in line and "s3cret" not in line


def test_the_cli_admin_key_variable_must_agree_with_the_configured_one(tmp_path: Path) -> None:
    line = serve_error(tmp_path, '[auth]\nadmin_key = "one"\n', env={"FLYWHEEL_ADMIN_KEY": "two"})
    assert "FLYWHEEL_ADMIN_KEY (the key the CLI sends) differs from auth.admin_key" in line
    assert "one" not in line.split("differs")[0] and "two" not in line


def test_the_cli_admin_key_variable_protects_the_admin_api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """FLYWHEEL_ADMIN_KEY is what `flywheel status` sends; a server started in the same shell requires it."""
    import httpx

    monkeypatch.setenv("FLYWHEEL_ADMIN_KEY", "cli-key")
    with ScriptedOpenAI() as upstream:
        gateway = GatewayProcess(tmp_path, f'[engines.up]\nbase_url = "{upstream.base_url}"\n'
                                           '[aliases.agent]\nengine = "up"\n').start()
        try:
            refused = httpx.get(f"{gateway.url}/flywheel/v1/aliases")  # loopback, but a key is configured now
            admitted = httpx.get(f"{gateway.url}/flywheel/v1/aliases", headers={"authorization": "Bearer cli-key"})
        finally:
            gateway.stop()
    assert refused.status_code == 401 and admitted.status_code == 200
    assert admitted.json()["data"][0]["base_model"] == "scripted"  # the upstream's only model


@pytest.fixture
def two_model_upstream() -> Iterator[str]:
    async def models(request: Request) -> Response:
        body = {"object": "list", "data": [{"id": "a", "object": "model"}, {"id": "b", "object": "model"}]}
        return Response(orjson.dumps(body), media_type="application/json")

    port = free_port()
    server = LoopbackServer(Starlette(routes=[Route("/v1/models", models)]), port)
    yield f"http://127.0.0.1:{port}/v1"
    server.stop()


def test_an_upstream_alias_without_base_model_needs_an_upstream_with_one_model(tmp_path: Path,
                                                                              two_model_upstream: str) -> None:
    line = serve_error(tmp_path, f'[engines.up]\nbase_url = "{two_model_upstream}"\n[aliases.agent]\nengine = "up"\n')
    assert "aliases.agent.base_model is not set and" in line and "lists 2 models (a, b)" in line
    down = f"http://127.0.0.1:{free_port()}/v1"
    line = serve_error(tmp_path, f'[engines.up]\nbase_url = "{down}"\n[aliases.agent]\nengine = "up"\n')
    assert f"aliases.agent.base_model is not set and {down}/models did not list its models" in line


def test_cli_failures_are_one_line(tmp_path: Path) -> None:
    from flywheel.capture.store import Store

    Store(tmp_path / "store.duckdb").close()
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    line = one_line_error(["trajectories", "export", "--database", str(tmp_path / "store.duckdb"),
                           "--out", str(blocker / "out.jsonl")])
    assert str(blocker) in line
    assert "greater than or equal to 0" in one_line_error(["promote", "--", "-1"])
    assert "No such command" in one_line_error(["no-such-command"])
