"""A temporal-clue-style deduction puzzle with a checkable answer (docs/examples.md)."""
