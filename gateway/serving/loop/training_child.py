"""The loop's training rounds run in a warm child process: ``python -m flywheel.gateway train --alias A --stdio``.

One child per alias, started by its first round, kept up: torch's imports and the base model's load are paid
once, not every round, and the serving process still never holds torch's training memory. This process opens
each round (one store call reads the batch and reserves the version), hands it over as a :class:`RoundRequest`
line on the child's stdin and reads a :class:`RoundReply` line from its stdout (``core/training_wire.py``), then
writes the round's record, or its failure: the child asks the gateway nothing. The child runs at a lower CPU
priority (``[loop] train_nice``) with its torch threads capped (``train_threads``), so serving keeps the cores
it needs. Its output goes to ``<data_dir>/logs/``. A child that dies is started again by the next round; one
whose round outlives ``train_timeout_s`` is killed, and so is every child when the gateway stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from flywheel.gateway.core.config import Settings
from flywheel.gateway.core.errors import OpenAIError
from flywheel.gateway.core.store_api import StoreApi
from flywheel.gateway.core.training_config import base_model_path, grpo_args
from flywheel.gateway.core.training_wire import RoundReply, RoundReport, RoundRequest, RoundSummary
from flywheel.gateway.serving.store_client import as_it_is


@dataclass
class ChildResult:
    returncode: int  # 0: the round answered ok; 1: it answered an error; else the child's exit status
    log_path: Path | None  # None: no child was asked (nothing to train, or the round was refused)
    tail: str  # the end of its log, for the failure record
    timed_out: bool
    reply: RoundReply | None  # None when the child died or timed out before it answered


@dataclass
class _Child:
    process: asyncio.subprocess.Process
    log_path: Path
    stopped: bool = False  # by stop_all: its round, if any, is not this process's to record


class TrainingChild:
    """Starts, asks, and on shutdown or timeout stops the warm training child of each alias; one round at a time."""

    def __init__(self, settings: Settings, store: StoreApi) -> None:
        self.settings = settings
        self.store = store  # a round's batch and version come from it, and its record or failure goes to it
        self.running: dict[str, _Child] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    def command(self, alias: str) -> list[str]:
        command = [sys.executable, "-m", "flywheel.gateway", "train", "--alias", alias, "--stdio"]
        if self.settings.loop.train_threads:
            command += ["--threads", str(self.settings.loop.train_threads)]
        return command

    def environment(self) -> dict[str, str]:
        env = {**os.environ, "PYTHONFAULTHANDLER": "1", "PYTHONUNBUFFERED": "1"}
        threads = self.settings.loop.train_threads
        if threads:
            env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
        env.pop("FLYWHEEL_ADMIN_KEY", None)  # the child calls nothing
        return env

    async def run(self, alias: str, group_ids: list[str] | None = None,
                  overrides: dict[str, Any] | None = None) -> ChildResult:
        """One round of ``alias``: opened here, trained in its child (started now if none is up), recorded here;
        its reply, or how the child ended."""
        lock = self._locks.setdefault(alias, asyncio.Lock())
        async with lock:
            started = time.perf_counter()
            with as_it_is():  # a round waits for no captured turn
                opened = await self._open(alias, group_ids, overrides or {})
            if isinstance(opened, RoundReply):
                return ChildResult(0 if opened.ok else 1, None, "", False, opened)
            opened_s = time.perf_counter() - started
            child = self.running.get(alias)
            if child is None or child.process.returncode is not None:
                child = self.running[alias] = await self._start(alias)
            line, timed_out = await self._ask(child.process, opened)
            reply = _reply(line)
            if reply is None:  # dead, too slow, or no reply: stopped; the next round starts a fresh child
                await self._stop(child.process, ended=not line and not timed_out)
                self.running.pop(alias, None)
            if reply is not None and reply.ok and reply.report is not None:
                reply = await self._record(reply, reply.report)
            returncode = (0 if reply.ok else 1) if reply is not None else \
                (child.process.returncode if child.process.returncode is not None else -9)
            tail = _tail(child.log_path)
            # stopped with the gateway, or as it stopped leading: the next start (or leader) records the round
            if (reply is None or not reply.ok) and not child.stopped:
                reason = "timed out" if timed_out else f"exited with {returncode}"
                await self._fail(opened, reply.error if reply is not None and reply.error else
                                 f"the training process {reason}; log {child.log_path}:\n{tail}")
            if reply is not None and reply.summary is not None:
                reply.summary.round_s += opened_s  # the child timed its part; the record added its own
            return ChildResult(returncode, child.log_path, tail, timed_out, reply)

    async def _open(self, alias: str, group_ids: list[str] | None,
                    overrides: dict[str, Any]) -> RoundRequest | RoundReply:
        """The round's request: its arguments checked, then its batch read and its version reserved (one store
        call); a reply instead when there is nothing to train or the round is refused (nothing reserved)."""
        from flywheel.trainer.grpo_args import GRPOArgs

        try:
            base = base_model_path(self.settings, alias)
        except ValueError as exc:
            return RoundReply(ok=False, error=str(exc))
        args = asdict(grpo_args(self.settings, base))
        unknown = sorted(set(overrides) - {f.name for f in fields(GRPOArgs)})
        if unknown:
            return RoundReply(ok=False, error=f"GRPOArgs has no field {unknown[0]!r}", param="args")
        try:
            GRPOArgs(**{**args, **overrides})
        except (TypeError, ValueError) as exc:
            return RoundReply(ok=False, error=str(exc), param="args")
        try:
            opened = await self.store.open_round(alias, base, self.settings.train.max_groups, group_ids)
        except OpenAIError as exc:  # the store's refusal (a round of the alias trains elsewhere) or that it is away
            return RoundReply(ok=False, error=exc.message)
        if opened.reserved is None:
            return RoundReply(ok=True, summary=RoundSummary(status="nothing", version=None, groups=0,
                                                            adapter_path=None, round_s=0.0))
        head = opened.head
        return RoundRequest(alias=alias, version=opened.reserved.version, out_dir=opened.reserved.path,
                            base_model=base, current={"version": head.version, "path": head.path} if head else None,
                            groups=[group.to_json() for group in opened.groups], args=args, overrides=overrides)

    async def _record(self, reply: RoundReply, report: RoundReport) -> RoundReply:
        """The round's record written; a record the store refused is the round's error (and its failure)."""
        started = time.perf_counter()
        try:
            with as_it_is():  # a record waits for no captured turn
                await self.store.record_round(report.alias, report.version, report.parent_version, promote=False,
                                              result=report.result, batch_group_ids=report.batch_group_ids)
        except OpenAIError as exc:  # the store process's answer, or that it is away
            return RoundReply(ok=False, error=f"the round's record failed: {exc}")
        if reply.summary is not None:
            reply.summary.round_s += time.perf_counter() - started
        return reply

    async def _fail(self, request: RoundRequest, error: str) -> None:
        """The reserved version and a run row say the round failed; its groups stay for the next round. A store
        that is away now finds the version ``training`` at its next start and records it failed then."""
        try:
            with as_it_is():
                await self.store.record_failed_round(request.alias, request.version, error,
                                                     [group["group_id"] for group in request.groups])
        except OpenAIError:
            pass

    async def _start(self, alias: str) -> _Child:
        logs = self.settings.data_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        log_path = logs / f"train-{alias}-{time.strftime('%Y%m%d-%H%M%S')}.log"
        nice = self.settings.loop.train_nice
        with log_path.open("ab") as log:
            process = await asyncio.create_subprocess_exec(
                *self.command(alias), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=log,
                env=self.environment(), start_new_session=True, preexec_fn=(lambda: os.nice(nice)) if nice else None,
                limit=1 << 24)  # a reply is one line: room for a round's metrics
        return _Child(process, log_path)

    async def _ask(self, process: asyncio.subprocess.Process, request: RoundRequest) -> tuple[bytes, bool]:
        """Send the request and read one line back: (the line, b"" when the child ended first; timed out)."""
        assert process.stdin is not None and process.stdout is not None
        try:
            process.stdin.write(request.model_dump_json().encode() + b"\n")
            await process.stdin.drain()
            return await asyncio.wait_for(process.stdout.readline(), self.settings.loop.train_timeout_s), False
        except TimeoutError:
            return b"", True
        except (BrokenPipeError, ConnectionResetError):  # it died before it read the request
            return b"", False

    async def stop_all(self) -> None:
        children, self.running = list(self.running.values()), {}
        for child in children:
            child.stopped = True
        await asyncio.gather(*(self._stop(child.process) for child in children))

    @staticmethod
    async def _stop(process: asyncio.subprocess.Process, grace_s: float = 10.0, *, ended: bool = False) -> None:
        """Terminates it, and kills it after ``grace_s``; one that ``ended`` (closed its stdout) gets ``grace_s``
        to exit first, since signalling polls it and a poll that reaps before asyncio's watcher leaves the exit
        status unknown (255)."""
        if process.stdin is not None:
            process.stdin.close()
        if ended:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(process.wait()), grace_s)
        if process.returncode is None:
            try:
                process.terminate()
                await asyncio.wait_for(process.wait(), grace_s)
            except ProcessLookupError:  # it ended on its own, not yet reaped
                pass
            except TimeoutError:
                process.kill()
        await process.wait()


def _reply(line: bytes) -> RoundReply | None:
    """The child's answer; None for an empty line (it ended) or one that is not a reply."""
    if not line.strip():
        return None
    try:
        return RoundReply.model_validate_json(line)
    except ValidationError:
        return None


def _tail(path: Path, size: int = 4000) -> str:
    """The last ``size`` bytes of a child's log: it grows with every round the child serves."""
    with path.open("rb") as log:
        log.seek(max(0, log.seek(0, os.SEEK_END) - size))
        return log.read().decode(errors="replace")
