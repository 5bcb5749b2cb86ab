"""Example agents over a Flywheel gateway: the `flywheel demo` agent and the seed examples (docs/examples.md)."""
