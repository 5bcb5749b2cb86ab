"""Embedded defaults, as a new user meets them: `flywheel serve` with no configuration and no admin key,
then the CLI with no flags, from the same directory.

The commands find the running gateway by themselves (``flywheel-data/gateway.json``) and its
admin API answers loopback callers — also on the store-backed routes, which the store process
serves for the gateway (it learns the caller's address from it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai

from flywheel.gateway.core.processes import free_port


def flywheel(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "flywheel.gateway", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})


def test_serve_on_defaults_then_every_command_with_no_flags(tmp_path: Path) -> None:
    port = free_port()  # the only thing given: port 8000 may be taken on a shared machine
    gateway = subprocess.Popen([sys.executable, "-m", "flywheel.gateway", "serve", "--port", str(port)], cwd=tmp_path,
                               stdout=subprocess.DEVNULL, stderr=(tmp_path / "serve.log").open("wb"),
                               env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        announced = tmp_path / "flywheel-data" / "gateway.json"
        deadline = time.monotonic() + 180
        while not announced.is_file():
            assert gateway.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the gateway never announced itself"
            time.sleep(0.2)
        url = json.loads(announced.read_text())["url"]
        assert url == f"http://127.0.0.1:{port}"
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=4)
        httpx.post(f"{url}/flywheel/v1/feedback", json={"completion_id": reply.id, "reward": 1.0},
                   timeout=30).raise_for_status()
        status = flywheel(tmp_path, "status")
        assert status.returncode == 0, status.stderr
        assert "flywheel serves version 0" in status.stdout and f"gateway {url}" in status.stdout
        groups = flywheel(tmp_path, "groups")  # a store-backed admin route, loopback, no key
        assert groups.returncode == 0 and groups.stdout.startswith("formed "), groups.stderr
        listed = flywheel(tmp_path, "trajectories", "list", "--json")
        assert listed.returncode == 0, listed.stderr
        assert [t["turn_count"] for t in json.loads(listed.stdout)["data"]] == [1]
        versions = flywheel(tmp_path, "versions")
        assert versions.returncode == 0 and "flywheel: versions" in versions.stdout, versions.stderr
        refused = flywheel(tmp_path, "promote", "3")
        assert refused.returncode == 2 and refused.stderr.startswith("error: ") and "no version 3" in refused.stderr
    finally:
        gateway.terminate()
        gateway.wait(timeout=60)
    assert not announced.exists()  # withdrawn on the way out
    offline = flywheel(tmp_path, "status")  # no gateway: the store file itself
    assert offline.returncode == 0 and "store file (no gateway running)" in offline.stdout, offline.stderr
