"""``flywheel groups`` and ``flywheel score``: the loop's jobs, run by hand.

Both go through the running gateway's admin API when one answers (DuckDB lets one process
open the store), and open the store file themselves otherwise — the same rule as
every command (``gateway/cli/common.py: locate``).
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from gateway.cli.common import (
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


def groups(config: ConfigOption = None, gateway: GatewayOption = None, admin_key: AdminKeyOption = None,
           data_dir: DataDirOption = None, database: DatabaseOption = None) -> None:
    """Form groups from closed trajectories now (explicit, same task, forks, cohorts).

    Example: flywheel groups
    """
    from gateway.api.feedback import run_group_formation

    location = locate(Target(config, gateway, admin_key, data_dir, database))
    if location.url is not None:
        formed = admin_call(location, "POST", "/flywheel/v1/jobs/groups")["formed"]
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


def train(alias: Annotated[str, typer.Option("--alias", help="The alias to train.")],
          config: ConfigOption = None, gateway: GatewayOption = None, admin_key: AdminKeyOption = None,
          data_dir: DataDirOption = None, database: DatabaseOption = None,
          max_groups: Annotated[int | None, typer.Option(help="Train on at most this many groups.")] = None,
          promote: Annotated[bool, typer.Option(help="Serve the new adapter at once (no evaluation gate).")] = False,
          set_: Annotated[list[str] | None, typer.Option(
              "--set", help="A GRPOArgs field for this round, e.g. --set max_steps=8 (repeatable).")] = None,
          ) -> None:
    """Run one GRPO round on the alias's scored groups and write adapter version N.

    Example: flywheel train --alias my-agent --max-groups 32 --promote
    """
    from capture.batches import TrainingGroup
    from gateway.loop.training import (
        base_model_path,
        grpo_args,
        promoted_version,
        record_training,
        round_to_json,
        training_batch,
    )
    from trainer import adapters

    location = locate(Target(config, gateway, admin_key, data_dir, database))
    settings = location.settings
    if alias not in settings.aliases:
        fail(f"--alias: no alias named {alias!r} in the configuration")
    limit = max_groups or settings.train.max_groups
    overrides = _field_values(set_ or [])
    if location.url is not None:
        batch = admin_call(location, "GET", "/flywheel/v1/training/batch",
                           {"alias": alias, "max_groups": str(limit)})
        groups = [TrainingGroup.from_json(g) for g in batch["groups"]]
        base, current = batch["base_model"], batch["current"]
    else:
        store = open_store(location.database or settings.database)
        try:
            groups = training_batch(store, alias, limit)
            promoted = promoted_version(store, alias)
        finally:
            store.close()
        try:
            base = base_model_path(settings, alias)
        except ValueError as exc:
            fail(str(exc))
        current = {"version": promoted.version, "path": promoted.path} if promoted else None
    if not groups:
        typer.echo(f"nothing to train: no scored groups for {alias} (run flywheel groups and flywheel score)")
        return
    try:
        args = grpo_args(settings, base, overrides)
    except TypeError as exc:
        fail(f"--set: {exc}")
    version, out_dir = adapters.reserve_version(settings.data_dir, alias)
    init = current["path"] if current else None
    typer.echo(f"training {alias} on {len(groups)} groups from {init or 'a fresh LoRA'} -> version {version}",
               err=True)
    from trainer.grpo import train_round

    result = train_round(base, groups, args, init_adapter=init, out_dir=out_dir,
                         optimizer_state=adapters.optimizer_state_of(init))
    if result.status != "finished":
        adapters.discard(out_dir)
        typer.echo(f"skipped: nothing trainable ({result.skipped})")
        return
    parent = current["version"] if current else None
    if location.url is not None:
        report = {"alias": alias, "version": version, "parent_version": parent, "promote": promote,
                  "result": round_to_json(result)}
        admin_call(location, "POST", "/flywheel/v1/training/rounds", json_body=report)
    else:
        store = open_store(location.database or settings.database)
        try:
            record_training(store, alias, result, version=version, parent_version=parent, promote=promote)
        finally:
            store.close()
    metrics = result.metrics
    typer.echo(f"version {version} written to {result.adapter_dir}: {len(result.group_ids)} groups, "
               f"loss {metrics.get('losses/loss', float('nan')):.4f}, "
               f"reward mean {metrics.get('reward/mean', float('nan')):.3f}"
               + (", promoted" if promote else ", candidate"))


def _field_values(pairs: list[str]) -> dict[str, Any]:
    """``["max_steps=8", "loss_type=grpo"]`` -> typed values (JSON where it parses, else the string)."""
    import json

    values: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            fail(f"--set: expected FIELD=VALUE, got {pair!r}")
        try:
            values[key.strip()] = json.loads(raw)
        except ValueError:
            values[key.strip()] = raw
    return values
