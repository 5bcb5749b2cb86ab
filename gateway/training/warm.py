"""The loop's warm training child: ``flywheel train --alias A --gateway URL --stdio`` runs rounds as they are asked.

One :class:`RoundRequest` JSON line in on stdin, one :class:`RoundReply` line out on stdout, until stdin closes;
the reply carries the round's record, which the serving process writes (the child does not call back for it).
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
from dataclasses import fields
from typing import TextIO

from pydantic import ValidationError

from flywheel.gateway.core.training_wire import RoundReply, RoundReport, RoundRequest
from flywheel.gateway.training.rounds import RoundError, Where, run_round, summarize


def serve(where: Where, alias: str) -> None:
    """Answer round requests for ``alias`` until stdin closes."""
    replies = os.fdopen(os.dup(1), "w")  # the serving process reads only replies here
    os.dup2(2, 1)  # so what the round prints, from Python or C, joins stderr: the log
    for line in sys.stdin:
        if line.strip():
            reply = answer(where, alias, line)
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


def answer(where: Where, alias: str, line: str) -> RoundReply:
    """One round, as the request line asks; every failure is a reply (a round that raised recorded itself failed)."""
    from flywheel.trainer.grpo import GRPOArgs

    try:
        request = RoundRequest.model_validate_json(line)
    except ValidationError as exc:
        return RoundReply(ok=False, error=f"not a round request: {exc.errors()[0]['msg']}")
    if request.alias != alias:
        return RoundReply(ok=False, error=f"this child trains {alias!r}, not {request.alias!r}")
    unknown = sorted(set(request.overrides) - {f.name for f in fields(GRPOArgs)})
    if unknown:
        return RoundReply(ok=False, error=f"GRPOArgs has no field {unknown[0]!r}", param="args")
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} round of {alias} asked: groups {request.group_ids or 'the batch'}, "
          f"overrides {request.overrides or 'none'}", file=sys.stderr, flush=True)
    started = time.perf_counter()
    try:
        outcome = run_round(where, alias, max_groups=None, overrides=request.overrides, group_ids=request.group_ids,
                            record=False)  # the reply carries the record: the serving process writes it
    except (RoundError, TypeError, ValueError) as exc:  # refused before training: bad arguments, a gateway that said no
        traceback.print_exc()
        return RoundReply(ok=False, error=str(exc))
    except Exception as exc:  # run_round recorded the failure with the gateway
        traceback.print_exc()
        return RoundReply(ok=False, error=f"{type(exc).__name__}: {exc}")
    report = RoundReport.model_validate(outcome.report) if outcome.report is not None else None
    return RoundReply(ok=True, summary=summarize(outcome, time.perf_counter() - started), report=report)
