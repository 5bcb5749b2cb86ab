"""Request validation for the OpenAI endpoints: the one place where every bound is defined.

The models check what the gateway and its engines read, strictly as OpenAI does (``"n": "2"``
and ``"stream": "yes"`` are 400s, not coerced; floats accept integers), and accept every
other field (``extra="allow"``): an unknown-but-valid OpenAI parameter is passed on, never
rejected. A few fields are refused by name because they would make an engine load or run
something the client chose (a template, code, a grammar, a path): :data:`NOT_ACCEPTED`.
Validation runs on the parsed dict; the dict itself (not a re-dump of the model) is what
reaches the engine, so nothing the client sent is reshaped. Engines read these values as
validated and add only their own limits (the local engine's context and ``max_batch_n``).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterable
from typing import Annotated, Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import ErrorDetails, PydanticCustomError

from flywheel.gateway.core.errors import BadRequest

OFF_LOOP_BODY_BYTES = 1 << 20  # bigger bodies are parsed and validated on a worker thread
MAX_JSON_DEPTH = 64  # a body nests at most this deep; orjson writes at most 254 levels, reads 1024
MAX_N = 128
MAX_TOP_LOGPROBS = 20
MAX_STOP_SEQUENCES = 16
MAX_STOP_CHARS = 256  # the local engine scans each stop string for a partial match at every token
MAX_TEMPLATE_KWARGS = 16
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1  # vLLM's bounds on seed

# Fields that would make an engine load or run what a client chose: refused with a 400 naming them.
NOT_ACCEPTED: dict[str, str] = {
    "chat_template": "the model's own chat template is always used; a template is code the engine runs",
    "lora_request": "adapters are loaded through the admin API, never named by a request",
    "logits_processors": "logits processors are code the engine would import and run",
    "guided_json": "use response_format with a json_schema",
    "guided_regex": "regular expressions and grammars are compiled by the engine at unbounded cost",
    "guided_grammar": "regular expressions and grammars are compiled by the engine at unbounded cost",
    "guided_choice": "use response_format with a json_schema",
    "guided_decoding_backend": "the engine's decoding backend is the server's choice",
    "guided_whitespace_pattern": "regular expressions and grammars are compiled by the engine at unbounded cost",
    "structured_outputs": "use response_format with a json_schema",
    "mm_processor_kwargs": "keyword arguments of the engine's own processors are the server's choice",
    "media_io_kwargs": "keyword arguments of the engine's own media loaders are the server's choice",
    "kv_transfer_params": "they name the engines and connections of a disaggregated deployment",
    "vllm_xargs": "they are arguments for the engine's plugins",
}

# apply_chat_template's own parameters and the variables it defines: a template kwarg may not replace them.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "chat_template", "conversation", "messages", "tools", "documents", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "processor_kwargs"})
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

TokenId = Annotated[int, Field(ge=0)]
StopSequence = Annotated[str, Field(max_length=MAX_STOP_CHARS)]
TemplateValue = bool | int | float | str | None


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


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


class ContentPart(_Open):
    type: str = Field(min_length=1)
    text: str | None = None

    @model_validator(mode="after")
    def _text_parts_have_text(self) -> ContentPart:
        if self.type == "text" and self.text is None:
            raise PydanticCustomError("missing", "a text content part needs a 'text' string")
        return self


class Message(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class NamedFunction(_Open):
    name: str = Field(min_length=1)


class NamedToolChoice(_Open):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(_Open):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class ResponseFormat(_Open):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class _Sampling(_Open):
    model: str = Field(min_length=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int | None = Field(default=None, ge=1, le=MAX_N)
    max_tokens: int | None = Field(default=None, ge=1)
    stop: StopSequence | Annotated[list[StopSequence], Field(max_length=MAX_STOP_SEQUENCES)] | None = None
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    return_token_ids: bool | None = None  # vLLM extension: exact prompt/completion token ids
    ignore_eos: bool | None = None  # vLLM extension: sample past the end-of-sequence token
    draw_without_replacement: bool | None = None  # local engine: the n choices distinct (stochastic beam search)
    metadata: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, TemplateValue] | None = Field(default=None, max_length=MAX_TEMPLATE_KWARGS)

    @model_validator(mode="before")
    @classmethod
    def _refuse_what_engines_would_load(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name in NOT_ACCEPTED.keys() & data.keys():
                raise PydanticCustomError("not_accepted", "'{param}' is not accepted: {reason}",
                                          {"param": name, "reason": NOT_ACCEPTED[name]})
        return data

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables_only(cls, value: dict[str, TemplateValue] | None) -> dict[str, TemplateValue] | None:
        for key in value or ():
            if key in RESERVED_TEMPLATE_KWARGS or not _IDENTIFIER.match(key):
                raise PydanticCustomError("not_accepted", "'{key}' is not a template variable a request may set",
                                          {"key": key})
        return value


class ChatCompletionRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: ResponseFormat | None = None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise PydanticCustomError("invalid_value", "'{param}' requires logprobs to be true",
                                      {"param": "top_logprobs"})
        return self


class CompletionRequest(_Sampling):
    prompt: (Annotated[str, Field(min_length=1)] | Annotated[list[str], Field(min_length=1)]
             | Annotated[list[TokenId], Field(min_length=1)]
             | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)])
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool | None = None


async def parse_request(raw: bytes, model: type[BaseModel]) -> dict[str, Any]:
    """:func:`parse_json_object` and :func:`validate_request`; a body over :data:`OFF_LOOP_BODY_BYTES` on a
    worker thread, where the depth walk and validation (Python-level work that grows with the body)
    let the event loop keep serving other requests."""
    if len(raw) <= OFF_LOOP_BODY_BYTES:
        return _parse_valid(raw, model)
    return await asyncio.to_thread(_parse_valid, raw, model)


def _parse_valid(raw: bytes, model: type[BaseModel]) -> dict[str, Any]:
    body = parse_json_object(raw)
    validate_request(model, body)
    return body


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """The request body as a dict, or a 400 that says why it is not one."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"We could not parse the JSON body of your request: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object.")
    if nested_deeper_than(body, MAX_JSON_DEPTH):
        raise BadRequest(f"The JSON body of your request nests deeper than {MAX_JSON_DEPTH} levels.")
    return body


_CONTAINERS = frozenset({dict, list})


def nested_deeper_than(value: dict[str, Any] | list[Any], limit: int) -> bool:
    """Whether parsed JSON nests more than ``limit`` objects/arrays deep (the outermost is level 1).

    Level by level; a container with no containers inside is checked by one C-level pass over
    its item types, so a long list of token ids costs little.
    """
    level: list[dict[str, Any] | list[Any]] = [value]
    for _ in range(limit):
        below: list[dict[str, Any] | list[Any]] = []
        for node in level:
            items: Iterable[Any] = node.values() if isinstance(node, dict) else node
            if not _CONTAINERS.isdisjoint(set(map(type, items))):
                below.extend(item for item in items if type(item) in _CONTAINERS)
        if not below:
            return False
        level = below
    return True


def validate_request(model: type[BaseModel], body: dict[str, Any]) -> None:
    """Raise a 400 naming the first invalid field, OpenAI style (``messages[0].role``)."""
    try:
        model.model_validate(body)
    except ValidationError as exc:
        error = most_specific(exc.errors())
        param = (error.get("ctx") or {}).get("param") or format_param(error["loc"])
        raise BadRequest(f"Invalid value for '{param}': {error['msg']}", param=param,
                         code="invalid_value" if error["type"] != "missing" else "missing_required_parameter"
                         ) from None


def most_specific(errors: list[ErrorDetails]) -> ErrorDetails:
    """The error that says most: of a union's branches, the one whose type matched and that got furthest.

    ``"stop": "x" * 300`` fails both as a string (too long) and as a list (not a list); the first is the news.
    """
    return max(errors, key=lambda error: (not error["type"].endswith("_type"), len(error["loc"])))


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def format_param(loc: tuple[int | str, ...]) -> str:
    """``("messages", 0, "role")`` -> ``messages[0].role``; pydantic's union branch tags are dropped."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" in part or "-" in part or part in _TYPE_TAGS or part[:1].isupper():
            continue  # union branch tags (model classes are capitalised; OpenAI's fields are snake_case)
        else:
            out += f".{part}" if out else part
    return out
