"""``LocalBackend``: ART's local backend as a gateway of its own, in a child process, with no GPU required.

    async with LocalBackend(path="./.flywheel") as backend:
        model = flywheel.TrainableModel(name="agent", project="demo", base_model="Qwen/Qwen2.5-0.5B-Instruct")
        await model.register(backend)          # starts `python -m flywheel.gateway serve` serving model.base_model
        ...                                    # rollouts, backend.train(model, groups), ...
    # the gateway is stopped here, also when the block raised

Each registered model is an alias named ``model.name`` serving ``model.base_model``: an HF id in the
local HF cache, a model directory, or ``"tiny"`` (the offline test model), with the local engine
(transformers + peft; CPU or GPU) — or, given ``vllm_base_url``, through a vLLM server started with
``--enable-lora`` (the gateway hot-loads each new adapter into it; training loads ``base_model``
locally). Registering a model the running gateway does not serve yet restarts it with the new
configuration; the data (``path``/data) persists across restarts and runs. The gateway's own loop
is off: every training step is one the program asks for, served at once, as in ART.

The child is stopped by ``close()``, by leaving the ``with`` block, and at interpreter exit:
terminate, wait, then kill — always the process this object started, never one found by name.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import secrets
import subprocess
import sys
import weakref
from pathlib import Path
from types import TracebackType

from flywheel.backend import Closed, Gateway
from flywheel.errors import GatewayStartError, MissingExtraError
from flywheel.model import Model

__all__ = ["LocalBackend"]

_SERVER_MODULES = ("fastapi", "uvicorn", "duckdb", "sqlmodel", "litellm")
_TRAIN_MODULES = ("torch", "transformers", "peft", "trl")
_STOP_WAIT_S = 30.0


def check_installed() -> None:
    """Raise :class:`MissingExtraError` naming the extra when the gateway or the trainer is not installed."""
    for modules, extra in ((_SERVER_MODULES, "gateway"), (_TRAIN_MODULES, "train")):
        missing = [name for name in modules if importlib.util.find_spec(name) is None]
        if missing:
            raise MissingExtraError(f"LocalBackend runs a gateway that serves and trains models; {', '.join(missing)} "
                                    f"not installed: pip install 'flywheel-rl[{extra}]'")


def _stop(holder: list[subprocess.Popen[bytes]]) -> None:
    """Terminate, wait, then kill the process in ``holder`` (a list, so a finalizer can hold it without the backend)."""
    while holder:
        process = holder.pop()
        if process.poll() is not None:
            continue
        process.terminate()
        try:
            process.wait(timeout=_STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=_STOP_WAIT_S)


def _toml(value: str) -> str:
    return json.dumps(value)  # a JSON string is a TOML basic string


class LocalBackend(Gateway):
    """A backend that runs its own gateway (see the module docstring); making one raises
    :class:`MissingExtraError` when ``flywheel-rl[train]`` is not installed.

    Args:
        path: where the gateway keeps its configuration, log and data (default ``./.flywheel``).
        port: the loopback port to serve on (default: a free one).
        vllm_base_url, vllm_api_key: serve through this vLLM server (``http://host:port/v1``)
            instead of the in-process local engine.
        extra_config: more TOML for the gateway's configuration (``[train] args = {...}``, ``[judge]``, ...).
        startup_timeout_s: how long to wait for the gateway to answer (loading a model takes a while).
    """

    def __init__(self, *, path: str | os.PathLike[str] | None = None, port: int | None = None,
                 vllm_base_url: str | None = None, vllm_api_key: str | None = None, extra_config: str = "",
                 startup_timeout_s: float = 600.0) -> None:
        check_installed()  # before the port: a free one comes from the gateway package
        from flywheel.gateway.core.processes import free_port

        self.path = Path(path or ".flywheel").resolve()
        self.port = port or free_port()
        super().__init__(f"http://127.0.0.1:{self.port}", admin_key=secrets.token_urlsafe(24))
        self.vllm_base_url = vllm_base_url
        self._vllm_api_key = vllm_api_key
        self.extra_config = extra_config
        self.startup_timeout_s = startup_timeout_s
        self.models: dict[str, str] = {}  # alias -> base model
        self._process: list[subprocess.Popen[bytes]] = []
        self._finalizer = weakref.finalize(self, _stop, self._process)  # also runs at interpreter exit

    @property
    def config_file(self) -> Path:
        return self.path / "flywheel.toml"

    @property
    def log_file(self) -> Path:
        return self.path / "gateway.log"

    @property
    def process(self) -> subprocess.Popen[bytes] | None:
        """The gateway process this backend started (None before the first ``register`` and after ``close``)."""
        return self._process[0] if self._process else None

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def close(self) -> Closed:
        """Stop the gateway (terminate, wait, kill) and release the connections."""
        _stop(self._process)
        return super().close()

    async def __aenter__(self) -> LocalBackend:
        return self

    def __enter__(self) -> LocalBackend:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    async def register(self, model: Model) -> None:
        """Serve ``model`` (restarting the gateway when it is new to it), then point the model at it."""
        base_model = getattr(model, "base_model", None)
        if base_model is None:
            raise ValueError(f"LocalBackend serves trainable models; {model.name!r} has no base_model")
        if self.models.get(model.name) != base_model or not self.running:
            self.models[model.name] = base_model
            await asyncio.to_thread(self.restart)
        await super().register(model)

    def configuration(self) -> str:
        """The gateway's TOML configuration for the registered models."""
        lines = [f"data_dir = {_toml(str(self.path / 'data'))}", 'log_level = "warning"',
                 self.extra_config,  # before the tables below: its top-level keys stay top-level
                 f"[routing]\ndefault = {_toml(next(iter(self.models)))}"]
        if "[loop" not in self.extra_config:  # ART's steps only: the loop would train (and gate) the same groups
            lines.append("[loop]\nenabled = false")
        if self.vllm_base_url:
            lines.append(f"[engines.vllm]\nbase_url = {_toml(self.vllm_base_url)}")
        engines = {base: f"local{i}" for i, base in enumerate(dict.fromkeys(self.models.values()))}
        for alias, base in self.models.items():
            if self.vllm_base_url:
                lines.append(f"[aliases.{_toml(alias)}]\nengine = \"vllm\"\nbase_model = {_toml(base)}\n"
                             f"train_model = {_toml(base)}")
            else:
                lines.append(f"[aliases.{_toml(alias)}]\nengine = {_toml(engines[base])}")
        if not self.vllm_base_url:
            lines += [f"[engines.{name}]\nmodel = {_toml(base)}" for base, name in engines.items()]
        return "\n".join(lines) + "\n"

    def restart(self) -> None:
        """(Re)start the gateway with the current configuration and wait until it answers."""
        if self.closed:
            raise GatewayStartError(f"{self!r} is closed")
        from flywheel.gateway.core.processes import NotAnswering, wait_until_answering

        _stop(self._process)
        self.path.mkdir(parents=True, exist_ok=True)
        self.config_file.write_text(self.configuration())
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "FLYWHEEL_AUTH__ADMIN_KEY": str(self.admin_key)}
        if self._vllm_api_key:
            env["FLYWHEEL_ENGINES__VLLM__API_KEY"] = self._vllm_api_key  # secrets by environment, never in files
        with self.log_file.open("ab") as log:
            self._process.append(subprocess.Popen(
                [sys.executable, "-m", "flywheel.gateway", "serve", "--config", str(self.config_file), "--port",
                 str(self.port)], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env))
        try:  # any answer: it serves (a 503 only says an engine is down)
            wait_until_answering(self.url, self._process[0], timeout_s=self.startup_timeout_s)
        except NotAnswering as exc:
            _stop(self._process)
            raise GatewayStartError(f"the gateway did not start: {exc}:\n{self._log_tail()}") from exc

    def _log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"
