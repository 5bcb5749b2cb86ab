"""The serving process: the OpenAI routes, the engines, routing and the canary split, the link to the store
process, the loop's scheduler and gate, and the dashboard (``serving/app.py`` is its composition root)."""
