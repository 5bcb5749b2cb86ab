"""How ``flywheel`` commands find the running gateway by themselves: ``<data_dir>/gateway.json``.

The gateway writes its local URL and pid there when it is ready and removes the file when it
stops; a command reads it (``gateway/cli/common.py: locate``) and talks to the admin API, since
the store file is the gateway's while it runs.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from gateway.config import Settings

FILE = "gateway.json"


def local_url(settings: Settings) -> str:
    """How a process on this machine reaches the gateway (the CLI, the loop's training child)."""
    host = "127.0.0.1" if settings.host in ("0.0.0.0", "::", "") else settings.host
    return f"http://{host}:{settings.port}"


def announce(settings: Settings) -> Path:
    path = settings.data_dir / FILE
    path.write_text(json.dumps({"url": local_url(settings), "pid": os.getpid()}) + "\n")
    return path


def withdraw(path: Path) -> None:
    with contextlib.suppress(OSError, ValueError):
        if json.loads(path.read_text()).get("pid") == os.getpid():  # not a newer gateway's
            path.unlink()


def announced_url(data_dir: Path) -> str | None:
    """The URL a gateway announced in ``data_dir``, if one did and its process is alive."""
    try:
        record = json.loads((data_dir / FILE).read_text())
        os.kill(int(record["pid"]), 0)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return str(record["url"])
