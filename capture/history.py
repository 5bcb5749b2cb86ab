"""A conversation's history across its turns: what a request changed in the history it sent,
and a branch's turns read back as one conversation.

Textbook clients repeat the whole history verbatim, so the latest request holds the whole
conversation. Production agents rewrite it (a system prompt with the time in it, a sliding
window, a summary, shortened tool results): the linker records what such a request changed
(:func:`history_edits`, stored in ``turns.history_edits``), and :func:`branch_conversation`
rebuilds the conversation as it happened from the turns of a branch, each turn's own
messages where it added them.
"""

from __future__ import annotations

from collections.abc import Sequence
from difflib import SequenceMatcher
from typing import Any, Protocol

from flywheel.capture.canonical import message_hash

_SYSTEM_ROLES = ("system", "developer")


class BranchStep(Protocol):
    """What :func:`branch_conversation` reads of a turn (``flywheel.capture.models.Turn`` has it)."""

    request_messages: list[dict[str, Any]] | None
    response_message: dict[str, Any] | None
    parent_message_index: int | None
    history_edits: dict[str, Any] | None


def history_edits(previous: Sequence[dict[str, Any]], sent: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """What differs between the conversation a turn continues and the history its request sent in its place.

    ``previous`` is the parent turn's request messages plus its answer; ``sent`` the new request's
    messages up to and including that answer. Compared as canonical messages (tool-call ids
    included): ``system_changed`` (any system or developer message differs), and among the other
    messages how many were ``dropped``, ``rewritten`` (replaced one for one) or ``added``.
    None when nothing differs.
    """
    system_changed = _system_hashes(previous) != _system_hashes(sent)
    before = [m for m in previous if m.get("role") not in _SYSTEM_ROLES]
    after = [m for m in sent if m.get("role") not in _SYSTEM_ROLES]
    # The common start and end first, by a cheap comparison: usually all that differs is a few messages
    shortest = min(len(before), len(after))
    start = next((i for i in range(shortest) if not _same(before[i], after[i])), shortest)
    end = next((i for i in range(shortest - start) if not _same(before[-1 - i], after[-1 - i])), shortest - start)
    before, after = before[start:len(before) - end], after[start:len(after) - end]
    if not before or not after:  # only dropped, or only added: nothing to align
        return _edits(system_changed, dropped=len(before), rewritten=0, added=len(after))
    aligned = SequenceMatcher(None, [message_hash(m) for m in before], [message_hash(m) for m in after],
                              autojunk=False)
    dropped = rewritten = added = 0
    for tag, i1, i2, j1, j2 in aligned.get_opcodes():
        removed, inserted = i2 - i1, j2 - j1
        if tag == "delete":
            dropped += removed
        elif tag == "insert":
            added += inserted
        elif tag == "replace":  # n old messages became m new ones: min(n, m) rewritten, the rest dropped or added
            rewritten += min(removed, inserted)
            dropped += max(0, removed - inserted)
            added += max(0, inserted - removed)
    return _edits(system_changed, dropped=dropped, rewritten=rewritten, added=added)


def _edits(system_changed: bool, *, dropped: int, rewritten: int, added: int) -> dict[str, Any] | None:
    if not (system_changed or dropped or rewritten or added):
        return None
    return {"system_changed": system_changed, "dropped": dropped, "rewritten": rewritten, "added": added}


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Canonically equal: the same dict (fast), or the same message_hash."""
    return a == b or message_hash(a) == message_hash(b)


def _system_hashes(messages: Sequence[dict[str, Any]]) -> list[str]:
    return [message_hash(m) for m in messages if m.get("role") in _SYSTEM_ROLES]


def branch_conversation(turns: Sequence[BranchStep]) -> tuple[list[dict[str, Any]], list[int]]:
    """A root-to-leaf run of turns as one conversation, and the position of each turn's answer in it.

    The first turn brings its whole request; each later one what it added after the answer it
    continued (``parent_message_index``), so a message keeps the form it was first sent in even
    when a later request shortened or dropped it. A turn whose request holds nothing of its
    parent's (an explicit id, ``parent_message_index`` null) brings its whole request; one
    stored before link rules were recorded (both null) repeated everything before it.
    """
    messages: list[dict[str, Any]] = []
    answers: list[int] = []
    for turn in turns:
        request = turn.request_messages or []
        at = turn.parent_message_index
        if messages and at is not None:
            messages += request[at + 1:]
        elif messages and turn.history_edits is not None:
            messages += request
        else:
            messages = list(request)
        answers.append(len(messages))
        messages.append(turn.response_message or {"role": "assistant", "content": ""})
    return messages, answers
