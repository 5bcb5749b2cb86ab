"""Tokens as text: incremental detokenization and the token text and bytes OpenAI logprobs report."""

from __future__ import annotations

import codecs
from typing import Any


def byte_decoder() -> dict[str, int]:
    """Inverse of the byte-level BPE alphabet (GPT-2 scheme): one printable char per byte."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table: dict[str, int] = {}
    shifted = 0
    for byte in range(256):
        if byte in kept:
            table[chr(byte)] = byte
        else:
            table[chr(256 + shifted)] = byte
            shifted += 1
    return table


class ByteDetokenizer:
    """Incremental text of a byte-level BPE stream; holds incomplete UTF-8 sequences back."""

    def __init__(self, table: list[bytes]) -> None:
        self._table = table
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def add(self, token_id: int) -> str:
        piece = self._table[token_id] if 0 <= token_id < len(self._table) else b""
        return self._decoder.decode(piece)

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


class FullDetokenizer:
    """Fallback for non-byte-level tokenizers: re-decode everything, emit the new suffix."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._text = ""

    def add(self, token_id: int) -> str:
        self._ids.append(token_id)
        text = self._tokenizer.decode(self._ids, skip_special_tokens=True)
        if text.endswith("\ufffd") or not text.startswith(self._text):
            return ""  # an unfinished character (or a re-spaced prefix): wait for more tokens
        new, self._text = text[len(self._text):], text
        return new

    def flush(self) -> str:
        text = self._tokenizer.decode(self._ids, skip_special_tokens=True)
        return text[len(self._text):] if text.startswith(self._text) else ""


Detokenizer = ByteDetokenizer | FullDetokenizer


class Vocabulary:
    """Per-token text and bytes: what detokenizers and OpenAI logprobs need."""

    def __init__(self, tokenizer: Any, size: int) -> None:
        self.tokenizer = tokenizer
        self.size = size
        added = dict(getattr(tokenizer, "added_tokens_decoder", {}))
        self.special_ids = {i for i, tok in added.items() if getattr(tok, "special", False)}
        self.special_ids |= set(getattr(tokenizer, "all_special_ids", []))
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self.byte_level = type(decoder).__name__ == "ByteLevel"
        self._shown: dict[int, tuple[str, list[int]]] = {}
        self.raw_bytes: list[bytes] = self._raw_bytes(added) if self.byte_level else []
        # Text bytes skip special tokens, as decode(skip_special_tokens=True) does.
        self.text_bytes = [b"" if i in self.special_ids else b for i, b in enumerate(self.raw_bytes)]

    def _raw_bytes(self, added: dict[int, Any]) -> list[bytes]:
        inverse = byte_decoder()
        pieces = self.tokenizer.convert_ids_to_tokens(list(range(len(self.tokenizer))))
        table: list[bytes] = []
        for token_id in range(max(self.size, len(pieces))):
            piece = pieces[token_id] if token_id < len(pieces) else None
            if token_id in added:
                table.append(str(added[token_id].content).encode())
            elif piece is None:
                table.append(b"")  # embedding rows past the tokenizer (padding to a multiple)
            elif all(ch in inverse for ch in piece):
                table.append(bytes(inverse[ch] for ch in piece))
            else:
                table.append(piece.encode())
        return table

    def detokenizer(self) -> Detokenizer:
        return ByteDetokenizer(self.text_bytes) if self.byte_level else FullDetokenizer(self.tokenizer)

    def show(self, token_id: int) -> tuple[str, list[int]]:
        """(token text, its bytes) as OpenAI logprobs report them."""
        if token_id not in self._shown:
            if self.byte_level and token_id < len(self.raw_bytes):
                raw = self.raw_bytes[token_id]
            else:
                raw = self.tokenizer.decode([token_id]).encode()
            self._shown[token_id] = (raw.decode("utf-8", errors="replace"), list(raw))
        return self._shown[token_id]
