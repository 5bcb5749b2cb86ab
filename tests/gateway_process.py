"""Run a real gateway (``python -m flywheel.gateway serve``) on a free loopback port for a test."""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
from pathlib import Path
from typing import ClassVar

import psutil

from flywheel.gateway.core.processes import NotAnswering, free_port, wait_until_answering


class GatewayProcess:
    """A gateway subprocess (and its store process); stopped by its handle (terminate, wait, then kill).

    Every started process is in ``running`` until stopped; the test session stops whatever a
    test left running (``tests/conftest.py``), and an exit hook catches the rest.
    """

    running: ClassVar[set[GatewayProcess]] = set()

    def __init__(self, tmp: Path, config_toml: str, *, name: str = "gateway") -> None:
        """``config_toml`` is the TOML body; ``data_dir`` and ``log_level`` are set here.

        Without a ``[loop]`` table of its own the loop is off: most tests run its jobs by hand
        (the admin API, the CLI) and a scheduler acting meanwhile would race them; the loop's
        own tests configure it.
        """
        if "[loop" not in config_toml:
            config_toml += "\n[loop]\nenabled = false\n"
        self.port = free_port()
        self.dir = tmp / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.config_file = self.dir / "flywheel.toml"
        self.config_file.write_text(f'data_dir = "{self.dir / "data"}"\nlog_level = "warning"\n{config_toml}')
        self.log_file = self.dir / "gateway.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.children: list[psutil.Process] = []  # the store process

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 90.0) -> GatewayProcess:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with self.log_file.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "flywheel.gateway", "serve", "--config", str(self.config_file),
                 "--port", str(self.port)], stdout=log, stderr=subprocess.STDOUT, env=env)
        GatewayProcess.running.add(self)
        try:
            wait_until_answering(self.url, self.proc, timeout_s=timeout_s)
        except NotAnswering as exc:
            self.stop()
            raise RuntimeError(f"the gateway did not start: {exc}:\n{self.log_file.read_text()}") from exc
        self.children = psutil.Process(self.proc.pid).children(recursive=True)
        return self

    @property
    def store_process(self) -> psutil.Process:
        (store,) = [p for p in self.children if "flywheel.gateway.storeproc.main" in p.cmdline()]
        return store

    def stop(self) -> None:
        """Stop the gateway, and wait until its store process is gone too (it releases the DuckDB file)."""
        GatewayProcess.running.discard(self)
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        _, alive = psutil.wait_procs(self.children, timeout=30)  # a killed gateway's store process exits itself
        for child in alive:
            child.kill()


@atexit.register
def _stop_leftovers() -> None:
    for gateway in list(GatewayProcess.running):
        gateway.stop()
