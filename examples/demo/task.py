"""The demo's environment: customer requests, four support tools, their results, and the reward.

A support agent gets one customer request, must call the one tool the request needs, gets
the tool's result, then answers. Each request's wording carries a cue word for exactly one
tool (" order" -> ``order``, " price" -> ``price``, " meeting" -> ``calendar``, " email" ->
``email``), which is what a tiny model can learn to read in minutes. Requests come from a
fixed pool, so the same request recurs and the gateway groups its attempts (same system
prompt, tools and first user message: ``capture/groups.py``).

Reward of an episode (``episode_reward``):

| first turn                                  | final answer ok | else |
|---------------------------------------------|-----------------|------|
| one well-formed call to the right tool      | 1.0             | 0.5  |
| one well-formed call to another tool        | 0.1             | 0.05 |
| no call, several, malformed, no end of turn | 0               | 0    |

A turn that ran into its ``max_tokens`` (no end-of-turn token: a collapsed model's endless
output) counts as malformed, so such a candidate scores 0 and the promotion gate can reject
it. ``turn_reward`` scores a single turn the same way: a first turn 1.0 / 0.1 / 0, the turn after
the tool's result 1.0 for a final answer.

Only the standard library: the agent, the gate and the tests import this without torch.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

Message = dict[str, Any]

SYSTEM_PROMPT = "You are a support agent. Call one tool, then answer."
# Single tokens in the tiny model's tokenizer (trainer/tiny_model.py): a tool name the model
# has to spell from pieces is where a tiny model goes wrong most (it splices names).
TOOL_DESCRIPTIONS = {
    "order": "Order status",
    "price": "Price of an item",
    "calendar": "Book a repair",
    "email": "Email a receipt",
}
TOOL_NAMES = list(TOOL_DESCRIPTIONS)
# Short schemas: the chat template renders every tool into the system prompt, and on CPU the
# prompt's length decides the speed. No parameters: every call is {"name": ..., "arguments": {}}.
TOOLS: list[dict[str, Any]] = [{"type": "function", "function": {"name": name, "description": description}}
                               for name, description in TOOL_DESCRIPTIONS.items()]
CUES = {"order": "order", "price": "price", "calendar": "meeting", "email": "email"}
# The cue word ends each request: a tiny model finds a word at a fixed distance from the end of the
# prompt from fewer examples than one anywhere in the sentence (docs/demo.md).
TEMPLATES = {
    "order": ["My {item} is late, where is my order?", "Did you ship my {item} order?",
              "I want to track my {item} order.", "Any news on my {item} order?"],
    "price": ["I would like to know the {item} price.", "How much is the {item}, what is the price?",
              "Is there a lower {item} price?", "Can you tell me the {item} price?"],
    "calendar": ["My {item} is broken, can I get a meeting?", "I need a {item} repair meeting.",
                 "Can we set up a {item} meeting?", "Please book a {item} meeting."],
    "email": ["Send the {item} receipt by email.", "I need my {item} bill by email.",
              "Can I get the {item} invoice by email?", "Please send the {item} warranty by email."],
}
ITEMS = ["laptop", "phone", "chair", "lamp", "bike", "camera", "desk", "kettle", "printer", "sofa"]
OPENERS = ["", "Hi. ", "Hello! ", "Good day. ", "Hey, ", "Thanks for your help. "]
# One result per tool and one answer to it: after the warm start the tool name is the episode's only
# real choice, so every sampled token but that one is (nearly) certain and GRPO's signal is not drowned.
RESULTS = {"order": '{"status": "shipped"}', "price": '{"price": 49}', "calendar": '{"slot": "Monday"}',
           "email": '{"sent": true}'}
ANSWERS = {"order": "It is on the way.", "price": "It is 49.", "calendar": "See you Monday.", "email": "Sent by email."}

FIRST_TURN_MAX_TOKENS = 24  # a call is 17 tokens with its end of turn: room for a few more, not for endless
FINAL_MAX_TOKENS = 12  # the answers above are 6-7 tokens with their end of turn
WRONG_TOOL_REWARD = 0.1  # a well-formed call to another tool
EVAL_SHARE = 5  # one request in EVAL_SHARE (by a hash of its text) is held out for evaluation


@dataclass(frozen=True)
class Request:
    """A customer request and the tool its cue word calls for."""

    text: str
    tool: str


def all_requests() -> list[Request]:
    """Every request the templates make (240 per tool), in a fixed order."""
    return [Request(f"{opener}{template.format(item=item)}", tool) for tool, templates in TEMPLATES.items()
            for template in templates for item in ITEMS for opener in OPENERS]


def is_held_out(text: str) -> bool:
    """Whether a request belongs to the evaluation split (stable across runs and machines)."""
    return int(hashlib.sha256(text.encode()).hexdigest(), 16) % EVAL_SHARE == 0


def request_pool(n: int, *, seed: int, held_out: bool = False) -> list[Request]:
    """``n`` distinct requests of one split, as many for each tool (n a multiple of 4), shuffled by ``seed``."""
    if n % len(TOOL_NAMES):
        raise ValueError(f"n={n} must be a multiple of {len(TOOL_NAMES)} (one share per tool)")
    rng = random.Random(seed)
    pool: list[Request] = []
    for tool in TOOL_NAMES:
        candidates = [r for r in all_requests() if r.tool == tool and is_held_out(r.text) == held_out]
        pool += rng.sample(candidates, n // len(TOOL_NAMES))
    rng.shuffle(pool)
    return pool


def cue_tool(text: str) -> str | None:
    """The tool whose cue word ``text`` contains, or None unless exactly one tool's cue is there."""
    words = {w.strip(".,!?:;").lower() for w in text.split()}
    found = [tool for tool, cue in CUES.items() if cue in words]
    return found[0] if len(found) == 1 else None


def first_messages(request: Request) -> list[Message]:
    """The conversation an episode starts with."""
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": request.text}]


def tool_result(tool: str) -> str:
    """What calling ``tool`` returns (JSON text)."""
    return RESULTS[tool]


# --------------------------------------------------------------------------- rewards


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # text parts
        return "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
    return ""


def _function(call: Any) -> Mapping[str, Any]:
    if not isinstance(call, Mapping):
        return {}
    function = call.get("function", call)  # OpenAI's {"function": {...}} or a bare {"name", "arguments"}
    return function if isinstance(function, Mapping) else {}


def _arguments_ok(arguments: Any) -> bool:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return False
    return isinstance(arguments, Mapping)


def called_tool(message: Mapping[str, Any] | None, *, truncated: bool = False,
                tool_names: Sequence[str] | None = None) -> str | None:
    """The tool a first-turn answer calls, when it is exactly one well-formed call and nothing else.

    Well-formed: the turn ended with its end-of-turn token (``truncated`` False), holds no
    text, one call whose name is one of ``tool_names`` (default: the task's) and whose
    arguments are a JSON object.
    """
    if message is None or truncated or _text(message.get("content")).strip():
        return None
    calls = message.get("tool_calls") or []
    if len(calls) != 1:
        return None
    function = _function(calls[0])
    name = function.get("name")
    if name not in (tool_names or TOOL_NAMES) or not _arguments_ok(function.get("arguments", {})):
        return None
    return str(name)


def is_final_answer(message: Mapping[str, Any] | None, *, truncated: bool = False) -> bool:
    """A final answer: some text, no tool call, ended with its end-of-turn token."""
    return (message is not None and not truncated and not message.get("tool_calls")
            and bool(_text(message.get("content")).strip()))


def tool_choice_reward(right_tool: str | None, called: str | None) -> float:
    """1.0 for the right tool, ``WRONG_TOOL_REWARD`` for another well-formed call, 0 for no (well-formed) call."""
    if called is None:
        return 0.0
    return 1.0 if called == right_tool else WRONG_TOOL_REWARD


def episode_reward(request: Request, first: Mapping[str, Any] | None, final: Mapping[str, Any] | None, *,
                   first_truncated: bool = False, final_truncated: bool = False) -> float:
    """The task reward of an episode: the tool choice, halved without a proper final answer (table above)."""
    score = tool_choice_reward(request.tool, called_tool(first, truncated=first_truncated))
    return score if is_final_answer(final, truncated=final_truncated) else score / 2


def turn_reward(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None,
                answer_message: Mapping[str, Any], *, truncated: bool = False) -> float:
    """Score one turn for its context: the task's reward hook (the gate, and the forked turns' groups).

    A first turn (no tool result since the last user message): 1.0 right tool, 0.1 another valid
    call, 0 otherwise; the right tool comes from the cue in the last user message, the valid names
    from ``tools``. A turn after the tool's result: 1.0 for a final answer, 0 otherwise.
    Pass ``truncated=True`` when the answer hit its ``max_tokens``: engines report a parsed call
    as ``finish_reason="tool_calls"`` even then, so only the caller knows that no end of turn came.
    """
    since_user = list(messages)[next((i for i in range(len(messages) - 1, -1, -1)
                                      if messages[i].get("role") == "user"), -1) + 1:]
    if any(m.get("role") == "tool" for m in since_user):
        return 1.0 if is_final_answer(answer_message, truncated=truncated) else 0.0
    user = next((_text(m.get("content")) for m in reversed(messages) if m.get("role") == "user"), "")
    names = [str(_function(t).get("name")) for t in tools or []]
    return tool_choice_reward(cue_tool(user), called_tool(answer_message, truncated=truncated, tool_names=names))


# --------------------------------------------------------------------------- warm start


def tool_call_message(tool: str, call_id: str = "call_0") -> Message:
    """The assistant message that calls ``tool`` (the form the warm start teaches)."""
    return {"role": "assistant", "content": None,
            "tool_calls": [{"id": call_id, "type": "function", "function": {"name": tool, "arguments": "{}"}}]}


def warm_start_examples(n: int, *, seed: int) -> list[tuple[list[Message], list[dict[str, Any]]]]:
    """``n`` whole episodes in the right format with the tool chosen at random: the format, not the task.

    Each is (messages, tools): system, request, a call to a random tool, its result, that tool's answer.
    """
    rng = random.Random(seed)
    requests = [r for r in all_requests() if not is_held_out(r.text)]
    examples = []
    for _ in range(n):
        request, tool = rng.choice(requests), rng.choice(TOOL_NAMES)
        messages = [*first_messages(request), tool_call_message(tool),
                    {"role": "tool", "tool_call_id": "call_0", "content": tool_result(tool)},
                    {"role": "assistant", "content": ANSWERS[tool]}]
        examples.append((messages, TOOLS))
    return examples
