"""``flywheel.Gateway``: the admin API of a running gateway, and an ART backend over it.

    with flywheel.Gateway("http://127.0.0.1:8000", admin_key="...") as gateway:
        gateway.versions("agent")                          # the alias's adapter versions
        gateway.promote("agent", 3); gateway.rollback("agent")
        page = gateway.trajectories(alias="agent", since="1h", limit=50)

    backend = flywheel.Gateway("http://127.0.0.1:8000", admin_key="...")
    await model.register(backend)                          # model.name must be one of the gateway's aliases
    result = await backend.train(model, groups, learning_rate=1e-5)   # step, metrics, checkpoint_path

The admin methods are synchronous; the backend methods ART awaits (``register``, ``train``,
``close``) run the same calls on a worker thread, so one admin client (``flywheel/admin_client.py``, with its
injectable ``transport``) serves both. Training sends each group to ``POST /flywheel/v1/groups`` (stored
with its rewards) and then asks ``POST /flywheel/v1/aliases/{alias}/train`` for one round on
exactly those groups, promoted at once: ART serves the step it just trained.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Generator, Iterable, Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal

import httpx
from openai.types.chat.chat_completion import Choice
from pydantic_core import to_jsonable_python
from rich.console import Console

from flywheel.admin_client import TIMEOUT, AdminClient, AdminError, AdminUnreachable
from flywheel.errors import FlywheelError, GatewayConnectionError, GatewayError, NotFoundError, gateway_error
from flywheel.trajectories import Trajectory, TrajectoryGroup
from flywheel.types import USE_DEFAULT, TrainResult, UseDefault

if TYPE_CHECKING:
    from flywheel.model import Model, TrainableModel

__all__ = ["Closed", "Gateway"]


class Closed:
    """What ``close()`` returns: nothing to wait for, but awaitable, so ART's ``await backend.close()`` works."""

    def __await__(self) -> Generator[Any, None, None]:
        return
        yield  # a generator that finishes at once


def _trajectory_payload(trajectory: Trajectory, position: int) -> dict[str, Any]:
    """One trajectory as ``POST /flywheel/v1/groups`` takes it."""
    if trajectory.additional_histories:
        raise ValueError(f"trajectory {position}: additional_histories are not trained by Flywheel yet; "
                         "send each history as a trajectory of its own")
    return {"trajectory_id": trajectory.id,
            "messages": to_jsonable_python(trajectory.messages()),
            "choices": [i for i, item in enumerate(trajectory.messages_and_choices) if isinstance(item, Choice)],
            "tools": to_jsonable_python(trajectory.tools),
            "reward": trajectory.reward}


def group_payload(alias: str, group: TrajectoryGroup) -> dict[str, Any]:
    return {"alias": alias, "key": group.id,
            "trajectories": [_trajectory_payload(t, i) for i, t in enumerate(group.trajectories)]}


def eval_metrics(groups: list[TrajectoryGroup]) -> list[dict[str, Any]]:
    """Means over every trajectory: ``reward``, each metric, and the count of failed rollouts."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for trajectory in (t for group in groups for t in group):
        for name, value in {"reward": trajectory.reward, **trajectory.metrics}.items():
            sums[name] = sums.get(name, 0.0) + float(value)
            counts[name] = counts.get(name, 0) + 1
    metrics = [{"name": name, "value": sums[name] / counts[name], "n": counts[name]} for name in sums]
    failed = sum(len(group.exceptions) for group in groups)
    rollouts = failed + counts.get("reward", 0)
    if rollouts:
        metrics.append({"name": "exceptions", "value": float(failed), "n": rollouts})
    return metrics


class Gateway:
    """A client for a running gateway (``url`` without ``/v1``); also an ART backend.

    ``admin_key``: the gateway's admin key; left at ``USE_DEFAULT`` it is ``$FLYWHEEL_ADMIN_KEY``,
    ``None`` sends none (a gateway without an admin key answers loopback clients). ``api_key``: the
    client key registered models send. ``transport``: an ``httpx.BaseTransport`` to use instead of
    the network. ``closed`` turns true once ``close()`` ran; calls then raise.
    """

    def __init__(self, url: str, *, admin_key: str | UseDefault | None = USE_DEFAULT, api_key: str | None = None,
                 timeout: httpx.Timeout = TIMEOUT, transport: httpx.BaseTransport | None = None) -> None:
        self.url = url.rstrip("/").removesuffix("/v1")
        self.admin_key = os.environ.get("FLYWHEEL_ADMIN_KEY") if admin_key is USE_DEFAULT else admin_key
        self.api_key = api_key
        self.closed = False
        self._admin = AdminClient(self.url, self.admin_key, timeout=timeout, transport=transport)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r}{', closed' if self.closed else ''})"

    # -- lifetime

    def close(self) -> Closed:
        """Release the connections; ``await backend.close()`` works too (ART's form)."""
        if not self.closed:
            self.closed = True
            self._admin.close()
        return Closed()

    def __enter__(self) -> Gateway:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    async def __aenter__(self) -> Gateway:
        return self

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        self.close()

    # -- the admin API

    @contextmanager
    def _errors(self) -> Iterator[None]:
        """The admin client's failures as the SDK's errors; a closed gateway calls nothing."""
        if self.closed:
            raise FlywheelError(f"{self!r} is closed")
        try:
            yield
        except AdminUnreachable as exc:
            raise GatewayConnectionError(f"{exc.method} {exc.url} failed: {type(exc.cause).__name__}: "
                                         f"{exc.cause}") from exc
        except AdminError as exc:
            raise gateway_error(exc) from None

    def request(self, method: str, path: str, *, params: dict[str, Any] | None = None, json: Any = None,
                timeout: httpx.Timeout | UseDefault | None = USE_DEFAULT) -> Any:
        """One admin call; the decoded JSON answer, or the :class:`GatewayError` for its status."""
        with self._errors():
            return self._admin.call(method, path, params=params, json=json, timeout=timeout)

    def status(self) -> dict[str, Any]:
        """``GET /flywheel/v1/status``: per alias, what it serves and what the loop is doing."""
        answer: dict[str, Any] = self.request("GET", "/flywheel/v1/status")
        return answer

    def aliases(self) -> list[dict[str, Any]]:
        """Each alias with the adapter version it serves (0: the base model) and its in-flight requests."""
        answer: list[dict[str, Any]] = self.request("GET", "/flywheel/v1/aliases")["data"]
        return answer

    def alias(self, name: str) -> dict[str, Any]:
        for served in self.aliases():
            if served["alias"] == name:
                return served
        known = ", ".join(a["alias"] for a in self.aliases()) or "none"
        raise NotFoundError(f"the gateway at {self.url} has no alias {name!r} (aliases: {known}); name the model "
                            "after one, or add [aliases.<name>] to the gateway's configuration",
                            status_code=404, code="model_not_found", param="name")

    def versions(self, alias: str) -> list[dict[str, Any]]:
        """The alias's adapter versions: number, status, metrics, gate results."""
        answer: list[dict[str, Any]] = self.request("GET", f"/flywheel/v1/aliases/{alias}/versions")["data"]
        return answer

    def promote(self, alias: str, version: int) -> dict[str, Any]:
        """Serve ``version`` now (no gate)."""
        answer: dict[str, Any] = self.request("POST", f"/flywheel/v1/aliases/{alias}/promote",
                                              json={"version": version})
        return answer

    def rollback(self, alias: str, version: int | None = None) -> dict[str, Any]:
        """Serve ``version`` again, or (None) the version served before the current one."""
        answer: dict[str, Any] = self.request("POST", f"/flywheel/v1/aliases/{alias}/rollback",
                                              json={"version": version})
        return answer

    def delete_version(self, alias: str, version: int) -> dict[str, Any]:
        """Delete a version's adapter files (never the serving one or a canary); its status becomes ``deleted``."""
        answer: dict[str, Any] = self.request("DELETE", f"/flywheel/v1/aliases/{alias}/versions/{version}")
        return answer

    def trajectories(self, **filters: Any) -> dict[str, Any]:
        """One page of captured trajectories, newest first: ``alias``, ``since``, ``until``, ``status``, ``task``,
        ``has_reward``, ``client_key_id``, ``limit``, ``after``, ``order`` (docs/storage.md)."""
        params = {k: str(v).lower() if isinstance(v, bool) else v for k, v in filters.items() if v is not None}
        answer: dict[str, Any] = self.request("GET", "/flywheel/v1/trajectories", params=params)
        return answer

    def trajectory(self, trajectory_id: str) -> dict[str, Any]:
        """One trajectory with its turns, branches, scores and feedback."""
        answer: dict[str, Any] = self.request("GET", f"/flywheel/v1/trajectories/{trajectory_id}")
        return answer

    def export(self, trajectory_id: str, format: Literal["openai", "art"] = "art") -> list[dict[str, Any]]:
        """A trajectory as records, one per branch: OpenAI fine-tuning lines or ART trajectories."""
        with self._errors():
            response = self._admin.request("GET", f"/flywheel/v1/trajectories/{trajectory_id}/export",
                                           params={"format": format})
        return [json.loads(line) for line in response.text.splitlines() if line.strip()]

    def record_group(self, alias: str, group: TrajectoryGroup) -> dict[str, Any]:
        """Store a group and its rewards (``POST /flywheel/v1/groups``); answers the stored group."""
        answer: dict[str, Any] = self.request("POST", "/flywheel/v1/groups", json=group_payload(alias, group))
        return answer

    def train_alias(self, alias: str, *, group_ids: list[str] | None, promote: bool = True,
                    args: dict[str, Any] | None = None) -> dict[str, Any]:
        """One training round now (``POST /flywheel/v1/aliases/{alias}/train``); waits for it to finish."""
        body = {"promote": promote, "group_ids": group_ids, "args": args or {}}
        answer: dict[str, Any] = self.request("POST", f"/flywheel/v1/aliases/{alias}/train", json=body, timeout=None)
        return answer

    def eval_metrics(self, alias: str, *, split: str | None = None) -> list[dict[str, Any]]:
        """Stored evaluation metrics of an alias (``model.log``), oldest first."""
        params = {"split": split} if split else None
        answer: list[dict[str, Any]] = self.request("GET", f"/flywheel/v1/aliases/{alias}/metrics",
                                                    params=params)["data"]
        return answer

    # -- the ART backend

    async def register(self, model: Model) -> None:
        """Check that the gateway serves ``model.name`` and point the model's inference fields at it."""
        await asyncio.to_thread(self.alias, model.name)
        model.inference_base_url = f"{self.url}/v1"
        model.inference_api_key = self.api_key
        model.inference_model_name = model.name

    async def _get_step(self, model: Model) -> int:
        served = await asyncio.to_thread(self.alias, model.name)
        return int(served.get("version") or 0)

    async def train(self, model: TrainableModel, trajectory_groups: Iterable[TrajectoryGroup], *,
                    learning_rate: float | UseDefault = USE_DEFAULT, beta: float | UseDefault = USE_DEFAULT,
                    epsilon: float | UseDefault = USE_DEFAULT, epsilon_high: float | UseDefault | None = USE_DEFAULT,
                    importance_sampling_level: Literal["token", "sequence"] | UseDefault = USE_DEFAULT,
                    scale_rewards: bool | UseDefault = USE_DEFAULT, promote: bool = True,
                    _args: dict[str, Any] | None = None, verbose: bool = False) -> TrainResult:
        """Train one step on these groups and (``promote``) serve the new adapter at once.

        Each argument left at ``USE_DEFAULT`` keeps the gateway's setting. ``epsilon_high=None``:
        the same as ``epsilon``. ``scale_rewards=False`` centers rewards without dividing by the
        group's std (Dr. GRPO). ``_args``: more ``GRPOArgs`` fields by name.
        """
        groups = [group for group in trajectory_groups if len(group)]
        if not groups:
            raise ValueError("nothing to train: every trajectory group is empty")
        args = dict(_args or {})
        for name, value in (("learning_rate", learning_rate), ("beta", beta), ("epsilon", epsilon),
                            ("epsilon_high", epsilon_high), ("importance_sampling_level", importance_sampling_level)):
            if value is not USE_DEFAULT:
                args[name] = value
        if scale_rewards is not USE_DEFAULT:
            args["advantage_scale"] = "group" if scale_rewards else "none"
        with Console(stderr=True).status(f"training {model.name} on {len(groups)} groups", spinner="dots"):
            stored = [await asyncio.to_thread(self.record_group, model.name, group) for group in groups]
            answer = await asyncio.to_thread(self.train_alias, model.name, group_ids=[g["id"] for g in stored],
                                             promote=promote, args=args)
        if verbose:
            Console(stderr=True).print(f"{model.name}: {answer.get('status')}, version {answer.get('version')}, "
                                       f"metrics {answer.get('metrics')}")
        finished = answer.get("status") == "finished" and answer.get("version") is not None
        step = int(answer["version"]) if finished else await self._get_step(model)
        metrics = {k: float(v) for k, v in (answer.get("metrics") or {}).items() if isinstance(v, int | float)}
        return TrainResult(step=step, metrics=metrics, checkpoint_path=answer.get("adapter_path"),
                           status="finished" if finished else "skipped", promoted=bool(answer.get("promoted")))

    async def _log(self, model: Model, trajectory_groups: list[TrajectoryGroup], split: str) -> None:
        body = {"split": split, "metrics": eval_metrics(trajectory_groups)}
        await asyncio.to_thread(self.request, "POST", f"/flywheel/v1/aliases/{model.name}/metrics", json=body)

    async def _delete_checkpoints(self, model: TrainableModel, best_checkpoint_metric: str) -> None:
        split, _, metric = best_checkpoint_metric.rpartition("/")
        if not split:
            raise ValueError(f"best_checkpoint_metric {best_checkpoint_metric!r}: expected split/metric, "
                             "e.g. val/reward")
        versions = await asyncio.to_thread(self.versions, model.name)
        rows = await asyncio.to_thread(self.eval_metrics, model.name, split=split)
        scores = {row["version"]: float(row["value"]) for row in rows if row["metric"] == metric}  # latest wins
        existing = [v["version"] for v in versions if v.get("status") not in ("deleted", "training", "failed")]
        if not existing:
            return
        keep = {max(existing)}
        if scores:
            keep.add(max(scores, key=lambda version: (scores[version], version)))
        for version in existing:
            if version not in keep and version != 0:
                await asyncio.to_thread(self._delete_if_allowed, model.name, version)

    def _delete_if_allowed(self, alias: str, version: int) -> None:
        """Delete one version; one the gateway must keep (serving, canary) is skipped, as ART keeps it."""
        try:
            self.delete_version(alias, version)
        except GatewayError as exc:
            if exc.status_code != 409:
                raise
