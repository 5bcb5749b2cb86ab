"""ART's models: a prompted ``Model`` to compare against, and the ``TrainableModel`` a backend trains.

    model = flywheel.TrainableModel(name="agent", project="tic-tac-toe", base_model="Qwen/Qwen2.5-7B-Instruct")
    await model.register(backend)              # flywheel.Gateway(url) or LocalBackend()
    client = model.openai_client()             # AsyncOpenAI at the gateway; calls are captured
    await model.train(groups, config=flywheel.TrainConfig(learning_rate=1e-5))
    await model.get_step()                     # the adapter version the gateway serves now

``model.name`` is the gateway alias the rollouts send as ``model=`` and that training updates.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

import openai
from pydantic import BaseModel, PrivateAttr

from flywheel.errors import NotRegisteredError
from flywheel.tagging import install_tagging
from flywheel.trajectories import Trajectory, TrajectoryGroup
from flywheel.types import USE_DEFAULT, TrainConfig, TrainResult, UseDefault

__all__ = ["Model", "TrainableModel"]

_INFERENCE_TIMEOUT = openai.Timeout(1200.0, connect=5.0)  # long agent turns; openai's own type (3.x: httpx2)


class Backend(Protocol):
    """What a model asks of the backend it is registered with (``flywheel.Gateway``, ``LocalBackend``)."""

    async def register(self, model: Model) -> None: ...

    async def train(self, model: TrainableModel, trajectory_groups: Iterable[TrajectoryGroup], *,
                    learning_rate: float | UseDefault = USE_DEFAULT, beta: float | UseDefault = USE_DEFAULT,
                    _args: dict[str, Any] | None = None, verbose: bool = False) -> TrainResult: ...

    async def _get_step(self, model: Model) -> int: ...

    async def _log(self, model: Model, trajectory_groups: list[TrajectoryGroup], split: str) -> None: ...

    async def _delete_checkpoints(self, model: TrainableModel, best_checkpoint_metric: str) -> None: ...


class Model(BaseModel):
    """A model a rollout can call: its name, where it is served, and (once registered) its backend."""

    name: str
    project: str
    config: Any = None
    inference_api_key: str | None = None
    inference_base_url: str | None = None
    inference_model_name: str | None = None

    _backend: Backend | None = PrivateAttr(default=None)
    _openai_client: openai.AsyncOpenAI | None = PrivateAttr(default=None)

    @property
    def trainable(self) -> bool:
        return False

    def backend(self) -> Backend:
        if self._backend is None:
            raise NotRegisteredError(f"model {self.name!r} is not registered: call `await model.register(backend)`")
        return self._backend

    async def register(self, backend: Backend) -> None:
        """Attach the backend (used by ``log``)."""
        self._backend = backend

    def get_inference_name(self) -> str:
        """The model name requests send: ``inference_model_name``, else ``name``."""
        return self.inference_model_name or self.name

    def openai_client(self) -> openai.AsyncOpenAI:
        """An ``AsyncOpenAI`` client for the model (one per model), tagging calls made inside rollouts."""
        if self._openai_client is None:
            if self.inference_base_url is None:
                raise NotRegisteredError(f"model {self.name!r} has no inference_base_url: register it with a "
                                         "backend first (or set inference_base_url for a prompted model)")
            client = openai.AsyncOpenAI(base_url=self.inference_base_url, api_key=self.inference_api_key or "unused",
                                        timeout=_INFERENCE_TIMEOUT)
            install_tagging(client)
            self._openai_client = client
        return self._openai_client

    async def log(self, trajectories: Iterable[Trajectory | BaseException] | Iterable[TrajectoryGroup],
                  split: str = "val") -> None:
        """Store evaluation metrics of these trajectories for the version served now (``{split}/reward``, ...)."""
        items = list(trajectories)
        if all(isinstance(item, TrajectoryGroup) for item in items):
            groups = [item for item in items if isinstance(item, TrajectoryGroup)]
        else:
            groups = [TrajectoryGroup([item for item in items if not isinstance(item, TrajectoryGroup)])]
        await self.backend()._log(self, groups, split)


class TrainableModel(Model):
    """A model the backend trains: a LoRA over ``base_model``, served under the alias ``name``.

    ``base_model`` is what ``LocalBackend`` serves: an HF id in the local HF cache, a local model
    directory, or ``"tiny"`` (the offline test model). A running ``Gateway`` serves what its
    configuration says; there ``base_model`` is informative.
    """

    base_model: str

    @property
    def trainable(self) -> bool:
        return True

    async def register(self, backend: Backend) -> None:
        """Prepare the backend to serve and train this model and point the inference fields at it."""
        await backend.register(self)
        self._backend = backend
        self._openai_client = None  # a client made before registering points at the old address

    async def get_step(self) -> int:
        """The adapter version the gateway serves for this model now (0: the base model)."""
        return await self.backend()._get_step(self)

    async def train(self, trajectory_groups: Iterable[TrajectoryGroup], config: TrainConfig | None = None,
                    _config: dict[str, Any] | None = None, verbose: bool = False) -> TrainResult:
        """Train one step on these groups and serve the result at once (ART's older form of ``backend.train``).

        ``config``'s explicitly set fields override the gateway's training settings; ``_config`` may
        add other GRPO settings by name (ART's unstable dev config, here ``trainer/grpo_args.py: GRPOArgs``).
        """
        settings = {} if config is None else {name: getattr(config, name) for name in config.model_fields_set}
        return await self.backend().train(self, trajectory_groups, learning_rate=settings.get("learning_rate",
                                          USE_DEFAULT), beta=settings.get("beta", USE_DEFAULT),
                                          _args=_config, verbose=verbose)

    async def delete_checkpoints(self, best_checkpoint_metric: str = "val/reward") -> None:
        """Delete the adapter files of every version but the latest and the best by ``best_checkpoint_metric``
        (``split/metric`` as stored by ``log``); the serving version and a canary are always kept."""
        await self.backend()._delete_checkpoints(self, best_checkpoint_metric)
