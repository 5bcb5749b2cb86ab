"""Tic-tac-toe, the ART way: groups of rollouts per scenario, gathered, then a GRPO step, repeated.

    python -m examples.tictactoe.explicit --base-model Qwen/Qwen2.5-1.5B-Instruct --steps 30
"""

from __future__ import annotations

import asyncio

from examples.art_loop import explicit_main
from examples.tictactoe.env import Game, Scenario

main = explicit_main(__doc__ or "", project="tic-tac-toe", episode=Game, scenario=Scenario, max_tokens=16)

if __name__ == "__main__":
    asyncio.run(main(None))
