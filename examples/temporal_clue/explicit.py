"""Temporal-clue-style deduction, the ART way: groups of answers per puzzle, then a GRPO step, repeated.

    python -m examples.temporal_clue.explicit --base-model Qwen/Qwen2.5-7B-Instruct --steps 40 --max-tokens 1024
"""

from __future__ import annotations

import asyncio

from examples.art_loop import explicit_main
from examples.temporal_clue.env import Puzzle, Scenario

main = explicit_main(__doc__ or "", project="temporal-clue", episode=Puzzle, scenario=Scenario, max_tokens=1024)

if __name__ == "__main__":
    asyncio.run(main(None))
