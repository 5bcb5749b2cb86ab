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

# The patterns are written for the speed of Python's re: each starts with a character class, so the
# engine jumps from candidate to candidate in C instead of trying every position; what would come first
# (a word boundary, a lookbehind) is checked right after that first character. tests/test_redaction.py
# holds them to their plain forms (docs/capture.md), which were 2-10x slower.
_EMAIL = re.compile(r"[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}")
_PHONE = re.compile(
    r"[+(\d](?<![\w+].)"  # not preceded by a word character or "+"
    r"(?:(?<=\+)\d{1,3}[\s.-]?(?:\(\d{2,4}\)|\d{2,4})"  # +country code, then area code
    r"|(?<=\()\d{2,4}\)"  # (area code)
    r"|(?<=\d)\d{1,3})"  # area code
    r"[\s.-]\d{3,4}[\s.-]\d{3,4}(?!\w)")
_CARD = re.compile(r"\d(?<!\d\d)(?:[ -]?\d){12,18}(?!\d)")  # 13-19 digits, single spaces or dashes between
_API_KEY = re.compile(
    r"[sprgAxbB]"
    r"(?:(?<=[spr])(?<!\w[spr])k-(?:[A-Za-z0-9]+-)*[A-Za-z0-9_-]{16,}"  # OpenAI / Anthropic / Stripe style
    r"|(?<=g)(?<!\wg)h[pousr]_[A-Za-z0-9]{20,}"  # GitHub tokens
    r"|(?<=A)(?<!\wA)KIA[0-9A-Z]{16}\b"  # AWS access key ids
    r"|(?<=x)(?<!\wx)ox[abprs]-[A-Za-z0-9-]{10,}"  # Slack tokens
    r"|(?<=[bB])(?i:earer)\s+[A-Za-z0-9._~+/=-]{20,})"  # bearer tokens
)


def _luhn_ok(text: str) -> bool:
    digits = [int(c) for c in text if c.isdigit()]
    total = 0
    for position, digit in enumerate(reversed(digits)):
        if position % 2 == 1:
            digit = digit * 2 - 9 if digit * 2 > 9 else digit * 2
        total += digit
    return total % 10 == 0


def _may_hold_digit(text: str) -> bool:
    """True whenever ``\\d`` can match. It matches every Unicode digit, so non-ASCII text always passes;
    ten substring scans are ~20x faster than re's own search for a digit."""
    return not text.isascii() or "0" in text or "1" in text or "2" in text or "3" in text or "4" in text or \
        "5" in text or "6" in text or "7" in text or "8" in text or "9" in text


def _may_hold_key(text: str) -> bool:
    """True whenever _API_KEY can match (each of its alternatives needs one of these substrings)."""
    return "k-" in text or "AKIA" in text or "xox" in text or ("gh" in text and "_" in text) or \
        "bearer" in text.lower()


@dataclass(frozen=True)
class Rule:
    name: str
    pattern: re.Pattern[str]
    accept: Callable[[str], bool] = field(default=lambda text: True)
    # A cheap test that is true whenever ``pattern`` can match: most text fails it and skips the regex
    # (a 1 KB system prompt cost ~380 us through the four built-in regexes, ~5 us through their tests).
    may_match: Callable[[str], bool] = field(default=lambda text: True)


BUILTIN_RULES = (
    Rule("API_KEY", _API_KEY, may_match=_may_hold_key),
    Rule("EMAIL", _EMAIL, may_match=lambda text: "@" in text),
    Rule("CARD", _CARD, _luhn_ok, may_match=_may_hold_digit),
    Rule("PHONE", _PHONE, may_match=_may_hold_digit),
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
        self._substitutions = tuple((rule.may_match, rule.pattern, _replacer(rule)) for rule in self.rules)

    def text(self, value: str) -> str:
        for may_match, pattern, replace in self._substitutions:
            if may_match(value):
                value = pattern.sub(replace, value)
        return value

    def message(self, message: dict[str, Any]) -> dict[str, Any]:
        """One chat message redacted (content, text parts, tool-call arguments): a copy when something
        changed, else the message itself (so comparing the two is an identity check)."""
        out = message
        content = message.get("content")
        if isinstance(content, str):
            text = self.text(content)
            if text != content:
                out = {**message, "content": text}
        elif isinstance(content, list):
            parts = [self._part(p) for p in content]
            if any(new is not old for new, old in zip(parts, content, strict=True)):
                out = {**message, "content": parts}
        calls = message.get("tool_calls")
        if calls:
            redacted_calls = [self._tool_call(call) for call in calls]
            if any(new is not old for new, old in zip(redacted_calls, calls, strict=True)):
                out = {**out, "tool_calls": redacted_calls}
        return out

    def _part(self, part: Any) -> Any:
        if not isinstance(part, dict) or not isinstance(part.get("text"), str):
            return part
        text = self.text(part["text"])
        return part if text == part["text"] else {**part, "text": text}

    def _tool_call(self, call: dict[str, Any]) -> dict[str, Any]:
        function = call.get("function") or {}
        arguments = function.get("arguments")
        if not isinstance(arguments, str):
            return call
        text = self.text(arguments)
        return call if text == arguments else {**call, "function": {**function, "arguments": text}}
