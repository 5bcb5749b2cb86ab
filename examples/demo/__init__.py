"""The ``flywheel demo`` task: a support agent that must pick the right tool for each request."""
