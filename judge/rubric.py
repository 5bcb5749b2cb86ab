"""The words the judge is given: the default rubric, the prompt texts, and rubric overrides.

Everything that changes what the judge model reads lives here, next to
:data:`PROMPT_VERSION`. Bump the version whenever a text below changes: it is part of
every cache key (an old answer is never reused for a new prompt) and it is recorded with
every score, so a person can tell which wording produced a number.

Rubric overrides come from config, most specific first (task, then alias, then default)::

    resolve_rubric({"default": None, "aliases": {"sql-agent": "..."}, "tasks": {"task_ab12...": "..."}},
                   alias="sql-agent", task="task_ab12...")
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, Field

PROMPT_VERSION = "ruler-v1"  # bump on any change to DEFAULT_RUBRIC or the templates below

DEFAULT_RUBRIC = """\
- Reaching the goal matters most: a trajectory that accomplishes what was asked must score clearly \
higher than any trajectory that does not, however polished the failing one looks.
- Among trajectories that reach the goal, prefer the more efficient ones: fewer wasted steps, no \
pointless tool calls, no detours, no needless length.
- Let the size of a score gap match the size of the quality gap: near-equal trajectories get \
near-equal scores, and a much better trajectory gets a much higher score.
- A trajectory that fails can still earn partial credit for real progress toward the goal \
(correct intermediate steps, useful information found), more than one that made none.
- Wrong facts, invented tool results, ignored instructions and unsafe actions count against a \
trajectory."""
"""The rubric used when config names none. Generic on purpose: the judge infers the goal
from the agent's own instructions (system prompt, first user message) and the task text."""

SYSTEM_TEMPLATE = """\
You are judging several attempts by an AI agent at the same goal. Each attempt is a \
trajectory: the conversation the agent had, including its tool calls and the tool results. \
Every trajectory started from the same instructions. Work out what the agent was asked to \
achieve, compare the trajectories with each other, and give each one a score from 0 to 1.

Scoring rubric:
{rubric}

Reply with a single JSON object and nothing else, of the form
{{"scores": [{{"trajectory_id": "<the id shown on the trajectory>", "explanation": "<one or two \
sentences on why>", "score": <a number from 0 to 1>}}]}}
with exactly one entry for each of the {count} trajectories, each id used once."""
"""System message; ``{rubric}`` and ``{count}`` are filled in."""

TASK_TEMPLATE = "<task>\n{task}\n</task>\n\n"
TOOLS_TEMPLATE = "<tools>\nThe agent could call these tools:\n{tools}\n</tools>\n\n"
CONTEXT_TEMPLATE = "<shared_context>\nEvery trajectory begins with these messages:\n{messages}\n</shared_context>\n\n"
TRAJECTORIES_HEADER_SHARED = "The {count} trajectories, each continuing from the shared context:\n\n"
TRAJECTORIES_HEADER_FULL = "The {count} trajectories:\n\n"
TRAJECTORY_TEMPLATE = '<trajectory id="{id}">\n{tools}{messages}\n</trajectory>'
TRAJECTORY_TOOLS_TEMPLATE = "<tools>\n{tools}\n</tools>\n"  # only when the trajectories had different tools


def rubric_hash(text: str) -> str:
    """A short stable fingerprint of a rubric (16 hex chars of SHA-256 over the stripped text).

    Stored with every score; whitespace at the ends does not change it, anything else does.
    """
    return hashlib.sha256(text.strip().encode("utf-8")).hexdigest()[:16]


class RubricConfig(BaseModel):
    """Rubric overrides as they sit in config (``[judge.rubrics]``); empty means the default."""

    default: str | None = None  # replaces DEFAULT_RUBRIC everywhere unless an alias or task says otherwise
    aliases: dict[str, str] = Field(default_factory=dict)  # served alias -> rubric
    tasks: dict[str, str] = Field(default_factory=dict)  # task key (capture's ``task_...``) -> rubric


def resolve_rubric(config_map: RubricConfig | Mapping[str, Any] | None, alias: str | None = None,
                   task: str | None = None) -> str:
    """The rubric for one group: the task's override, else the alias's, else the default.

    ``config_map`` is a :class:`RubricConfig` or the same shape as a plain mapping
    (``{"default": str | None, "aliases": {alias: str}, "tasks": {task_key: str}}``);
    ``None`` or empty entries fall through to :data:`DEFAULT_RUBRIC`. Blank strings count
    as unset so a config can switch an override off without deleting the key.
    """
    if config_map is None:
        return DEFAULT_RUBRIC
    config = config_map if isinstance(config_map, RubricConfig) else RubricConfig.model_validate(config_map)
    candidates = (
        config.tasks.get(task) if task is not None else None,
        config.aliases.get(alias) if alias is not None else None,
        config.default,
    )
    for rubric in candidates:
        if rubric and rubric.strip():
            return rubric
    return DEFAULT_RUBRIC
