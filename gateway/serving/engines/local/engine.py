"""The local engine: transformers + peft in this process, vLLM's OpenAI dialect outside.

The event loop never runs model code: one worker thread owns the model and steps every
request's job in turn (:mod:`.worker`); prompts are rendered and tokenized before the job
is submitted, big ones on a thread pool of their own (:mod:`.prompts`); results are shaped
into OpenAI responses and chunks here (:mod:`.responses`). Closing a stream, or cancelling
the task of a non-streaming call (a client that went away), cancels the request's jobs:
the worker drops them before their next step.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from pathlib import Path
from typing import Any

from flywheel.gateway.core.config import LocalEngineConfig
from flywheel.gateway.core.errors import BadRequest, UpstreamError
from flywheel.gateway.serving.engines.base import Body, Chunk
from flywheel.gateway.serving.engines.local.prompts import PreparedRequest, Preparer
from flywheel.gateway.serving.engines.local.responses import (
    ChatChunks,
    CompletionChunks,
    Result,
    chat_response,
    completion_response,
)
from flywheel.gateway.serving.engines.local.runtime import Runtime, load_runtime, set_threads
from flywheel.gateway.serving.engines.local.worker import Run, Step, Worker, call_on_worker


class LocalEngine:
    """The :class:`flywheel.gateway.serving.engines.base.Engine` for a model loaded in this process."""

    draws_without_replacement = True  # stochastic beam search (beams.py)

    def __init__(self, config: LocalEngineConfig, data_dir: Path, threads: int = 0) -> None:
        self.config = config
        self.data_dir = Path(data_dir)
        self.threads = threads  # torch threads for decoding; 0: torch's default
        self._runtime: Runtime | None = None
        self._worker: Worker | None = None
        self._preparer: Preparer | None = None
        self._adapters: dict[str, str] = {}  # event-loop view: name -> path
        self._active_requests = 0  # from the start of preparation to the last chunk

    # ----------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        if self._runtime is not None:
            return
        runtime = await asyncio.to_thread(load_runtime, self.config, self.data_dir)
        self._worker = Worker()
        self._worker.start()
        if self.threads:  # set on the thread that decodes: OpenMP's thread count is per calling thread
            await call_on_worker(self._worker, lambda: set_threads(self.threads))
        self._preparer = Preparer(runtime, self.config)
        self._runtime = runtime

    async def aclose(self) -> None:
        worker, preparer = self._worker, self._preparer
        self._worker, self._runtime, self._preparer = None, None, None
        self._adapters.clear()
        if preparer is not None:
            preparer.close()
        if worker is not None:
            await asyncio.to_thread(worker.stop)

    def _ready(self) -> tuple[Runtime, Worker, Preparer]:
        if self._runtime is None or self._worker is None or self._preparer is None:
            raise UpstreamError("the local engine is not started")
        return self._runtime, self._worker, self._preparer

    # ----------------------------------------------------------------- adapters and health

    async def _call(self, fn: Callable[[Runtime], Any]) -> Any:
        runtime, worker, _ = self._ready()
        return await call_on_worker(worker, lambda: fn(runtime))

    async def load_adapter(self, name: str, path: str) -> None:
        if not name or name == self.config.model:
            raise BadRequest("the adapter name must be non-empty and differ from the base model", param="name")
        if not (Path(path) / "adapter_config.json").is_file():
            raise BadRequest(f"no PEFT adapter (adapter_config.json) at {path}", param="path")
        await self._call(lambda runtime: runtime.load_adapter(name, str(path)))
        self._adapters[name] = str(path)

    async def unload_adapter(self, name: str) -> None:
        await self._call(lambda runtime: runtime.unload_adapter(name))
        self._adapters.pop(name, None)

    async def adapters(self) -> list[str]:
        names: list[str] = await self._call(lambda runtime: sorted(runtime.adapters))  # the worker's own view
        return names

    async def health(self) -> Body:
        runtime, worker, _ = self._ready()
        return {"engine": "local", "model": self.config.model, "path": str(runtime.path),
                "device": str(runtime.device), "adapters": sorted(self._adapters),
                "active_requests": self._active_requests, "running_jobs": worker.running_jobs}

    # ----------------------------------------------------------------- running

    async def _steps(self, request: PreparedRequest) -> AsyncGenerator[Step, None]:
        runtime, worker, _ = self._ready()
        run = Run(runtime, worker, request.prompts, request.sampling)
        try:
            while (step := await run.next()) is not None:
                yield step
        finally:
            run.cancel()  # normal end, error, client disconnect (aclose) or task cancellation alike

    async def _collect(self, request: PreparedRequest) -> list[Result]:
        """Run a request to the end; results indexed job * n + choice."""
        n = request.sampling.n
        results = [Result() for _ in range(n * len(request.prompts))]
        async with contextlib.aclosing(self._steps(request)) as steps:
            async for step in steps:
                for delta in step.deltas:
                    results[step.job * n + delta.index].add(delta)
        return results

    @contextlib.asynccontextmanager
    async def _active(self) -> AsyncIterator[None]:
        self._active_requests += 1
        try:
            yield
        finally:
            self._active_requests -= 1

    # ----------------------------------------------------------------- the OpenAI surface

    async def chat(self, body: Body) -> Body:
        runtime, _, preparer = self._ready()
        async with self._active():
            request = await preparer.chat(body, self._adapters)
            return chat_response(request, await self._collect(request), body.get("model"), runtime.vocab)

    async def completion(self, body: Body) -> Body:
        runtime, _, preparer = self._ready()
        async with self._active():
            request = await preparer.completion(body, self._adapters)
            return completion_response(request, await self._collect(request), body.get("model"), runtime.vocab)

    async def chat_stream(self, body: Body) -> AsyncGenerator[Chunk, None]:
        """Bad requests fail on the first ``anext``, before any chunk exists."""
        runtime, _, preparer = self._ready()
        async with self._active():
            request = await preparer.chat(body, self._adapters)
            chunks = ChatChunks(request, body.get("model"), runtime.vocab)
            for chunk in chunks.opening():
                yield chunk
            completion_tokens = 0
            # aclosing: a client disconnect closes this generator, which must cancel the job now.
            async with contextlib.aclosing(self._steps(request)) as steps:
                async for step in steps:
                    for delta in step.deltas:
                        completion_tokens += len(delta.tokens)
                        for chunk in chunks.of(delta):
                            yield chunk
            if request.include_usage:
                yield chunks.usage(completion_tokens)

    async def completion_stream(self, body: Body) -> AsyncGenerator[Chunk, None]:
        runtime, _, preparer = self._ready()
        async with self._active():
            request = await preparer.completion(body, self._adapters)
            chunks = CompletionChunks(request, body.get("model"), runtime.vocab)
            completion_tokens = 0
            async with contextlib.aclosing(self._steps(request)) as steps:
                async for step in steps:
                    for delta in step.deltas:
                        completion_tokens += len(delta.tokens)
                        yield chunks.of(step.job, delta)
            if request.include_usage:
                yield chunks.usage(completion_tokens)
