"""Example agents over a Flywheel gateway: the `flywheel demo` support agent and the seed examples (docs/examples.md)."""
