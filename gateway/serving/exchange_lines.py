"""Big captured exchanges as JSON lines, serialized without holding the event loop.

orjson holds the GIL for a whole ``dumps`` call (a thread alone would stall the loop just the
same: ~50 ms for a response with 20 000 tokens of top-20 logprobs), so a big exchange is
serialized on a worker thread piece by piece, and the thread hands the GIL back between
pieces. The line is the one :meth:`flywheel.capture.turns.CapturedExchange.to_line` writes.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import orjson

from flywheel.capture.turns import CapturedExchange

OFF_LOOP_LINE_BYTES = 1 << 20  # exchanges estimated bigger than this are serialized off the event loop
_PIECE_ITEMS = 256  # list items serialized in one orjson call: well under a millisecond for logprob entries
_PIECE_DEPTH = 5  # exchange -> response -> choices -> choice -> logprobs -> content entries
_LOGPROB_ENTRY_BYTES = 64  # roughly what one token's logprob entry (or one top alternative) writes
_TOKEN_ID_BYTES = 8


def estimated_bytes(exchange: CapturedExchange, request_bytes: int) -> int:
    """A cheap upper estimate of the line's size: the request as it came, token ids and logprob entries."""
    request, response = exchange.request, exchange.response
    top = request.get("top_logprobs") if exchange.endpoint == "chat.completions" else request.get("logprobs")
    entries_per_token = 1 + (top if isinstance(top, int) and not isinstance(top, bool) else 0)
    choices = response.get("choices") or ()
    completion_tokens = sum(len(choice.get("token_ids") or ()) for choice in choices)
    prompt_tokens = len(response.get("prompt_token_ids") or ()) + sum(
        len(choice.get("prompt_token_ids") or ()) for choice in choices)
    return (request_bytes + prompt_tokens * _TOKEN_ID_BYTES
            + completion_tokens * (_TOKEN_ID_BYTES + entries_per_token * _LOGPROB_ENTRY_BYTES))


def line_in_pieces(exchange: CapturedExchange) -> bytes:
    """The exchange's JSON line from pieces of at most ``_PIECE_ITEMS`` list items each, joined once."""
    out = [b"{"]
    for position, name in enumerate(f.name for f in fields(exchange)):
        out.append(b',"' if position else b'"')
        out.append(name.encode() + b'":')
        _pieces(getattr(exchange, name), _PIECE_DEPTH, out)
    out.append(b"}\n")
    return b"".join(out)


def dumps_in_pieces(value: Any, depth: int) -> bytes:
    """``orjson.dumps(value)``, one orjson call per piece down to ``depth`` levels."""
    out: list[bytes] = []
    _pieces(value, depth, out)
    return b"".join(out)


def _pieces(value: Any, depth: int, out: list[bytes]) -> None:
    # One list joined once: joining at every level would copy a big line again and again, holding the GIL
    if depth and isinstance(value, dict):
        out.append(b"{")
        for position, (key, item) in enumerate(value.items()):
            out.append(b"," + orjson.dumps(key) + b":" if position else orjson.dumps(key) + b":")
            _pieces(item, depth - 1, out)
        out.append(b"}")
    elif depth and isinstance(value, list) and len(value) > _PIECE_ITEMS:
        out.append(b"[")
        for start in range(0, len(value), _PIECE_ITEMS):
            piece = orjson.dumps(value[start:start + _PIECE_ITEMS])
            out.append(piece[1:-1] if not start else b"," + piece[1:-1])
        out.append(b"]")
    elif depth and isinstance(value, list):
        out.append(b"[")
        for position, item in enumerate(value):
            if position:
                out.append(b",")
            _pieces(item, depth - 1, out)
        out.append(b"]")
    else:
        out.append(orjson.dumps(value))
