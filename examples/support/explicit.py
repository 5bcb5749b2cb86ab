"""Airline support, the ART way: groups of conversations per task, gathered, then a GRPO step, repeated.

    python -m examples.support.explicit --base-model Qwen/Qwen2.5-7B-Instruct --steps 40 --max-tokens 256
"""

from __future__ import annotations

import asyncio

from examples.art_loop import explicit_main
from examples.support.env import Conversation, task

main = explicit_main(__doc__ or "", project="airline-support", episode=Conversation, scenario=task,
                     max_tokens=256, groups=5)

if __name__ == "__main__":
    asyncio.run(main(None))
