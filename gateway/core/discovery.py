"""How ``flywheel`` commands find the running gateway by themselves: ``<data_dir>/gateway.json``.

The gateway writes its local URL and pid there when it is ready and removes the file when it
stops; a command reads it (``gateway/cli/common.py: locate``) and talks to the admin API, since
the store file is the gateway's while it runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from pathlib import Path

import httpx

from flywheel.gateway.core.config import Settings

FILE = "gateway.json"


def local_url(settings: Settings) -> str:
    """How a process on this machine reaches the gateway (the CLI, the loop's training child)."""
    host = "127.0.0.1" if settings.host in ("0.0.0.0", "::", "") else settings.host
    return f"http://{host}:{settings.port}"


async def announce_when_listening(settings: Settings, timeout_s: float = 120.0) -> None:
    """Write ``gateway.json`` once the server accepts connections (the lifespan runs before it listens)."""
    url = local_url(settings)
    deadline = asyncio.get_running_loop().time() + timeout_s
    async with httpx.AsyncClient(timeout=2.0) as client:
        while asyncio.get_running_loop().time() < deadline:
            try:
                await client.get(url + "/healthz")
                break
            except httpx.TransportError:
                await asyncio.sleep(0.05)
    (settings.data_dir / FILE).write_text(json.dumps({"url": url, "pid": os.getpid()}) + "\n")


def withdraw(settings: Settings) -> None:
    path = settings.data_dir / FILE
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
