"""Flywheel's client SDK: tags and rewards for any agent, and an ART-compatible training API.

An agent needs no SDK to be captured: pointing its ``openai`` client's ``base_url`` at the gateway
is enough. The helpers tag conversations and report how they went::

    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="sk-...")
    with flywheel.trajectory(client, group_id="run-7") as t:       # `async with` for AsyncOpenAI
        reply = client.chat.completions.create(model="gpt-4o", messages=[...])
        t.reward = 1.0                                             # sent (and the trajectory closed) at exit
    flywheel.feedback(client, completion_id=reply.id, label="good")

OpenPipe ART code runs with ``import flywheel as art`` (docs/from-art.md lists every name and
difference)::

    backend = art.LocalBackend()                                   # or art.Gateway(url, admin_key=...)
    model = art.TrainableModel(name="agent", project="p", base_model="Qwen/Qwen2.5-7B-Instruct")
    await model.register(backend)
    groups = await art.gather_trajectory_groups(
        (art.TrajectoryGroup(rollout(model, s) for _ in range(8)) for s in scenarios))
    await model.train(groups, config=art.TrainConfig(learning_rate=1e-5))

Importing ``flywheel`` loads only ``openai``, ``httpx``, ``pydantic`` and ``rich``. RULER
(``flywheel.rewards``) and ``LocalBackend`` need the server parts (``flywheel-rl[gateway]``,
``[train]``).

Exceptions::

    FlywheelError
    ├── GatewayError                the gateway answered with an error: status_code, code, param
    │   ├── BadRequestError         400: the request named a bad value (param says which)
    │   ├── AuthenticationError     401: a missing or wrong client or admin key
    │   └── NotFoundError           404: no such alias, trajectory or version
    ├── GatewayConnectionError      the gateway could not be reached
    ├── GatewayStartError           LocalBackend's gateway did not start (its log tail included)
    ├── NotRegisteredError          (also ValueError) a model used before `await model.register(backend)`
    └── MissingExtraError           (also ImportError) a feature needs flywheel-rl[gateway] or [train]
"""

from __future__ import annotations

from flywheel import rewards
from flywheel.backend import Gateway
from flywheel.errors import (
    AuthenticationError,
    BadRequestError,
    FlywheelError,
    GatewayConnectionError,
    GatewayError,
    GatewayStartError,
    MissingExtraError,
    NotFoundError,
    NotRegisteredError,
)
from flywheel.gather import gather_trajectory_groups
from flywheel.local import LocalBackend
from flywheel.model import Model, TrainableModel
from flywheel.tagging import TrajectoryScope, feedback, headers, trajectory
from flywheel.trajectories import History, Trajectory, TrajectoryGroup
from flywheel.types import USE_DEFAULT, TrainConfig, TrainResult

__all__ = [
    "USE_DEFAULT",
    "AuthenticationError",
    "BadRequestError",
    "FlywheelError",
    "Gateway",
    "GatewayConnectionError",
    "GatewayError",
    "GatewayStartError",
    "History",
    "LocalBackend",
    "MissingExtraError",
    "Model",
    "NotFoundError",
    "NotRegisteredError",
    "TrainConfig",
    "TrainResult",
    "TrainableModel",
    "Trajectory",
    "TrajectoryGroup",
    "TrajectoryScope",
    "feedback",
    "gather_trajectory_groups",
    "headers",
    "rewards",
    "trajectory",
]
