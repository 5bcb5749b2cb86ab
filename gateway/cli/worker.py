"""``flywheel trainer``: a trainer worker on another machine (a GPU box), for a gateway with ``[train] workers``.

    flywheel trainer --gateway https://flywheel.internal:8000 --admin-key $KEY

It asks the gateway's admin API for a round of each alias it serves; the gateway hands one out
only when its loop would train and no version of that alias is in flight, so several workers never
take the same work (a second reservation is refused). The worker downloads the version it continues
from, trains (``gateway/training/rounds.py: run_round``, the code ``flywheel train`` runs), uploads the
new version and reports the round; the loop's gate takes it from there. With ``--shared`` it reads
and writes the gateway's adapter directory in place instead (a volume both machines mount).
SIGTERM or Ctrl-C lets a round in progress finish, then stops.
"""

from __future__ import annotations

import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Annotated

import typer

from flywheel.gateway.cli.common import (
    AdminKeyOption,
    ConfigOption,
    GatewayOption,
    Location,
    Target,
    admin_call,
    fail,
    locate,
)
from flywheel.gateway.cli.jobs import LaunchOption, describe_round, field_values, launcher_of


def trainer(gateway: GatewayOption = None, admin_key: AdminKeyOption = None, config: ConfigOption = None,
            alias: Annotated[list[str] | None, typer.Option(
                "--alias", help="Train only this alias (repeatable; default: every alias the gateway serves).")
            ] = None,
            poll_s: Annotated[float, typer.Option(min=0.1, help="Seconds between asks when no round is due.")
                              ] = 10.0,
            once: Annotated[bool, typer.Option(help="Ask each alias once, train what is due, then exit.")] = False,
            workdir: Annotated[Path | None, typer.Option(
                help="Scratch space for downloads and the version being trained (default: a temporary directory).")
            ] = None,
            shared: Annotated[bool, typer.Option(
                help="Read and write the gateway's adapter directory in place (a shared volume): no transfer.")
            ] = False,
            base_model: Annotated[str | None, typer.Option(
                help="The base weights on this machine (a directory or cached HF id; default: what the gateway names).")
            ] = None,
            launch: LaunchOption = None,
            threads: Annotated[int | None, typer.Option(help="torch CPU threads (default: torch's choice).")] = None,
            set_: Annotated[list[str] | None, typer.Option(
                "--set", help="A GRPOArgs field for every round, e.g. --set max_steps=8 (repeatable).")] = None,
            ) -> None:
    """Take training rounds from a running gateway, train them here, and hand the adapters back.

    Example: flywheel trainer --gateway http://gateway:8000 --admin-key $FLYWHEEL_ADMIN_KEY
    """
    from flywheel.gateway.training.rounds import AdminApi, RoundError, run_round

    location = locate(Target(config, gateway, admin_key, None, None))
    if location.url is None:
        fail("flywheel trainer works through a running gateway: give --gateway URL")
    aliases = _aliases_to_train(location, alias)
    overrides, launcher = field_values(set_ or []), launcher_of(launch)
    if threads:
        import torch

        torch.set_num_threads(threads)
    stop = threading.Event()
    _stop_after_the_round(stop)
    with tempfile.TemporaryDirectory(prefix="flywheel-trainer-") as scratch:
        where = AdminApi(location.url, location.admin_key, workdir=None if shared else (workdir or Path(scratch)))
        typer.echo(f"trainer worker for {location.url}: aliases {', '.join(aliases)}; "
                   f"{'shared adapter directory' if shared else f'uploads from {where.workdir}'}")
        rounds = failed = 0
        while not stop.is_set():
            trained = False
            for name in aliases:
                started = time.monotonic()
                try:
                    outcome = run_round(where, name, max_groups=None, overrides=overrides, base_model=base_model,
                                        launcher=launcher)
                except RoundError as exc:  # the gateway is down, or refused (another worker holds the round)
                    typer.echo(f"{_now()} {name}: {exc}")
                    continue
                except Exception as exc:  # run_round recorded the failure with the gateway; the next round retries
                    failed += 1
                    typer.echo(f"{_now()} {name}: round failed: {type(exc).__name__}: {exc}")
                    continue
                if outcome.status == "nothing":
                    continue
                trained, rounds = True, rounds + 1
                typer.echo(f"{_now()} {name}: {describe_round(outcome, promote=False)} "
                           f"({time.monotonic() - started:.0f} s)")
            if once:
                break
            if not trained:
                stop.wait(poll_s)
        typer.echo(f"trainer worker stopped: {rounds} rounds trained, {failed} failed")


def _aliases_to_train(location: Location, wanted: list[str] | None) -> list[str]:
    """The gateway's aliases (only ``wanted``, each checked); refuses a gateway that trains by itself."""
    entries = admin_call(location, "GET", "/flywheel/v1/status", timeout_s=30)["aliases"]
    served = [entry["alias"] for entry in entries]
    if not any(entry["loop"].get("workers") for entry in entries):
        fail(f"the gateway at {location.url} trains in its own process: set [train] workers = true there to hand "
             "rounds to trainer workers")
    unknown = [name for name in wanted or [] if name not in served]
    if unknown:
        fail(f"--alias: the gateway serves no alias named {unknown[0]!r} (it serves {', '.join(served)})")
    return wanted or served


def _stop_after_the_round(stop: threading.Event) -> None:
    """The first SIGTERM or Ctrl-C stops after the round in progress; a second one stops at once."""

    def handler(signum: int, frame: object) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()
        typer.echo("stopping after the round in progress (again to stop now)")

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def _now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S")
