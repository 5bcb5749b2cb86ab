"""A stand-in for vLLM's OpenAI server with runtime LoRA updating, on a loopback port.

It speaks the protocol the gateway's upstream engine uses (``VLLM_ALLOW_RUNTIME_LORA_UPDATING``):
``GET /v1/models`` lists the base model and every loaded LoRA (``parent`` = the base);
``POST /v1/load_lora_adapter {"lora_name", "lora_path"}`` loads one (400 if the name is taken,
as vLLM answers without ``load_inplace``); ``POST /v1/unload_lora_adapter {"lora_name"}`` (404 if
unknown); chat completions for the base model or a loaded LoRA (404 for any other model, as vLLM).
Each answer says which model produced it (``served by <model>``), and ``events`` records every
load, unload and answer in order, so tests can check what the gateway did and when.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from tests.scripted_openai import LoopbackServer, Reply, ScriptedOpenAI

BASE = "base-model"


def _error(status: int, message: str) -> Response:
    body = {"error": {"message": message, "type": "NotFoundError" if status == 404 else "BadRequestError",
                      "param": None, "code": status}}
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")


@dataclass
class VllmStandIn(ScriptedOpenAI):
    loras: dict[str, str] = field(default_factory=dict)  # name -> path
    events: list[tuple[str, str]] = field(default_factory=list)  # ("load" | "unload" | "answer", model)
    refuse_listing: set[str] = field(default_factory=set)  # names /v1/models leaves out (a silent failed load)

    def __post_init__(self) -> None:
        self.answered = 0
        self.reply = self._say_who

    def _say_who(self, body: dict[str, Any]) -> Reply:
        self.answered += 1  # a number per answer: no two conversations get the same text
        return Reply(content=f"served by {body['model']} #{self.answered}")

    def __enter__(self) -> VllmStandIn:
        self._server = LoopbackServer(Starlette(routes=[
            Route("/v1/chat/completions", self._checked_chat, methods=["POST"]),
            Route("/v1/models", self._list, methods=["GET"]),
            Route("/v1/load_lora_adapter", self._load, methods=["POST"]),
            Route("/v1/unload_lora_adapter", self._unload, methods=["POST"])]), self.port)
        return self

    async def _list(self, request: Request) -> Response:
        data: list[dict[str, Any]] = [{"id": BASE, "object": "model", "parent": None}]
        data += [{"id": name, "object": "model", "parent": BASE, "root": path}
                 for name, path in self.loras.items() if name not in self.refuse_listing]
        return Response(orjson.dumps({"object": "list", "data": data}), media_type="application/json")

    async def _load(self, request: Request) -> Response:
        body = orjson.loads(await request.body())
        name = body["lora_name"]
        if name in self.loras:
            return _error(400, f"The lora adapter '{name}' has already been loaded.")
        self.loras[name] = body["lora_path"]
        self.events.append(("load", name))
        return Response(f"Success: LoRA adapter '{name}' added successfully.", media_type="text/plain")

    async def _unload(self, request: Request) -> Response:
        name = orjson.loads(await request.body())["lora_name"]
        if self.loras.pop(name, None) is None:
            return _error(404, f"The lora adapter '{name}' cannot be found.")
        self.events.append(("unload", name))
        return Response(f"Success: LoRA adapter '{name}' removed successfully.", media_type="text/plain")

    async def _checked_chat(self, request: Request) -> Response:
        model = orjson.loads(await request.body()).get("model")
        if model != BASE and model not in self.loras:
            return _error(404, f"The model `{model}` does not exist.")
        self.events.append(("answer", str(model)))
        return await self._chat(request)


@pytest.fixture
def vllm() -> Iterator[VllmStandIn]:
    """A stand-in of its own for each test (registered in conftest.py)."""
    with VllmStandIn() as server:
        yield server
