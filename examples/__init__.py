"""Seed examples: game agents, a support agent, an email-search agent and a deduction puzzle (docs/examples.md)."""
