"""One training round, start to end, as a process of its own: ``flywheel train`` and the loop's training child.

    batch = where.batch(alias, max_groups)            # scored groups, base weights, the version serving now
    init = where.readable(alias, batch.current)       # that version's adapter, on this machine
    reserved = where.reserve(alias)                   # the store hands out the version number and directory,
                                                      # asked on a thread while the trainer is built
    result = train_round(...)                         # trainer/grpo.py, into where.writable(...)
    where.publish(...)                                # a worker's files go to the gateway (an upload)
    where.record(...)  or  where.fail(...)            # the version becomes a candidate (or failed)

``where`` is the running gateway's admin API (:class:`AdminApi`) or the store file when no
gateway runs (:class:`StoreFile`); both speak the same shapes, so the round is one function.
A worker that shares no filesystem with the gateway (``AdminApi(..., workdir=DIR)``) downloads
the version it continues from and uploads the one it trains; otherwise the files are read and
written where the gateway keeps them (one machine, or a shared volume).
A round that raises is recorded as failed and its groups stay for the next round; a process
that dies without a word (killed, out of memory) is recorded by whoever started it.
"""

from __future__ import annotations

import functools
import shutil
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from flywheel.admin_client import AdminCallError, AdminClient
from flywheel.gateway.core.config import Settings
from flywheel.gateway.core.training_wire import RoundSummary


class RoundError(RuntimeError):
    """The round could not start, or the gateway refused what it sent (the message says which)."""


@dataclass
class Batch:
    groups: list[dict[str, Any]]  # TrainingGroup.to_json() each
    base_model: str
    current: dict[str, Any] | None  # {"version", "path"} of the adapter serving now, None for the base model
    args: dict[str, Any]  # the GRPOArgs the gateway's configuration resolves to for this alias


class Where(Protocol):
    def batch(self, alias: str, max_groups: int | None, group_ids: list[str] | None) -> Batch: ...

    def readable(self, alias: str, current: dict[str, Any] | None) -> str | None: ...

    def reserve(self, alias: str, batch: Batch) -> dict[str, Any]: ...

    def writable(self, alias: str, reserved: dict[str, Any]) -> str: ...

    def publish(self, alias: str, version: int, out_dir: str) -> None: ...

    def record(self, report: dict[str, Any]) -> dict[str, Any] | None: ...

    def fail(self, alias: str, version: int, error: str, group_ids: list[str]) -> None: ...


_TRAINING = "/flywheel/v1/training"


@contextmanager
def _refusals() -> Iterator[None]:
    """A failed admin call (the gateway down, or its error answer) as the RoundError that says why."""
    try:
        yield
    except AdminCallError as exc:
        raise RoundError(str(exc)) from None


class AdminApi:
    """A running gateway's ``/flywheel/v1/training`` routes."""

    def __init__(self, url: str, admin_key: str | None, timeout_s: float = 3600.0, workdir: Path | None = None) -> None:
        self.client = AdminClient(url, admin_key, timeout=timeout_s)
        self.workdir = workdir  # None: the gateway's adapter directory is reachable here (a shared volume)

    def _call(self, method: str, path: str, *, params: dict[str, str] | None = None, json: Any = None) -> Any:
        with _refusals():
            return self.client.call(method, _TRAINING + path, params=params, json=json)

    def batch(self, alias: str, max_groups: int | None, group_ids: list[str] | None) -> Batch:
        params = {"alias": alias} | ({"max_groups": str(max_groups)} if max_groups else {})  # else the gateway's
        if group_ids:
            params["group_ids"] = ",".join(group_ids)
        body = self._call("GET", "/batch", params=params)
        return Batch(body["groups"], body["base_model"], body["current"], body["args"])

    def readable(self, alias: str, current: dict[str, Any] | None) -> str | None:
        if self.workdir is None:
            return current["path"] if current else None
        scratch = self.workdir / alias  # each round of an alias starts here and replaces the last one's files
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir(parents=True)
        if current is None:
            return None
        return str(self.download(alias, current["version"], scratch / "current"))

    def download(self, alias: str, version: int, out_dir: Path) -> Path:
        """Version ``version``'s files from the gateway into ``out_dir`` (absent or empty)."""
        from flywheel.trainer import adapters

        out_dir.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out_dir.parent) as archive:
            with _refusals():
                self.client.download(f"{_TRAINING}/adapters/{alias}/{version}", archive)
            archive.seek(0)
            try:
                adapters.unpack(archive, out_dir)
            except adapters.AdapterError as exc:
                raise RoundError(f"version {version} from the gateway: {exc}") from None
        return out_dir

    def reserve(self, alias: str, batch: Batch) -> dict[str, Any]:
        row: dict[str, Any] = self._call("POST", "/versions", json={"alias": alias})  # the gateway knows the rest
        return row

    def writable(self, alias: str, reserved: dict[str, Any]) -> str:
        return reserved["path"] if self.workdir is None else str(self.workdir / alias / str(reserved["version"]))

    def publish(self, alias: str, version: int, out_dir: str) -> None:
        if self.workdir is None:
            return  # written where the gateway reads it
        from flywheel.trainer import adapters

        with tempfile.TemporaryFile(dir=Path(out_dir).parent) as archive:
            adapters.pack(out_dir, archive)
            archive.seek(0)
            with _refusals():
                self.client.upload(f"{_TRAINING}/adapters/{alias}/{version}", archive, "application/x-tar")

    def record(self, report: dict[str, Any]) -> dict[str, Any] | None:
        adapter: dict[str, Any] | None = self._call("POST", "/rounds", json=report)["adapter_version"]
        return adapter

    def fail(self, alias: str, version: int, error: str, group_ids: list[str]) -> None:
        self._call("POST", "/failures", json={"alias": alias, "version": version, "error": error,
                                              "group_ids": group_ids})


class StoreFile:
    """The store file itself (no gateway may hold it): the same operations the store process runs."""

    def __init__(self, store: Any, settings: Settings) -> None:
        self.store, self.settings = store, settings

    def batch(self, alias: str, max_groups: int | None, group_ids: list[str] | None) -> Batch:
        from dataclasses import asdict

        from flywheel.gateway.core.training_config import base_model_path, grpo_args
        from flywheel.gateway.storeproc import store_ops

        try:
            base = base_model_path(self.settings, alias)
        except ValueError as exc:
            raise RoundError(str(exc)) from None
        groups = [group.to_json() for group in store_ops.batch(
            self.store, self.settings, alias, max_groups or self.settings.train.max_groups, group_ids)]
        head = store_ops.training_head(self.store, self.settings, alias)
        current = {"version": head.version, "path": head.path} if head else None
        return Batch(groups, base, current, asdict(grpo_args(self.settings, base)))

    def readable(self, alias: str, current: dict[str, Any] | None) -> str | None:
        return current["path"] if current else None

    def reserve(self, alias: str, batch: Batch) -> dict[str, Any]:
        from flywheel.gateway.storeproc import store_ops

        return store_ops.reserve_version(self.store, self.settings, alias, base_model=batch.base_model,
                                         parent_version=batch.current["version"] if batch.current else None
                                         ).model_dump(mode="json")

    def writable(self, alias: str, reserved: dict[str, Any]) -> str:
        return str(reserved["path"])

    def publish(self, alias: str, version: int, out_dir: str) -> None:
        pass  # written in place

    def record(self, report: dict[str, Any]) -> dict[str, Any] | None:
        from flywheel.gateway.storeproc import store_ops

        adapter = store_ops.record_round(self.store, self.settings, **report)
        return adapter.model_dump(mode="json") if adapter is not None else None

    def fail(self, alias: str, version: int, error: str, group_ids: list[str]) -> None:
        from flywheel.gateway.storeproc import store_ops

        store_ops.failed_round(self.store, self.settings, alias, version, error, group_ids)


@dataclass
class RoundOutcome:
    status: str  # "finished" | "skipped" | "nothing"
    version: int | None
    result: Any  # flywheel.trainer.grpo_args.RoundResult, None when nothing was trained
    groups: int
    report: dict[str, Any] | None = None  # what was (or, with record=False, is to be) recorded; None: nothing


def run_round(where: Where, alias: str, *, max_groups: int | None, overrides: dict[str, Any], promote: bool = False,
              group_ids: list[str] | None = None, base_model: str | None = None,
              launcher: list[str] | None = None, record: bool = True) -> RoundOutcome:
    """Fetch a batch, reserve a version, train, record; a round that raises is recorded failed, then re-raised.

    ``record=False``: the caller records the outcome's ``report`` (the warm child's reply carries it to the
    serving process, which writes it without a call back to itself).
    ``base_model``: where this machine keeps the base weights the gateway names (default: the same name).
    ``launcher``: train in ``launcher + ["-m", "flywheel.trainer.grpo", ...]`` (``accelerate launch --num_processes 4``:
    several GPUs, the same code) instead of in this process."""
    from flywheel.capture.batches import TrainingGroup
    from flywheel.trainer import adapters
    from flywheel.trainer.grpo_args import GRPOArgs

    GRPOArgs(**overrides)  # a bad override is refused before the batch
    batch = where.batch(alias, max_groups, group_ids)
    if not batch.groups:
        return RoundOutcome("nothing", None, None, 0)
    args = GRPOArgs(**{**batch.args, **overrides})
    groups = [TrainingGroup.from_json(g) for g in batch.groups]
    batch_ids = [g.group_id for g in groups]
    init = where.readable(alias, batch.current)  # before reserving: a failed download uses up no version number
    with ThreadPoolExecutor(1, thread_name_prefix="flywheel-reserve") as pool:
        # The store's answer comes while the trainer is built; training starts only once it has come (a refused
        # round trains nothing), so it costs the round no time of its own.
        reserving = pool.submit(where.reserve, alias, batch)

        def out_dir() -> str:
            return where.writable(alias, reserving.result())

        try:
            from flywheel.trainer.grpo import train_round

            train = functools.partial(launched_round, launcher) if launcher else train_round
            result = train(base_model or batch.base_model, groups, args, init_adapter=init, out_dir=out_dir,
                           optimizer_state=adapters.optimizer_state_of(init))
            version = reserving.result()["version"]
            if result.status == "finished":
                where.publish(alias, version, out_dir())
        except Exception as exc:
            if reserving.exception() is not None:  # refused: nothing was trained, no version to fail
                raise
            adapters.discard(out_dir())
            where.fail(alias, reserving.result()["version"], f"{type(exc).__name__}: {exc}", batch_ids)
            raise
    if result.status != "finished":
        adapters.discard(out_dir())
    reported = result.to_json() | {"base_model": batch.base_model}  # the gateway's name for the weights
    report = {"alias": alias, "version": version, "parent_version": batch.current["version"] if batch.current else None,
              "promote": promote, "result": reported, "batch_group_ids": batch_ids}
    if record:
        where.record(report)
    return RoundOutcome(result.status, version, result, len(groups), report)


def summarize(outcome: RoundOutcome, round_s: float) -> RoundSummary:
    """The round's report: what ``flywheel train --json`` prints and the loop's warm child answers."""
    result = outcome.result
    metrics: dict[str, float] = result.metrics if result else {}
    cached = result.config.get("derived", {}).get("base_model_cached") if result else None
    return RoundSummary(status=outcome.status, version=outcome.version, groups=outcome.groups,
                        adapter_path=str(result.adapter_dir) if result and result.adapter_dir else None,
                        metrics=metrics, round_s=round_s, train_s=metrics.get("charts/train_seconds"),
                        model_load_s=metrics.get("charts/model_load_seconds"), warm=bool(cached))


def launched_round(launcher: list[str], base_model: str, groups: list[Any], args: Any, *, init_adapter: str | None,
                   out_dir: Callable[[], str], optimizer_state: Path | None) -> Any:
    """``train_round`` as ``python -m flywheel.trainer.grpo`` under ``launcher``; ``--result-json`` is the result."""
    import json
    import subprocess
    from dataclasses import asdict

    from flywheel.trainer.grpo_args import RoundResult

    with tempfile.TemporaryDirectory(prefix="flywheel-round-") as tmp:
        files = Path(tmp)
        (files / "groups.jsonl").write_text("".join(json.dumps(group.to_json()) + "\n" for group in groups))
        (files / "args.json").write_text(json.dumps(asdict(args)))
        command = [*launcher, "-m", "flywheel.trainer.grpo",
                   "--base", base_model, "--groups", str(files / "groups.jsonl"),
                   "--out", out_dir(), "--args-json", str(files / "args.json"),
                   "--result-json", str(files / "result.json")]
        if init_adapter:
            command += ["--init-adapter", init_adapter]
        if optimizer_state:
            command += ["--optimizer-state", str(optimizer_state)]
        done = subprocess.run(command, check=False)  # its output is the worker's: progress, TRL's logs
        if done.returncode != 0 or not (files / "result.json").is_file():
            raise RuntimeError(f"{' '.join(launcher)} -m flywheel.trainer.grpo exited with status {done.returncode}")
        return RoundResult.from_json(json.loads((files / "result.json").read_text()))
