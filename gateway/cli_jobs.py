"""``flywheel groups`` and ``flywheel score``: the loop's jobs, run by hand.

Both go through the running gateway's admin API when one answers (DuckDB lets one process
open the store), and open the store file themselves otherwise — the same rule as
``flywheel trajectories`` (``gateway/cli_trajectories.py: locate``).
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

import httpx
import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from gateway.cli_trajectories import (
    AdminKeyOption,
    AliasOption,
    ConfigOption,
    DatabaseOption,
    DataDirOption,
    GatewayOption,
    Location,
    Target,
    fail_cli,
    locate,
    open_store,
)


def admin_post(location: Location, path: str, params: dict[str, str] | None = None,
               timeout_s: float = 3600.0) -> dict[str, Any]:
    """POST to the located gateway's admin API; a failure is a one-line CLI error."""
    headers = {"authorization": f"Bearer {location.admin_key}"} if location.admin_key else {}
    try:
        response = httpx.post(f"{location.url}{path}", params=params, headers=headers, timeout=timeout_s)
    except httpx.HTTPError as exc:
        fail_cli(f"gateway at {location.url} failed: {type(exc).__name__}")
    if response.status_code != 200:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text[:200]
        fail_cli(f"gateway answered {response.status_code}: {message}")
    result: dict[str, Any] = response.json()
    return result


def groups(config: ConfigOption = None, gateway: GatewayOption = None, admin_key: AdminKeyOption = None,
           data_dir: DataDirOption = None, database: DatabaseOption = None) -> None:
    """Form groups from closed trajectories now (explicit, same task, forks, cohorts).

    Example: flywheel groups
    """
    from gateway.feedback_api import run_group_formation

    location = locate(Target(config, gateway, admin_key, data_dir, database))
    if location.url is not None:
        formed = admin_post(location, "/flywheel/v1/jobs/groups")["formed"]
    else:
        store = open_store(location.database or location.settings.database)
        try:
            formed = run_group_formation(store, location.settings.groups)
        finally:
            store.close()
    by_source: dict[str, int] = {}
    for group in formed:
        by_source[group["source"]] = by_source.get(group["source"], 0) + 1
    detail = ", ".join(f"{n} {source}" for source, n in sorted(by_source.items()))
    typer.echo(f"formed {len(formed)} groups" + (f" ({detail})" if detail else ""))


def score(config: ConfigOption = None, gateway: GatewayOption = None, admin_key: AdminKeyOption = None,
          data_dir: DataDirOption = None, database: DatabaseOption = None, alias: AliasOption = None,
          limit: Annotated[int | None, typer.Option(help="Score at most this many groups.")] = None) -> None:
    """Score every closed, unscored group with RULER and store the final rewards.

    Example: flywheel score --alias my-agent
    """
    location = locate(Target(config, gateway, admin_key, data_dir, database))
    if location.url is not None:
        params = {"alias": alias} if alias else None
        summary = admin_post(location, "/flywheel/v1/jobs/score", params)
    else:
        summary = _score_file(location, alias, limit)
    typer.echo(f"scored {summary['scored']}/{summary['groups']} groups ({summary['trajectories']} trajectories), "
               f"{summary['failed']} failed, in {summary['seconds']:.1f} s")
    if summary["failed"]:
        typer.echo("failed groups stay unscored and are tried again next run: "
                   + ", ".join(summary["failed_group_ids"]), err=True)


def _score_file(location: Location, alias: str | None, limit: int | None) -> dict[str, Any]:
    from dataclasses import asdict

    from judge.scoring import pending_groups, score_pending

    settings = location.settings
    store = open_store(location.database or settings.database)
    try:
        total = len(pending_groups(store.engine, alias, limit))
        columns = (TextColumn("scoring"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, transient=True, console=Console(stderr=True)) as progress:  # stdout: the summary
            task = progress.add_task("groups", total=total)
            result = asyncio.run(score_pending(store.engine, settings.judge, settings.rewards, alias=alias,
                                               limit=limit, on_group_done=lambda g, ok: progress.advance(task)))
        return asdict(result)
    finally:
        store.close()
