"""An engine that forwards to any OpenAI-compatible server (vLLM in production).

One ``aiohttp.ClientSession`` per engine, opened in :meth:`start` and closed in
:meth:`aclose`; streams are read as bytes arrive and handed on event by event, never
buffered whole. Upstream failures become :mod:`flywheel.gateway.core.errors` exceptions:
connection trouble and 5xx -> 502, timeouts -> 504, and the upstream's own 4xx
verdicts on the request (400, 404, 413, 422, 429) keep their status and message.
Adapters are loaded through vLLM's runtime LoRA API
(``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``): ``/v1/load_lora_adapter`` — on ``base_url``, or on
each server of ``replica_urls`` when ``base_url`` is a load balancer in front of them (that API acts
on the one server it reaches); an adapter counts as loaded when every one of them lists it.

Why aiohttp and not httpx: this is the hot path of every request, and side by side httpx's
client cost more CPU per request and its pool degraded under concurrency (docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson

from flywheel.gateway.core.config import OpenAIEngineConfig
from flywheel.gateway.core.errors import OpenAIError, UpstreamError, UpstreamTimeout
from flywheel.gateway.serving.engines.base import Body, Chunk

_JSON = {"content-type": "application/json"}
_RELAYED_STATUSES = {400, 404, 413, 422, 429}  # the upstream's verdict on the request itself


class OpenAIUpstreamEngine:
    """Forwards requests to ``config.base_url`` over one pooled HTTP client."""

    draws_without_replacement = False  # vLLM has beam search, not this sampling: its siblings are independent

    def __init__(self, config: OpenAIEngineConfig) -> None:
        self.config = config
        self.base_url = config.base_url.rstrip("/")
        self.lora_urls = [url.rstrip("/") for url in config.replica_urls] or [self.base_url]
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        headers = {}
        if self.config.api_key is not None:
            headers["authorization"] = f"Bearer {self.config.api_key.get_secret_value()}"
        self._session = aiohttp.ClientSession(
            headers=headers,
            # sock_read: the longest silence tolerated between bytes (a stream may run for minutes).
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.config.connect_timeout_s,
                                          sock_read=self.config.timeout_s),
            connector=aiohttp.TCPConnector(limit=self.config.max_connections, ttl_dns_cache=300),
            cookie_jar=aiohttp.DummyCookieJar(),
            auto_decompress=True,
        )

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise UpstreamError("upstream engine is not started")
        return self._session

    async def chat(self, body: Body) -> Body:
        return await self._post_json("/chat/completions", body)

    def chat_stream(self, body: Body) -> AsyncIterator[Chunk]:
        return self._post_stream("/chat/completions", body)

    async def completion(self, body: Body) -> Body:
        return await self._post_json("/completions", body)

    def completion_stream(self, body: Body) -> AsyncIterator[Chunk]:
        return self._post_stream("/completions", body)

    async def load_adapter(self, name: str, path: str) -> None:
        """Load on every server that does not list ``name`` yet (a replica that restarted lost its adapters)."""
        for url in self.lora_urls:
            if name not in await self._models(url):
                await self._post_json("/load_lora_adapter", {"lora_name": name, "lora_path": path},
                                      expect_json=False, base_url=url)

    async def unload_adapter(self, name: str) -> None:
        for url in self.lora_urls:
            if name in await self._models(url):
                await self._post_json("/unload_lora_adapter", {"lora_name": name}, expect_json=False, base_url=url)

    async def adapters(self) -> list[str]:
        """The adapters every server lists: vLLM lists each loaded LoRA in ``GET /v1/models``."""
        listed = [await self._models(url) for url in self.lora_urls]
        return [name for name in listed[0] if all(name in other for other in listed[1:])]

    async def _models(self, base_url: str) -> list[str]:
        try:
            async with self.session.get(base_url + "/models") as response:
                content, status = await response.read(), response.status
        except TimeoutError:
            raise _timeout(self.config) from None
        except aiohttp.ClientError as exc:
            raise _unreachable(self.config, exc) from None
        if status >= 400:
            raise upstream_failure(status, content)
        try:
            return [str(model["id"]) for model in orjson.loads(content)["data"]]
        except (orjson.JSONDecodeError, KeyError, TypeError):
            raise UpstreamError("upstream /models answered something that is not a model list") from None

    async def health(self) -> Body:
        try:
            async with self.session.get(self.base_url + "/models",
                                        timeout=aiohttp.ClientTimeout(total=5.0)) as response:
                status = response.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise UpstreamError(f"upstream {self.base_url} unreachable: {type(exc).__name__}") from None
        if status != 200:
            raise UpstreamError(f"upstream {self.base_url} answered {status}")
        return {"engine": "openai", "base_url": self.base_url}

    async def _post_json(self, path: str, body: Body, *, expect_json: bool = True, base_url: str | None = None) -> Body:
        try:
            async with self.session.post((base_url or self.base_url) + path, data=orjson.dumps(body),
                                         headers=_JSON) as response:
                content = await response.read()
                status = response.status
        except TimeoutError:
            raise _timeout(self.config) from None
        except aiohttp.ClientError as exc:
            raise _unreachable(self.config, exc) from None
        if status >= 400:
            raise upstream_failure(status, content)
        if not expect_json:
            return {}
        try:
            result: Body = orjson.loads(content)
        except orjson.JSONDecodeError:
            raise UpstreamError("upstream returned a body that is not JSON") from None
        return result

    async def _post_stream(self, path: str, body: Body) -> AsyncIterator[Chunk]:
        try:
            response = await self.session.post(self.base_url + path, data=orjson.dumps(body), headers=_JSON)
        except TimeoutError:
            raise _timeout(self.config) from None
        except aiohttp.ClientError as exc:
            raise _unreachable(self.config, exc) from None
        ended = False
        try:
            if response.status >= 400:
                raise upstream_failure(response.status, await response.read())
            async for data in sse_data(response.content):
                if data == b"[DONE]":
                    break
                chunk = orjson.loads(data)
                if "error" in chunk:
                    raise upstream_failure(502, data)
                yield chunk
            ended = True
        except TimeoutError:
            raise _timeout(self.config) from None
        except aiohttp.ClientError as exc:
            raise _unreachable(self.config, exc) from None
        except orjson.JSONDecodeError:
            raise UpstreamError("upstream sent a stream event that is not JSON") from None
        finally:
            if ended:
                response.release()
            else:  # abandoned (the client went away) or broken: closing the connection stops the generation
                response.close()


async def sse_data(stream: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    """The payload of every ``data:`` line, as bytes arrive.

    Lines are split here rather than with ``readline``: vLLM's first chunk carries the
    whole ``prompt_token_ids`` and can exceed aiohttp's 64 KiB line limit.
    """
    pending = b""
    async for piece in stream.iter_any():
        pending += piece
        *lines, pending = pending.split(b"\n")
        for line in lines:
            if line.startswith(b"data:"):
                yield line[5:].strip()
    if pending.startswith(b"data:"):
        yield pending[5:].strip()


def upstream_failure(status: int, content: bytes) -> OpenAIError:
    """Map an upstream error response to the error the gateway reports."""
    message, param, code = f"upstream answered HTTP {status}", None, None
    try:
        error: Any = orjson.loads(content).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        error = None
    if isinstance(error, dict):
        message = f"upstream: {error.get('message') or message}"
        param, code = error.get("param"), error.get("code")
    elif isinstance(error, str):
        message = f"upstream: {error}"
    if status in _RELAYED_STATUSES:
        return OpenAIError(message, param=param, code=code, status_code=status,
                           error_type="invalid_request_error")
    return UpstreamError(message, param=param)


def _timeout(config: OpenAIEngineConfig) -> UpstreamTimeout:
    return UpstreamTimeout(f"upstream {config.base_url} did not answer within {config.timeout_s:g} s")


def _unreachable(config: OpenAIEngineConfig, exc: aiohttp.ClientError | asyncio.TimeoutError) -> UpstreamError:
    return UpstreamError(f"upstream {config.base_url} unreachable: {type(exc).__name__}")
