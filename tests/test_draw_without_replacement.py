"""The local engine's ``draw_without_replacement`` (n distinct choices, an exact stochastic beam search draw)
and the gateway's ``[groups] fork_draw``, which asks it for a forked turn's siblings."""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from sqlmodel import select
from transformers import AutoModelForCausalLM

from flywheel.capture.models import Turn
from flywheel.capture.store import Store
from flywheel.gateway.core.config import LocalEngineConfig
from flywheel.gateway.core.errors import BadRequest
from flywheel.gateway.serving.engines.local import LocalEngine
from flywheel.gateway.serving.engines.local.beams import log_inclusion
from tests.gateway_process import GatewayProcess
from tests.support import tiny_dir

COLD = 0.1  # the tiny model is close to uniform at T = 1: colder, a few sequences carry most of the mass
HI = [{"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.getbasetemp() / "flywheel-models"
    tiny_dir(root)
    return root


@pytest.fixture(scope="module")
def engine(root: Path) -> Iterator[LocalEngine]:
    engine = LocalEngine(LocalEngineConfig(model="tiny", max_batch_n=8), root)
    asyncio.run(engine.start())
    yield engine
    asyncio.run(engine.aclose())


def ids_of(response: dict[str, Any]) -> list[tuple[int, ...]]:
    return [tuple(c["token_ids"]) for c in response["choices"]]


async def test_choices_are_distinct_where_independent_ones_repeat(engine: LocalEngine, root: Path) -> None:
    cold = 0.03
    body = {"model": "tiny", "messages": HI, "max_tokens": 3, "n": 4, "temperature": cold,
            "return_token_ids": True, "logprobs": True}
    independent = [ids_of(await engine.chat({**body, "seed": s})) for s in range(8)]
    drawn = [await engine.chat({**body, "seed": s, "draw_without_replacement": True}) for s in range(8)]
    assert sum(len(set(ids)) < 4 for ids in independent) >= 6  # the control: this cold, independent ones repeat
    assert all(len(set(ids_of(r))) == 4 for r in drawn)
    # Each drawn choice says how likely it was to be among the drawn (log q <= 0); independent ones say nothing.
    assert all(c["inclusion_logprob"] <= 0 for r in drawn for c in r["choices"])
    assert "inclusion_logprob" not in (await engine.chat({**body, "seed": 0}))["choices"][0]
    # Each choice reports its tokens' log_softmax(logits / T), as an independent forward pass computes them.
    model = AutoModelForCausalLM.from_pretrained(root / "models" / "tiny").eval()
    response = drawn[0]
    prompt = response["prompt_token_ids"]
    for choice in response["choices"]:
        ids = choice["token_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1]
        expected = torch.log_softmax(logits / cold, dim=-1).gather(1, torch.tensor(ids)[:, None]).squeeze(1)
        reported = torch.tensor([e["logprob"] for e in choice["logprobs"]["content"]])
        assert torch.allclose(expected, reported, atol=1e-4)
        assert choice["finish_reason"] == "length"
    # Same seed, same draw; streamed, the same choices
    assert ids_of(await engine.chat({**body, "seed": 0, "draw_without_replacement": True})) == ids_of(response)
    chunks = [c async for c in engine.chat_stream({**body, "seed": 0, "draw_without_replacement": True,
                                                   "stream": True})]
    streamed = {i: [t for c in chunks if c["choices"] and c["choices"][0]["index"] == i
                    for t in c["choices"][0].get("token_ids", [])] for i in range(4)}
    assert [tuple(streamed[i]) for i in range(4)] == ids_of(response)


async def test_pairs_follow_the_without_replacement_law_over_whole_sequences(engine: LocalEngine,
                                                                             root: Path) -> None:
    """Two-token sequences, two choices: P(first = a, second = b) = p(a) p(b) / (1 - p(a)), p over sequences.

    The first step alone is the Gumbel-top-k trick; the second tests the conditioned perturbations."""
    model = AutoModelForCausalLM.from_pretrained(root / "models" / "tiny").eval()
    prompt = (await engine.completion({"model": "tiny", "prompt": "Hello", "max_tokens": 1,
                                       "return_token_ids": True}))["choices"][0]["prompt_token_ids"]
    with torch.no_grad():
        first = torch.softmax(model(torch.tensor([prompt])).logits[0, -1] / COLD, dim=-1)
        heads = first.topk(3).indices.tolist()
        seq_p: dict[tuple[int, int], float] = {}
        for a in heads:
            second = torch.softmax(model(torch.tensor([[*prompt, a]])).logits[0, -1] / COLD, dim=-1)
            for b in second.topk(3).indices.tolist():
                seq_p[(a, b)] = first[a].item() * second[b].item()
    top = sorted(seq_p, key=seq_p.__getitem__, reverse=True)[:4]
    expected = {(s, t): seq_p[s] * seq_p[t] / (1 - seq_p[s]) for s, t in itertools.permutations(top, 2)}
    draws = 500
    seen: Counter[tuple[tuple[int, ...], tuple[int, ...]] | str] = Counter()
    for seed in range(draws):
        response = await engine.completion({"model": "tiny", "prompt": prompt, "max_tokens": 2, "n": 2,
                                            "temperature": COLD, "seed": seed, "return_token_ids": True,
                                            "draw_without_replacement": True})
        a, b = ids_of(response)
        seen[(a, b) if (a, b) in expected else "other"] += 1
    assert sum(expected.values()) > 0.5  # the cells below carry most of the mass
    cells = [*expected, "other"]
    law = {**expected, "other": 1 - sum(expected.values())}
    total_variation = sum(abs(seen[c] / draws - law[c]) for c in cells) / 2
    assert total_variation < 0.08, (total_variation, {c: (seen[c], round(law[c] * draws)) for c in cells})


async def test_a_cold_draw_is_refused_naming_the_field(engine: LocalEngine) -> None:
    with pytest.raises(BadRequest) as err:
        await engine.chat({"model": "tiny", "messages": HI, "n": 2, "temperature": 0,
                           "draw_without_replacement": True})
    assert err.value.param == "draw_without_replacement"


def test_inclusion_probability_is_one_minus_exp_of_minus_exp() -> None:
    assert log_inclusion(-1.0, float("-inf")) == 0.0  # nothing left out: every sequence was drawn
    assert log_inclusion(-1.0, -3.0) == pytest.approx(torch.log1p(-torch.exp(-torch.exp(torch.tensor(2.0)))).item())
    assert log_inclusion(-30.0, -3.0) == pytest.approx(-27.0)  # q -> p / exp(kappa) for rare sequences


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
