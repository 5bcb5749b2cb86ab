"""Tic-tac-toe, zero code: a plain openai agent at the gateway's base_url; each game's result is feedback.

    python -m examples.tictactoe.zero_code --base-url http://127.0.0.1:8000/v1 --steps 5
"""

from __future__ import annotations

import asyncio

from examples.agent import zero_code_main
from examples.tictactoe.env import Game, Scenario

main = zero_code_main(__doc__ or "", episode=Game, scenario=Scenario, max_tokens=16)

if __name__ == "__main__":
    asyncio.run(main(None))
