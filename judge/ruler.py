"""RULER: a judge model scores the trajectories of a group relative to each other.

    result = await ruler(message_lists, "openai/o3")                      # RulerResult
    scored = await ruler_score_group(group, "hosted_vllm/Qwen/Qwen3-32B",
                                     api_base="http://127.0.0.1:8001/v1", swallow_exceptions=True)

How one group is judged (see ``docs/judge.md``):

1. Identical trajectories (same messages and tools) are judged once; the copies get its score.
2. The messages every distinct trajectory starts with are sent once, as shared context; each
   trajectory's remainder is sent under an id ``"1"``..``"N"``; the task text and the tool
   schemas are sent when given.
3. One ``litellm.acompletion`` call with a pydantic ``response_format`` asks for
   ``{"scores": [{"trajectory_id", "explanation", "score"}]}``.
4. The answer is checked: parseable, one entry per id, known ids only, scores in [0, 1].
   Timeouts, 429/5xx, connection errors and unusable answers are retried with exponential
   backoff; other API errors (401, 400, ...) are not.

Only the ranking inside a group matters to GRPO, so the scores need no calibration
across groups. ``import flywheel.judge`` does not import litellm (it takes seconds); the first
call does, after ``LITELLM_LOCAL_MODEL_COST_MAP=True`` is set unless the user chose
otherwise, so start-up never waits on a download of the cost map.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import logging
import math
import os
import random
import re
import weakref
from collections.abc import Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

from flywheel.capture.trajectory import Trajectory, TrajectoryGroup
from flywheel.judge import rubric as prompts
from flywheel.judge.rubric import DEFAULT_RUBRIC, PROMPT_VERSION, RubricConfig, rubric_hash

log = logging.getLogger("judge")

Message = dict[str, Any]
Tools = list[dict[str, Any]]


# --------------------------------------------------------------------------- errors


class JudgeError(Exception):
    """Base of every error the judge raises; ``swallow_exceptions=True`` turns these into ``None``.

    Tree::

        JudgeError
        ├── JudgeCallError              the call failed (after retries, or at once for 4xx)
        │   └── JudgeTimeoutError       no answer within ``timeout_s``
        └── JudgeAnswerError            the judge answered, but not usably
            ├── MalformedAnswerError    not JSON, or not the requested shape
            ├── ScoreCountError         not one entry per trajectory
            ├── TrajectoryIdError       an unknown or repeated trajectory id
            └── ScoreRangeError         a score outside [0, 1] (or NaN)

    ``attempts`` is how many calls were made before giving up.
    """

    attempts: int = 0


class JudgeCallError(JudgeError):
    """The judge could not be reached or refused the request (the litellm error is ``__cause__``)."""


class JudgeTimeoutError(JudgeCallError):
    """The judge did not answer within ``timeout_s``."""


class JudgeAnswerError(JudgeError):
    """The judge answered, but the answer cannot be used as scores (retried: models do better on a redo)."""


class MalformedAnswerError(JudgeAnswerError):
    """The answer is not JSON of the requested shape (or has no content at all)."""


class ScoreCountError(JudgeAnswerError):
    """The answer has a different number of scores than there are trajectories."""


class TrajectoryIdError(JudgeAnswerError):
    """The answer names a trajectory id that was not sent, or names one twice."""


class ScoreRangeError(JudgeAnswerError):
    """A score lies outside [0, 1] or is not a number."""


# --------------------------------------------------------------------------- results


class RulerScore(BaseModel):
    """One trajectory's score. Also the item schema the judge must answer in."""

    # Models sometimes write ids as numbers although the schema says string.
    model_config = ConfigDict(coerce_numbers_to_str=True)

    trajectory_id: str = Field(description="The id shown on the trajectory being scored.")
    explanation: str = Field(description="One or two sentences on why the trajectory got this score.")
    score: float = Field(description="From 0 (worst) to 1 (best), relative to the other trajectories.")


class JudgeAnswer(BaseModel):
    """The judge's whole answer; passed to litellm as ``response_format``."""

    scores: list[RulerScore] = Field(description="Exactly one entry per trajectory.")


class RulerResult(BaseModel):
    """The scores for one group (in the order the trajectories were given) and what they cost.

    ``scores[i].trajectory_id`` is ``str(i + 1)``. Usage and cost add up every call made for
    this result, retries included; a cache hit costs nothing now (``cached=True``, zeros).
    ``cost_usd`` is ``None`` when litellm has no price for the judge model.
    """

    scores: list[RulerScore]
    judge_model: str
    rubric_hash: str
    prompt_version: str = PROMPT_VERSION
    cache_key: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float | None = None
    attempts: int = 0  # calls made (0: cache hit or empty group)
    cached: bool = False


class JudgeConfig(BaseModel):
    """The ``[judge]`` config section (the gateway embeds it); see ``docs/judge.md``."""

    enabled: bool = True  # false: no judge calls; groups are scored from client feedback alone
    model: str = "openai/o3"  # any litellm model string; the gateway's own alias via hosted_vllm/ + api_base
    api_base: str | None = None  # OpenAI-style base URL including /v1 (local vLLM, the gateway itself)
    api_key: SecretStr | None = None  # None: litellm reads the provider's usual env var
    timeout_s: float = Field(default=120.0, gt=0)  # per call; reasoning judges on big groups are slow
    max_retries: int = Field(default=3, ge=0)  # retries after the first call: timeouts, 429/5xx, bad answers...
    backoff_s: float = Field(default=1.0, ge=0)  # first retry delay; doubles each retry (jitter), up to backoff_max_s
    backoff_max_s: float = Field(default=30.0, ge=0)
    max_concurrency: int = Field(default=4, ge=1)  # judge calls in flight at once across the scoring job
    swallow_exceptions: bool = True  # a failed group stays unscored instead of stopping the job
    extra_litellm_params: dict[str, Any] = Field(default_factory=dict)  # e.g. {"reasoning_effort": "low"}
    rubrics: RubricConfig = Field(default_factory=RubricConfig)
    # "module:function" or an http(s) URL: each member's last answer scored by the task's own check, not RULER
    reward_hook: str | None = None

    @field_validator("reward_hook")
    @classmethod
    def _hook_named(cls, target: str | None) -> str | None:
        if target is not None and not target.startswith(("http://", "https://")) and ":" not in target:
            raise ValueError(f"judge.reward_hook {target!r}: expected module:function or an http(s) URL")
        return target

    def call_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for :func:`ruler` / :func:`ruler_score_group` (model and rubric aside)."""
        return {"api_base": self.api_base,
                "api_key": self.api_key.get_secret_value() if self.api_key else None,
                "timeout_s": self.timeout_s, "max_retries": self.max_retries, "backoff_s": self.backoff_s,
                "backoff_max_s": self.backoff_max_s, "extra_litellm_params": dict(self.extra_litellm_params)}


# --------------------------------------------------------------------------- the prompt


@dataclass(frozen=True)
class Candidate:
    """What the judge sees of one trajectory: its messages and the tools it had."""

    messages: list[Message]
    tools: Tools | None = None


def _canonical(value: Any) -> str:
    """JSON with sorted keys: equal content gives equal text (dedup, cache keys)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def _readable(value: Any) -> str:
    """JSON as the judge reads it: keys in their given order, non-ASCII kept."""
    return json.dumps(value, ensure_ascii=False, default=str)


def _dedupe(candidates: Sequence[Candidate]) -> tuple[list[Candidate], list[int]]:
    """Distinct candidates in first-seen order, and for each input the index of its distinct twin."""
    distinct: list[Candidate] = []
    seen: dict[str, int] = {}
    index_of: list[int] = []
    for candidate in candidates:
        key = _canonical([candidate.messages, candidate.tools or []])
        if key not in seen:
            seen[key] = len(distinct)
            distinct.append(candidate)
        index_of.append(seen[key])
    return distinct, index_of


def common_prefix_length(message_lists: Sequence[Sequence[Message]]) -> int:
    """How many leading messages all lists share (compared as canonical JSON)."""
    if not message_lists:
        return 0
    length = 0
    for position, message in enumerate(message_lists[0]):
        expected = _canonical(message)
        if all(len(other) > position and _canonical(other[position]) == expected for other in message_lists[1:]):
            length += 1
        else:
            break
    return length


def build_judge_messages(candidates: Sequence[Candidate], rubric: str = DEFAULT_RUBRIC,
                         task: str | None = None) -> list[Message]:
    """The system and user messages for judging distinct ``candidates`` labelled ``"1"``..``"N"``.

    With two or more candidates, their common leading messages go once into
    ``<shared_context>`` and each ``<trajectory>`` holds only its remainder (possibly
    ``[]``). A single candidate is sent whole. Tools shared by all go once into
    ``<tools>``; when they differ, each trajectory carries its own.
    """
    count = len(candidates)
    system = prompts.SYSTEM_TEMPLATE.format(rubric=rubric.strip(), count=count)
    user = prompts.TASK_TEMPLATE.format(task=task.strip()) if task and task.strip() else ""

    tool_texts = {_canonical(c.tools or []) for c in candidates}
    shared_tools = len(tool_texts) == 1
    if shared_tools and candidates[0].tools:
        user += prompts.TOOLS_TEMPLATE.format(tools=_readable(candidates[0].tools))

    prefix = common_prefix_length([c.messages for c in candidates]) if count > 1 else 0
    if prefix:
        user += prompts.CONTEXT_TEMPLATE.format(messages=_readable(candidates[0].messages[:prefix]))
        user += prompts.TRAJECTORIES_HEADER_SHARED.format(count=count)
    else:
        user += prompts.TRAJECTORIES_HEADER_FULL.format(count=count)

    blocks = []
    for number, candidate in enumerate(candidates, start=1):
        own_tools = "" if shared_tools else prompts.TRAJECTORY_TOOLS_TEMPLATE.format(
            tools=_readable(candidate.tools or []))
        blocks.append(prompts.TRAJECTORY_TEMPLATE.format(id=number, tools=own_tools,
                                                         messages=_readable(candidate.messages[prefix:])))
    user += "\n\n".join(blocks)
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


# Parameters that change where or how patiently we ask, not what the judge answers.
_NOT_IN_CACHE_KEY = frozenset({"api_base", "base_url", "api_key", "timeout", "num_retries", "max_retries",
                               "metadata", "extra_headers", "caching"})


def ruler_cache_key(candidates: Sequence[Candidate], judge_model: str, rubric: str = DEFAULT_RUBRIC,
                    task: str | None = None, extra_litellm_params: Mapping[str, Any] | None = None) -> str:
    """Content hash of one judging: model, rubric, prompt version, task, params, trajectories in order.

    Equal keys mean the judge would be asked exactly the same thing, so a stored answer
    can stand in for a new call. The endpoint (``api_base``) is deliberately not part of it.
    """
    params = {k: v for k, v in (extra_litellm_params or {}).items() if k not in _NOT_IN_CACHE_KEY}
    payload = {"prompt_version": PROMPT_VERSION, "judge_model": judge_model, "rubric": rubric_hash(rubric),
               "task": (task or "").strip(), "params": params,
               "trajectories": [[c.messages, c.tools or []] for c in candidates]}
    return "ruler_" + hashlib.sha256(_canonical(payload).encode("utf-8")).hexdigest()


# --------------------------------------------------------------------------- the answer

_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)


def parse_answer(content: str | None, expected_ids: Sequence[str]) -> list[RulerScore]:
    """The judge's scores in ``expected_ids`` order, or the named :class:`JudgeAnswerError`."""
    if not content or not content.strip():
        raise MalformedAnswerError("the judge's answer has no content")
    text = content.strip()
    fenced = _FENCE.match(text)  # judges without structured output like to fence their JSON
    if fenced:
        text = fenced.group(1)
    try:
        answer = JudgeAnswer.model_validate_json(text)
    except ValueError as exc:
        raise MalformedAnswerError(f"the judge's answer is not the requested JSON: {text[:200]!r}") from exc

    if len(answer.scores) != len(expected_ids):
        raise ScoreCountError(f"expected {len(expected_ids)} scores, got {len(answer.scores)}")
    by_id: dict[str, RulerScore] = {}
    for item in answer.scores:
        item_id = item.trajectory_id.strip()
        if item_id not in expected_ids:
            raise TrajectoryIdError(f"unknown trajectory id {item_id!r}; expected {list(expected_ids)}")
        if item_id in by_id:
            raise TrajectoryIdError(f"trajectory id {item_id!r} scored twice")
        if not (math.isfinite(item.score) and 0.0 <= item.score <= 1.0):
            raise ScoreRangeError(f"score {item.score!r} for trajectory {item_id!r} is outside [0, 1]")
        by_id[item_id] = item.model_copy(update={"trajectory_id": item_id})
    return [by_id[i] for i in expected_ids]


# --------------------------------------------------------------------------- the call


def _litellm() -> Any:
    """Import litellm on first use: it takes seconds, and offline it must not fetch the cost map."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    litellm.suppress_debug_info = True  # otherwise every failed call prints a "Give Feedback" banner
    return litellm


_RETRYABLE_STATUS = frozenset({408, 409, 425, 429})


def _retryable(exc: JudgeError) -> bool:
    """Timeouts, rate limits, 5xx, connection errors and unusable answers are worth another try; 4xx are not."""
    if isinstance(exc, (JudgeAnswerError, JudgeTimeoutError)):
        return True
    cause = exc.__cause__
    if isinstance(cause, (TimeoutError, ConnectionError)):
        return True
    status = getattr(cause, "status_code", None)
    if isinstance(status, int):
        return status >= 500 or status in _RETRYABLE_STATUS
    # openai.APIConnectionError / litellm.APIConnectionError may carry no usable status.
    return type(cause).__name__ in ("APIConnectionError", "APITimeoutError", "Timeout")


@dataclass
class _Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float | None = None

    def add(self, response: Any) -> None:
        usage = getattr(response, "usage", None)
        self.prompt_tokens += int(getattr(usage, "prompt_tokens", 0) or 0)
        self.completion_tokens += int(getattr(usage, "completion_tokens", 0) or 0)
        # litellm prices the call from its local cost map; None when the model is not in it.
        cost = (getattr(response, "_hidden_params", None) or {}).get("response_cost")
        if cost is not None:
            self.cost_usd = (self.cost_usd or 0.0) + float(cost)


async def _call_judge(messages: list[Message], judge_model: str, *, api_base: str | None, api_key: str | None,
                      timeout_s: float, extra_litellm_params: Mapping[str, Any] | None) -> Any:
    """The one place the judge model is called."""
    litellm = _litellm()
    kwargs: dict[str, Any] = {"response_format": JudgeAnswer, **(extra_litellm_params or {})}
    if api_base is not None and _direct(litellm, judge_model, kwargs):
        return await _call_endpoint(litellm, messages, judge_model, api_base=api_base, api_key=api_key,
                                    timeout_s=timeout_s, kwargs=kwargs)
    kwargs.update(model=judge_model, messages=messages, timeout=timeout_s,
                  max_retries=0, num_retries=0,  # the loop in _judge retries; the openai client would add 2 more
                  caching=False)
    if api_base is not None:
        kwargs["api_base"] = api_base
    if api_key is not None:
        kwargs["api_key"] = api_key
    try:
        # Backstop in case a provider path ignores ``timeout``: the call must end.
        async with asyncio.timeout(timeout_s * 1.5 + 1.0):
            return await litellm.acompletion(**kwargs)
    except TimeoutError as exc:
        raise JudgeTimeoutError(f"no answer from {judge_model} within {timeout_s} s") from exc
    except Exception as exc:
        if isinstance(exc, litellm.Timeout):
            raise JudgeTimeoutError(f"no answer from {judge_model} within {timeout_s} s") from exc
        raise JudgeCallError(f"calling {judge_model} failed: {type(exc).__name__}: {exc}") from exc


# An endpoint of one's own that speaks OpenAI's API, named by ``api_base``: litellm would add nothing but its cost
OPENAI_COMPATIBLE = ("openai/", "hosted_vllm/")
# The arguments such an endpoint takes as they are; any other is litellm's to translate
OPENAI_CHAT_ARGUMENTS = frozenset({"response_format", "temperature", "top_p", "max_tokens", "max_completion_tokens",
                                   "seed", "stop", "reasoning_effort", "presence_penalty", "frequency_penalty"})


def _direct(litellm: Any, judge_model: str, kwargs: Mapping[str, Any]) -> bool:
    """Whether the judge (at an ``api_base``) is an OpenAI-compatible endpoint litellm has no price for, called with
    arguments such an endpoint takes: then litellm's per-call work (routing, logging, pricing) buys nothing
    (docs/judge.md)."""
    if not judge_model.startswith(OPENAI_COMPATIBLE) or not set(kwargs) <= OPENAI_CHAT_ARGUMENTS:
        return False
    name = judge_model.split("/", 1)[1]
    return judge_model not in litellm.model_cost and name not in litellm.model_cost


class EndpointError(Exception):
    """An error answer of the judge's endpoint (``_call_endpoint``): its status, for ``_retryable``."""

    def __init__(self, status_code: int, message: str) -> None:
        super().__init__(f"HTTP {status_code}: {message}")
        self.status_code = status_code


# Per event loop (a pooled connection belongs to the loop that opened it): api_base -> httpx.AsyncClient
_ENDPOINTS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, Any]] = weakref.WeakKeyDictionary()


@functools.cache
def _schema_format(litellm: Any, answer: type[BaseModel]) -> dict[str, Any]:
    return dict(litellm.utils.type_to_response_format_param(answer))


async def _call_endpoint(litellm: Any, messages: list[Message], judge_model: str, *, api_base: str,
                         api_key: str | None, timeout_s: float, kwargs: dict[str, Any]) -> Any:
    """The judge called over plain HTTP: the request litellm would send (the model's name without its prefix, the
    answer's JSON schema as litellm renders it), the answer read into what ``judge_candidates`` reads of litellm's
    (``choices[0].message.content``, ``usage``), its errors as the judge's."""
    import httpx

    clients = _ENDPOINTS.setdefault(asyncio.get_running_loop(), {})
    client = clients.get(api_base)
    if client is None:
        client = clients[api_base] = httpx.AsyncClient()
    body = {**kwargs, "model": judge_model.split("/", 1)[1], "messages": messages}
    if isinstance(body["response_format"], type):
        body["response_format"] = _schema_format(litellm, body["response_format"])
    elif body["response_format"] is None:
        del body["response_format"]  # send none, as litellm does
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with asyncio.timeout(timeout_s * 1.5 + 1.0):
            response = await client.post(api_base.rstrip("/") + "/chat/completions", json=body, headers=headers,
                                         timeout=timeout_s)
    except (TimeoutError, httpx.TimeoutException) as exc:
        raise JudgeTimeoutError(f"no answer from {judge_model} within {timeout_s} s") from exc
    except httpx.HTTPError as exc:
        raise JudgeCallError(f"calling {judge_model} failed: {type(exc).__name__}: {exc}") \
            from ConnectionError(str(exc))
    if response.status_code >= 400:
        raise JudgeCallError(f"calling {judge_model} failed: HTTP {response.status_code}") \
            from EndpointError(response.status_code, response.text[:500])
    try:
        answer = response.json()
        return SimpleNamespace(choices=[SimpleNamespace(message=SimpleNamespace(**choice["message"]))
                                        for choice in answer["choices"]],
                               usage=SimpleNamespace(**(answer.get("usage") or {})))
    except (ValueError, KeyError, TypeError) as exc:
        raise JudgeAnswerError(f"{judge_model} answered no chat completion: {response.text[:200]!r}") from exc


def _backoff_delay(retry: int, backoff_s: float, backoff_max_s: float) -> float:
    """Exponential backoff with jitter, so many groups failing together do not retry in lockstep."""
    return min(backoff_max_s, backoff_s * 2 ** (retry - 1)) * random.uniform(0.5, 1.0)


async def judge_candidates(candidates: Sequence[Candidate], judge_model: str, *, rubric: str = DEFAULT_RUBRIC,
                           task: str | None = None, api_base: str | None = None, api_key: str | None = None,
                           timeout_s: float = 120.0, max_retries: int = 3, backoff_s: float = 1.0,
                           backoff_max_s: float = 30.0, semaphore: asyncio.Semaphore | None = None,
                           extra_litellm_params: Mapping[str, Any] | None = None) -> RulerResult:
    """Judge candidates (each with its own tools); :func:`ruler` and :func:`ruler_score_group` call this."""
    key = ruler_cache_key(candidates, judge_model, rubric, task, extra_litellm_params)
    result = RulerResult(scores=[], judge_model=judge_model, rubric_hash=rubric_hash(rubric), cache_key=key)
    if not candidates:
        return result
    distinct, index_of = _dedupe(candidates)
    if len(distinct) == 1 and len(candidates) > 1:
        log.info("all %d trajectories are identical: judging one, without others to compare it with",
                 len(candidates))
    messages = build_judge_messages(distinct, rubric, task)
    expected_ids = [str(i) for i in range(1, len(distinct) + 1)]

    usage = _Usage()
    attempts = 0
    while True:
        attempts += 1
        try:
            async with semaphore if semaphore is not None else contextlib.nullcontext():
                response = await _call_judge(messages, judge_model, api_base=api_base, api_key=api_key,
                                             timeout_s=timeout_s, extra_litellm_params=extra_litellm_params)
            usage.add(response)  # a malformed answer was still paid for
            choices = getattr(response, "choices", None) or []
            content = getattr(choices[0].message, "content", None) if choices else None
            distinct_scores = parse_answer(content, expected_ids)
            break
        except JudgeError as exc:
            exc.attempts = attempts
            if attempts > max_retries or not _retryable(exc):
                raise
            delay = _backoff_delay(attempts, backoff_s, backoff_max_s)
            log.warning("judge %s, attempt %d of %d failed (%s); retrying in %.2f s",
                        judge_model, attempts, max_retries + 1, exc, delay)
            await asyncio.sleep(delay)

    scores = [distinct_scores[twin].model_copy(update={"trajectory_id": str(position + 1)})
              for position, twin in enumerate(index_of)]
    return result.model_copy(update={"scores": scores, "prompt_tokens": usage.prompt_tokens,
                                     "completion_tokens": usage.completion_tokens, "cost_usd": usage.cost_usd,
                                     "attempts": attempts})


async def ruler(message_lists: Sequence[Sequence[Message]], judge_model: str = "openai/o3", *,
                rubric: str = DEFAULT_RUBRIC, tools: Tools | None = None, task: str | None = None,
                api_base: str | None = None, api_key: str | None = None, timeout_s: float = 120.0,
                max_retries: int = 3, backoff_s: float = 1.0, backoff_max_s: float = 30.0,
                semaphore: asyncio.Semaphore | None = None,
                extra_litellm_params: Mapping[str, Any] | None = None) -> RulerResult:
    """Score trajectories given as OpenAI message lists, relative to each other.

    Args:
        message_lists: one list of chat messages per trajectory (assistant turns included).
        judge_model: a litellm model string: ``openai/o3``, ``anthropic/...``, ``hosted_vllm/<name>``.
        rubric: grading standards; :data:`~flywheel.judge.rubric.DEFAULT_RUBRIC` suits most tasks.
        tools: the tool schemas all trajectories had (sent once).
        task: an optional description of the goal, when the messages do not make it plain.
        api_base, api_key: the judge's endpoint (OpenAI-style base URL with ``/v1``) and key.
        timeout_s: per call. max_retries: retries after the first call. backoff_s, backoff_max_s: retry delays.
        semaphore: shared by concurrent callers to cap judge calls in flight.
        extra_litellm_params: more ``litellm.acompletion`` arguments (``reasoning_effort``, ``temperature``,
            ``response_format`` to replace the JSON schema for providers without structured output).

    Returns:
        A :class:`RulerResult`: ``scores[i]`` belongs to ``message_lists[i]`` (``trajectory_id == str(i + 1)``).

    Raises:
        JudgeCallError, JudgeAnswerError: once the retries are spent (see :class:`JudgeError`).
    """
    candidates = [Candidate(list(messages), list(tools) if tools else None) for messages in message_lists]
    return await judge_candidates(candidates, judge_model, rubric=rubric, task=task, api_base=api_base,
                                  api_key=api_key, timeout_s=timeout_s, max_retries=max_retries,
                                  backoff_s=backoff_s, backoff_max_s=backoff_max_s, semaphore=semaphore,
                                  extra_litellm_params=extra_litellm_params)


def group_candidates(group: TrajectoryGroup) -> list[Candidate]:
    """What the judge sees of each trajectory in a group."""
    return [Candidate(t.messages(), list(t.tools) if t.tools else None) for t in group.trajectories]


def apply_scores(group: TrajectoryGroup, result: RulerResult) -> TrajectoryGroup:
    """A copy of ``group`` whose rewards are the judge's scores (the input is left untouched).

    Per trajectory: ``reward`` = score; ``metrics["ruler_score"]`` = score;
    ``metrics["independent_reward"]`` = the reward it had before (ART's name, so ART code
    comparing the two keeps working); ``metadata["ruler"]`` = explanation, judge model,
    rubric hash, prompt version and cache key; one line in ``logs``. The group's
    ``metadata["ruler"]`` holds the call's usage and cost.
    """
    if len(result.scores) != len(group.trajectories):
        raise ValueError(f"{len(result.scores)} scores for {len(group.trajectories)} trajectories")
    audit = {"judge_model": result.judge_model, "rubric_hash": result.rubric_hash,
             "prompt_version": result.prompt_version, "cache_key": result.cache_key}
    scored: list[Trajectory] = []
    for trajectory, score in zip(group.trajectories, result.scores, strict=True):
        copy = trajectory.model_copy(deep=True)
        copy.metrics["independent_reward"] = trajectory.reward
        copy.metrics["ruler_score"] = score.score
        copy.reward = score.score
        copy.metadata["ruler"] = {"explanation": score.explanation, **audit}
        copy.logs.append(f"RULER ({result.judge_model}) scored {score.score:.3f}: {score.explanation}")
        scored.append(copy)
    metadata = {**group.metadata, "ruler": {**audit, "prompt_tokens": result.prompt_tokens,
                                            "completion_tokens": result.completion_tokens,
                                            "cost_usd": result.cost_usd, "attempts": result.attempts,
                                            "cached": result.cached}}
    return TrajectoryGroup(trajectories=scored, id=group.id, metadata=metadata)


def group_cache_key(group: TrajectoryGroup, judge_model: str, rubric: str = DEFAULT_RUBRIC, task: str | None = None,
                    extra_litellm_params: Mapping[str, Any] | None = None) -> str:
    """The judge cache's key under which :func:`ruler_score_group` looks up and stores its answer about ``group``."""
    return ruler_cache_key(group_candidates(group), judge_model, rubric, task, extra_litellm_params)


class AnswerCache(Protocol):
    """Where ``ruler_score_group`` keeps the judge's answers (``flywheel.judge.cache.JudgeCache``, on the store)."""

    def claim(self, key: str) -> AbstractAsyncContextManager[None]: ...

    def get(self, key: str) -> RulerResult | None: ...

    def put(self, key: str, result: RulerResult, trajectory_ids: Sequence[str | None], group_id: str | None = None,
            *, none_stored: bool = False) -> Any: ...


async def ruler_score_group(group: TrajectoryGroup, judge_model: str = "openai/o3", *,
                            rubric: str = DEFAULT_RUBRIC, task: str | None = None,
                            swallow_exceptions: bool = False, cache: AnswerCache | None = None,
                            api_base: str | None = None, api_key: str | None = None, timeout_s: float = 120.0,
                            max_retries: int = 3, backoff_s: float = 1.0, backoff_max_s: float = 30.0,
                            semaphore: asyncio.Semaphore | None = None,
                            extra_litellm_params: Mapping[str, Any] | None = None) -> TrajectoryGroup | None:
    """Judge a group and return a copy with the scores as rewards (see :func:`apply_scores`).

    With ``cache`` (a :class:`~flywheel.judge.cache.JudgeCache` on the store), a group whose
    content was judged before with the same model, rubric and prompt version is answered
    from the ``scores`` table without a call; a new answer is written there, with the
    trajectory ids, the group id and the call's tokens and cost. Concurrent callers with
    the same content wait for the first one instead of paying twice.

    Returns ``None`` instead of raising a :class:`JudgeError` when ``swallow_exceptions``
    is set, so a gatherer can drop the group and go on. Other arguments: see :func:`ruler`.
    """
    try:
        if cache is None:
            result = await judge_candidates(
                group_candidates(group), judge_model, rubric=rubric, task=task, api_base=api_base, api_key=api_key,
                timeout_s=timeout_s, max_retries=max_retries, backoff_s=backoff_s, backoff_max_s=backoff_max_s,
                semaphore=semaphore, extra_litellm_params=extra_litellm_params)
        else:
            key = group_cache_key(group, judge_model, rubric, task, extra_litellm_params)
            trajectory_ids = [t.id for t in group.trajectories]
            async with cache.claim(key):
                hit = cache.get(key)
                if hit is not None:
                    result = hit
                else:  # what the judge sees, built only when it is asked
                    result = await judge_candidates(
                        group_candidates(group), judge_model, rubric=rubric, task=task, api_base=api_base,
                        api_key=api_key, timeout_s=timeout_s, max_retries=max_retries, backoff_s=backoff_s,
                        backoff_max_s=backoff_max_s, semaphore=semaphore, extra_litellm_params=extra_litellm_params)
                # A hit for other trajectories (same content, another group) still records their rows.
                cache.put(key, result, trajectory_ids, group.id, none_stored=hit is None)
    except JudgeError as exc:
        if not swallow_exceptions:
            raise
        log.warning("group %s left unscored: %s: %s (after %d attempts)", group.id or "(in memory)",
                    type(exc).__name__, exc, exc.attempts)
        return None
    return apply_scores(group, result)
