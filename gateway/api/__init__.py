"""The HTTP routes: the OpenAI API, Stored Completions, trajectories, feedback, training, admin."""
