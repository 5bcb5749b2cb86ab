"""Siblings of a forked turn answered by another version than the client's.

A forked turn (``fork_fraction``, ``X-Flywheel-Fork``) asks the engine for the client's choices plus
``fork_k`` siblings the client never sees; the judge scores them together as a fork group. Two kinds
of sibling come from another version, each one more engine request on the side: the client's answer
never waits for it, and a failed one is logged and left out of the group.

- During a canary one sibling more comes from the other arm (the candidate when the conversation is
  on the serving version, and the other way round), so every such group holds both versions on one
  context, judged in one call: the canary's best pair (``gateway/serving/loop/abtest.py``). It is
  stored as the canary's pair (``turns.canary_pair``) and left out of training: the round learns from
  the client's answer and the ``fork_k`` siblings, as when no canary runs.
- With ``groups.fork_from = "head"`` the other siblings come from the training line's head, so the
  next round learns from samples of the policy it trains on (docs/loop.md, "Forks from the head").

With ``groups.fork_draw = "without_replacement"`` those siblings are drawn without replacement (distinct
answers, stochastic beam search) where the engine can; from the serving version too, then in a side
request of their own (kind ``drawn``), so the client's answer stays an ordinary, streamable sample.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

from flywheel.capture.turns import CapturedExchange
from flywheel.gateway.serving.engines.base import Body
from flywheel.gateway.serving.served_model import ServedModel
from flywheel.gateway.serving.store_link import StoreLink

log = logging.getLogger("flywheel.api")
_RUNNING: set[asyncio.Task[Body]] = set()  # the loop keeps only weak references to tasks


@dataclass(slots=True)
class CrossFork:
    """Siblings answered by another version, on their way: the task, who answers, the first choice index, why."""

    task: asyncio.Task[Body]
    served: ServedModel
    index: int
    kind: Literal["canary", "head", "drawn"]

    @classmethod
    def start(cls, to_engine: Body, served: ServedModel, index: int, n: int = 1,
              kind: Literal["canary", "head", "drawn"] = "canary", without_replacement: bool = False) -> CrossFork:
        request = {k: v for k, v in to_engine.items() if k not in ("stream", "stream_options")}
        if without_replacement and n > 1 and served.engine.draws_without_replacement:
            request["draw_without_replacement"] = True
        served.in_flight += 1
        task = asyncio.create_task(served.engine.chat({**request, "model": served.engine_model, "n": n}))
        _RUNNING.add(task)
        task.add_done_callback(lambda done: cls._finished(done, served, kind))
        return cls(task, served, index, kind)

    @staticmethod
    def _finished(task: asyncio.Task[Body], served: ServedModel, kind: str) -> None:
        served.in_flight -= 1
        _RUNNING.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("a %s fork on %s failed (%s): its group goes without it", kind, served.engine_model,
                        task.exception())

    def joined(self, exchange: CapturedExchange) -> CapturedExchange:
        """``exchange`` with these answers as its choices from ``index`` on (recorded as this version's), once done."""
        if self.task.cancelled() or self.task.exception() is not None:
            return exchange
        choices = self.task.result().get("choices") or []
        if not choices:
            return exchange
        ours = [{**choice, "index": self.index + n} for n, choice in enumerate(choices)]
        response = {**exchange.response, "choices": [*exchange.response.get("choices", []), *ours]}
        arm = (self.index, self.served.version, self.served.engine_model)
        if self.kind == "canary":
            return replace(exchange, response=response, other_arm=arm)
        return replace(exchange, response=response, explored=arm)


def submit(store_link: StoreLink, exchange: CapturedExchange, request_bytes: int, sides: Sequence[CrossFork]) -> None:
    """Capture ``exchange`` now, or with the other versions' siblings once all their answers are in."""
    if not sides:
        store_link.submit(exchange, request_bytes)
        return
    waiting = {id(side.task) for side in sides}

    def one_in(task: asyncio.Task[Body]) -> None:
        waiting.discard(id(task))
        if not waiting:
            joined = exchange
            for side in sides:
                joined = side.joined(joined)
            store_link.submit(joined, request_bytes)

    for side in sides:
        side.task.add_done_callback(one_in)
