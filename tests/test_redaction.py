"""Redaction: the built-in rules, as run (rewritten for speed), match their plain definitions (docs/capture.md);
every string of what is written — turn rows, the spool, log records — goes through them, ids pass unchanged."""

from __future__ import annotations

import io
import json
import logging
import random
import re
import uuid
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path

import orjson

from flywheel.capture.recorder import Spool
from flywheel.capture.redaction import BUILTIN_RULES, RedactingFilter, Redactor, _luhn_ok
from flywheel.capture.turns import CapturedExchange, prepare_lines, prepare_turns

# The definitions, as docs/capture.md writes them, in the order they apply.
PLAIN = {
    "API_KEY": re.compile(r"\b(?:sk|pk|rk)-(?:[A-Za-z0-9]+-)*[A-Za-z0-9_-]{16,}|\bgh[pousr]_[A-Za-z0-9]{20,}"
                          r"|\bAKIA[0-9A-Z]{16}\b|\bxox[abprs]-[A-Za-z0-9-]{10,}|(?i:bearer)\s+[A-Za-z0-9._~+/=-]{20,}"),
    "EMAIL": re.compile(r"[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}"),
    "CARD": re.compile(r"(?<![\w-])(?:\d[ -]?){12,18}\d(?![\w-])"),
    "PHONE": re.compile(r"(?<![\w+-])(?:\+\d{1,3}[\s.-]?)?(?:\(\d{2,4}\)|\d{2,4})[\s.-]\d{3,4}[\s.-]\d{3,4}"
                        r"(?![\w-])"),
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
            assert all(end - start >= rules[name].min_length for start, end in expected), (name, text)
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


KEY = "sk-proj-abcdefghijklmnopqrstuvwx"  # what an agent pastes: redacted wherever it lands
MAIL = "alice.liddell@example.com"


def exchange_with_secrets(response_text: str = f"your key is {KEY}") -> CapturedExchange:
    """Secrets in every field a turn row takes from an exchange, keys of objects included."""
    call = {"id": "call_1", "type": "function", "function": {"name": "send", "arguments": json.dumps({"to": MAIL})}}
    request = {
        "model": f"gpt-4o for {MAIL}", "user": KEY, "metadata": {"owner": MAIL, KEY: "x"},
        "x_vendor_field": [{"k": KEY}],
        "tools": [{"type": "function", "function": {"name": "send", "description": f"mails {MAIL}",
                                                    "parameters": {"type": "object"}}}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]},
                     {"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": "call_1", "content": f"sent; receipt to {MAIL}"}],
    }
    answer = {"role": "assistant", "content": response_text,
              "tool_calls": [{**call, "function": {"name": "send", "arguments": json.dumps({"key": KEY})}}]}
    response = {"id": "chatcmpl-0123456789abcdef0123456789abcdef", "prompt_token_ids": [1, 2, 3],
                "choices": [{"index": 0, "message": answer, "finish_reason": "stop", "token_ids": [4, 5]}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 2}}
    return CapturedExchange(completion_id=response["id"], endpoint="chat.completions", requested_model=request["model"],
                            alias="agent", engine_model="agent", adapter_version=0, client_key_id=None,
                            request=request, response=response, created_at=datetime.now(UTC), latency_ms=1.0,
                            trajectory_id=f"conversation of {MAIL}", task=f"task {KEY}", group_id=f"group {MAIL}")


def test_every_string_of_a_turn_row_is_redacted_keys_included() -> None:
    (turn,) = prepare_turns(exchange_with_secrets(), Redactor())
    written = orjson.dumps(turn.to_json()).decode()
    assert KEY not in written and MAIL not in written
    row = turn.row
    assert row["params"]["user"] == "[REDACTED:API_KEY]"
    assert row["params"]["x_vendor_field"] == [{"k": "[REDACTED:API_KEY]"}]
    assert row["request_metadata"] == {"owner": "[REDACTED:EMAIL]", "[REDACTED:API_KEY]": "x"}
    assert row["tools"][0]["function"]["description"] == "mails [REDACTED:EMAIL]"
    assert turn.explicit_trajectory_id == "conversation of [REDACTED:EMAIL]"
    assert (row["requested_model"], row["task_key"], row["group_key"]) == (
        "gpt-4o for [REDACTED:EMAIL]", "task [REDACTED:API_KEY]", "group [REDACTED:EMAIL]")
    assert row["completion_id"] == "chatcmpl-0123456789abcdef0123456789abcdef"  # the engine's id, untouched
    assert row["redacted"] and row["prompt_token_ids"] is None and row["completion_token_ids"] is None


def test_token_ids_are_dropped_only_for_the_texts_they_encode() -> None:
    plain = exchange_with_secrets()
    plain.request["messages"][2]["content"] = "sent"
    plain.request["messages"][1]["tool_calls"][0]["function"]["arguments"] = "{}"
    plain.request["tools"][0]["function"]["description"] = "mails"
    plain.response["choices"][0]["message"] = {"role": "assistant", "content": "done"}
    unknown = plain.request.pop("x_vendor_field")
    (turn,) = prepare_turns(plain, Redactor())  # secrets left in model, user, metadata: never part of the prompt
    assert not turn.row["redacted"] and turn.row["completion_token_ids"] == [4, 5]
    assert turn.row["prompt_token_ids"] == [1, 2, 3] and turn.row["params"]["user"] == "[REDACTED:API_KEY]"
    plain.request["x_vendor_field"] = unknown  # an unknown field may reach the chat template: its tokens go
    (turn,) = prepare_turns(plain, Redactor())
    assert turn.row["redacted"] and turn.row["prompt_token_ids"] is None

    two = exchange_with_secrets()
    two.request.update(messages=[{"role": "user", "content": "hi"}], tools=None, x_vendor_field=None)
    two.response["choices"] = [{"index": 0, "message": {"role": "assistant", "content": "plain"}, "token_ids": [4]},
                               {"index": 1, "message": {"role": "assistant", "content": KEY}, "token_ids": [5]}]
    first, second = prepare_turns(two, Redactor())
    assert (first.row["completion_token_ids"], second.row["completion_token_ids"]) == ([4], None)


def test_redaction_walks_json_once_and_returns_what_it_did_not_change() -> None:
    redactor = Redactor()
    clean = {"messages": [{"role": "user", "content": "hi"}], "n": 1, "nested": {"deep": [[{"x": None}]]}}
    assert redactor.json(clean) is clean
    mixed = {"keep": clean["messages"], "change": {"deeper": [1, MAIL]}}
    out = redactor.json(mixed)
    assert out == {"keep": clean["messages"], "change": {"deeper": [1, "[REDACTED:EMAIL]"]}}
    assert out["keep"] is mixed["keep"] and mixed["change"]["deeper"][1] == MAIL  # a copy; the input is untouched
    assert redactor.json({MAIL: 1}) == {"[REDACTED:EMAIL]": 1}
    assert redactor.json({"order": "4111111111111112 shipped"}) == {"order": "4111111111111112 shipped"}  # no Luhn


def test_ids_pass_through_redaction_unchanged() -> None:
    """Hex and UUID ids hold digit runs and dashes: the card and phone rules never match inside them."""
    rng = random.Random(3)
    redactor = Redactor()
    ids = [str(uuid.UUID(int=rng.getrandbits(128), version=4)) for _ in range(3000)]
    ids += [f"{prefix}{rng.getrandbits(128):032x}" for prefix in ("chatcmpl-", "traj_", "") for _ in range(1000)]
    ids += [f"{rng.getrandbits(40):d}-{rng.getrandbits(40):d}" for _ in range(500)]  # digits and dashes only
    assert [i for i in ids if redactor.text(i) != i] == []


def test_the_spool_holds_redacted_turns_only(tmp_path: Path) -> None:
    """Both spool writers (the gateway's fallback, the recorder's overflow) append prepare_lines' turns."""
    spool = Spool(tmp_path / "spool" / "turns.jsonl")
    stats: Counter[str] = Counter()
    spool.keep(prepare_lines([exchange_with_secrets().to_line()], Redactor(), stats), stats)
    text = spool.path.read_text()
    assert stats["spooled"] == 1 and "[REDACTED:API_KEY]" in text
    assert KEY not in text and MAIL not in text


def test_log_records_are_redacted_arguments_and_tracebacks_included() -> None:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    handler.addFilter(RedactingFilter(Redactor(secrets=["hunter2-admin"])))
    logger = logging.getLogger("tests.redaction")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        logger.warning("store write failed for row %s", {"user": KEY, "mail": MAIL})
        try:
            raise ValueError(f"bad key {KEY} from {MAIL}, admin key hunter2-admin")
        except ValueError:
            logger.exception("request failed")
    finally:
        logger.removeHandler(handler)
    text = out.getvalue()
    assert "Traceback" in text and "ValueError: bad key [REDACTED:API_KEY] from [REDACTED:EMAIL]" in text
    assert "[REDACTED:SECRET]" in text
    assert KEY not in text and MAIL not in text and "hunter2-admin" not in text
