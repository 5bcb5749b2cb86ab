"""The gateway's ``[groups] fork_draw``: a forked turn's siblings drawn without replacement by the local engine
(whose ``draw_without_replacement`` tests/test_local_engine.py checks)."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import httpx
import openai
from sqlmodel import select

from flywheel.capture.models import Score, Turn
from flywheel.capture.store import Store
from flywheel.gateway.core.config import load_settings
from flywheel.gateway.storeproc.store_ops import canary_rewards
from tests.gateway_process import GatewayProcess


def test_a_forked_turns_siblings_are_distinct_and_the_client_streams_as_before(tmp_path: Path,
                                                                              tiny_model: Path) -> None:
    """``fork_draw = "without_replacement"``: the siblings come in a side request drawn by stochastic beam
    search, so they differ even where independent samples would repeat; the client's answer is its own."""
    gateway = GatewayProcess(tmp_path, f"""
[engines.local]
model = "{tiny_model}"
[aliases.agent]
engine = "local"
[groups]
fork_fraction = 1.0
fork_k = 3
fork_draw = "without_replacement"
""").start()
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
    cold = {"model": "agent", "max_tokens": 3, "temperature": 0.03}
    replies = [client.chat.completions.create(messages=[{"role": "user", "content": f"ticket {n}"}], **cold)
               for n in range(3)]
    chunks = list(client.chat.completions.create(messages=[{"role": "user", "content": "ticket 3"}], stream=True,
                                                 **cold))
    assert all(len(reply.choices) == 1 for reply in replies)
    assert {choice.index for chunk in chunks for choice in chunk.choices} == {0}
    completions = [*(reply.id for reply in replies), chunks[0].id]
    gateway.stop()
    store = Store(gateway.dir / "data" / "flywheel.duckdb")
    try:
        with store.session() as session:
            turns = [t for t in session.exec(select(Turn)) if t.completion_id in completions]
    finally:
        store.close()
    for completion in completions:
        siblings = [tuple(t.completion_token_ids or ()) for t in turns
                    if t.completion_id == completion and t.source == "fork"]
        assert len(siblings) == 3 and len(set(siblings)) == 3, (completion, siblings)
        client = [t for t in turns if t.completion_id == completion and t.source == "client"]
        assert [t.choice_index for t in client] == [0] and client[0].inclusion_logprob is None
        # each sibling keeps log q for the trainer's weights (trainer/samples.py: centred_rewards)
        assert all(t.inclusion_logprob is not None and t.inclusion_logprob <= 0 for t in turns
                   if t.completion_id == completion and t.source == "fork")


def test_the_canary_measures_a_version_by_its_samples_not_by_its_drawn_siblings(tmp_path: Path,
                                                                               tiny_model: Path) -> None:
    """A drawn sibling is kept apart from the answers drawn before it, so it is no sample of its version: the
    canary's fork pairs leave it out. Four forked turns scored by a reward hook give four canary rewards, the
    clients' answers, and not sixteen."""
    gateway = GatewayProcess(tmp_path, f"""
[engines.local]
model = "{tiny_model}"
[aliases.agent]
engine = "local"
[auth]
admin_key = "admin"
[judge]
reward_hook = "tests.variety_task:reward"
[groups]
form_every_s = 3600
fork_fraction = 1.0
fork_k = 3
fork_draw = "without_replacement"
[loop.gate]
holdout_fraction = 0.0
""").start()
    since = datetime.now(UTC)
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
    for n in range(4):
        client.chat.completions.create(model="agent", max_tokens=3, temperature=1.0,
                                       messages=[{"role": "user", "content": f"ticket {n}"}])
    admin = {"authorization": "Bearer admin"}
    formed = httpx.post(f"{gateway.url}/flywheel/v1/jobs/groups", headers=admin, timeout=60).json()["formed"]
    assert [g["source"] for g in formed] == ["fork"] * 4
    scored = httpx.post(f"{gateway.url}/flywheel/v1/jobs/score", headers=admin, timeout=60).json()
    assert scored["failed"] == 0 and scored["scored"] == 4, scored
    gateway.stop()
    store = Store(gateway.dir / "data" / "flywheel.duckdb")
    try:
        with store.session() as session:
            hook_scores = list(session.exec(select(Score).where(Score.source == "hook")))
        rewards = canary_rewards(store, load_settings([gateway.config_file]), "agent", since, [0])
    finally:
        store.close()
    assert len(hook_scores) == 16  # every member was scored and trains
    assert len(rewards) == 4 and {r.order for r in rewards} == {"0000"}, rewards  # each turn's client answer
