"""An engine that forwards to any OpenAI-compatible server (vLLM in production).

One ``httpx.AsyncClient`` per engine, opened in :meth:`start` and closed in
:meth:`aclose`; streams are read line by line and handed on chunk by chunk, never
buffered whole. Upstream failures become :mod:`gateway.errors` exceptions:
connection trouble and 5xx -> 502, timeouts -> 504, and the upstream's own 4xx
verdicts on the request (400, 404, 413, 422, 429) keep their status and message.
Adapters are loaded through vLLM's runtime LoRA API
(``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``): ``/v1/load_lora_adapter``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson

from gateway.config import OpenAIEngineConfig
from gateway.engines.base import Body, Chunk
from gateway.errors import OpenAIError, UpstreamError, UpstreamTimeout

_JSON = {"content-type": "application/json"}
_RELAYED_STATUSES = {400, 404, 413, 422, 429}  # the upstream's verdict on the request itself


class OpenAIUpstreamEngine:
    """Forwards requests to ``config.base_url`` over one pooled HTTP client."""

    def __init__(self, config: OpenAIEngineConfig) -> None:
        self.config = config
        self._client: httpx.AsyncClient | None = None

    async def start(self) -> None:
        headers = {}
        if self.config.api_key is not None:
            headers["authorization"] = f"Bearer {self.config.api_key.get_secret_value()}"
        self._client = httpx.AsyncClient(
            base_url=self.config.base_url.rstrip("/"),
            headers=headers,
            timeout=httpx.Timeout(self.config.timeout_s, connect=self.config.connect_timeout_s),
            limits=httpx.Limits(max_connections=self.config.max_connections,
                                max_keepalive_connections=self.config.max_connections),
        )

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            raise UpstreamError("upstream engine is not started")
        return self._client

    async def chat(self, body: Body) -> Body:
        return await self._post_json("/chat/completions", body)

    def chat_stream(self, body: Body) -> AsyncIterator[Chunk]:
        return self._post_stream("/chat/completions", body)

    async def completion(self, body: Body) -> Body:
        return await self._post_json("/completions", body)

    def completion_stream(self, body: Body) -> AsyncIterator[Chunk]:
        return self._post_stream("/completions", body)

    async def load_adapter(self, name: str, path: str) -> None:
        await self._post_json("/load_lora_adapter", {"lora_name": name, "lora_path": path}, expect_json=False)

    async def unload_adapter(self, name: str) -> None:
        await self._post_json("/unload_lora_adapter", {"lora_name": name}, expect_json=False)

    async def health(self) -> Body:
        try:
            response = await self.client.get("/models", timeout=5.0)
        except httpx.HTTPError as exc:
            raise UpstreamError(f"upstream {self.config.base_url} unreachable: {type(exc).__name__}") from None
        if response.status_code != 200:
            raise UpstreamError(f"upstream {self.config.base_url} answered {response.status_code}")
        return {"engine": "openai", "base_url": self.config.base_url}

    async def _post_json(self, path: str, body: Body, *, expect_json: bool = True) -> Body:
        try:
            response = await self.client.post(path, content=orjson.dumps(body), headers=_JSON)
        except httpx.TimeoutException:
            raise _timeout(self.config) from None
        except httpx.HTTPError as exc:
            raise _unreachable(self.config, exc) from None
        if response.status_code >= 400:
            raise upstream_failure(response.status_code, response.content)
        if not expect_json:
            return {}
        try:
            result: Body = orjson.loads(response.content)
        except orjson.JSONDecodeError:
            raise UpstreamError("upstream returned a body that is not JSON") from None
        return result

    async def _post_stream(self, path: str, body: Body) -> AsyncIterator[Chunk]:
        request = self.client.build_request("POST", path, content=orjson.dumps(body), headers=_JSON)
        try:
            response = await self.client.send(request, stream=True)
        except httpx.TimeoutException:
            raise _timeout(self.config) from None
        except httpx.HTTPError as exc:
            raise _unreachable(self.config, exc) from None
        try:
            if response.status_code >= 400:
                raise upstream_failure(response.status_code, await response.aread())
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, comments, event names
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                chunk = orjson.loads(data)
                if "error" in chunk:
                    raise upstream_failure(502, data.encode())
                yield chunk
        except httpx.TimeoutException:
            raise _timeout(self.config) from None
        except httpx.HTTPError as exc:
            raise _unreachable(self.config, exc) from None
        except orjson.JSONDecodeError:
            raise UpstreamError("upstream sent a stream event that is not JSON") from None
        finally:
            await response.aclose()


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


def _unreachable(config: OpenAIEngineConfig, exc: httpx.HTTPError) -> UpstreamError:
    return UpstreamError(f"upstream {config.base_url} unreachable: {type(exc).__name__}")
