"""Process-level helpers: tuning shared by the gateway process and the store process, and what starts a
server process needs (a free loopback port, a bounded wait until it answers)."""

from __future__ import annotations

import contextlib
import gc
import socket
import subprocess
import time
from typing import Any


class NotAnswering(RuntimeError):
    """A started server exited, or did not answer within its deadline."""


def tune_gc() -> None:
    """Fewer, cheaper collections for a server process, called once it has started: every request or
    captured turn allocates thousands of short-lived containers (freed by refcount), and full
    collections walked every object imported at startup (docs/engineering-notes.md, "The store").
    Frozen startup objects and a 10k gen-0 threshold take most of it away."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, 50, 100)


def free_ports(n: int) -> list[int]:
    """``n`` distinct loopback ports nothing listens on; each socket stays bound until all are chosen."""
    with contextlib.ExitStack() as sockets:
        bound = [sockets.enter_context(socket.socket()) for _ in range(n)]
        for sock in bound:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in bound]


def free_port() -> int:
    """A loopback port nothing listens on (the server started next binds it)."""
    return free_ports(1)[0]


def stop(process: subprocess.Popen[Any], grace_s: float = 60.0) -> None:
    """SIGTERM, then SIGKILL if ``process`` has not exited within ``grace_s``."""
    process.terminate()
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        process.kill()


def wait_until_answering(url: str, process: subprocess.Popen[Any] | None = None, *, timeout_s: float,
                         require_ok: bool = False, path: str = "/healthz") -> None:
    """Poll ``url + path`` until the server answers: with any status (a 503 from /healthz only says an
    engine is down), or with a 2xx when ``require_ok``. Raise :class:`NotAnswering` when ``process``
    exits first or ``timeout_s`` passes."""
    import httpx  # here, not at the top: the store process imports this module and needs no HTTP client

    deadline = time.monotonic() + timeout_s
    last_status: int | None = None
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise NotAnswering(f"the process exited with status {process.returncode} before {url}{path} answered")
        try:
            last_status = httpx.get(url + path, timeout=2.0).status_code
            if not require_ok or 200 <= last_status < 300:
                return
        except httpx.TransportError:  # not listening yet, or too busy starting to answer
            pass
        time.sleep(0.1)  # a bounded poll of another process: the deadline ends it
    answered = f" with a 2xx (last answer: {last_status})" if last_status is not None else ""
    raise NotAnswering(f"{url}{path} did not answer{answered} within {timeout_s:g} s")
