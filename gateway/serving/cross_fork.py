"""While a canary runs, one fork of a forked turn is answered by the other arm: a same-context pair.

A forked turn (``fork_fraction``, ``X-Flywheel-Fork``) asks the engine for the client's choices plus
``fork_k`` siblings the client never sees; the judge scores them together as a fork group. During a
canary the last sibling comes from the other version instead (the candidate when the conversation is
on the serving version, and the other way round), so every such group holds both versions on one
context, judged in one call: the canary's best pair (``gateway/serving/loop/abtest.py``). It is one
more engine request on the side: the client's answer never waits for it, and a failed one is logged
and left out of the group.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, replace

from flywheel.capture.turns import CapturedExchange
from flywheel.gateway.serving.engines.base import Body
from flywheel.gateway.serving.served_model import ServedModel
from flywheel.gateway.serving.store_link import StoreLink

log = logging.getLogger("flywheel.api")
_RUNNING: set[asyncio.Task[Body]] = set()  # the loop keeps only weak references to tasks


@dataclass(slots=True)
class CrossFork:
    """The other arm's answer to a forked turn, on its way: its task, who answers, and its choice index."""

    task: asyncio.Task[Body]
    served: ServedModel
    index: int

    @classmethod
    def start(cls, to_engine: Body, served: ServedModel, index: int) -> CrossFork:
        request = {k: v for k, v in to_engine.items() if k not in ("stream", "stream_options")}
        served.in_flight += 1
        task = asyncio.create_task(served.engine.chat({**request, "model": served.engine_model, "n": 1}))
        _RUNNING.add(task)
        task.add_done_callback(lambda done: cls._finished(done, served))
        return cls(task, served, index)

    @staticmethod
    def _finished(task: asyncio.Task[Body], served: ServedModel) -> None:
        served.in_flight -= 1
        _RUNNING.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("the canary's fork on %s failed (%s): its group goes without it", served.engine_model,
                        task.exception())

    def joined(self, exchange: CapturedExchange) -> CapturedExchange:
        """``exchange`` with this answer as its choice ``index`` (recorded as the other version's), once done."""
        if self.task.cancelled() or self.task.exception() is not None:
            return exchange
        choices = self.task.result().get("choices") or []
        if not choices:
            return exchange
        response = {**exchange.response, "choices": [*exchange.response.get("choices", []),
                                                     {**choices[0], "index": self.index}]}
        return replace(exchange, response=response,
                       other_arm=(self.index, self.served.version, self.served.engine_model))


def submit(store_link: StoreLink, exchange: CapturedExchange, request_bytes: int, cross: CrossFork | None) -> None:
    """Capture ``exchange`` now, or with the other arm's fork once that answer is in."""
    if cross is None:
        store_link.submit(exchange, request_bytes)
        return
    cross.task.add_done_callback(lambda _: store_link.submit(cross.joined(exchange), request_bytes))
