"""The loop's warm training child: ``flywheel train --alias A --stdio`` runs rounds as they are given.

One :class:`RoundRequest` JSON line in on stdin (a round the serving process opened: its batch, base weights,
the version it continues from and the version it trains), one :class:`RoundReply` line out on stdout, until
stdin closes. The child asks nothing of the gateway: the reply carries the round's record, or its error, and
the serving process writes it.
torch, transformers and TRL are imported once, and the base model and tokenizer stay loaded between rounds
(``flywheel.trainer.model_cache``). Everything else the round prints (TRL's log lines, tracebacks) goes to
stderr, which the serving process points at the child's log file.
"""

from __future__ import annotations

import gc
import os
import sys
import time
import traceback
from typing import Any, TextIO

from pydantic import ValidationError

from flywheel.gateway.core.training_wire import RoundReply, RoundReport, RoundRequest
from flywheel.gateway.training.rounds import Batch, RoundError, run_round, summarize


class GivenRound:
    """``rounds.Where`` for a round handed over whole: the batch and version are the request's, nothing is asked;
    the serving process records the round, or its failure, from the reply."""

    def __init__(self, request: RoundRequest) -> None:
        self.request = request

    def batch(self, alias: str, max_groups: int | None, group_ids: list[str] | None) -> Batch:
        given = self.request
        return Batch(given.groups, given.base_model, given.current, given.args)

    def readable(self, alias: str, current: dict[str, Any] | None) -> str | None:
        return current["path"] if current else None

    def reserve(self, alias: str, batch: Batch) -> dict[str, Any]:
        return {"version": self.request.version, "path": self.request.out_dir}

    def writable(self, alias: str, reserved: dict[str, Any]) -> str:
        return str(reserved["path"])

    def publish(self, alias: str, version: int, out_dir: str) -> None:
        pass  # written where the gateway reads it

    def record(self, report: dict[str, Any]) -> dict[str, Any] | None:
        raise RoundError("a given round's record goes back in the reply")  # run_round(record=False) never calls it

    def fail(self, alias: str, version: int, error: str, group_ids: list[str]) -> None:
        pass  # the reply's error: the serving process records it


def serve(alias: str) -> None:
    """Answer round requests for ``alias`` until stdin closes."""
    replies = os.fdopen(os.dup(1), "w")  # the serving process reads only replies here
    os.dup2(2, 1)  # so what the round prints, from Python or C, joins stderr: the log
    for line in sys.stdin:
        if line.strip():
            reply = answer(alias, line)
            _write(replies, reply)
            # accelerate runs a full collection in every train(); frozen, what this process keeps (torch's
            # modules, the kept model) is not walked again: 0.5 s a round on the tiny model (docs/benchmarks.md)
            gc.collect()
            gc.freeze()
            if reply.summary is not None and reply.summary.adapter_path:
                prepare(reply.summary.adapter_path)  # after the freeze: a trainer no round takes is collected


def prepare(adapter_path: str) -> None:
    """The next round's trainer, built while this process waits for that round (trainer/round_trainer.py)."""
    from flywheel.trainer import round_trainer

    try:
        round_trainer.prepare_next(adapter_path)
    except Exception:  # the next round builds its own
        traceback.print_exc()


def _write(replies: TextIO, reply: RoundReply) -> None:
    replies.write(reply.model_dump_json() + "\n")
    replies.flush()


def answer(alias: str, line: str) -> RoundReply:
    """One round, as the request line gives it; every failure is a reply."""
    try:
        request = RoundRequest.model_validate_json(line)
    except ValidationError as exc:
        return RoundReply(ok=False, error=f"not a round request: {exc.errors()[0]['msg']}")
    if request.alias != alias:
        return RoundReply(ok=False, error=f"this child trains {alias!r}, not {request.alias!r}")
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} round of {alias} given: version {request.version}, "
          f"{len(request.groups)} groups, overrides {request.overrides or 'none'}", file=sys.stderr, flush=True)
    started = time.perf_counter()
    try:
        outcome = run_round(GivenRound(request), alias, max_groups=None, overrides=request.overrides,
                            record=False)  # the reply carries the record: the serving process writes it
    except Exception as exc:  # the serving process records the round failed, with this error
        traceback.print_exc()
        return RoundReply(ok=False, error=f"{type(exc).__name__}: {exc}")
    report = RoundReport.model_validate(outcome.report) if outcome.report is not None else None
    return RoundReply(ok=True, summary=summarize(outcome, time.perf_counter() - started), report=report)
