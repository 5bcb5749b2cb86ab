"""Run a real gateway (``python -m gateway serve``) on a free loopback port for a test."""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import ClassVar

import httpx

from tests.scripted_openai import free_port


class GatewayProcess:
    """A gateway subprocess; stopped by its handle (terminate, wait, then kill).

    Every started process is in ``running`` until stopped; the test session stops whatever a
    test left running (``tests/conftest.py``), and an exit hook catches the rest.
    """

    running: ClassVar[set[GatewayProcess]] = set()

    def __init__(self, tmp: Path, config_toml: str, *, name: str = "gateway") -> None:
        """``config_toml`` is the TOML body; ``data_dir`` and ``log_level`` are set here."""
        self.port = free_port()
        self.dir = tmp / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.config_file = self.dir / "flywheel.toml"
        self.config_file.write_text(f'data_dir = "{self.dir / "data"}"\nlog_level = "warning"\n{config_toml}')
        self.log_file = self.dir / "gateway.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 90.0) -> GatewayProcess:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with self.log_file.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "gateway", "serve", "--config", str(self.config_file),
                 "--port", str(self.port)], stdout=log, stderr=subprocess.STDOUT, env=env)
        GatewayProcess.running.add(self)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited with {self.proc.returncode}:\n{self.log_file.read_text()}")
            try:
                httpx.get(self.url + "/healthz", timeout=2.0)
                return self
            except httpx.TransportError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"gateway did not answer within {timeout_s} s:\n{self.log_file.read_text()}")

    def stop(self) -> None:
        GatewayProcess.running.discard(self)
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)


@atexit.register
def _stop_leftovers() -> None:
    for gateway in list(GatewayProcess.running):
        gateway.stop()
