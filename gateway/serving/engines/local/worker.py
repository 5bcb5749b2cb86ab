"""The one thread that owns the model, and the jobs it round-robins one step at a time.

Every request is a *job*: a Python generator that performs one decode step per ``next()``.
The worker round-robins one step at a time across active jobs, so concurrent requests
(base and different adapters alike) progress side by side and a long generation cannot
starve a short one. Adapter loads and unloads are jobs too and run between steps. Jobs hand
events back with ``loop.call_soon_threadsafe``; cancelling a job from the event loop flags
it, and the worker drops it before its next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

import torch

from flywheel.gateway.core.errors import OpenAIError, UpstreamError
from flywheel.gateway.serving.engines.local.beams import log_inclusion, replay, stochastic_beam_search
from flywheel.gateway.serving.engines.local.decoding import Choice, Delta, Sampling, sample
from flywheel.gateway.serving.engines.local.runtime import Runtime

log = logging.getLogger(__name__)


@dataclass
class Step:
    job: int
    deltas: list[Delta]


@dataclass
class Done:
    job: int
    result: Any = None


@dataclass
class Failed:
    job: int
    error: OpenAIError


Event = Step | Done | Failed


class Job:
    """Work for the worker thread: ``steps()`` does one unit per ``next()``."""

    def __init__(self, index: int, loop: asyncio.AbstractEventLoop, sink: Callable[[Event], None]) -> None:
        self.index = index
        self.cancelled = False  # set from the event loop; a bool store is atomic under the GIL
        self.result: Any = None
        self._loop = loop
        self._sink = sink

    def emit(self, event: Event) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening any more
            self._loop.call_soon_threadsafe(self._sink, event)

    def steps(self) -> Generator[None, None, None]:
        raise NotImplementedError


class CallJob(Job):
    """Runs one function on the worker thread between decode steps (adapter load/unload)."""

    def __init__(self, fn: Callable[[], Any], loop: asyncio.AbstractEventLoop, sink: Callable[[Event], None]) -> None:
        super().__init__(0, loop, sink)
        self._fn = fn

    def steps(self) -> Generator[None, None, None]:
        self.result = self._fn()
        return
        yield  # a generator that finishes on its first step


class GenerationJob(Job):
    """Decodes ``sampling.n`` continuations of one prompt, one token per step."""

    def __init__(self, runtime: Runtime, index: int, prompt: list[int], sampling: Sampling,
                 loop: asyncio.AbstractEventLoop, sink: Callable[[Event], None]) -> None:
        super().__init__(index, loop, sink)
        self._runtime = runtime
        self._prompt = prompt
        self._sampling = sampling

    def _generator(self) -> torch.Generator:
        generator = torch.Generator(device=self._runtime.device)
        if self._sampling.seed is None:
            generator.seed()
        else:
            generator.manual_seed(self._sampling.seed % (1 << 63))
        return generator

    def steps(self) -> Generator[None, None, None]:
        if self._sampling.without_replacement:
            yield from self._drawn_without_replacement()
            return
        runtime, sampling = self._runtime, self._sampling
        generator = self._generator()
        choices = [Choice(i, sampling, runtime.eos_ids, runtime.vocab.detokenizer()) for i in range(sampling.n)]
        # n samples of one prompt: a batch of identical rows needs no padding or mask.
        inputs = torch.tensor([self._prompt] * sampling.n, dtype=torch.long, device=runtime.device)
        cache: Any = None
        while True:
            logits, cache = runtime.forward(inputs, cache, sampling.adapter)
            picked = sample(logits, sampling, generator)
            deltas = []
            for row, choice in enumerate(choices):
                if choice.finish_reason is not None:
                    continue  # finished rows keep riding along in the batch; their tokens are ignored
                delta = choice.add(picked.tokens[row], picked.logprobs[row] if picked.logprobs else None,
                                   picked.top[row] if picked.top else None)
                if delta is not None:
                    deltas.append(delta)
            if deltas:
                self.emit(Step(self.index, deltas))
            if all(c.finish_reason is not None for c in choices):
                return
            inputs = torch.tensor(picked.tokens, dtype=torch.long, device=runtime.device)[:, None]
            yield

    def _drawn_without_replacement(self) -> Generator[None, None, None]:
        """The ``n`` choices by stochastic beam search; their text is known only at the end: one step."""
        runtime, sampling = self._runtime, self._sampling
        beams, kappa = yield from stochastic_beam_search(runtime, self._prompt, sampling, self._generator())
        deltas: list[Delta] = []
        for index, beam in enumerate(beams):
            replay(beam, index, sampling, runtime, deltas)
            deltas[-1].inclusion_logprob = log_inclusion(beam.phi, kappa)
        self.emit(Step(self.index, deltas))


class Worker:
    """The thread that owns the model and round-robins job steps."""

    def __init__(self) -> None:
        self._inbox: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._active: deque[tuple[Job, Generator[None, None, None]]] = deque()
        self._thread = threading.Thread(target=self._run, name="flywheel-local-engine", daemon=True)
        # Jobs admitted, not yet finished or dropped: ``_active`` is one short while a job steps
        self.running_jobs = 0

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        self._inbox.put(job)

    def stop(self, timeout: float = 10.0) -> None:
        self._inbox.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while self._admit(block=not self._active):
            self._step()
        # Shutting down: fail whatever is running or still queued, so no caller waits forever.
        stopping = UpstreamError("the local engine is shutting down")
        for job, steps in self._active:
            steps.close()
            job.emit(Failed(job.index, stopping))
        while True:
            try:
                queued = self._inbox.get_nowait()
            except queue.Empty:
                break
            if queued is not None:
                queued.emit(Failed(queued.index, stopping))

    def _admit(self, *, block: bool) -> bool:
        """Move submitted jobs to the active ring; False once asked to stop."""
        while True:
            try:
                job = self._inbox.get() if block else self._inbox.get_nowait()
            except queue.Empty:
                return True
            if job is None:
                return False
            self._active.append((job, job.steps()))
            self.running_jobs += 1
            block = False

    def _step(self) -> None:
        job, steps = self._active.popleft()
        if job.cancelled:
            steps.close()
        else:
            try:
                next(steps)
            except StopIteration:
                job.emit(Done(job.index, job.result))
            except OpenAIError as exc:
                job.emit(Failed(job.index, exc))
            except Exception as exc:
                log.exception("local engine job failed")
                job.emit(Failed(job.index, UpstreamError(f"local generation failed: {exc}")))
            else:
                self._active.append((job, steps))
                return
        self.running_jobs -= 1


class Run:
    """The generation jobs of one request as the event loop sees them: events in, cancel out."""

    def __init__(self, runtime: Runtime, worker: Worker, prompts: list[list[int]], sampling: Sampling) -> None:
        loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        self._jobs = [GenerationJob(runtime, i, prompt, sampling, loop, self._queue.put_nowait)
                      for i, prompt in enumerate(prompts)]
        self._running = len(self._jobs)
        for job in self._jobs:
            worker.submit(job)

    async def next(self) -> Step | None:
        """The next step's deltas, or None when every job has finished."""
        while self._running:
            event = await self._queue.get()
            if isinstance(event, Failed):
                raise event.error
            if isinstance(event, Done):
                self._running -= 1
                continue
            return event
        return None

    def cancel(self) -> None:
        for job in self._jobs:
            job.cancelled = True


async def call_on_worker(worker: Worker, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on the worker thread between decode steps; its result, or its error raised here."""
    done: asyncio.Queue[Event] = asyncio.Queue()
    worker.submit(CallJob(fn, asyncio.get_running_loop(), done.put_nowait))
    event = await done.get()
    if isinstance(event, Failed):
        raise event.error
    assert isinstance(event, Done)
    return event.result
