"""The built-in redaction rules, as run (rewritten for speed), match their plain definitions (docs/capture.md)."""

from __future__ import annotations

import random
import re

from capture.redaction import BUILTIN_RULES, Redactor, _luhn_ok

# The definitions, as docs/capture.md writes them, in the order they apply.
PLAIN = {
    "API_KEY": re.compile(r"\b(?:sk|pk|rk)-(?:[A-Za-z0-9]+-)*[A-Za-z0-9_-]{16,}|\bgh[pousr]_[A-Za-z0-9]{20,}"
                          r"|\bAKIA[0-9A-Z]{16}\b|\bxox[abprs]-[A-Za-z0-9-]{10,}|(?i:bearer)\s+[A-Za-z0-9._~+/=-]{20,}"),
    "EMAIL": re.compile(r"[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}"),
    "CARD": re.compile(r"(?<!\d)(?:\d[ -]?){12,18}\d(?!\d)"),
    "PHONE": re.compile(r"(?<![\w+])(?:\+\d{1,3}[\s.-]?)?(?:\(\d{2,4}\)|\d{2,4})[\s.-]\d{3,4}[\s.-]\d{3,4}(?!\w)"),
}

# Characters and fragments that make the rules match, fail, and nearly match.
_CHARS = list("0123456789" * 4 + "  --..++()\n\t_@") + list("skprghAKIAxobeaBERZ") + ["٣", "４", "é", "ſ", "K"]
_FRAGMENTS = ["sk-", "pk-", "rk-", "ghp_", "AKIA", "xoxb-", "Bearer ", "bEaReR\t", "+1 ", "(555) ",
              "4111 1111 1111 1111", "555-123-4567", "+44 20 7946 0958", "x", "a1", "_", "a@b.co",
              "jo.e+x@mail.example.org",
              "sk-proj-abcdefghijklmnopq", "ghp_abcdefghijklmnopqrstu", "AKIAABCDEFGHIJKLMNOP", "xoxb-1234567890a",
              "Bearer abcdefghijklmnopqrstuvwx"]


def random_text(rng: random.Random) -> str:
    parts = []
    for _ in range(rng.randrange(1, 12)):
        if rng.random() < 0.3:
            parts.append(rng.choice(_FRAGMENTS))
        else:
            parts.append("".join(rng.choice(_CHARS) for _ in range(rng.randrange(1, 25))))
    return "".join(parts)


def plain_redaction(text: str) -> str:
    for name, pattern in PLAIN.items():
        def replace(match: re.Match[str], name: str = name) -> str:
            ok = _luhn_ok(match.group()) if name == "CARD" else True
            return f"[REDACTED:{name}]" if ok else match.group()
        text = pattern.sub(replace, text)
    return text


def test_fast_rules_match_the_plain_ones_on_random_text() -> None:
    rng = random.Random(7)
    rules = {rule.name: rule for rule in BUILTIN_RULES}
    assert list(rules) == list(PLAIN)
    redactor = Redactor()
    matched = dict.fromkeys(PLAIN, 0)
    for _ in range(20_000):
        text = random_text(rng)
        for name, plain in PLAIN.items():
            expected = [m.span() for m in plain.finditer(text)]
            assert [m.span() for m in rules[name].pattern.finditer(text)] == expected, (name, text)
            assert rules[name].may_match(text) or not expected, (name, text)  # the skip test never hides a match
            matched[name] += bool(expected)
        assert redactor.text(text) == plain_redaction(text), text
    assert all(count > 500 for count in matched.values()), matched  # the corpus exercises every rule


def test_known_secrets_are_redacted_and_plain_text_is_kept() -> None:
    redactor = Redactor()
    text = ("mail jo@example.com, call +1 (555) 123-4567, card 4111 1111 1111 1111, key sk-proj-abcdefghijklmnop1234, "
            "AKIAABCDEFGHIJKLMNOP, Authorization: Bearer abcdefghijklmnopqrstuvwxyz")
    assert redactor.text(text) == ("mail [REDACTED:EMAIL], call [REDACTED:PHONE], card [REDACTED:CARD], key "
                                   "[REDACTED:API_KEY], [REDACTED:API_KEY], Authorization: [REDACTED:API_KEY]")
    assert redactor.text("order 4111111111111112 shipped") == "order 4111111111111112 shipped"  # fails Luhn
    assert redactor.text("Réponds en français, 東京 — ٣ things") == "Réponds en français, 東京 — ٣ things"
