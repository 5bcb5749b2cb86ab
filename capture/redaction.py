"""Redaction of captured text before anything is written (store or spool).

Built-in rules catch e-mail addresses, phone numbers, card-like numbers (Luhn-checked)
and API-key-like tokens; user rules are extra regexes. Matches become
``[REDACTED:<RULE>]``. Redaction works on the copy that is stored, never on what the
client receives.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

_EMAIL = re.compile(r"[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}")
_PHONE = re.compile(r"(?<![\w+])(?:\+\d{1,3}[\s.-]?)?(?:\(\d{2,4}\)|\d{2,4})[\s.-]\d{3,4}[\s.-]\d{3,4}(?!\w)")
_CARD = re.compile(r"(?<!\d)(?:\d[ -]?){12,18}\d(?!\d)")
_API_KEY = re.compile(
    r"\b(?:sk|pk|rk)-(?:[A-Za-z0-9]+-)*[A-Za-z0-9_-]{16,}"  # OpenAI / Anthropic / Stripe style
    r"|\bgh[pousr]_[A-Za-z0-9]{20,}"  # GitHub tokens
    r"|\bAKIA[0-9A-Z]{16}\b"  # AWS access key ids
    r"|\bxox[abprs]-[A-Za-z0-9-]{10,}"  # Slack tokens
    r"|(?i:bearer)\s+[A-Za-z0-9._~+/=-]{20,}"
)


def _luhn_ok(text: str) -> bool:
    digits = [int(c) for c in text if c.isdigit()]
    total = 0
    for position, digit in enumerate(reversed(digits)):
        if position % 2 == 1:
            digit = digit * 2 - 9 if digit * 2 > 9 else digit * 2
        total += digit
    return total % 10 == 0


@dataclass(frozen=True)
class Rule:
    name: str
    pattern: re.Pattern[str]
    accept: Callable[[str], bool] = field(default=lambda text: True)


BUILTIN_RULES = (
    Rule("API_KEY", _API_KEY),
    Rule("EMAIL", _EMAIL),
    Rule("CARD", _CARD, _luhn_ok),
    Rule("PHONE", _PHONE),
)


def _replacer(rule: Rule) -> Callable[[re.Match[str]], str]:
    def replace(match: re.Match[str]) -> str:
        return f"[REDACTED:{rule.name}]" if rule.accept(match.group()) else match.group()
    return replace


class Redactor:
    """Applies the built-in rules (unless disabled) and the user's regexes to text."""

    def __init__(self, *, builtin: bool = True, patterns: list[str] | None = None) -> None:
        rules = list(BUILTIN_RULES) if builtin else []
        for index, pattern in enumerate(patterns or []):
            try:
                rules.append(Rule(f"CUSTOM_{index}", re.compile(pattern)))
            except re.error as exc:
                raise ValueError(f"capture.redaction.patterns[{index}]: invalid regex {pattern!r}: {exc}") from None
        self.rules = tuple(rules)
        self._substitutions = tuple((rule.pattern, _replacer(rule)) for rule in self.rules)

    def text(self, value: str) -> str:
        for pattern, replace in self._substitutions:
            value = pattern.sub(replace, value)
        return value

    def message(self, message: dict[str, Any]) -> dict[str, Any]:
        """A redacted copy of one chat message (content, text parts, tool-call arguments)."""
        out = dict(message)
        content = message.get("content")
        if isinstance(content, str):
            out["content"] = self.text(content)
        elif isinstance(content, list):
            out["content"] = [{**p, "text": self.text(p["text"])} if isinstance(p, dict) and isinstance(
                p.get("text"), str) else p for p in content]
        if message.get("tool_calls"):
            out["tool_calls"] = [self._tool_call(call) for call in message["tool_calls"]]
        return out

    def _tool_call(self, call: dict[str, Any]) -> dict[str, Any]:
        function = dict(call.get("function") or {})
        if isinstance(function.get("arguments"), str):
            function["arguments"] = self.text(function["arguments"])
        return {**call, "function": function}
