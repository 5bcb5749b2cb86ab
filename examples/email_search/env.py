"""Email search in the shape of ART•E: search and read tools over an inbox, an answer that cites its sources.

The inbox is ``inbox.json`` (18 synthetic emails about an ordinary office; names, no addresses) with
questions whose answers hide in one email, sometimes one that corrects an earlier one. The agent
calls ``search_emails`` (keywords, optional sender and dates) and ``read_email``, and ends with
``return_final_answer(answer, sources)``. The explicit form is judged by RULER; this environment's
own check — the answer contains the expected fact (1.0, or 0.5 without citing the right email) —
becomes ``metrics["independent_reward"]``, the curve the example prints.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from openai.types.chat.chat_completion_message import ChatCompletionMessage

INBOX = json.loads((Path(__file__).with_name("inbox.json")).read_text())
EMAILS: dict[str, dict[str, str]] = {email["id"]: email for email in INBOX["emails"]}
SYSTEM = ("You answer questions about the user's inbox. Today is 2025-05-20. Search with search_emails and read "
          "with read_email; later emails may correct earlier ones. When you know the answer, call "
          "return_final_answer with a short answer and the ids of the emails it comes from. If the inbox does not "
          "say, answer \"I don't know\".")
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "search_emails", "description": "Emails containing every keyword (subject or body), newest first.",
        "parameters": {"type": "object", "required": ["keywords"], "properties": {
            "keywords": {"type": "array", "items": {"type": "string"}},
            "sender": {"type": "string", "description": "only emails from this sender"},
            "after": {"type": "string", "description": "YYYY-MM-DD, only emails sent on or after"},
            "before": {"type": "string", "description": "YYYY-MM-DD, only emails sent on or before"}}}}},
    {"type": "function", "function": {
        "name": "read_email", "description": "One email in full.",
        "parameters": {"type": "object", "required": ["message_id"],
                       "properties": {"message_id": {"type": "string"}}}}},
    {"type": "function", "function": {
        "name": "return_final_answer", "description": "The answer to the question, with the ids of its sources.",
        "parameters": {"type": "object", "required": ["answer", "sources"], "properties": {
            "answer": {"type": "string"}, "sources": {"type": "array", "items": {"type": "string"}}}}}},
]


@dataclass(frozen=True)
class Question:
    question: str
    answer: str
    sources: tuple[str, ...]


QUESTIONS = tuple(Question(q["question"], q["answer"], tuple(q["sources"])) for q in INBOX["questions"])


def search(keywords: list[str], sender: str | None = None, after: str | None = None,
           before: str | None = None) -> list[dict[str, str]]:
    words = [k.lower() for k in keywords if k.strip()]
    found = [e for e in EMAILS.values()
             if all(w in (e["subject"] + " " + e["body"]).lower() for w in words)
             and (sender is None or sender.lower() in e["from"].lower())
             and (after is None or e["date"] >= after) and (before is None or e["date"] <= before)]
    return [{"message_id": e["id"], "from": e["from"], "date": e["date"], "subject": e["subject"],
             "snippet": e["body"][:80]} for e in sorted(found, key=lambda e: e["date"], reverse=True)[:5]]


@dataclass
class Search:
    """One question answered from the inbox; see the module docstring."""

    question: Question
    tools: list[dict[str, Any]] | None = field(default_factory=lambda: TOOLS)
    max_turns: int = 6
    answer: str | None = None
    sources: list[str] = field(default_factory=list)
    tool_calls: int = 0
    tool_errors: int = 0

    def start(self) -> list[dict[str, Any]]:
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": self.question.question}]

    def respond(self, message: ChatCompletionMessage) -> list[dict[str, Any]] | None:
        if not message.tool_calls:
            self.answer = message.content or ""  # a plain reply counts as the answer, without sources
            return None
        replies = []
        for call in message.tool_calls:
            if call.type != "function":
                continue
            self.tool_calls += 1
            try:
                args = json.loads(call.function.arguments or "{}")
                if call.function.name == "return_final_answer":
                    self.answer, self.sources = str(args["answer"]), [str(s) for s in args.get("sources", [])]
                    return None
                if call.function.name == "search_emails":
                    result: Any = search(**args)
                elif call.function.name == "read_email":
                    result = EMAILS[args["message_id"]]
                else:
                    raise KeyError(f"no tool named {call.function.name!r}")
            except (ValueError, TypeError, KeyError) as exc:
                self.tool_errors += 1
                result = {"error": str(exc)}
            replies.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)})
        return replies

    def reward(self) -> float:
        if self.answer is None or self.question.answer.lower() not in self.answer.lower():
            return 0.0
        return 1.0 if set(self.question.sources) <= set(self.sources) else 0.5

    def metrics(self) -> dict[str, float]:
        return {"tool_calls": float(self.tool_calls), "tool_errors": float(self.tool_errors),
                "answered": float(self.answer is not None), "cited": float(bool(self.sources))}


def question(number: int) -> Question:
    """Scenario ``number``: the questions in turn."""
    return QUESTIONS[number % len(QUESTIONS)]
