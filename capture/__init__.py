"""Trajectory capture: the store, the linker and the recorder (the Capture issue fills this in)."""
