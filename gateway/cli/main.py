"""The ``flywheel`` command.

Examples::

    flywheel serve                         # tiny model, local engine, ./flywheel-data
    flywheel serve --config deploy/flywheel.example.toml
    flywheel tiny-model ./tiny             # build the offline test model
"""

from __future__ import annotations

import faulthandler
import os
from pathlib import Path
from typing import Annotated

import httpx
import typer

from flywheel.gateway.cli import autorl, demo, export_adapter, jobs, loop, worker
from flywheel.gateway.cli.common import ConfigOption, fail, settings_or_exit
from flywheel.gateway.cli.preflight import PreflightError, preflight
from flywheel.gateway.cli.trajectories import trajectories_app
from flywheel.gateway.core.log_setup import configure_logging

app = typer.Typer(help="Flywheel: an OpenAI-compatible gateway that learns from its own traffic.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  rich_markup_mode=None)

app.add_typer(trajectories_app, name="trajectories")
app.command("groups")(jobs.groups)
app.command("score")(jobs.score)
app.command("train")(jobs.train)
app.command("trainer")(worker.trainer)
app.command("status")(loop.status)
app.command("versions")(loop.versions)
app.command("promote")(loop.promote)
app.command("rollback")(loop.rollback)
app.command("autorl")(autorl.autorl)
app.command("demo")(demo.demo)
app.command("export-adapter")(export_adapter.export_adapter)

@app.command()
def serve(config: ConfigOption = None,
          host: Annotated[str | None, typer.Option(help="Address to listen on.")] = None,
          port: Annotated[int | None, typer.Option(help="Port to listen on.")] = None,
          data_dir: Annotated[Path | None, typer.Option(help="Where the gateway keeps its files.")] = None,
          allow_unauthenticated: Annotated[bool, typer.Option(
              "--allow-unauthenticated", help="Listen on a non-loopback host with no client or admin key "
                                             "(refused otherwise; docs/security.md).")] = False,
          ) -> None:
    """Run the gateway.

    Example: flywheel serve --port 8000
    """
    import uvicorn

    from flywheel.gateway.serving.app import build_app

    settings = settings_or_exit(config, host=host, port=port, data_dir=data_dir)
    try:
        preflight(settings, allow_unauthenticated=allow_unauthenticated, environ=os.environ)
    except PreflightError as exc:
        fail(str(exc))
    configure_logging(settings)  # redacted, uvicorn's loggers included (log_config=None)
    # asyncio's own loop: uvloop crashes this process on the training child's pipe (docs/gateway.md, "Two processes")
    uvicorn.run(build_app(settings), host=settings.host, port=settings.port, log_config=None,
                log_level=settings.log_level, timeout_graceful_shutdown=30, loop="asyncio")


@app.command("tiny-model")
def tiny_model(path: Annotated[Path, typer.Argument(help="Directory to write the model into.")],
               seed: Annotated[int, typer.Option(help="Random seed; same seed, same model.")] = 0) -> None:
    """Build the tiny offline model (Qwen2 architecture, random init, BPE tokenizer).

    Example: flywheel tiny-model ./tiny --seed 0
    """
    from flywheel.trainer.tiny_model import build_tiny_model

    out = build_tiny_model(path, seed=seed)
    typer.echo(f"tiny model written to {out}")


def main() -> None:
    """The ``flywheel`` command. Bad usage is one ``error:`` line and exit status 2; a file or connection that
    fails (a path that cannot be written, a gateway that stops answering) one line and status 1."""
    faulthandler.enable()  # a crash in native code (torch, tokenizers) leaves every thread's Python stack in the log
    try:
        code = app(standalone_mode=False)
    except typer.TyperException as exc:  # a usage error: one line, not the usage text
        typer.echo(f"error: {exc.format_message()}", err=True)
        raise SystemExit(exc.exit_code) from None
    except typer.Abort:
        typer.echo("error: aborted", err=True)
        raise SystemExit(1) from None
    except OSError as exc:
        where = f" {exc.filename}" if exc.filename else ""
        typer.echo(f"error: cannot use{where}: {exc.strerror or exc}", err=True)
        raise SystemExit(1) from None
    except httpx.HTTPError as exc:
        typer.echo(f"error: the gateway call failed: {type(exc).__name__}: {exc}", err=True)
        raise SystemExit(1) from None
    raise SystemExit(code if isinstance(code, int) else 0)
