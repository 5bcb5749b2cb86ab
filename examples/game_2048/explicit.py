"""2048, the ART way: groups of rollouts per scenario, gathered, then a GRPO step, repeated.

    python -m examples.game_2048.explicit --base-model Qwen/Qwen2.5-3B-Instruct --steps 40
"""

from __future__ import annotations

import asyncio

from examples.art_loop import explicit_main
from examples.game_2048.env import Game, Scenario

main = explicit_main(__doc__ or "", project="2048", episode=Game, scenario=Scenario, max_tokens=16)

if __name__ == "__main__":
    asyncio.run(main(None))
