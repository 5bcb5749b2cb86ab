"""An airline customer-support agent with tools and a checkable outcome (docs/examples.md)."""
