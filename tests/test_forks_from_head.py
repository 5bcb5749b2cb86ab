"""``groups.fork_from = "head"``: forked turns' siblings come from the training line's head.

The gateway runs in front of the vLLM stand-in (``tests/vllm_standin.py``), whose answers name the model that
produced them; the test plays the training child through the admin API, so the version it records is a trained
one, on the line.
"""

from __future__ import annotations

from pathlib import Path

import openai
from sqlmodel import select

from flywheel.capture.models import Turn
from flywheel.capture.store import Store
from tests.loop_story import report_round
from tests.test_loop_versions import start, status
from tests.vllm_standin import BASE, VllmStandIn
from tests.waiting import wait_for


def test_with_fork_from_head_the_training_head_answers_the_siblings_and_the_client_the_serving_version(
        tmp_path: Path, vllm: VllmStandIn) -> None:
    """``fork_from = "head"``: a forked turn's siblings come from the newest version never shown worse (here a
    candidate waiting for held-out contexts), recorded as its turns; the client's answer stays the serving one's."""
    gateway = start(tmp_path, vllm, """
[groups]
fork_fraction = 1.0
fork_k = 2
fork_from = "head"
[loop]
tick_s = 0.2
min_groups = 1000  # the test trains the round itself
[loop.gate]
min_contexts = 1000  # the candidate waits: it stays the head, and version 0 serves
""")
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
    before = client.chat.completions.create(model="agent", messages=[{"role": "user", "content": "ticket #1"}])
    assert report_round(gateway, {}) == 1  # a trained version: the line's head
    wait_for(lambda: ("load", "agent@1") in vllm.events, what="the head loaded for the forks")
    wait_for(lambda: (status(gateway)["forks_from"] or {}).get("version") == 1,
             what="the status to say the head answers the forks")  # the load answered, then the router switched
    after = [client.chat.completions.create(model="agent", messages=[{"role": "user", "content": f"ticket #{n}"}])
             for n in range(2, 5)]
    assert all(len(reply.choices) == 1 and f"served by {BASE}" in (reply.choices[0].message.content or "")
               for reply in [before, *after])  # the client sees the serving version alone
    chunks = list(client.chat.completions.create(model="agent", stream=True,
                                                 messages=[{"role": "user", "content": "ticket #5"}]))
    assert {choice.index for chunk in chunks for choice in chunk.choices} == {0}
    assert f"served by {BASE}" in "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    streamed = chunks[0].id
    wait_for(lambda: vllm.events.count(("answer", "agent@1")) >= 1 + 4, what="the head's answers")  # its ping too
    assert status(gateway)["serving"]["version"] == 0
    gateway.stop()
    store = Store(gateway.dir / "data" / "flywheel.duckdb")
    try:
        with store.session() as session:
            turns = list(session.exec(select(Turn)))
    finally:
        store.close()
    by_completion: dict[str, list[Turn]] = {}
    for turn in turns:
        by_completion.setdefault(turn.completion_id, []).append(turn)
    recorded = {completion: sorted((t.choice_index, t.source, t.adapter_version, t.engine_model) for t in rows)
                for completion, rows in by_completion.items()}
    assert recorded[before.id] == [(0, "client", 0, BASE), (1, "fork", 0, BASE), (2, "fork", 0, BASE)]
    for completion in [*(reply.id for reply in after), streamed]:
        assert recorded[completion] == [(0, "client", 0, BASE), (1, "fork", 1, "agent@1"), (2, "fork", 1, "agent@1")]
        assert all(f"served by {t.engine_model}" in (t.response_message or {}).get("content", "")
                   for t in by_completion[completion])
