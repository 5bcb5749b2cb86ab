"""The ``flywheel`` command.

Examples::

    flywheel serve                         # tiny model, local engine, ./flywheel-data
    flywheel serve --config deploy/flywheel.example.toml
    flywheel tiny-model ./tiny             # build the offline test model
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError

from gateway import cli_jobs
from gateway.cli_trajectories import trajectories_app
from gateway.config import Settings, load_settings

app = typer.Typer(help="Flywheel: an OpenAI-compatible gateway that learns from its own traffic.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  rich_markup_mode=None)

app.add_typer(trajectories_app, name="trajectories")
app.command("groups")(cli_jobs.groups)
app.command("score")(cli_jobs.score)
app.command("train")(cli_jobs.train)

ConfigOption = Annotated[Path | None, typer.Option("--config", "-c", help="TOML configuration file.")]


def fail(message: str) -> None:
    """One line on stderr and a non-zero exit: the CLI's way to report bad input."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code=2)


def settings_or_exit(config: Path | None, **overrides: Any) -> Settings:
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
    raise AssertionError("unreachable")


@app.command()
def serve(config: ConfigOption = None,
          host: Annotated[str | None, typer.Option(help="Address to listen on.")] = None,
          port: Annotated[int | None, typer.Option(help="Port to listen on.")] = None,
          data_dir: Annotated[Path | None, typer.Option(help="Where the gateway keeps its files.")] = None,
          ) -> None:
    """Run the gateway.

    Example: flywheel serve --port 8000
    """
    import uvicorn

    from gateway.app import build_app

    settings = settings_or_exit(config, host=host, port=port, data_dir=data_dir)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    uvicorn.run(build_app(settings), host=settings.host, port=settings.port,
                log_level=settings.log_level, timeout_graceful_shutdown=30)


@app.command("tiny-model")
def tiny_model(path: Annotated[Path, typer.Argument(help="Directory to write the model into.")],
               seed: Annotated[int, typer.Option(help="Random seed; same seed, same model.")] = 0) -> None:
    """Build the tiny offline model (Qwen2 architecture, random init, BPE tokenizer).

    Example: flywheel tiny-model ./tiny --seed 0
    """
    from trainer.tiny_model import build_tiny_model

    out = build_tiny_model(path, seed=seed)
    typer.echo(f"tiny model written to {out}")
