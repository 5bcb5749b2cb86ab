"""Airline support, zero code: a plain openai agent with tools at the gateway's base_url; the outcome is feedback.

    python -m examples.support.zero_code --base-url http://127.0.0.1:8000/v1 --steps 5 --max-tokens 256
"""

from __future__ import annotations

import asyncio

from examples.agent import zero_code_main
from examples.support.env import Conversation, task

main = zero_code_main(__doc__ or "", episode=Conversation, scenario=task, max_tokens=256, groups=5)

if __name__ == "__main__":
    asyncio.run(main(None))
