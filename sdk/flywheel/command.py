"""The ``flywheel`` command's entry point: the gateway's CLI, or one line saying how to install it.

``pip install flywheel-rl`` is the light SDK; the command runs the server parts, which come with
``flywheel-rl[gateway]`` (serving) and ``flywheel-rl[train]`` (training).
"""

from __future__ import annotations

import sys

# What the [gateway] extra installs; an import error naming one of these means the extra is missing.
GATEWAY_MODULES = frozenset({"fastapi", "starlette", "uvicorn", "aiohttp", "pyarrow", "orjson", "pydantic_settings",
                             "typer", "prometheus_client", "sqlmodel", "sqlalchemy", "duckdb", "duckdb_engine",
                             "pytz", "apscheduler", "litellm", "click"})


def main() -> None:
    try:
        from flywheel.gateway.cli import main as cli_main
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] not in GATEWAY_MODULES:
            raise
        sys.stderr.write(f"error: the flywheel command needs the gateway, which is not installed ({exc.name} is "
                         "missing): pip install 'flywheel-rl[gateway]' (add [train] to train models)\n")
        raise SystemExit(2) from None
    cli_main()  # usage errors and failures: one line (flywheel.gateway.cli.main.main)
