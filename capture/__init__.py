"""Trajectory capture: the store, the linker, the recorder, redaction, groups and export (docs/capture.md)."""
