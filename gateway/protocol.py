"""Request validation for the OpenAI endpoints.

The models check only what the gateway and its engines rely on and accept every
other field (``extra="allow"``): an unknown-but-valid OpenAI parameter is passed on,
never rejected. Validation runs on the parsed dict; the dict itself (not a re-dump of
the model) is what reaches the engine, so nothing the client sent is reshaped.
"""

from __future__ import annotations

from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gateway.errors import BadRequest


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class FunctionDef(_Open):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Open):
    type: Literal["function"]
    function: FunctionDef


class ToolCallFunction(_Open):
    name: str
    arguments: str | dict[str, Any]


class ToolCall(_Open):
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class Message(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class StreamOptions(_Open):
    include_usage: bool | None = None


class ResponseFormat(_Open):
    type: Literal["text", "json_object", "json_schema"]


class _Sampling(_Open):
    model: str = Field(min_length=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int | None = Field(default=None, ge=1, le=128)
    max_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    return_token_ids: bool | None = None  # vLLM extension: exact prompt/completion token ids
    metadata: dict[str, Any] | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: ResponseFormat | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] = Field(min_length=1)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool | None = None


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """The request body as a dict, or a 400 that says why it is not one."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"We could not parse the JSON body of your request: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object.")
    return body


def validate_request(model: type[BaseModel], body: dict[str, Any]) -> None:
    """Raise a 400 naming the first invalid field, OpenAI style (``messages[0].role``)."""
    try:
        model.model_validate(body)
    except ValidationError as exc:
        error = exc.errors()[0]
        param = format_param(error["loc"])
        raise BadRequest(f"Invalid value for '{param}': {error['msg']}", param=param,
                         code="invalid_value" if error["type"] != "missing" else "missing_required_parameter"
                         ) from None


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def format_param(loc: tuple[int | str, ...]) -> str:
    """``("messages", 0, "role")`` -> ``messages[0].role``; pydantic's union branch tags are dropped."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" in part or part in _TYPE_TAGS or part.startswith("function-"):
            continue  # names of union branches, not fields
        else:
            out += f".{part}" if out else part
    return out
