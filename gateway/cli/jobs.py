"""``flywheel groups`` and ``flywheel score``: the loop's jobs, run by hand.

Both go through the running gateway's admin API when one answers (DuckDB lets one process
open the store), and open the store file themselves otherwise — the same rule as
every command (``gateway/cli/common.py: locate``).
"""

from __future__ import annotations

import asyncio
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from flywheel.gateway.cli.common import (
    AdminKeyOption,
    AliasOption,
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

if TYPE_CHECKING:
    from flywheel.gateway.training.rounds import RoundOutcome


def groups(config: ConfigOption = None, gateway: GatewayOption = None, admin_key: AdminKeyOption = None,
           data_dir: DataDirOption = None, database: DatabaseOption = None) -> None:
    """Form groups from closed trajectories now (explicit, same task, forks, cohorts).

    Example: flywheel groups
    """
    from flywheel.gateway.storeproc.store_ops import run_group_formation

    location = locate(Target(config, gateway, admin_key, data_dir, database))
    if location.url is not None:
        formed = admin_call(location, "POST", "/flywheel/v1/jobs/groups")["formed"]
    else:
        store = open_store(location.database or location.settings.database)
        try:
            formed = [group.model_dump() for group in run_group_formation(store, location.settings)]
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
        summary = admin_call(location, "POST", "/flywheel/v1/jobs/score", params)
    else:
        summary = _score_file(location, alias, limit)
    typer.echo(f"scored {summary['scored']}/{summary['groups']} groups ({summary['trajectories']} trajectories), "
               f"{summary['failed']} failed, in {summary['seconds']:.1f} s")
    if summary["failed"]:
        typer.echo("failed groups stay unscored and are tried again next run: "
                   + ", ".join(summary["failed_group_ids"]), err=True)


def _score_file(location: Location, alias: str | None, limit: int | None) -> dict[str, Any]:
    from dataclasses import asdict

    from flywheel.judge.scoring import pending_groups, score_pending

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


LaunchOption = Annotated[str | None, typer.Option(
    help='Train each round under this launcher, e.g. "accelerate launch --num_processes 4" (several GPUs).')]


def launcher_of(launch: str | None) -> list[str] | None:
    """``--launch``'s words (one line and exit 2 when its quoting is broken)."""
    try:
        return shlex.split(launch or "") or None
    except ValueError as exc:
        fail(f"--launch: {exc}")


def train(alias: Annotated[str, typer.Option("--alias", help="The alias to train.")],
          config: ConfigOption = None, gateway: GatewayOption = None, admin_key: AdminKeyOption = None,
          data_dir: DataDirOption = None, database: DatabaseOption = None,
          max_groups: Annotated[int | None, typer.Option(help="Train on at most this many groups.")] = None,
          group_ids: Annotated[str | None, typer.Option(
              help="Train on these scored groups only (comma-separated ids).")] = None,
          promote: Annotated[bool, typer.Option(help="Serve the new adapter at once (no evaluation gate).")] = False,
          threads: Annotated[int | None, typer.Option(help="torch CPU threads (default: torch's choice).")] = None,
          launch: LaunchOption = None,
          workdir: Annotated[Path | None, typer.Option(
              help="With a gateway on another machine: train in this directory and upload the adapter.")] = None,
          json_: Annotated[bool, typer.Option("--json", help="End with one JSON line: status, version, metrics.")
                           ] = False,
          set_: Annotated[list[str] | None, typer.Option(
              "--set", help="A GRPOArgs field for this round, e.g. --set max_steps=8 (repeatable).")] = None,
          stdio: Annotated[bool, typer.Option(
              "--stdio", help="Stay up and train the rounds given on stdin, one JSON line each way (the loop's "
                              "training child, docs/loop.md); each round brings its own settings, so every other "
                              "option but --threads is ignored.")] = False,
          ) -> None:
    """Run one GRPO round on the alias's scored groups and write adapter version N (a candidate for the gate).

    Example: flywheel train --alias my-agent --max-groups 32 --promote
    """
    import time

    from flywheel.gateway.training.rounds import AdminApi, RoundError, StoreFile, Where, run_round, summarize

    if threads:
        import torch

        torch.set_num_threads(threads)
    if stdio:  # each round comes whole on stdin: no configuration, store or gateway to find
        from flywheel.gateway.training import warm

        warm.serve(alias)
        return
    location = locate(Target(config, gateway, admin_key, data_dir, database))
    settings = location.settings
    if location.url is None and alias not in settings.aliases:  # a gateway checks the alias itself
        fail(f"--alias: no alias named {alias!r} in the configuration")
    overrides = field_values(set_ or [])
    store = None
    where: Where
    if workdir is not None and location.url is None:
        fail("--workdir uploads to a running gateway: give --gateway URL")
    if location.url is not None:
        where = AdminApi(location.url, location.admin_key, workdir=workdir)
    else:
        store = open_store(location.database or settings.database)
        where = StoreFile(store, settings)
    started = time.perf_counter()
    try:
        outcome = run_round(where, alias, max_groups=max_groups, overrides=overrides, promote=promote,
                            group_ids=[g for g in group_ids.split(",") if g] if group_ids else None,
                            launcher=launcher_of(launch))
    except (RoundError, TypeError, ValueError) as exc:  # TypeError: an unknown --set field
        fail(str(exc))
    finally:
        if store is not None:
            store.close()
    if outcome.status == "nothing":
        typer.echo(f"nothing to train: no scored groups for {alias} (run flywheel groups and flywheel score)")
    else:
        typer.echo(describe_round(outcome, promote))
    if json_:
        typer.echo(summarize(outcome, time.perf_counter() - started).model_dump_json())


def describe_round(outcome: RoundOutcome, promote: bool) -> str:
    """One line for a round that trained or skipped."""
    if outcome.status != "finished":
        return f"version {outcome.version} skipped: nothing trainable ({outcome.result.skipped})"
    metrics = outcome.result.metrics
    return (f"version {outcome.version} written to {outcome.result.adapter_dir}: {len(outcome.result.group_ids)} "
            f"groups, loss {metrics.get('losses/loss', float('nan')):.4f}, reward mean "
            f"{metrics.get('reward/mean', float('nan')):.3f}" + (", promoted" if promote else ", candidate"))


def field_values(pairs: list[str]) -> dict[str, Any]:
    """``["max_steps=8", "loss_type=grpo"]`` -> typed values (JSON where it parses, else the string), each a
    GRPOArgs field."""
    import json
    from dataclasses import fields

    from flywheel.trainer.grpo_args import GRPOArgs

    known = {f.name for f in fields(GRPOArgs)}
    values: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            fail(f"--set: expected FIELD=VALUE, got {pair!r}")
        if key.strip() not in known:
            fail(f"--set: GRPOArgs has no field {key.strip()!r}")
        try:
            values[key.strip()] = json.loads(raw)
        except ValueError:
            values[key.strip()] = raw
    return values
