"""2048 on a 4x4 board (docs/examples.md)."""
