"""The engine protocol: what the HTTP layer needs from whatever generates tokens.

Both engines speak one dialect, vLLM's flavour of the OpenAI API:

- ``body`` is the OpenAI request as a plain dict, already validated by
  :mod:`flywheel.gateway.core.protocol` (strict types, every bound, refused fields): an engine adds
  only its own limits, as 400s naming the field. ``body["model"]`` is the name the
  engine serves: the base model or the name a LoRA adapter was loaded under (``alias@N``).
- Non-streaming calls return the OpenAI response dict. When ``return_token_ids`` is
  true it carries ``prompt_token_ids`` (top level for chat, per choice for
  completions) and ``choices[].token_ids``; ``logprobs`` follows OpenAI's shape.
- Streaming calls are async iterators of chunk dicts (``chat.completion.chunk`` /
  ``text_completion``). The usage chunk (empty ``choices``) comes last when
  ``stream_options.include_usage`` is true. The gateway adds ``data: `` framing and
  ``[DONE]``.
- Failures raise :class:`flywheel.gateway.core.errors.OpenAIError` subclasses, before the first
  chunk when possible (a bad request on the stream's first ``anext``); after it, the
  gateway turns them into an SSE error event. Closing a stream early (the client left)
  must stop the generation.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol, runtime_checkable

Body = dict[str, Any]
Chunk = dict[str, Any]


@runtime_checkable
class Engine(Protocol):
    """Generates completions for a base model and the LoRA adapters loaded into it."""

    draws_without_replacement: bool  # takes ``draw_without_replacement``: n distinct choices (forks' siblings)

    async def start(self) -> None:
        """Acquire resources (load weights, open connection pools)."""

    async def aclose(self) -> None:
        """Release everything :meth:`start` acquired."""

    async def chat(self, body: Body) -> Body:
        """``POST /v1/chat/completions`` without streaming."""

    def chat_stream(self, body: Body) -> AsyncIterator[Chunk]:
        """``POST /v1/chat/completions`` with ``stream: true``."""

    async def completion(self, body: Body) -> Body:
        """``POST /v1/completions`` without streaming."""

    def completion_stream(self, body: Body) -> AsyncIterator[Chunk]:
        """``POST /v1/completions`` with ``stream: true``."""

    async def load_adapter(self, name: str, path: str) -> None:
        """Load the PEFT adapter at ``path`` so requests can name it as ``model``."""

    async def unload_adapter(self, name: str) -> None:
        """Forget the adapter loaded under ``name``."""

    async def adapters(self) -> list[str]:
        """Names of the adapters loaded now, as the engine itself reports them (a switch confirms with it)."""

    async def health(self) -> Body:
        """A small dict describing readiness; raises ``UpstreamError`` when not ready."""
