"""Codenames, the guesser's side, on a small bundled board (docs/examples.md)."""
