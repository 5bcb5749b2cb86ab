"""What ``flywheel serve`` checks before it starts: each failure is one line saying what to change.

The settings are valid by the time they get here (``gateway/core/config.py``); these checks need the
file system, the network or the process environment:

- exposure: a host other than loopback with neither client keys nor an admin key is refused
  unless ``auth.allow_unauthenticated`` (or ``--allow-unauthenticated``) says it is meant;
- ``FLYWHEEL_ADMIN_KEY``, the key the CLI sends, becomes the admin key when none is configured
  (one variable for the server and its CLI) and must equal it when one is;
- the data directory (and the store's and spool's directories) can be written;
- the port can be bound;
- every local engine's model and every configured adapter exists;
- every alias on an upstream engine knows the model name to send: its ``base_model``, else the
  one model the upstream's ``/v1/models`` lists.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import tempfile
from collections.abc import Mapping
from pathlib import Path

import httpx
from pydantic import SecretStr

from flywheel.gateway.core.config import (
    CLI_ADMIN_KEY_VARIABLE,
    TINY_MODEL,
    LocalEngineConfig,
    OpenAIEngineConfig,
    Settings,
)


class PreflightError(RuntimeError):
    """The gateway cannot start as configured; the message names the setting and what is wrong."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name other than localhost: it may resolve to anything


def check_exposure(settings: Settings, allow_unauthenticated: bool) -> None:
    auth = settings.auth
    if is_loopback(settings.host) or auth.api_keys or auth.admin_key is not None:
        return
    if allow_unauthenticated or auth.allow_unauthenticated:
        return
    raise PreflightError(
        f"host {settings.host} is reachable from other machines and no key is configured: anyone could use the "
        "model and the admin API. Set auth.api_keys and/or auth.admin_key, or say the open server is meant "
        "with --allow-unauthenticated (auth.allow_unauthenticated = true)")


def adopt_cli_admin_key(settings: Settings, environ: Mapping[str, str]) -> None:
    """``FLYWHEEL_ADMIN_KEY`` protects the admin API when no admin key is configured; a different one is an error."""
    key = environ.get(CLI_ADMIN_KEY_VARIABLE)
    if not key:
        return
    configured = settings.auth.admin_key
    if configured is None:
        if any(client.get_secret_value() == key for client in settings.auth.api_keys):
            raise PreflightError(f"{CLI_ADMIN_KEY_VARIABLE} is also a client key: every client would be an admin")
        settings.auth.admin_key = SecretStr(key)
    elif configured.get_secret_value() != key:
        raise PreflightError(f"{CLI_ADMIN_KEY_VARIABLE} (the key the CLI sends) differs from auth.admin_key: "
                             "the CLI would be refused; unset it or make them equal")


def check_writable(settings: Settings) -> None:
    """The data directory, and the directories of the spool and of a DuckDB store file, can be written."""
    directories = {settings.data_dir: "data_dir"}  # a directory is named after the first setting that puts it there
    directories.setdefault(settings.spool_path.parent, "capture.spool_path")
    if "://" not in settings.database:
        directories.setdefault(Path(settings.database).parent, "capture.database")
    for directory, setting in directories.items():
        try:
            directory.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=directory):
                pass
        except OSError as exc:
            raise PreflightError(f"{setting}: cannot write to {directory} ({exc.strerror or exc})") from None


def check_port(settings: Settings) -> None:
    family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds it
            probe.bind((settings.host.strip("[]"), settings.port))
    except OSError as exc:
        raise PreflightError(f"cannot listen on {settings.host}:{settings.port} ({exc.strerror or exc})") from None


def check_models(settings: Settings) -> None:
    """Local engines' models and configured adapters exist (nothing is downloaded, so a missing one never will)."""
    for name, engine in settings.engines.items():
        if isinstance(engine, LocalEngineConfig) and engine.model != TINY_MODEL:
            _check_model(f"engines.{name}.model", engine.model)
    for name, alias in settings.aliases.items():
        if alias.train_model is not None and alias.train_model != TINY_MODEL:
            _check_model(f"aliases.{name}.train_model", alias.train_model)
        if alias.adapter is not None and not (Path(alias.adapter) / "adapter_config.json").is_file():
            raise PreflightError(f"aliases.{name}.adapter: no PEFT adapter at {alias.adapter} "
                                 "(adapter_config.json missing)")


def _check_model(setting: str, model: str) -> None:
    path = Path(model).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise PreflightError(f"{setting}: {model} is not a model directory (config.json missing)")
        return
    if model.startswith((".", "/", "~")) or model.count("/") > 1 or not _in_hf_cache(model):
        raise PreflightError(f"{setting}: no model directory at {model}, and no model of that name in the "
                             "Hugging Face cache (nothing is downloaded)")


def _in_hf_cache(model: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # no [train] extra: the local engine cannot run at all
        return False
    try:
        return isinstance(try_to_load_from_cache(model, "config.json"), str)
    except ValueError:  # not a valid repository id
        return False


async def resolve_upstream_models(settings: Settings, timeout_s: float = 10.0) -> None:
    """Set ``base_model`` of every upstream alias that has none to the one model its upstream lists.

    vLLM answers 404 for a model name it does not serve, so the alias's own name is never guessed.
    """
    for name, alias in settings.aliases.items():
        engine = settings.engines[alias.engine]
        if alias.base_model is None and isinstance(engine, OpenAIEngineConfig):
            alias.base_model = await _only_model(f"aliases.{name}.base_model", engine, timeout_s)


async def _only_model(setting: str, engine: OpenAIEngineConfig, timeout_s: float) -> str:
    headers = {"authorization": f"Bearer {engine.api_key.get_secret_value()}"} if engine.api_key else {}
    url = f"{engine.base_url}/models"
    try:
        async with httpx.AsyncClient(timeout=timeout_s) as client:
            response = await client.get(url, headers=headers)
        response.raise_for_status()
        models = response.json()["data"]
        names = [str(model["id"]) for model in models if not model.get("parent")]  # LoRAs name their parent
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise PreflightError(f"{setting} is not set and {url} did not list its models ({type(exc).__name__}); "
                             "set it to the model name the upstream serves") from None
    if len(names) != 1:
        raise PreflightError(f"{setting} is not set and {url} lists {len(names)} models "
                             f"({', '.join(names) or 'none'}): set it to the one to serve")
    return names[0]


def preflight(settings: Settings, *, allow_unauthenticated: bool, environ: Mapping[str, str]) -> None:
    """Every check above, in order; the first failure raises :class:`PreflightError`."""
    adopt_cli_admin_key(settings, environ)
    check_exposure(settings, allow_unauthenticated)
    check_writable(settings)
    check_port(settings)
    check_models(settings)
    asyncio.run(resolve_upstream_models(settings))
