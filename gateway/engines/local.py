"""In-process engine: transformers + peft on one worker thread, vLLM's OpenAI dialect outside.

Design, and why:

- ONE worker thread owns the model. PyTorch modules and PEFT's adapter switching are not
  safe to drive from several threads, and one owner makes adapter loads trivially
  serialised with forwards. The asyncio loop never runs model code.
- Every request is a *job*: a Python generator that performs one decode step per
  ``next()``. The worker round-robins one step at a time across active jobs, so
  concurrent requests (base and different adapters alike) progress side by side and a
  long generation cannot starve a short one. Adapter loads/unloads are jobs too and run
  between steps.
- Jobs hand events back with ``loop.call_soon_threadsafe(queue.put_nowait, event)``; the
  async side turns them into OpenAI response dicts or chunks. Closing/cancelling the
  async side flags the job, and the worker drops it before its next step.
- Decoding is our own loop (KV cache, temperature, top-p, stop strings, logprobs) rather
  than ``model.generate``, because we need per-step interleaving, per-token logprobs in
  OpenAI's shape, streaming that holds back possible stop strings / tool-call markers,
  and exact token ids for training capture.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import json
import logging
import queue
import threading
import time
import uuid
import warnings
from collections import deque
from collections.abc import AsyncGenerator, Callable, Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from gateway.config import TINY_MODEL, LocalEngineConfig
from gateway.engines.base import Body, Chunk
from gateway.engines.toolcalls import parse_tool_calls, partial_marker_start, tool_call_hold_start
from gateway.errors import BadRequest, NotFound, OpenAIError, UpstreamError

log = logging.getLogger(__name__)

MAX_TOP_LOGPROBS = 20
MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM reports impossible tokens the same way


# --------------------------------------------------------------------------- request model


@dataclass(frozen=True)
class Sampling:
    """Validated decoding parameters of one request."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stop: tuple[str, ...] = ()
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    adapter: str | None = None  # None: the base model
    hold_tool_calls: bool = False  # chat with tools: stream must not leak <tool_call> text
    ignore_eos: bool = False  # vLLM's extension: keep sampling past EOS until max_tokens


@dataclass
class _Request:
    prompts: list[list[int]]
    sampling: Sampling
    return_token_ids: bool
    include_usage: bool
    parse_tools: bool = False


@dataclass
class _Token:
    id: int
    logprob: float | None
    top: list[tuple[int, float]] | None
    offset: int  # characters of completion text before this token (legacy text_offset)


@dataclass
class _Delta:
    """What one choice produced since its last delta (worker -> event loop)."""

    index: int
    text: str
    tokens: list[_Token]
    finish_reason: str | None = None
    full_text: str | None = None  # the whole completion text, on the final delta


@dataclass
class _Step:
    job: int
    deltas: list[_Delta]


@dataclass
class _Done:
    job: int
    result: Any = None


@dataclass
class _Failed:
    job: int
    error: OpenAIError


_Event = _Step | _Done | _Failed


# --------------------------------------------------------------------------- validation helpers


def _number(body: Body, key: str, default: float, low: float, high: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise BadRequest(f"{key} must be a number between {low} and {high}", param=key)
    return float(value)


def _integer(body: Body, key: str, low: int, high: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    too_big = high is not None and isinstance(value, int) and value > high
    if isinstance(value, bool) or not isinstance(value, int) or value < low or too_big:
        bounds = f">= {low}" if high is None else f"between {low} and {high}"
        raise BadRequest(f"{key} must be an integer {bounds}", param=key)
    return value


def _stops(body: Body) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise BadRequest("stop must be a string or a list of strings", param="stop")
    return tuple(s for s in value if s)


def _text_of_parts(parts: list[Any]) -> str:
    texts = []
    for part in parts:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise BadRequest("only text content parts are supported by the local engine", param="messages")
        texts.append(part["text"])
    return "\n".join(texts)  # how vLLM joins text parts


def _call_for_template(call: Any) -> Any:
    # Chat templates index into arguments as a mapping; OpenAI sends them as a JSON string.
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return call
    function = dict(call["function"])
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        with contextlib.suppress(ValueError):
            parsed = json.loads(arguments)
            if isinstance(parsed, dict):
                function["arguments"] = parsed
    return {**call, "function": function}


def normalise_messages(raw: Any) -> list[dict[str, Any]]:
    """OpenAI messages as chat templates expect them: string content, dict arguments."""
    if not isinstance(raw, list) or not raw:
        raise BadRequest("messages must be a non-empty list", param="messages")
    messages = []
    for message in raw:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequest("each message must be an object with a role", param="messages")
        message = dict(message)
        if isinstance(message.get("content"), list):
            message["content"] = _text_of_parts(message["content"])
        if message.get("tool_calls"):
            message["tool_calls"] = [_call_for_template(c) for c in message["tool_calls"]]
        messages.append(message)
    return messages


def _completion_prompts(raw: Any) -> list[str | list[int]]:
    """/v1/completions prompt: a string, strings, token ids, or lists of token ids."""
    if isinstance(raw, str):
        return [raw]
    if isinstance(raw, list) and raw:
        if all(isinstance(x, int) and not isinstance(x, bool) for x in raw):
            return [list(raw)]
        if all(isinstance(x, str) for x in raw):
            return list(raw)
        if all(isinstance(x, list) and x and all(isinstance(t, int) for t in x) for x in raw):
            return [list(x) for x in raw]
    raise BadRequest("prompt must be a string, a list of strings, or token ids", param="prompt")


# --------------------------------------------------------------------------- tokens and text


def _byte_decoder() -> dict[str, int]:
    """Inverse of the byte-level BPE alphabet (GPT-2 scheme): one printable char per byte."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table: dict[str, int] = {}
    shifted = 0
    for byte in range(256):
        if byte in kept:
            table[chr(byte)] = byte
        else:
            table[chr(256 + shifted)] = byte
            shifted += 1
    return table


class _ByteDetokenizer:
    """Incremental text of a byte-level BPE stream; holds incomplete UTF-8 sequences back."""

    def __init__(self, table: list[bytes]) -> None:
        self._table = table
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def add(self, token_id: int) -> str:
        piece = self._table[token_id] if 0 <= token_id < len(self._table) else b""
        return self._decoder.decode(piece)

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


class _FullDetokenizer:
    """Fallback for non-byte-level tokenizers: re-decode everything, emit the new suffix."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._text = ""

    def add(self, token_id: int) -> str:
        self._ids.append(token_id)
        text = self._tokenizer.decode(self._ids, skip_special_tokens=True)
        if text.endswith("\ufffd") or not text.startswith(self._text):
            return ""  # an unfinished character (or a re-spaced prefix): wait for more tokens
        new, self._text = text[len(self._text):], text
        return new

    def flush(self) -> str:
        text = self._tokenizer.decode(self._ids, skip_special_tokens=True)
        return text[len(self._text):] if text.startswith(self._text) else ""


class Vocabulary:
    """Per-token text and bytes: what detokenizers and OpenAI logprobs need."""

    def __init__(self, tokenizer: Any, size: int) -> None:
        self.tokenizer = tokenizer
        self.size = size
        added = dict(getattr(tokenizer, "added_tokens_decoder", {}))
        self.special_ids = {i for i, tok in added.items() if getattr(tok, "special", False)}
        self.special_ids |= set(getattr(tokenizer, "all_special_ids", []))
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self.byte_level = type(decoder).__name__ == "ByteLevel"
        self._shown: dict[int, tuple[str, list[int]]] = {}
        self.raw_bytes: list[bytes] = self._raw_bytes(added) if self.byte_level else []
        # Text bytes skip special tokens, as decode(skip_special_tokens=True) does.
        self.text_bytes = [b"" if i in self.special_ids else b for i, b in enumerate(self.raw_bytes)]

    def _raw_bytes(self, added: dict[int, Any]) -> list[bytes]:
        inverse = _byte_decoder()
        pieces = self.tokenizer.convert_ids_to_tokens(list(range(len(self.tokenizer))))
        table: list[bytes] = []
        for token_id in range(max(self.size, len(pieces))):
            piece = pieces[token_id] if token_id < len(pieces) else None
            if token_id in added:
                table.append(str(added[token_id].content).encode())
            elif piece is None:
                table.append(b"")  # embedding rows past the tokenizer (padding to a multiple)
            elif all(ch in inverse for ch in piece):
                table.append(bytes(inverse[ch] for ch in piece))
            else:
                table.append(piece.encode())
        return table

    def detokenizer(self) -> _ByteDetokenizer | _FullDetokenizer:
        return _ByteDetokenizer(self.text_bytes) if self.byte_level else _FullDetokenizer(self.tokenizer)

    def show(self, token_id: int) -> tuple[str, list[int]]:
        """(token text, its bytes) as OpenAI logprobs report them."""
        if token_id not in self._shown:
            if self.byte_level and token_id < len(self.raw_bytes):
                raw = self.raw_bytes[token_id]
            else:
                raw = self.tokenizer.decode([token_id]).encode()
            self._shown[token_id] = (raw.decode("utf-8", errors="replace"), list(raw))
        return self._shown[token_id]


class _Choice:
    """Text state of one sampled sequence: stop strings, hold-back, finish."""

    def __init__(self, index: int, sampling: Sampling, eos_ids: set[int],
                 detokenizer: _ByteDetokenizer | _FullDetokenizer) -> None:
        self.index = index
        self.sampling = sampling
        self.eos_ids = eos_ids
        self.detokenizer = detokenizer
        self.token_count = 0
        self.text = ""
        self.released = 0  # characters of text already handed out
        self.pending: list[_Token] = []  # tokens whose text is not handed out yet
        self.finish_reason: str | None = None
        self._stopped_by_string = False  # text was cut at a stop string: nothing more to flush

    def add(self, token_id: int, logprob: float | None, top: list[tuple[int, float]] | None) -> _Delta | None:
        self.token_count += 1
        self.pending.append(_Token(token_id, logprob, top, len(self.text)))
        if token_id in self.eos_ids and not self.sampling.ignore_eos:
            self.finish_reason = "stop"
        else:
            self.text += self.detokenizer.add(token_id)
            self._check_stop()
        if self.finish_reason is None and self.token_count >= self.sampling.max_tokens:
            self.finish_reason = "length"
        if self.finish_reason is not None:
            if not self._stopped_by_string:
                self.text += self.detokenizer.flush()
            return self._release(len(self.text))
        end = self._hold_start()
        return self._release(end) if end > self.released else None

    def _check_stop(self) -> None:
        # Any stop string lies after `released`: a possible stop prefix is never released.
        hits = [i for s in self.sampling.stop if (i := self.text.find(s, self.released)) >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self.finish_reason = "stop"
            self._stopped_by_string = True

    def _hold_start(self) -> int:
        end = len(self.text)
        for stop in self.sampling.stop:
            end = min(end, partial_marker_start(self.text, stop))
        if self.sampling.hold_tool_calls:
            end = min(end, tool_call_hold_start(self.text, self.released))
        return max(end, self.released)

    def _release(self, end: int) -> _Delta:
        finished = self.finish_reason is not None
        delta = _Delta(self.index, self.text[self.released:end], self.pending, self.finish_reason,
                       self.text if finished else None)
        self.released, self.pending = end, []
        return delta


# --------------------------------------------------------------------------- sampling


@dataclass
class _Picked:
    tokens: list[int]
    logprobs: list[float] | None = None
    top: list[list[tuple[int, float]]] | None = None


def _top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    # Keep the smallest prefix whose mass reaches top_p (the most likely token always stays).
    outside = sorted_probs.cumsum(dim=-1) - sorted_probs > top_p
    sorted_probs = sorted_probs.masked_fill(outside, 0.0)
    return torch.zeros_like(probs).scatter(-1, order, sorted_probs)


def sample(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> _Picked:
    """Pick one token per row of ``logits`` (rows x vocab, float32)."""
    if sampling.temperature > 0:
        scaled = logits / sampling.temperature
        probs = torch.softmax(scaled, dim=-1)
        if sampling.top_p < 1.0:
            probs = _top_p_filter(probs, sampling.top_p)
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(1)
    else:
        scaled = logits
        tokens = logits.argmax(dim=-1)
    if not sampling.logprobs:
        return _Picked(tokens.tolist())
    # Logprobs are log_softmax(logits / temperature), before top-p: the distribution the
    # token was drawn from as TRL recomputes it, and what vLLM reports with
    # --logprobs-mode processed_logprobs. Temperature 0 (greedy) reports raw logits.
    logprobs = torch.log_softmax(scaled, dim=-1)
    chosen = logprobs.gather(1, tokens[:, None]).squeeze(1).tolist()
    top = None
    if sampling.top_logprobs > 0:
        values, indices = logprobs.topk(sampling.top_logprobs, dim=-1)
        top = [list(zip(ids, vals, strict=True)) for ids, vals in zip(indices.tolist(), values.tolist(),
                                                                        strict=True)]
    return _Picked(tokens.tolist(), chosen, top)


# --------------------------------------------------------------------------- the model owner


class _Runtime:
    """Model, tokenizer and adapter state. Mutated only on the worker thread."""

    def __init__(self, model: Any, tokenizer: Any, device: torch.device, path: Path) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.device = device
        self.path = path
        vocab_size = int(getattr(model.config, "vocab_size", len(tokenizer)))
        self.vocab = Vocabulary(tokenizer, vocab_size)
        self.eos_ids = self._eos_ids()
        self.context = int(getattr(model.config, "max_position_embeddings", 0) or tokenizer.model_max_length)
        self.adapters: set[str] = set()
        self._active_adapter: str | None = None  # what PEFT currently has set

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        configured = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        for source in (configured, self.tokenizer.eos_token_id):
            if isinstance(source, int):
                ids.add(source)
            elif isinstance(source, list):
                ids.update(int(i) for i in source)
        im_end = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        if isinstance(im_end, int) and im_end != self.tokenizer.unk_token_id:
            ids.add(im_end)  # ChatML turn end, even if a config forgot it
        return ids

    @contextlib.contextmanager
    def _adapter(self, name: str | None) -> Iterator[None]:
        if not self.adapters:
            if name is not None:
                raise NotFound(f"adapter {name!r} is not loaded")
            yield
            return
        if name is None:
            with self.model.disable_adapter():
                yield
            return
        if name not in self.adapters:
            raise NotFound(f"adapter {name!r} is not loaded")
        if self._active_adapter != name:  # set_adapter walks every module: skip when unchanged
            self.model.set_adapter(name, inference_mode=True)
            self._active_adapter = name
        yield

    def forward(self, input_ids: torch.Tensor, cache: Any, adapter: str | None) -> tuple[torch.Tensor, Any]:
        """Last-position logits (rows x vocab, float32) and the updated KV cache."""
        with torch.no_grad(), self._adapter(adapter):
            out = self.model(input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1, :].float(), out.past_key_values

    def load_adapter(self, name: str, path: str) -> None:
        from peft import PeftModel

        if name in self.adapters:
            raise BadRequest(f"an adapter named {name!r} is already loaded", param="name")
        try:
            with warnings.catch_warnings():
                # peft 0.21 calls a deprecated transformers-5 alias on every load: not actionable.
                warnings.filterwarnings("ignore", ".*is_gradient_checkpointing", FutureWarning)
                if not self.adapters:
                    self.model = PeftModel.from_pretrained(self.model, path, adapter_name=name,
                                                           is_trainable=False)
                else:
                    self.model.load_adapter(path, adapter_name=name, is_trainable=False)
        except Exception as exc:  # peft raises assorted types for incompatible adapters
            raise BadRequest(f"could not load adapter from {path}: {exc}", param="path") from exc
        self.model.eval()
        self.adapters.add(name)
        self._active_adapter = None if len(self.adapters) > 1 else name

    def unload_adapter(self, name: str) -> None:
        if name not in self.adapters:
            raise NotFound(f"adapter {name!r} is not loaded")
        if len(self.adapters) == 1:
            # PEFT cannot leave a PeftModel with zero adapters in a usable state:
            # strip the LoRA layers and serve the plain base model again.
            self.model = self.model.unload()
        else:
            if name in self.model.active_adapters:  # PEFT warns when deleting the active one: move off it
                other = next(a for a in sorted(self.adapters) if a != name)
                self.model.set_adapter(other, inference_mode=True)
            self.model.delete_adapter(name)
        self.adapters.discard(name)
        self._active_adapter = None


# --------------------------------------------------------------------------- jobs and the worker


class _Job:
    """Work for the worker thread: ``steps()`` does one unit per ``next()``."""

    def __init__(self, index: int, loop: asyncio.AbstractEventLoop, sink: Callable[[_Event], None]) -> None:
        self.index = index
        self.cancelled = False  # set from the event loop; a bool store is atomic under the GIL
        self._loop = loop
        self._sink = sink

    def emit(self, event: _Event) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening any more
            self._loop.call_soon_threadsafe(self._sink, event)

    def steps(self) -> Generator[None, None, None]:
        raise NotImplementedError


class _CallJob(_Job):
    """Runs one function on the worker thread between decode steps (adapter load/unload)."""

    def __init__(self, fn: Callable[[], Any], loop: asyncio.AbstractEventLoop,
                 sink: Callable[[_Event], None]) -> None:
        super().__init__(0, loop, sink)
        self._fn = fn
        self.result: Any = None

    def steps(self) -> Generator[None, None, None]:
        self.result = self._fn()
        return
        yield  # a generator that finishes on its first step


class _GenerationJob(_Job):
    """Decodes ``sampling.n`` continuations of one prompt, one token per step."""

    def __init__(self, runtime: _Runtime, index: int, prompt: list[int], sampling: Sampling,
                 loop: asyncio.AbstractEventLoop, sink: Callable[[_Event], None]) -> None:
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
        runtime, sampling = self._runtime, self._sampling
        generator = self._generator()
        choices = [_Choice(i, sampling, runtime.eos_ids, runtime.vocab.detokenizer())
                   for i in range(sampling.n)]
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
                self.emit(_Step(self.index, deltas))
            if all(c.finish_reason is not None for c in choices):
                return
            inputs = torch.tensor(picked.tokens, dtype=torch.long, device=runtime.device)[:, None]
            yield


class _Worker:
    """The thread that owns the model and round-robins job steps."""

    def __init__(self) -> None:
        self._inbox: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._active: deque[tuple[_Job, Generator[None, None, None]]] = deque()
        self._thread = threading.Thread(target=self._run, name="flywheel-local-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: _Job) -> None:
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
            job.emit(_Failed(job.index, stopping))
        while True:
            try:
                queued = self._inbox.get_nowait()
            except queue.Empty:
                break
            if queued is not None:
                queued.emit(_Failed(queued.index, stopping))

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
            block = False

    def _step(self) -> None:
        job, steps = self._active.popleft()
        if job.cancelled:
            steps.close()
            return
        try:
            next(steps)
        except StopIteration:
            job.emit(_Done(job.index, getattr(job, "result", None)))
        except OpenAIError as exc:
            job.emit(_Failed(job.index, exc))
        except Exception as exc:
            log.exception("local engine job failed")
            job.emit(_Failed(job.index, UpstreamError(f"local generation failed: {exc}")))
        else:
            self._active.append((job, steps))


class _Run:
    """The jobs of one request as the event loop sees them: events in, cancel out."""

    def __init__(self, runtime: _Runtime, worker: _Worker, request: _Request) -> None:
        loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[_Event] = asyncio.Queue()
        self._jobs = [_GenerationJob(runtime, i, prompt, request.sampling, loop, self._queue.put_nowait)
                      for i, prompt in enumerate(request.prompts)]
        self._running = len(self._jobs)
        for job in self._jobs:
            worker.submit(job)

    async def next(self) -> _Step | None:
        """The next step's deltas, or None when every job has finished."""
        while self._running:
            event = await self._queue.get()
            if isinstance(event, _Failed):
                raise event.error
            if isinstance(event, _Done):
                self._running -= 1
                continue
            return event
        return None

    def cancel(self) -> None:
        for job in self._jobs:
            job.cancelled = True


# --------------------------------------------------------------------------- response shapes


@dataclass
class _Result:
    """Everything one choice produced, for non-streaming responses."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    tokens: list[_Token] = field(default_factory=list)
    finish_reason: str = "stop"


def _logprob(value: float | None) -> float:
    return max(float(value if value is not None else MIN_LOGPROB), MIN_LOGPROB)


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class LocalEngine:
    """The :class:`gateway.engines.base.Engine` for a model loaded in this process."""

    def __init__(self, config: LocalEngineConfig, data_dir: Path) -> None:
        self.config = config
        self.data_dir = Path(data_dir)
        self._runtime: _Runtime | None = None
        self._worker: _Worker | None = None
        self._adapters: dict[str, str] = {}  # event-loop view: name -> path
        self._active_requests = 0

    # ----------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        if self._runtime is not None:
            return
        self._runtime = await asyncio.to_thread(self._load)
        self._worker = _Worker()
        self._worker.start()

    async def aclose(self) -> None:
        worker, self._worker, self._runtime = self._worker, None, None
        self._adapters.clear()
        if worker is not None:
            await asyncio.to_thread(worker.stop)

    def _model_path(self) -> Path | str:
        from trainer.tiny_model import ensure_tiny_model

        if self.config.model == TINY_MODEL:
            return ensure_tiny_model(self.data_dir / "models" / "tiny")
        local = Path(self.config.model).expanduser()
        return local if local.is_dir() else self.config.model  # else an HF id, from the cache only

    def _device_and_dtype(self) -> tuple[torch.device, torch.dtype]:
        name = self.config.device
        if name == "auto":
            name = "cuda" if torch.cuda.is_available() else "cpu"
        device = torch.device(name)
        if self.config.dtype == "auto":
            return device, (torch.bfloat16 if device.type == "cuda" else torch.float32)
        dtype = getattr(torch, self.config.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise UpstreamError(f"unknown dtype {self.config.dtype!r} for the local engine")
        return device, dtype

    def _load(self) -> _Runtime:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        source = self._model_path()
        device, dtype = self._device_and_dtype()
        try:
            tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
            model: Any = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, local_files_only=True)
        except (OSError, ValueError) as exc:
            raise UpstreamError(
                f"model {self.config.model!r} is neither a local directory nor in the Hugging Face cache "
                f"(nothing is downloaded): {exc}") from exc
        tokenizer.padding_side = "left"  # not saved with tokenizers; batched generation needs it
        model.to(device).eval()
        log.info("local engine: %s on %s (%s)", source, device, dtype)
        return _Runtime(model, tokenizer, device, Path(str(source)))

    def _ready(self) -> tuple[_Runtime, _Worker]:
        if self._runtime is None or self._worker is None:
            raise UpstreamError("the local engine is not started")
        return self._runtime, self._worker

    # ----------------------------------------------------------------- adapters

    async def _call(self, fn: Callable[[_Runtime], Any]) -> Any:
        runtime, worker = self._ready()
        loop = asyncio.get_running_loop()
        done: asyncio.Queue[_Event] = asyncio.Queue()
        worker.submit(_CallJob(lambda: fn(runtime), loop, done.put_nowait))
        event = await done.get()
        if isinstance(event, _Failed):
            raise event.error
        assert isinstance(event, _Done)
        return event.result

    async def load_adapter(self, name: str, path: str) -> None:
        if not name or name == self.config.model:
            raise BadRequest("the adapter name must be non-empty and differ from the base model",
                             param="name")
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
        runtime, _ = self._ready()
        return {"engine": "local", "model": self.config.model, "path": str(runtime.path),
                "device": str(runtime.device), "adapters": sorted(self._adapters),
                "active_requests": self._active_requests}

    # ----------------------------------------------------------------- request preparation

    def _sampling(self, body: Body, runtime: _Runtime, prompt_tokens: int, *, hold_tool_calls: bool,
                  logprobs: bool, top_logprobs: int) -> Sampling:
        limit = runtime.context - prompt_tokens
        if limit <= 0:
            raise BadRequest(f"the prompt has {prompt_tokens} tokens; the model's context is "
                             f"{runtime.context}", param="messages" if "messages" in body else "prompt")
        key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = _integer(body, key, 1)
        if max_tokens is not None and max_tokens > limit:
            raise BadRequest(f"{key}={max_tokens} plus {prompt_tokens} prompt tokens exceeds the model's "
                             f"context of {runtime.context} tokens", param=key)
        n = _integer(body, "n", 1) or 1
        if n > self.config.max_batch_n:
            raise BadRequest(f"n must be at most {self.config.max_batch_n}", param="n")
        model = body.get("model")
        return Sampling(
            max_tokens=max_tokens or min(self.config.default_max_tokens, limit),
            temperature=_number(body, "temperature", 1.0, 0.0, 100.0),
            top_p=_number(body, "top_p", 1.0, 1e-9, 1.0),
            n=n, stop=_stops(body), seed=_integer(body, "seed", -(1 << 63)),
            logprobs=logprobs, top_logprobs=top_logprobs,
            adapter=model if isinstance(model, str) and model in self._adapters else None,
            hold_tool_calls=hold_tool_calls, ignore_eos=bool(body.get("ignore_eos")))

    @staticmethod
    def _stream_usage(body: Body) -> bool:
        options = body.get("stream_options")
        return bool(isinstance(options, dict) and options.get("include_usage"))

    def _render(self, runtime: _Runtime, body: Body, tools: list[Any] | None) -> list[int]:
        messages = normalise_messages(body.get("messages"))
        extra = body.get("chat_template_kwargs")
        try:
            text = runtime.tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, tokenize=False,
                **(extra if isinstance(extra, dict) else {}))
        except Exception as exc:  # jinja raises many types for malformed conversations
            raise BadRequest(f"could not render the conversation: {exc}", param="messages") from exc
        # The template already wrote every special token: encode without adding more.
        return list(runtime.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _chat_request(self, body: Body) -> _Request:
        runtime, _ = self._ready()
        response_format = body.get("response_format")
        if isinstance(response_format, dict) and response_format.get("type", "text") != "text":
            raise BadRequest("the local engine supports only response_format type 'text'",
                             param="response_format")
        tools = body.get("tools") or None
        if tools is not None and not isinstance(tools, list):
            raise BadRequest("tools must be a list", param="tools")
        prompt = self._render(runtime, body, tools)
        parse_tools = tools is not None and body.get("tool_choice", "auto") != "none"
        top = _integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS) or 0
        want_logprobs = bool(body.get("logprobs"))
        if top and not want_logprobs:
            raise BadRequest("top_logprobs requires logprobs to be true", param="top_logprobs")
        sampling = self._sampling(body, runtime, len(prompt), hold_tool_calls=parse_tools,
                                  logprobs=want_logprobs, top_logprobs=top)
        return _Request([prompt], sampling, bool(body.get("return_token_ids")), self._stream_usage(body),
                        parse_tools)

    def _completion_request(self, body: Body) -> _Request:
        runtime, _ = self._ready()
        if body.get("echo"):
            raise BadRequest("echo is not supported by the local engine", param="echo")
        prompts: list[list[int]] = []
        for prompt in _completion_prompts(body.get("prompt")):
            ids = list(runtime.tokenizer(prompt)["input_ids"]) if isinstance(prompt, str) else prompt
            if not ids or any(not 0 <= i < runtime.vocab.size for i in ids):
                raise BadRequest("prompt token ids must be non-empty and inside the vocabulary",
                                 param="prompt")
            prompts.append(ids)
        top = _integer(body, "logprobs", 0, MAX_TOP_LOGPROBS)
        longest = max(len(p) for p in prompts)
        sampling = self._sampling(body, runtime, longest, hold_tool_calls=False,
                                  logprobs=top is not None, top_logprobs=top or 0)
        return _Request(prompts, sampling, bool(body.get("return_token_ids")), self._stream_usage(body))

    # ----------------------------------------------------------------- running

    async def _collect(self, request: _Request) -> list[_Result]:
        """Run a request to the end; results indexed job * n + choice."""
        n = request.sampling.n
        results = [_Result() for _ in range(n * len(request.prompts))]
        async with contextlib.aclosing(self._steps(request)) as steps:
            async for step in steps:
                for delta in step.deltas:
                    result = results[step.job * n + delta.index]
                    result.tokens.extend(delta.tokens)
                    result.token_ids.extend(t.id for t in delta.tokens)
                    if delta.finish_reason is not None:
                        result.finish_reason = delta.finish_reason
                        result.text = delta.full_text or ""
        return results

    async def _steps(self, request: _Request) -> AsyncGenerator[_Step, None]:
        runtime, worker = self._ready()
        run = _Run(runtime, worker, request)
        self._active_requests += 1
        try:
            while (step := await run.next()) is not None:
                yield step
        finally:
            # Normal end, error, client disconnect (aclose) or task cancellation alike.
            run.cancel()
            self._active_requests -= 1

    def _chat_logprobs(self, tokens: list[_Token], top_n: int) -> list[dict[str, Any]]:
        runtime, _ = self._ready()
        vocab = runtime.vocab
        entries = []
        for token in tokens:
            text, raw = vocab.show(token.id)
            alternatives = []
            for alt_id, alt_lp in (token.top or [])[:top_n]:
                alt_text, alt_raw = vocab.show(alt_id)
                alternatives.append({"token": alt_text, "logprob": _logprob(alt_lp), "bytes": alt_raw})
            entries.append({"token": text, "logprob": _logprob(token.logprob), "bytes": raw,
                            "top_logprobs": alternatives})
        return entries

    def _legacy_logprobs(self, tokens: list[_Token], top_n: int) -> dict[str, Any]:
        runtime, _ = self._ready()
        vocab = runtime.vocab
        return {
            "tokens": [vocab.show(t.id)[0] for t in tokens],
            "token_logprobs": [_logprob(t.logprob) for t in tokens],
            "top_logprobs": [{vocab.show(i)[0]: _logprob(lp) for i, lp in (t.top or [])[:top_n]}
                             for t in tokens],
            "text_offset": [t.offset for t in tokens],
        }

    # ----------------------------------------------------------------- chat

    async def chat(self, body: Body) -> Body:
        request = self._chat_request(body)
        results = await self._collect(request)
        sampling = request.sampling
        choices = []
        for index, result in enumerate(results):
            content: str | None = result.text
            calls: list[dict[str, Any]] = []
            if request.parse_tools:
                content, calls = parse_tool_calls(result.text)
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = calls
            choice: dict[str, Any] = {
                "index": index, "message": message,
                "logprobs": ({"content": self._chat_logprobs(result.tokens, sampling.top_logprobs)}
                             if sampling.logprobs else None),
                "finish_reason": "tool_calls" if calls else result.finish_reason}
            if request.return_token_ids:
                choice["token_ids"] = result.token_ids
            choices.append(choice)
        response: Body = {
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": body.get("model"), "choices": choices,
            "usage": _usage(len(request.prompts[0]), sum(len(r.token_ids) for r in results))}
        if request.return_token_ids:
            response["prompt_token_ids"] = request.prompts[0]
        return response

    def chat_stream(self, body: Body) -> AsyncGenerator[Chunk, None]:
        # Validate and tokenise now, so bad requests fail before any chunk exists.
        request = self._chat_request(body)
        return self._chat_chunks(body, request)

    async def _chat_chunks(self, body: Body, request: _Request) -> AsyncGenerator[Chunk, None]:
        sampling = request.sampling
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk",
                "created": int(time.time()), "model": body.get("model")}

        def chunk(choice: dict[str, Any], **extra: Any) -> Chunk:
            return {**head, "choices": [choice], **extra}

        def piece(index: int, delta: dict[str, Any], tokens: list[_Token], finish: str | None) -> Chunk:
            choice: dict[str, Any] = {
                "index": index, "delta": delta,
                "logprobs": ({"content": self._chat_logprobs(tokens, sampling.top_logprobs)}
                             if sampling.logprobs and tokens else None),
                "finish_reason": finish}
            if request.return_token_ids:
                choice["token_ids"] = [t.id for t in tokens]
            return chunk(choice)

        extra = {"prompt_token_ids": request.prompts[0]} if request.return_token_ids else {}
        for index in range(sampling.n):
            yield chunk({"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None}, **extra)
        completion_tokens = 0
        # aclosing: a client disconnect closes this generator, which must cancel the job now.
        async with contextlib.aclosing(self._steps(request)) as steps:
            async for step in steps:
                for delta in step.deltas:
                    completion_tokens += len(delta.tokens)
                    if delta.finish_reason is None:
                        yield piece(delta.index, {"content": delta.text}, delta.tokens, None)
                        continue
                    for out in self._chat_final_chunks(delta, request, piece):
                        yield out
        if request.include_usage:
            yield {**head, "choices": [], "usage": _usage(len(request.prompts[0]), completion_tokens)}

    @staticmethod
    def _chat_final_chunks(delta: _Delta, request: _Request,
                           piece: Callable[[int, dict[str, Any], list[_Token], str | None], Chunk]
                           ) -> Iterator[Chunk]:
        """The last text, the tool calls (parsed from the held-back tail) and the finish chunk."""
        text, finish = delta.text, delta.finish_reason
        calls: list[dict[str, Any]] = []
        if request.parse_tools:
            content, calls = parse_tool_calls(delta.text)
            if calls:
                text, finish = content or "", "tool_calls"
        tokens = delta.tokens
        if text:
            yield piece(delta.index, {"content": text}, tokens, None)
            tokens = []
        if calls:
            tool_deltas = [{"index": k, **call} for k, call in enumerate(calls)]
            yield piece(delta.index, {"tool_calls": tool_deltas}, tokens, None)
            tokens = []
        yield piece(delta.index, {}, tokens, finish)

    # ----------------------------------------------------------------- completions

    def _completion_choice(self, request: _Request, job: int, delta: _Delta,
                           started: set[int]) -> dict[str, Any]:
        sampling = request.sampling
        index = job * sampling.n + delta.index
        choice: dict[str, Any] = {
            "index": index, "text": delta.text,
            "logprobs": (self._legacy_logprobs(delta.tokens, sampling.top_logprobs)
                         if sampling.logprobs else None),
            "finish_reason": delta.finish_reason}
        if request.return_token_ids:
            if index not in started:  # vLLM sends the prompt's ids with each choice's first chunk
                choice["prompt_token_ids"] = request.prompts[job]
            choice["token_ids"] = [t.id for t in delta.tokens]
        started.add(index)
        return choice

    async def completion(self, body: Body) -> Body:
        request = self._completion_request(body)
        results = await self._collect(request)
        sampling, n = request.sampling, request.sampling.n
        choices = []
        for index, result in enumerate(results):
            choice: dict[str, Any] = {
                "index": index, "text": result.text,
                "logprobs": (self._legacy_logprobs(result.tokens, sampling.top_logprobs)
                             if sampling.logprobs else None),
                "finish_reason": result.finish_reason}
            if request.return_token_ids:
                choice["prompt_token_ids"] = request.prompts[index // n]
                choice["token_ids"] = result.token_ids
            choices.append(choice)
        prompt_tokens = sum(len(p) for p in request.prompts)
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": body.get("model"), "choices": choices,
                "usage": _usage(prompt_tokens, sum(len(r.token_ids) for r in results))}

    def completion_stream(self, body: Body) -> AsyncGenerator[Chunk, None]:
        request = self._completion_request(body)
        return self._completion_chunks(body, request)

    async def _completion_chunks(self, body: Body, request: _Request) -> AsyncGenerator[Chunk, None]:
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": body.get("model")}
        started: set[int] = set()
        completion_tokens = 0
        async with contextlib.aclosing(self._steps(request)) as steps:
            async for step in steps:
                for delta in step.deltas:
                    completion_tokens += len(delta.tokens)
                    yield {**head, "choices": [self._completion_choice(request, step.job, delta, started)]}
        if request.include_usage:
            prompt_tokens = sum(len(p) for p in request.prompts)
            yield {**head, "choices": [], "usage": _usage(prompt_tokens, completion_tokens)}
