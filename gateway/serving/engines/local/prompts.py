"""Request preparation: a validated OpenAI body becomes token ids and sampling parameters.

Bodies arrive validated by :mod:`flywheel.gateway.core.protocol` (types and bounds, one definition of each);
this module adds only what this engine cannot do or hold: non-text content, ``echo``,
structured output, ``n`` above ``max_batch_n``, prompts and completions beyond the context.

Rendering the chat template and tokenizing grow with the prompt (a 6 MB prompt takes
seconds to tokenize), so prompts over :data:`INLINE_BYTES` are prepared on a small thread
pool of their own: the event loop keeps serving and the worker keeps stepping other jobs
(tokenizers release the GIL while they encode).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson

from flywheel.gateway.core.config import LocalEngineConfig
from flywheel.gateway.core.errors import BadRequest
from flywheel.gateway.serving.engines.base import Body
from flywheel.gateway.serving.engines.local.decoding import Sampling
from flywheel.gateway.serving.engines.local.runtime import Runtime

INLINE_BYTES = 16 * 1024  # smaller prompts render and tokenize on the event loop: well under a millisecond
PREPARE_THREADS = 2  # big prompts at once; more would only compete for the same cores

T = TypeVar("T")


@dataclass
class PreparedRequest:
    """What the worker needs to run one request, and what the response shapes need to know."""

    prompts: list[list[int]]
    sampling: Sampling
    return_token_ids: bool
    include_usage: bool
    parse_tools: bool = False


def _text_of_parts(parts: list[dict[str, Any]], index: int) -> str:
    for position, part in enumerate(parts):
        if part["type"] != "text":
            raise BadRequest(f"only text content parts are supported by the local engine, not {part['type']!r}",
                             param=f"messages[{index}].content[{position}]")
    return "\n".join(part["text"] for part in parts)  # how vLLM joins text parts


def _call_for_template(call: dict[str, Any]) -> dict[str, Any]:
    # Chat templates index into arguments as a mapping; OpenAI sends them as a JSON string.
    function = dict(call["function"])
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        with contextlib.suppress(ValueError):
            parsed = json.loads(arguments)
            if isinstance(parsed, dict):
                function["arguments"] = parsed
    return {**call, "function": function}


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Validated OpenAI messages as chat templates expect them: string content, dict arguments."""
    out = []
    for index, message in enumerate(messages):
        message = dict(message)
        if isinstance(message.get("content"), list):
            message["content"] = _text_of_parts(message["content"], index)
        if message.get("tool_calls"):
            message["tool_calls"] = [_call_for_template(call) for call in message["tool_calls"]]
        out.append(message)
    return out


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], tools: list[Any] | None,
                template_kwargs: dict[str, Any]) -> list[int]:
    """The prompt's token ids: the model's own chat template, then the tokenizer."""
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False,
                                             **template_kwargs)
    except Exception as exc:  # jinja raises many types for malformed conversations
        raise BadRequest(f"could not render the conversation: {exc}", param="messages") from exc
    # The template already wrote every special token: encode without adding more.
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def tokenize_prompts(tokenizer: Any, prompt: str | list[Any]) -> list[list[int]]:
    """/v1/completions ``prompt`` (a string, strings, token ids, or lists of them) as token id lists."""
    if isinstance(prompt, str):
        return [list(tokenizer(prompt)["input_ids"])]
    if all(isinstance(item, int) for item in prompt):
        return [list(prompt)]
    return [list(tokenizer(item)["input_ids"]) if isinstance(item, str) else list(item) for item in prompt]


def include_usage(body: Body) -> bool:
    return bool((body.get("stream_options") or {}).get("include_usage"))


class Preparer:
    """Turns validated bodies into :class:`PreparedRequest`; big prompts on its own thread pool."""

    def __init__(self, runtime: Runtime, config: LocalEngineConfig) -> None:
        self._runtime = runtime
        self._config = config
        self._pool = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="flywheel-local-prepare")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def _prepare(self, size: int, fn: Callable[..., T], *args: Any) -> T:
        if size <= INLINE_BYTES:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def chat(self, body: Body, adapters: Collection[str]) -> PreparedRequest:
        response_format = body.get("response_format") or {}
        if response_format.get("type", "text") != "text":
            raise BadRequest("the local engine supports only response_format type 'text'", param="response_format")
        self._check_n(body)
        messages = template_messages(body["messages"])
        tools = body.get("tools") or None
        size = len(orjson.dumps([body["messages"], tools]))
        prompt = await self._prepare(size, render_chat, self._runtime.tokenizer, messages, tools,
                                     body.get("chat_template_kwargs") or {})
        parse_tools = tools is not None and body.get("tool_choice") != "none"
        sampling = self._sampling(body, len(prompt), adapters, hold_tool_calls=parse_tools,
                                  logprobs=bool(body.get("logprobs")), top_logprobs=body.get("top_logprobs") or 0)
        return PreparedRequest([prompt], sampling, bool(body.get("return_token_ids")), include_usage(body),
                               parse_tools)

    async def completion(self, body: Body, adapters: Collection[str]) -> PreparedRequest:
        if body.get("echo"):
            raise BadRequest("echo is not supported by the local engine", param="echo")
        self._check_n(body)
        raw = body["prompt"]
        size = len(raw) if isinstance(raw, str) else sum(len(p) for p in raw if isinstance(p, str))
        prompts = await self._prepare(size, tokenize_prompts, self._runtime.tokenizer, raw)
        vocabulary = self._runtime.vocab.size
        if any(not ids or any(i >= vocabulary for i in ids) for ids in prompts):
            raise BadRequest("prompt token ids must be non-empty and inside the vocabulary", param="prompt")
        top = body.get("logprobs")
        sampling = self._sampling(body, max(len(p) for p in prompts), adapters, hold_tool_calls=False,
                                  logprobs=top is not None, top_logprobs=top or 0)
        return PreparedRequest(prompts, sampling, bool(body.get("return_token_ids")), include_usage(body))

    def _check_n(self, body: Body) -> None:
        if (body.get("n") or 1) > self._config.max_batch_n:
            raise BadRequest(f"n must be at most {self._config.max_batch_n} on this engine", param="n")

    def _sampling(self, body: Body, prompt_tokens: int, adapters: Collection[str], *, hold_tool_calls: bool,
                  logprobs: bool, top_logprobs: int) -> Sampling:
        context = self._runtime.context
        limit = context - prompt_tokens
        if limit <= 0:
            param = "messages" if "messages" in body else "prompt"
            raise BadRequest(f"'{param}' is {prompt_tokens} tokens long; the model's context is {context} tokens",
                             param=param)
        key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = body.get(key)
        if max_tokens is not None and max_tokens > limit:
            raise BadRequest(f"{key}={max_tokens} plus {prompt_tokens} prompt tokens exceeds the model's "
                             f"context of {context} tokens", param=key)
        stop = body.get("stop") or ()
        temperature, top_p, model = body.get("temperature"), body.get("top_p"), body.get("model")
        without_replacement = bool(body.get("draw_without_replacement"))
        if without_replacement and temperature == 0:
            raise BadRequest("draw_without_replacement needs a temperature above 0", param="draw_without_replacement")
        return Sampling(
            max_tokens=max_tokens or min(self._config.default_max_tokens, limit),
            temperature=1.0 if temperature is None else float(temperature),
            top_p=1.0 if top_p is None else float(top_p),
            n=body.get("n") or 1, stop=tuple(s for s in ([stop] if isinstance(stop, str) else stop) if s),
            seed=body.get("seed"), logprobs=logprobs, top_logprobs=top_logprobs,
            adapter=model if model in adapters else None, hold_tool_calls=hold_tool_calls,
            ignore_eos=bool(body.get("ignore_eos")), without_replacement=without_replacement)
