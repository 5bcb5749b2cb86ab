"""RULER judging and reward sources (the Judge issue fills this in)."""
