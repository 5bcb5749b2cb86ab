"""Codenames (the guesser), zero code: a plain openai agent at the gateway's base_url; each turn's score is feedback.

    python -m examples.codenames.zero_code --base-url http://127.0.0.1:8000/v1 --steps 5
"""

from __future__ import annotations

import asyncio

from examples.agent import zero_code_main
from examples.codenames.env import Scenario, Turn

main = zero_code_main(__doc__ or "", episode=Turn, scenario=Scenario, max_tokens=16)

if __name__ == "__main__":
    asyncio.run(main(None))
