"""Email search (ART•E's shape), the ART way: groups of searches per question, judged by RULER, then GRPO.

    python -m examples.email_search.explicit --base-model Qwen/Qwen2.5-7B-Instruct --steps 30 --max-tokens 256 \
        --judge-model openai/o4-mini
"""

from __future__ import annotations

import asyncio

from examples.art_loop import explicit_main
from examples.email_search.env import Search, question

main = explicit_main(__doc__ or "", project="email-search", episode=Search, scenario=question, ruler=True,
                     max_tokens=256)

if __name__ == "__main__":
    asyncio.run(main(None))
