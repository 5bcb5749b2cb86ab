"""uvicorn's server, woken once a second when idle rather than ten times; the store process serves on it.

uvicorn's main loop sleeps 0.1 s between looks at whether it should stop: ten trips a second through the event
loop of a process with nothing to do (docs/benchmarks.md, "Loop bookkeeping cost"). :class:`QuietServer` looks once
a second. A SIGINT or SIGTERM still stops it at once: while it waits, those go to an asyncio signal handler, which
wakes the loop (uvicorn's ``signal.signal`` handler would run only at the next look).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import threading
from typing import Any

import uvicorn
from uvicorn.server import HANDLED_SIGNALS, STARTUP_FAILURE

TICK_S = 1.0


class QuietServer(uvicorn.Server):
    async def main_loop(self) -> None:
        stop = asyncio.Event()
        listened = self._listen(stop)
        try:
            counter = 0
            while not await self.on_tick(counter):
                counter = (counter + 10) % 864_000  # every tick is one of on_tick's once-a-second ones (the date)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(TICK_S):
                        await stop.wait()
        finally:
            for sig in listened:
                asyncio.get_running_loop().remove_signal_handler(sig)
                signal.signal(sig, self.handle_exit)  # uvicorn's own for the shutdown: a second SIGINT forces it

    def _listen(self, stop: asyncio.Event) -> tuple[signal.Signals, ...]:
        """The stop signals, handled on the loop while it waits (only the main thread may handle signals)."""
        if threading.current_thread() is not threading.main_thread():
            return ()

        def handle(sig: signal.Signals) -> None:
            self.handle_exit(sig, None)
            stop.set()

        for sig in HANDLED_SIGNALS:
            asyncio.get_running_loop().add_signal_handler(sig, handle, sig)
        return HANDLED_SIGNALS


def run(app: Any, **options: Any) -> None:
    """``uvicorn.run(app, **options)`` on a :class:`QuietServer` (one process, no reload)."""
    config = uvicorn.Config(app, **options)
    server = QuietServer(config)
    try:
        with contextlib.suppress(KeyboardInterrupt):
            server.run()
    finally:
        if config.uds and os.path.exists(config.uds):
            os.remove(config.uds)
    if not server.started:
        sys.exit(STARTUP_FAILURE)
