"""Example agents that run against a Flywheel gateway with the plain ``openai`` client."""
