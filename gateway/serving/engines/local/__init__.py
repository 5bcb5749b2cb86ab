"""The local engine: transformers + peft in this process (development, tests, small deployments).

``runtime`` owns the model, ``worker`` steps jobs on the thread that owns it, ``prompts``
prepares requests, ``decoding`` samples and cuts text, ``vocabulary`` turns tokens into
text, ``toolcalls`` parses Hermes tool calls, ``responses`` shapes OpenAI answers, and
``engine`` is the :class:`LocalEngine` that joins them.
"""

from __future__ import annotations

from flywheel.gateway.serving.engines.local.engine import LocalEngine

__all__ = ["LocalEngine"]
