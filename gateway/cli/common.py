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
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import httpx
import typer
from pydantic import ValidationError

from flywheel.admin_client import AdminCallError, AdminClient
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


def admin_client(location: Location, timeout_s: float = 3600.0) -> AdminClient:
    """A client of the located gateway's admin API (the caller checked that one runs)."""
    assert location.url is not None, "no gateway was located"
    return AdminClient(location.url, location.admin_key, timeout=timeout_s)


@contextmanager
def admin_failures() -> Iterator[None]:
    """A failed admin call (the gateway down, or its error answer) as a one-line CLI error."""
    try:
        yield
    except AdminCallError as exc:
        fail(str(exc))


def admin_call(location: Location, method: str, path: str, params: dict[str, str] | None = None, *,
               json_body: dict[str, Any] | None = None, timeout_s: float = 3600.0) -> dict[str, Any]:
    """Call the located gateway's admin API; a failure is a one-line CLI error."""
    with admin_client(location, timeout_s) as client, admin_failures():
        result: dict[str, Any] = client.call(method, path, params=params, json=json_body)
    return result
