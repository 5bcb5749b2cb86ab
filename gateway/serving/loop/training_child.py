"""The loop's training round runs in a child process: ``python -m flywheel.gateway train --gateway URL``.

The same path a person runs by hand, so the serving process never holds torch's training memory.
The child runs at a lower CPU priority (``[loop] train_nice``) with its torch threads capped
(``train_threads``), so serving keeps the cores it needs; it talks to this gateway's admin API
(the admin key, if any, goes by environment, never on the command line where ``ps`` shows it).
Its output goes to ``<data_dir>/logs/``. A child that outlives ``train_timeout_s`` is killed.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flywheel.gateway.core.config import Settings


@dataclass
class ChildResult:
    returncode: int
    log_path: Path
    tail: str  # the end of its output, for the failure record
    timed_out: bool
    summary: dict[str, Any] | None  # the round's own report (``flywheel train --json``), when it got that far


class TrainingChild:
    """Starts, waits for and, on shutdown or timeout, stops one training child at a time per alias."""

    def __init__(self, settings: Settings, gateway_url: str) -> None:
        self.settings = settings
        self.gateway_url = gateway_url
        self.running: dict[str, asyncio.subprocess.Process] = {}

    def command(self, alias: str, group_ids: list[str] | None = None, overrides: list[str] | None = None) -> list[str]:
        loop = self.settings.loop
        command = [sys.executable, "-m", "flywheel.gateway",
                   "train", "--alias", alias, "--gateway", self.gateway_url, "--json"]
        if loop.train_threads:
            command += ["--threads", str(loop.train_threads)]
        if group_ids:
            command += ["--group-ids", ",".join(group_ids)]
        for override in overrides or []:
            command += ["--set", override]
        return command

    def environment(self) -> dict[str, str]:
        env = {**os.environ, "PYTHONFAULTHANDLER": "1", "PYTHONUNBUFFERED": "1"}
        threads = self.settings.loop.train_threads
        if threads:
            env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
        admin = self.settings.auth.admin_key
        if admin is not None:
            env["FLYWHEEL_ADMIN_KEY"] = admin.get_secret_value()
        return env

    async def run(self, alias: str, group_ids: list[str] | None = None, overrides: list[str] | None = None
                  ) -> ChildResult:
        logs = self.settings.data_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        log_path = logs / f"train-{alias}-{time.strftime('%Y%m%d-%H%M%S')}.log"
        nice = self.settings.loop.train_nice
        with log_path.open("wb") as out:
            process = await asyncio.create_subprocess_exec(
                *self.command(alias, group_ids, overrides), stdout=out, stderr=asyncio.subprocess.STDOUT,
                env=self.environment(), start_new_session=True, preexec_fn=(lambda: os.nice(nice)) if nice else None)
        self.running[alias] = process
        timed_out = False
        try:
            await asyncio.wait_for(process.wait(), self.settings.loop.train_timeout_s)
        except TimeoutError:
            timed_out = True
            await self._stop(process)
        finally:
            self.running.pop(alias, None)
        tail = log_path.read_bytes()[-4000:].decode(errors="replace")
        return ChildResult(process.returncode if process.returncode is not None else -9, log_path, tail, timed_out,
                           _summary(tail))

    async def stop_all(self) -> None:
        await asyncio.gather(*(self._stop(p) for p in list(self.running.values())))

    @staticmethod
    async def _stop(process: asyncio.subprocess.Process, grace_s: float = 10.0) -> None:
        if process.returncode is not None:
            return
        process.terminate()
        try:
            await asyncio.wait_for(process.wait(), grace_s)
        except TimeoutError:
            process.kill()
            await process.wait()


def _summary(output: str) -> dict[str, Any] | None:
    """The last line of the child's output that is a JSON object: its ``--json`` report."""
    for line in reversed(output.splitlines()):
        if line.startswith("{"):
            try:
                parsed = json.loads(line)
            except ValueError:
                continue
            return parsed if isinstance(parsed, dict) else None
    return None
