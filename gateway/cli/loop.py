"""``flywheel status``, ``versions``, ``promote`` and ``rollback``: the loop, seen and steered by hand.

Examples::

    flywheel status                      # the running gateway of ./flywheel-data, found by itself
    flywheel versions --alias my-agent
    flywheel promote 7 --alias my-agent
    flywheel rollback                    # back to the version served before the current one

They talk to the running gateway's admin API (it holds the store and the engines); with no
gateway running, ``status`` and ``versions`` read the store file, and a switch is refused (it
would change what a stopped gateway serves without loading anything: start the gateway first).
"""

from __future__ import annotations

import json
import math
from typing import Annotated, Any

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from flywheel.gateway.cli.common import (
    AdminKeyOption,
    ConfigOption,
    DatabaseOption,
    DataDirOption,
    GatewayOption,
    Location,
    Target,
    admin_call,
    fail,
    locate,
    open_store,
)
from flywheel.gateway.core.config import MAX_VERSION

AliasArg = Annotated[str | None, typer.Option("--alias", help="The alias (default: the only one, or the first).")]
JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")]


def _alias(location: Location, alias: str | None) -> str:
    aliases = list(location.settings.aliases)
    if alias is None:
        if location.url is not None:  # the running gateway's own aliases, whatever our config says
            return str(admin_call(location, "GET", "/flywheel/v1/aliases")["data"][0]["alias"])
        return aliases[0]
    return alias


def _console() -> Console:
    return Console(highlight=False, width=None if Console().is_terminal else 160)


def _reward(cell: dict[str, Any] | None) -> str:
    if not cell or not cell.get("n"):
        return "-"
    mean, n = cell["mean"], cell["n"]
    if "low" in cell:
        return f"{mean:.3f} [{cell['low']:.3f}, {cell['high']:.3f}] n={n}"
    return f"{mean:.3f} n={n}"


def _offline_status(location: Location) -> dict[str, Any]:
    """``/flywheel/v1/status`` computed on the store file: what a stopped gateway would report."""
    from pydantic_core import to_jsonable_python

    from flywheel.gateway.serving.loop.scheduler import ALIAS_JOBS, GLOBAL_JOBS
    from flywheel.gateway.storeproc import store_ops

    settings = location.settings
    store = open_store(location.database or settings.database)
    try:
        out = []
        for alias in settings.aliases:
            rows = store_ops.serving(store, settings)[alias]
            last = store_ops.last_runs(store, settings, alias=alias, jobs=[*GLOBAL_JOBS, *ALIAS_JOBS])
            out.append({"alias": alias, "serving": {"version": rows.serving.version if rows.serving else 0,
                                                    "row": rows.serving},
                        "candidate": rows.in_flight, "canary": None, "monitor": None,
                        "pending": store_ops.pending(store, settings, alias), "jobs": last,
                        "reward_by_version": store_ops.reward_by_version(store, settings, alias)
                        .model_dump(exclude_none=True),
                        "loop": {"enabled": False, "note": "no gateway is running"}})
        return {"aliases": to_jsonable_python(out)}
    finally:
        store.close()


def status(config: ConfigOption = None, gateway: GatewayOption = None, admin_key: AdminKeyOption = None,
           data_dir: DataDirOption = None, database: DatabaseOption = None, json_: JsonOption = False) -> None:
    """Per alias: serving version, candidate and its A/B numbers, pending work, jobs, reward per version.

    Example: flywheel status
    """
    location = locate(Target(config, gateway, admin_key, data_dir, database))
    body = admin_call(location, "GET", "/flywheel/v1/status") if location.url else _offline_status(location)
    if json_:
        typer.echo(json.dumps(body, indent=2))
        return
    console = _console()
    for entry in body["aliases"]:
        _print_alias(console, entry, location.url)


def _print_alias(console: Console, entry: dict[str, Any], url: str | None) -> None:
    serving = entry["serving"]
    where = f"gateway {url}" if url else "store file (no gateway running)"
    console.print(f"[bold]{entry['alias']}[/bold] serves version {serving['version']}"
                  + (f" ({serving.get('adapter')})" if serving.get("adapter") else " (the base model)") + f" — {where}")
    candidate, canary = entry.get("candidate"), entry.get("canary")
    if candidate:
        console.print(f"  candidate: version {candidate['version']}, {candidate['status']}"
                      + (f" — {candidate['reason']}" if candidate.get("reason") else ""))
    if canary and canary.get("ab"):
        ab = canary["ab"]
        console.print(f"  canary {canary['fraction']:.0%}: {ab['pairs']} pairs, candidate {_num(ab['mean_candidate'])}"
                      f" (n={ab['n_candidate']}) vs {_num(ab['mean_baseline'])} (n={ab['n_baseline']}), "
                      f"p(better)={ab['p_better']:.4f}, p(worse)={ab['p_worse']:.4f}")
    monitor = entry.get("monitor")
    if monitor and "pairs" in monitor:
        console.print(f"  monitor: {monitor['pairs']} pairs against version {monitor['baseline_version']}, "
                      f"p(worse)={monitor['p_worse']:.4f}" + (" — finished" if monitor.get("finished") else ""))
    pending = entry["pending"]
    console.print(f"  pending: {pending['open_trajectories']} open trajectories, groups {pending['groups'] or {}}")
    rewards = entry["reward_by_version"]["versions"]
    if rewards:
        table = Table(box=box.SIMPLE, title="reward per version (95% interval)", title_justify="left")
        table.add_column("version")
        table.add_column("reward")
        for version, cell in rewards.items():
            table.add_row(version, _reward(cell))
        console.print(table)
    jobs = Table(box=box.SIMPLE, title="last run of each job", title_justify="left")
    for column in ("job", "status", "finished", "detail"):
        jobs.add_column(column)
    for job, run in sorted(entry["jobs"].items()):
        said = run.get("error") or run.get("detail") or ""
        jobs.add_row(job, run["status"], (run.get("finished_at") or "")[:19], said)
    console.print(jobs)


def _num(value: float | None) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.3f}"


def versions(config: ConfigOption = None, gateway: GatewayOption = None, admin_key: AdminKeyOption = None,
             data_dir: DataDirOption = None, database: DatabaseOption = None, alias: AliasArg = None,
             json_: JsonOption = False) -> None:
    """Every version of an alias with its status, training metrics and gate results.

    Example: flywheel versions --alias my-agent
    """
    location = locate(Target(config, gateway, admin_key, data_dir, database))
    name = _alias(location, alias)
    if location.url is not None:
        rows = admin_call(location, "GET", f"/flywheel/v1/aliases/{name}/versions")["data"]
    else:
        from flywheel.gateway.storeproc import store_ops

        store = open_store(location.database or location.settings.database)
        try:
            rows = [row.model_dump(mode="json") for row in store_ops.list_versions(store, location.settings, name)]
        finally:
            store.close()
    if json_:
        typer.echo(json.dumps(rows, indent=2))
        return
    table = Table(box=box.SIMPLE, title=f"{name}: versions", title_justify="left")
    for column in ("version", "status", "source", "from", "reward (train)", "offline gate", "canary", "reason"):
        table.add_column(column)
    for row in rows:
        gate = row.get("gate") or {}
        offline, online = gate.get("offline") or {}, gate.get("online") or {}
        table.add_row(str(row["version"]), row["status"], row["source"], str(row.get("parent_version") or "base"),
                      _num((row.get("metrics") or {}).get("reward/mean")),
                      _offline_cell(offline),
                      f"{online.get('decision', '-')} ({online.get('pairs', 0)} pairs)" if online else "-",
                      row.get("reason") or "")
    _console().print(table)


def _offline_cell(offline: dict[str, Any]) -> str:
    if not offline:
        return "-"
    tied = " (all tie)" if offline.get("decision") == "inconclusive" else ""
    return f"{offline['win_rate']:.2f} of {offline['contexts']}{tied}"


def _switch(location: Location, path: str, body: dict[str, Any]) -> dict[str, Any]:
    if location.url is None:
        fail("no gateway is running: start it (flywheel serve) to switch versions — it loads what it serves")
    return admin_call(location, "POST", path, json_body=body)


def promote(version: Annotated[int, typer.Argument(help="The version to serve (0: the base model).", min=0,
                                                   max=MAX_VERSION)],
            config: ConfigOption = None, gateway: GatewayOption = None, admin_key: AdminKeyOption = None,
            data_dir: DataDirOption = None, alias: AliasArg = None) -> None:
    """Serve a version now, by hand (no gate).

    Example: flywheel promote 7 --alias my-agent
    """
    location = locate(Target(config, gateway, admin_key, data_dir, None))
    name = _alias(location, alias)
    served = _switch(location, f"/flywheel/v1/aliases/{name}/promote", {"version": version})
    typer.echo(f"{name} now serves version {served['version']}")


def rollback(version: Annotated[int | None, typer.Argument(
                 help="The version to return to (default: the one served before the current one).", min=0,
                 max=MAX_VERSION)] = None,
             config: ConfigOption = None, gateway: GatewayOption = None, admin_key: AdminKeyOption = None,
             data_dir: DataDirOption = None, alias: AliasArg = None) -> None:
    """Return to an earlier version; the current one is marked rolled back.

    Example: flywheel rollback
    """
    location = locate(Target(config, gateway, admin_key, data_dir, None))
    name = _alias(location, alias)
    served = _switch(location, f"/flywheel/v1/aliases/{name}/rollback", {"version": version})
    typer.echo(f"{name} rolled back: it now serves version {served['version']}")
