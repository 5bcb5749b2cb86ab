"""What every ``flywheel`` command shares: options, one-line failures, settings, and where the data is.

Where a command's data comes from (DuckDB lets one process open the file):

- ``--gateway URL``: the running gateway's admin API, nothing else.
- ``--database``: that store file, opened directly (no gateway may hold it).
- otherwise the gateway of the data directory (``--data-dir``, else the configuration's): the
  one it announced in ``gateway.json`` (``gateway/core/discovery.py``), or the configuration's host and
  port, when it answers ``/healthz``; when none answers, the data directory's store file.

The admin key is ``--admin-key``, else ``FLYWHEEL_ADMIN_KEY``, else the configuration's.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import httpx
import typer
from pydantic import ValidationError

from flywheel.gateway.core.config import Settings, load_settings
from flywheel.gateway.core.discovery import announced_url, local_url

if TYPE_CHECKING:
    from flywheel.capture.store import Store

ConfigOption = Annotated[list[Path] | None, typer.Option(
    "--config", "-c", metavar="<path>",
    help="TOML configuration file; repeat it to layer files (later ones win, key by key).")]
GatewayOption = Annotated[str | None, typer.Option(
    "--gateway", help="Admin API of a running gateway, e.g. http://127.0.0.1:8000 (default: the config's "
                      "host and port, when it answers).")]
AdminKeyOption = Annotated[str | None, typer.Option(
    "--admin-key", help="Admin key for the gateway (default: $FLYWHEEL_ADMIN_KEY, then the config's).",
    show_default=False)]
DataDirOption = Annotated[Path | None, typer.Option(
    "--data-dir", help="Data directory: its running gateway, else its store file (default: the config's).")]
DatabaseOption = Annotated[str | None, typer.Option(
    "--database", help="Store file (or URL) to open directly (no gateway).")]
AliasOption = Annotated[str | None, typer.Option("--alias", help="Only this model alias.")]


def fail(message: str) -> NoReturn:
    """One line on stderr and a non-zero exit: the CLI's way to report bad input."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code=2)


def settings_or_exit(config: Sequence[Path] | None, **overrides: Any) -> Settings:
    try:
        return load_settings(config, **{k: v for k, v in overrides.items() if v is not None})
    except FileNotFoundError as exc:
        fail(str(exc))
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(p) for p in error["loc"]) or "config"
        fail(f"invalid configuration: {where}: {error['msg']}")
    except ValueError as exc:  # TOML syntax errors
        fail(f"invalid configuration: {exc}")


def error_message(response: httpx.Response) -> str:
    """The message of an OpenAI-shaped error response (the start of the body otherwise)."""
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text[:200]


def error_code(response: httpx.Response) -> str | None:
    try:
        return str(response.json()["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return None


@dataclass
class Target:
    """The options every command shares: which configuration, which gateway or file."""

    config: Sequence[Path] | None
    gateway: str | None
    admin_key: str | None
    data_dir: Path | None
    database: str | None


@dataclass
class Location:
    """Where a command's data lives: a running gateway (``url``) or a store file (``database``)."""

    settings: Settings
    url: str | None = None
    admin_key: str | None = None
    database: str | None = None


def locate(target: Target) -> Location:
    """The running gateway's admin API when one answers, otherwise the store file (see the module docstring)."""
    if target.gateway and (target.database or target.data_dir):
        fail("--gateway reads through a running gateway; --database/--data-dir name a store: choose one")
    settings = settings_or_exit(target.config, data_dir=target.data_dir)
    if target.database:
        return Location(settings, database=target.database)
    # An explicit --data-dir trusts only the gateway announced in it, not whatever answers at the config's port.
    url = target.gateway or announced_url(settings.data_dir) or (None if target.data_dir else local_url(settings))
    if url is not None and _answers(url):
        admin = settings.auth.admin_key.get_secret_value() if settings.auth.admin_key else None
        return Location(settings, url=url, admin_key=target.admin_key or os.environ.get("FLYWHEEL_ADMIN_KEY")
                        or admin)
    if target.gateway:
        fail(f"no gateway answers at {url}")
    return Location(settings, database=settings.database)


def _answers(url: str) -> bool:
    try:
        httpx.get(url.rstrip("/") + "/healthz", timeout=2.0)
    except httpx.HTTPError:
        return False
    return True


def open_store(database: str) -> Store:
    from flywheel.capture.store import SchemaError, Store, database_url, printable_url

    url = database_url(database)
    if url.startswith("duckdb:///") and not Path(url.removeprefix("duckdb:///")).is_file():
        fail(f"no store at {url.removeprefix('duckdb:///')} (is a gateway running elsewhere? pass --gateway URL)")
    try:
        return Store(database)
    except SchemaError as exc:
        fail(str(exc))
    except Exception as exc:
        message = str(exc).splitlines()[0]
        if "lock" in message.lower():
            fail(f"the store is open in another process (a gateway?); use --gateway URL. ({message})")
        fail(f"cannot open the store {printable_url(database)}: {message}")


def admin_call(location: Location, method: str, path: str, params: dict[str, str] | None = None, *,
               json_body: dict[str, Any] | None = None, timeout_s: float = 3600.0) -> dict[str, Any]:
    """Call the located gateway's admin API; a failure is a one-line CLI error."""
    headers = {"authorization": f"Bearer {location.admin_key}"} if location.admin_key else {}
    try:
        response = httpx.request(method, f"{location.url}{path}", params=params, json=json_body, headers=headers,
                                 timeout=timeout_s)
    except httpx.HTTPError as exc:
        fail(f"gateway at {location.url} failed: {type(exc).__name__}")
    if response.status_code != 200:
        fail(f"gateway answered {response.status_code}: {error_message(response)}")
    result: dict[str, Any] = response.json()
    return result
