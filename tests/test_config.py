"""Configuration: TOML + environment, routing, and the CLI's one-line errors on bad input."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from gateway.config import LocalEngineConfig, OpenAIEngineConfig, load_settings

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


@pytest.mark.parametrize(("content", "expected"), [
    ("port = 'abc'\n", "invalid configuration: port"),
    ("this is not toml", "invalid configuration"),
    ("unknown_key = 1\n", "unknown_key"),
])
def test_cli_reports_bad_config_in_one_line(tmp_path: Path, content: str, expected: str) -> None:
    config = tmp_path / "bad.toml"
    config.write_text(content)
    result = subprocess.run([sys.executable, "-m", "gateway", "serve", "--config", str(config)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0]


def test_cli_reports_missing_config_file(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "gateway", "serve", "--config", str(tmp_path / "none.toml")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "config file not found" in result.stderr
