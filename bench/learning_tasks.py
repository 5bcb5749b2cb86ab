"""The learning suite's tasks: six agents of different shapes, each with a reward read from the conversation.

Every task is a tiny environment: a system prompt, maybe tools, a request generator, what the
environment answers to a turn (a tool's result, or the end), and a score computed from the messages
alone (the request, the answers, the tool results), so that the agent's feedback, the judge stand-in
(bench/learning_judge.py) and the gate all read the same reward from what a judge would see.

| task | shape | reward |
|---|---|---|
| ``tool_choice`` | pick one of three tools from the request's wording, then answer | 1 / 0.1 wrong tool / 0 |
| ``argument`` | one tool; copy the size the request names into its argument | 1 / 0.3 other value / 0 |
| ``length`` | no tools; answer in the number of words the request asks for | 1 - distance / 3 |
| ``letters`` | no tools; use the letter the request names as often as possible | share of that letter, x3, at most 1 |
| ``two_calls`` | ``lookup`` gives a code; ``send`` must pass that code on | 1 / 0.2 other code / 0.1 lookup only |
| ``judged`` | no tools; an open line about a subject, scored by a judge for naming it | 1 named and short / 0.3 / 0 |

Requests come in two traffic shapes (bench/learning_suite.py): ``repeated`` (a pool of requests,
each several times in a row) and ``unique`` (a ticket number makes every request new). Nothing in
the loop's configuration names a task: deploy/flywheel.small-model.toml is used for all of them.
Only the standard library: the judge and the agent import this without torch.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

Message = dict[str, Any]
Tool = dict[str, Any]


def function_tool(name: str, description: str, parameters: Mapping[str, str] | None = None) -> Tool:
    """An OpenAI tool schema; ``parameters`` maps each (string) parameter to its description."""
    schema: dict[str, Any] = {"type": "object", "properties": {
        key: {"type": "string", "description": text} for key, text in (parameters or {}).items()},
        "required": list(parameters or {})}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": schema}}


@dataclass(frozen=True)
class Request:
    text: str
    truth: str  # what a right answer needs (a tool, a value, a count); the score reads it from the text again


@dataclass(frozen=True)
class Task:
    """One environment of the suite (see the module docstring)."""

    name: str
    system: str
    tools: list[Tool] | None
    templates: Mapping[str, Sequence[str]]  # truth -> request wordings ("{x}" is filled from fillers)
    fillers: Sequence[str]
    score: Callable[[Sequence[Message]], float]  # the reward of a whole conversation
    step: Callable[[Sequence[Message]], Message | None]  # the environment's reply to the last turn, or the end
    warm_start: Callable[[Request, random.Random], list[Message]]  # a conversation in the right format
    max_tokens: int = 24  # per assistant turn

    def request(self, rng: random.Random) -> Request:
        truth = rng.choice(sorted(self.templates))
        return Request(rng.choice(self.templates[truth]).format(x=rng.choice(self.fillers)), truth)

    def first_messages(self, request: Request, ticket: int | None = None) -> list[Message]:
        text = request.text if ticket is None else f"Ticket {ticket}: {request.text}"
        return [{"role": "system", "content": self.system}, {"role": "user", "content": text}]

    def warm_start_examples(self, n: int, *, seed: int) -> list[tuple[list[Message], list[Tool] | None]]:
        """``n`` conversations in the task's format whose choices are random: the format, not the task.

        Half carry a ticket number, as unique traffic's requests do: a tiny model knows no wording it was not shown.
        """
        rng = random.Random(seed)
        examples = []
        for _ in range(n):
            request, ticket = self.request(rng), rng.randrange(10_000, 100_000) if rng.random() < 0.5 else None
            examples.append(([*self.first_messages(request, ticket), *self.warm_start(request, rng)], self.tools))
        return examples


# --------------------------------------------------------------------------- reading a conversation


def text_of(message: Mapping[str, Any] | None) -> str:
    content = (message or {}).get("content")
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
    return content if isinstance(content, str) else ""


def request_text(messages: Sequence[Message]) -> str:
    return next((text_of(m) for m in messages if m.get("role") == "user"), "")


def assistant_turns(messages: Sequence[Message]) -> list[Message]:
    return [m for m in messages if m.get("role") == "assistant"]


def only_call(message: Mapping[str, Any] | None, tools: Sequence[str]) -> tuple[str, dict[str, Any]] | None:
    """(name, arguments) when the turn is exactly one call to a known tool with an object of arguments."""
    if message is None or text_of(message).strip():
        return None
    calls = message.get("tool_calls") or []
    if len(calls) != 1:
        return None
    function = calls[0].get("function") or {}
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if function.get("name") not in tools or not isinstance(arguments, dict):
        return None
    return str(function["name"]), arguments


def final_text(message: Mapping[str, Any] | None) -> str | None:
    """The text of a final answer (text, no call), else None."""
    if message is None or message.get("tool_calls"):
        return None
    text = text_of(message).strip()
    return text or None


def words(text: str) -> list[str]:
    return re.findall(r"[A-Za-z0-9']+", text)


def tool_message(call_id: str, content: Any) -> Message:
    return {"role": "tool", "tool_call_id": call_id, "content": json.dumps(content)}


def call_message(name: str, arguments: Mapping[str, Any], call_id: str = "call_0") -> Message:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}]}


def call_id_of(message: Mapping[str, Any]) -> str:
    return str((message.get("tool_calls") or [{}])[0].get("id") or "call_0")


def which(text: str, cues: Mapping[str, str]) -> str | None:
    """The key whose cue word the text holds, when exactly one does."""
    found = {w.lower() for w in words(text)}
    hits = [key for key, cue in cues.items() if cue in found]
    return hits[0] if len(hits) == 1 else None


def end_after_answer(messages: Sequence[Message]) -> Message | None:
    return None


FILLER_WORDS = ["today", "please", "now", "again", "soon", "here", "quickly", "thanks"]

# --------------------------------------------------------------------------- tool_choice

CHOICE_TOOLS = {"weather": "The forecast", "stock": "Stock levels", "send": "Send a message"}
CHOICE_CUES = {"weather": "rain", "stock": "left", "send": "tell"}
CHOICE_RESULTS = {"weather": {"forecast": "sun"}, "stock": {"left": 3}, "send": {"sent": True}}


def choice_score(messages: Sequence[Message]) -> float:
    turns = assistant_turns(messages)
    right = which(request_text(messages), CHOICE_CUES)
    called = only_call(turns[0] if turns else None, list(CHOICE_TOOLS))
    if called is None:
        return 0.0
    score = 1.0 if called[0] == right else 0.1
    return score if len(turns) > 1 and final_text(turns[1]) else score / 2


def choice_step(messages: Sequence[Message]) -> Message | None:
    turns = assistant_turns(messages)
    called = only_call(turns[-1], list(CHOICE_TOOLS)) if len(turns) == 1 else None
    return tool_message(call_id_of(turns[-1]), CHOICE_RESULTS[called[0]]) if called else None


def choice_warm(request: Request, rng: random.Random) -> list[Message]:
    tool = rng.choice(list(CHOICE_TOOLS))
    return [call_message(tool, {}), tool_message("call_0", CHOICE_RESULTS[tool]), {"role": "assistant",
                                                                                    "content": "Done."}]


TOOL_CHOICE = Task(
    name="tool_choice", system="You help with one request. Call one tool, then answer.",
    tools=[function_tool(name, text) for name, text in CHOICE_TOOLS.items()],
    templates={"weather": ["Will it rain {x}?", "Should I expect rain {x}?"],
               "stock": ["How many are left {x}?", "Are any left {x}?"],
               "send": ["Please tell Sam {x}.", "Can you tell the team {x}?"]},
    fillers=FILLER_WORDS, score=choice_score, step=choice_step, warm_start=choice_warm)

# --------------------------------------------------------------------------- argument

SIZES = ["small", "large"]


def argument_score(messages: Sequence[Message]) -> float:
    turns = assistant_turns(messages)
    called = only_call(turns[0] if turns else None, ["order"])
    if called is None:
        return 0.0
    asked = which(request_text(messages), {s: s for s in SIZES})
    return 1.0 if called[1].get("size") == asked else 0.3


def argument_warm(request: Request, rng: random.Random) -> list[Message]:
    return [call_message("order", {"size": rng.choice(SIZES)})]


ARGUMENT = Task(
    name="argument", system="You place orders. Call the order tool with the size asked for.",
    tools=[function_tool("order", "Order a coffee", {"size": "small or large"})],
    templates={size: [f"One {size} coffee {{x}}.", f"I would like a {size} one {{x}}."] for size in SIZES},
    fillers=FILLER_WORDS, score=argument_score, step=end_after_answer, warm_start=argument_warm)

# --------------------------------------------------------------------------- length

COUNTS = {"one": 1, "two": 2, "three": 3}
VOCABULARY = ["yes", "no", "maybe", "sure", "fine", "good", "well", "right", "okay", "done"]


def length_score(messages: Sequence[Message]) -> float:
    turns = assistant_turns(messages)
    answer = final_text(turns[0] if turns else None)
    target = which(request_text(messages), {k: k for k in COUNTS})
    if answer is None or target is None:
        return 0.0
    return max(0.0, 1.0 - abs(len(words(answer)) - COUNTS[target]) / 3)


def length_warm(request: Request, rng: random.Random) -> list[Message]:
    return [{"role": "assistant", "content": " ".join(rng.choices(VOCABULARY, k=rng.randint(1, 5)))}]


LENGTH = Task(
    name="length", system="Reply in exactly as many words as asked.", tools=None,
    templates={k: [f"Answer in {k} words {{x}}.", f"Use {k} words {{x}}."] for k in COUNTS},
    fillers=FILLER_WORDS, score=length_score, step=end_after_answer, warm_start=length_warm, max_tokens=16)

# --------------------------------------------------------------------------- letters

LETTERS = ["a", "e", "o"]


def letters_score(messages: Sequence[Message]) -> float:
    turns = assistant_turns(messages)
    answer = final_text(turns[0] if turns else None)
    match = re.search(r"letter ([a-z])\b", request_text(messages))
    letters = [c for c in (answer or "").lower() if c.isalpha()]
    if not letters or match is None:
        return 0.0
    return min(1.0, 3 * letters.count(match.group(1)) / len(letters))


def letters_warm(request: Request, rng: random.Random) -> list[Message]:
    return [{"role": "assistant", "content": " ".join(rng.choices(VOCABULARY, k=rng.randint(2, 4)))}]


LETTERS_TASK = Task(
    name="letters", system="Write a short line using the letter asked for as often as you can.", tools=None,
    templates={c: [f"The letter {c} {{x}}.", f"Write with the letter {c} {{x}}."] for c in LETTERS},
    fillers=FILLER_WORDS, score=letters_score, step=end_after_answer, warm_start=letters_warm, max_tokens=16)

# --------------------------------------------------------------------------- two_calls

CODES = ["north", "south", "east", "west"]


def lookup_result(messages: Sequence[Message]) -> str | None:
    """The code the lookup returned in this conversation (the first tool result)."""
    result = next((text_of(m) for m in messages if m.get("role") == "tool"), None)
    try:
        return str(json.loads(result)["code"]) if result else None
    except (ValueError, KeyError, TypeError):
        return None


def two_calls_score(messages: Sequence[Message]) -> float:
    turns = assistant_turns(messages)
    if only_call(turns[0] if turns else None, ["lookup"]) is None:
        return 0.0
    sent = only_call(turns[1] if len(turns) > 1 else None, ["send"])
    if sent is None:
        return 0.1
    return 1.0 if sent[1].get("code") == lookup_result(messages) else 0.2


def ticket_code(messages: Sequence[Message]) -> str:
    """The lookup's answer: a code fixed by the request's text, so a conversation replays the same way."""
    return CODES[sum(map(ord, request_text(messages))) % len(CODES)]


def two_calls_step(messages: Sequence[Message]) -> Message | None:
    turns = assistant_turns(messages)
    if len(turns) == 1 and only_call(turns[0], ["lookup"]):
        return tool_message(call_id_of(turns[0]), {"code": ticket_code(messages)})
    return None


def two_calls_warm(request: Request, rng: random.Random) -> list[Message]:
    code = rng.choice(CODES)
    return [call_message("lookup", {}), tool_message("call_0", {"code": code}),
            call_message("send", {"code": rng.choice(CODES)}, "call_1")]


TWO_CALLS = Task(
    name="two_calls", system="Look the code up, then send that code.",
    tools=[function_tool("lookup", "Look up the code"), function_tool("send", "Send a code", {"code": "the code"})],
    templates={"any": ["Send my code {x}.", "I need my code sent {x}.", "Pass the code on {x}."]},
    fillers=FILLER_WORDS, score=two_calls_score, step=two_calls_step, warm_start=two_calls_warm)

# --------------------------------------------------------------------------- judged

SUBJECTS = ["weather", "price", "order", "meeting", "city", "email"]


def judged_score(messages: Sequence[Message]) -> float:
    turns = assistant_turns(messages)
    answer = final_text(turns[0] if turns else None)
    subject = which(request_text(messages), {s: s for s in SUBJECTS})
    if answer is None or subject is None:
        return 0.0
    named = subject in {w.lower() for w in words(answer)}
    return (1.0 if named else 0.3) if len(words(answer)) <= 8 else (0.5 if named else 0.0)


def judged_warm(request: Request, rng: random.Random) -> list[Message]:
    return [{"role": "assistant", "content": f"The {rng.choice(SUBJECTS)} is {rng.choice(VOCABULARY)}."}]


JUDGED = Task(
    name="judged", system="Write one short line about what the user names.", tools=None,
    templates={s: [f"Say something about the {s} {{x}}.", f"A line on the {s} {{x}}, please."] for s in SUBJECTS},
    fillers=FILLER_WORDS, score=judged_score, step=end_after_answer, warm_start=judged_warm, max_tokens=16)

RUBRIC = ("A short line (at most eight words) that names the subject the user asked about is best; a longer "
          "one that names it is half as good; one that does not name it is poor.")

TASKS: dict[str, Task] = {t.name: t for t in (TOOL_CHOICE, ARGUMENT, LENGTH, LETTERS_TASK, TWO_CALLS, JUDGED)}


def task_of(messages: Sequence[Message]) -> Task | None:
    """The task a conversation belongs to, by its system prompt (what a judge reads first)."""
    system = text_of(messages[0]) if messages and messages[0].get("role") == "system" else ""
    return next((t for t in TASKS.values() if t.system == system), None)


def gate_reward(messages: Sequence[Message], tools: Sequence[Mapping[str, Any]] | None,
                answer_message: Mapping[str, Any], *, truncated: bool = False) -> float:
    """The offline gate's hook: one answer to a held-out context, scored as its task scores a conversation.

    A cut-off answer (``truncated``) scores 0: it never ended its turn.
    """
    task = task_of(messages)
    if task is None or truncated:
        return 0.0
    return task.score([*messages, dict(answer_message)])
