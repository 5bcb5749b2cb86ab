"""The ``flywheel`` command.

Examples::

    flywheel serve                         # tiny model, local engine, ./flywheel-data
    flywheel serve --config deploy/flywheel.example.toml
    flywheel tiny-model ./tiny             # build the offline test model
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer

from gateway.cli import autorl, demo, export_adapter, jobs, loop
from gateway.cli.common import ConfigOption, settings_or_exit
from gateway.cli.trajectories import trajectories_app

app = typer.Typer(help="Flywheel: an OpenAI-compatible gateway that learns from its own traffic.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  rich_markup_mode=None)

app.add_typer(trajectories_app, name="trajectories")
app.command("groups")(jobs.groups)
app.command("score")(jobs.score)
app.command("train")(jobs.train)
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
