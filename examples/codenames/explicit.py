"""Codenames (the guesser), the ART way: groups of rollouts per board, gathered, then a GRPO step, repeated.

    python -m examples.codenames.explicit --base-model Qwen/Qwen2.5-7B-Instruct --steps 30
"""

from __future__ import annotations

import asyncio

from examples.art_loop import explicit_main
from examples.codenames.env import Scenario, Turn

main = explicit_main(__doc__ or "", project="codenames", episode=Turn, scenario=Scenario, max_tokens=16)

if __name__ == "__main__":
    asyncio.run(main(None))
