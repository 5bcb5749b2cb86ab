"""Versions, hot swaps, the canary, the monitor and rollback — against a vLLM stand-in on loopback.

The gateway's upstream engine talks to ``tests/vllm_standin.py`` (vLLM's runtime-LoRA protocol:
list, load, unload, chat), which answers ``served by <model> #<n>``, so every test can see which
version served what. Rewards come from the test's client through the feedback endpoint, as an
application's would; the loop runs by itself (short ticks) and is observed through the admin API
and the ``flywheel`` CLI.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from sqlmodel import select
from typer.testing import CliRunner

from flywheel.capture.models import JobRun
from flywheel.capture.store import Store
from flywheel.gateway.cli import app as cli
from tests.gateway_process import GatewayProcess
from tests.scripted_judge import ScriptedJudge
from tests.scripted_openai import Reply
from tests.vllm_standin import BASE, VllmStandIn
from tests.waiting import wait_for

ADMIN = {"authorization": "Bearer admin"}


def fake_adapter(root: Path, name: str) -> str:
    """A directory the gateway accepts as a PEFT adapter (the stand-in never reads it)."""
    path = root / name
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    return str(path)


def start(tmp_path: Path, vllm: VllmStandIn, tail: str = "[loop]\nenabled = false\n",
          name: str = "gw", engine: str = "") -> GatewayProcess:
    """A gateway in front of the vLLM stand-in, admin key "admin"; ``tail``: the sections after (the loop's, by
    default); ``engine``: more lines for ``[engines.vllm]``."""
    return GatewayProcess(tmp_path, f"""
adapter_dirs = ["{tmp_path}"]  # fake_adapter writes there
[engines.vllm]
base_url = "{vllm.base_url}"
{engine}
[aliases.agent]
engine = "vllm"
base_model = "{BASE}"
[auth]
admin_key = "admin"
{tail}""", name=name).start()


def admin(gateway: GatewayProcess, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
    response = httpx.request(method, f"{gateway.url}/flywheel/v1{path}", headers=ADMIN, timeout=60, **kwargs)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def served_by(client: openai.OpenAI, messages: list[dict[str, Any]] | None = None) -> tuple[str, str, str]:
    """(model that answered, completion id, answer text) of one chat turn."""
    reply = client.chat.completions.create(model="anything", messages=messages or [{"role": "user", "content": "hi"}])
    text = reply.choices[0].message.content or ""
    return text.split()[2], reply.id, text


def status(gateway: GatewayProcess) -> dict[str, Any]:
    entry: dict[str, Any] = admin(gateway, "GET", "/status")["aliases"][0]
    return entry


def test_every_switch_gets_its_own_version_and_the_manual_one_survives_a_restart(tmp_path: Path,
                                                                                   vllm: VllmStandIn) -> None:
    gateway = start(tmp_path, vllm)
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
    manual, trained = fake_adapter(tmp_path, "manual"), fake_adapter(tmp_path, "trained")
    # The reproduction: a manual switch, then an adapter trained elsewhere promoted through the gate's path.
    switched = admin(gateway, "PUT", "/aliases/agent/adapter", json={"path": manual})
    assert (switched["version"], switched["adapter"]) == (1, "agent@1")
    assert served_by(client)[0] == "agent@1"
    candidate = admin(gateway, "POST", "/aliases/agent/candidates", json={"path": trained})
    assert candidate["version"] == 2 and candidate["status"] == "candidate"
    promoted = admin(gateway, "POST", "/aliases/agent/promote", json={"version": 2})
    assert (promoted["version"], promoted["adapter_path"]) == (2, trained)
    assert vllm.loras.get("agent@2") == trained and "agent@1" not in vllm.loras  # loaded, then the old unloaded
    assert served_by(client)[0] == "agent@2"
    assert vllm.events.index(("load", "agent@2")) < vllm.events.index(("unload", "agent@1"))
    # Back to the manual version by hand, and it survives a restart: the store says what serves.
    runner = CliRunner()
    rolled = runner.invoke(cli, ["rollback", "--config", str(gateway.config_file), "--gateway", gateway.url])
    assert rolled.exit_code == 0, rolled.output
    assert "now serves version 1" in rolled.output
    gateway.stop()
    gateway = start(tmp_path, vllm)
    assert served_by(openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0))[0] == "agent@1"
    rows = {row["version"]: row for row in admin(gateway, "GET", "/aliases/agent/versions")["data"]}
    assert (rows[1]["status"], rows[1]["source"], rows[2]["status"]) == ("promoted", "manual", "rolled_back")
    shown = runner.invoke(cli, ["versions", "--config", str(gateway.config_file), "--gateway", gateway.url])
    assert shown.exit_code == 0 and "rolled_back" in shown.output, shown.output
    promoted_again = runner.invoke(cli, ["promote", "2", "--config", str(gateway.config_file),
                                         "--gateway", gateway.url])
    assert promoted_again.exit_code == 0 and "now serves version 2" in promoted_again.output
    assert served_by(openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0))[0] == "agent@2"
    gateway.stop()


def test_the_status_shows_every_quiet_tick_and_the_store_keeps_a_quiet_streak_s_first_run(tmp_path: Path,
                                                                                           vllm: VllmStandIn) -> None:
    gateway = start(tmp_path, vllm, "[loop]\ntick_s = 0.2\nmin_groups = 1000\n")
    first = wait_for(lambda: (run := status(gateway)["jobs"].get("gate") or {}).get("finished_at") and run,
                     what="a finished gate run")  # one read: the next tick may be running by a second one
    assert (first["status"], first["detail"]) == ("idle", "no candidate")
    later = wait_for(lambda: (run := status(gateway)["jobs"]["gate"])["started_at"] > first["started_at"] and run,
                     what="a later gate run in the status")
    assert later["id"] != first["id"]
    gateway.stop()
    store = Store(gateway.dir / "data" / "flywheel.duckdb")
    try:
        with store.session() as session:
            stored = list(session.exec(select(JobRun).where(JobRun.job == "gate")))
    finally:
        store.close()
    (kept,) = stored  # the streak's first run only, not those the status showed after it
    shown = [datetime.fromisoformat(run["started_at"]) for run in (first, later)]
    assert kept.status == "idle" and kept.started_at.replace(tzinfo=UTC) <= shown[0] < shown[1]


def test_every_vllm_replica_loads_each_version_and_a_replica_that_lost_it_gets_it_again(tmp_path: Path,
                                                                                         vllm: VllmStandIn) -> None:
    with VllmStandIn() as second:  # two vLLM servers; traffic goes to the first (a load balancer's stand-in)
        gateway = start(tmp_path, vllm, engine=f'replica_urls = ["{vllm.base_url}", "{second.base_url}"]')
        try:
            one, two = fake_adapter(tmp_path, "one"), fake_adapter(tmp_path, "two")
            assert admin(gateway, "PUT", "/aliases/agent/adapter", json={"path": one})["adapter"] == "agent@1"
            assert vllm.loras == {"agent@1": one} and second.loras == {"agent@1": one}
            second.loras.clear()  # the second server restarted: it lost its runtime adapters
            switched = httpx.put(f"{gateway.url}/flywheel/v1/aliases/agent/adapter", headers=ADMIN, timeout=60,
                                        json={"path": two})
            assert switched.status_code == 200, switched.text
            assert vllm.loras == {"agent@2": two} and second.loras == {"agent@2": two}  # loaded on both, old gone
            second.refuse_listing.add("agent@3")  # one replica never lists it: the alias does not switch
            three = httpx.put(f"{gateway.url}/flywheel/v1/aliases/agent/adapter", headers=ADMIN, timeout=60,
                              json={"path": fake_adapter(tmp_path, "three")})
            assert three.status_code == 502 and "did not list agent@3" in three.text, three.text
            assert status(gateway)["serving"]["version"] == 2
        finally:
            gateway.stop()


def test_a_version_the_engine_does_not_list_is_never_switched_to(tmp_path: Path, vllm: VllmStandIn) -> None:
    gateway = start(tmp_path, vllm)
    first = admin(gateway, "PUT", "/aliases/agent/adapter", json={"path": fake_adapter(tmp_path, "one")})
    vllm.refuse_listing.add("agent@2")  # loads "fine" but never shows up: a reload that silently did nothing
    refused = httpx.put(f"{gateway.url}/flywheel/v1/aliases/agent/adapter", headers=ADMIN, timeout=60,
                        json={"path": fake_adapter(tmp_path, "two")})
    assert refused.status_code == 502 and "did not list agent@2" in refused.json()["error"]["message"]
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
    assert served_by(client)[0] == first["adapter"]
    rows = {row["version"]: row for row in admin(gateway, "GET", "/aliases/agent/versions")["data"]}
    assert rows[1]["status"] == "promoted" and rows[2]["status"] == "rejected"
    gateway.stop()


# Feedback is answered once its batch commits: a test posting it every conversation waits for one each time.
QUICK_FEEDBACK = "[capture]\nbatch_wait_s = 0.05\n"
CANARY = """
[loop]
tick_s = 0.3
[loop.gate]
offline = false
[loop.canary]
fraction = 0.3
alpha = 0.05
pair_wait_s = 0.5  # every conversation here is a new task: its reward is paired in arrival order after 0.5 s
[loop.monitor]
alpha = 0.05
""" + QUICK_FEEDBACK


def converse(client: openai.OpenAI, gateway: GatewayProcess, turns: int, reward_of: Callable[[str], float]
             ) -> list[str]:
    """One conversation of ``turns`` turns (each repeats the history); feedback on its last answer."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"task {random.random()}"}]
    models, last_id = [], ""
    for turn in range(turns):
        model, last_id, text = served_by(client, messages)
        models.append(model)
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f"and then {turn}?"}]
    feedback = httpx.post(f"{gateway.url}/flywheel/v1/feedback", timeout=30,
                          json={"completion_id": last_id, "reward": reward_of(models[-1])})
    assert feedback.status_code == 200, feedback.text
    return models


def on_canary(tmp_path: Path, vllm: VllmStandIn, config: str, adapter: str) -> tuple[GatewayProcess, openai.OpenAI]:
    """A gateway on ``config`` whose first candidate, the fake adapter ``adapter``, is on canary; a client of it."""
    gateway = start(tmp_path, vllm, config)
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
    admin(gateway, "POST", "/aliases/agent/candidates", json={"path": fake_adapter(tmp_path, adapter)})
    wait_for(lambda: (status(gateway)["canary"] or {}).get("version") == 1, what="version 1's canary")
    return gateway, client


def test_canary_is_sticky_near_its_fraction_and_promotes_a_better_candidate(tmp_path: Path,
                                                                            vllm: VllmStandIn) -> None:
    gateway, client = on_canary(tmp_path, vllm, CANARY, "cand")
    random.seed(3)
    on_candidate = []
    # the candidate earns 1, the base model 0.4: the test must see "better". The split is random, so the pairs
    # it needs take a varying number of conversations (60 fell short once in CI): at most 200
    for _ in range(200):
        models = converse(client, gateway, 3, lambda m: 1.0 if m == "agent@1" else 0.4)
        decided = status(gateway)["canary"] is None  # a promotion moves every conversation's next turn
        if not decided:
            assert len(set(models)) == 1, models  # during the canary a conversation never changes version
        on_candidate.append(models[0] == "agent@1")
        if decided:
            break
    share = sum(on_candidate) / len(on_candidate)
    assert 0.05 < share < 0.6, share  # 0.3 of conversations, with the noise of a few dozen
    served = wait_for(lambda: status(gateway)["serving"]["version"] == 1 and status(gateway), what="promotion")
    version = admin(gateway, "GET", "/aliases/agent/versions")["data"][0]
    online = version["gate"]["online"]
    assert version["status"] == "promoted" and online["decision"] == "better" and online["p_better"] <= 0.05
    assert version["reason"].startswith("canary: better than version 0") and "ab" in served["jobs"]
    gateway.stop()


def test_worse_candidate_is_rejected_and_a_drop_after_promotion_rolls_back(tmp_path: Path,
                                                                           vllm: VllmStandIn) -> None:
    # 1. A worse candidate: rejected, the base model keeps serving, the candidate is unloaded.
    gateway, client = on_canary(tmp_path, vllm, CANARY, "worse")
    for _ in range(80):
        converse(client, gateway, 1, lambda m: 0.0 if m == "agent@1" else 0.8)
        if status(gateway)["canary"] is None:
            break
    rows = wait_for(lambda: [r for r in admin(gateway, "GET", "/aliases/agent/versions")["data"]
                             if r["status"] == "rejected"], what="the rejection")
    assert rows[0]["version"] == 1 and rows[0]["gate"]["online"]["decision"] == "worse"
    assert status(gateway)["serving"]["version"] == 0 and "agent@1" not in vllm.loras
    # 2. A better one is promoted by the canary ...
    admin(gateway, "POST", "/aliases/agent/candidates", json={"path": fake_adapter(tmp_path, "better")})
    wait_for(lambda: status(gateway)["canary"], what="the second canary")
    for _ in range(80):
        converse(client, gateway, 1, lambda m: 1.0 if m == "agent@2" else 0.3)
        if status(gateway)["serving"]["version"] == 2:
            break
    wait_for(lambda: status(gateway)["serving"]["version"] == 2, what="the promotion of version 2")
    # ... and when its live reward drops below what version 0 earned, the monitor rolls it back by itself.
    for _ in range(80):
        converse(client, gateway, 1, lambda m: 0.0)
        if status(gateway)["serving"]["version"] == 0:
            break
    wait_for(lambda: status(gateway)["serving"]["version"] == 0, what="the automatic rollback")
    rows = {row["version"]: row for row in admin(gateway, "GET", "/aliases/agent/versions")["data"]}
    assert rows[2]["status"] == "rolled_back" and "monitor" in rows[2]["reason"]
    assert rows[2]["gate"]["monitor"]["decision"] == "worse"
    assert "agent@2" not in vllm.loras
    gateway.stop()


HAND_OVER = CANARY.replace("alpha = 0.05\npair_wait_s", "alpha = 0.05\nmax_pairs = 1000\nhand_over_pairs = 6\n"
                                                         "pair_wait_s")


def test_an_undecided_canary_hands_over_to_the_newer_candidate_waiting(tmp_path: Path, vllm: VllmStandIn) -> None:
    gateway, client = on_canary(tmp_path, vllm, HAND_OVER, "same")
    # one candidate may wait while a canary runs, not two
    admin(gateway, "POST", "/aliases/agent/candidates", json={"path": fake_adapter(tmp_path, "newer")})
    refused = httpx.post(f"{gateway.url}/flywheel/v1/aliases/agent/candidates", headers=ADMIN, timeout=30,
                         json={"path": fake_adapter(tmp_path, "third")})
    assert refused.status_code == 409 and "version 2 in flight (candidate)" in refused.text, refused.text
    for _ in range(100):  # version 1 earns what version 0 does: no test can decide it
        converse(client, gateway, 1, lambda m: 0.5)
        if (status(gateway)["canary"] or {}).get("version") == 2:
            break
    rows = wait_for(lambda: {r["version"]: r for r in admin(gateway, "GET", "/aliases/agent/versions")["data"]
                             if r["status"] == "rejected"}, what="the hand-over")
    online = rows[1]["gate"]["online"]
    assert online["decision"] == "handed_over" and 6 <= online["pairs"] < 1000, online
    assert rows[1]["reason"].startswith("canary: handed over to version 2 undecided after"), rows[1]["reason"]
    wait_for(lambda: (status(gateway)["canary"] or {}).get("version") == 2, what="version 2's canary")
    assert status(gateway)["serving"]["version"] == 0
    gateway.stop()


MIN_GAIN = CANARY.replace("fraction = 0.3\nalpha = 0.05\n", "fraction = 0.5\nalpha = 0.05\nmin_gain = 0.2\n")


def test_a_candidate_shown_to_gain_less_than_min_gain_is_rejected_by_the_test(tmp_path: Path,
                                                                               vllm: VllmStandIn) -> None:
    gateway, client = on_canary(tmp_path, vllm, MIN_GAIN, "same")
    for _ in range(150):  # version 1 earns what version 0 does: neither better nor worse, and not better by 0.2
        converse(client, gateway, 1, lambda m: 0.5)
        if status(gateway)["canary"] is None:
            break
    rows = wait_for(lambda: [r for r in admin(gateway, "GET", "/aliases/agent/versions")["data"]
                             if r["status"] == "rejected"], what="the test's rejection")
    online = rows[0]["gate"]["online"]
    assert online["decision"] == "not_better" and online["p_not_better"] <= 0.05 and online["min_gain"] == 0.2
    assert online["p_better"] > 0.05 and online["p_worse"] > 0.05, online
    assert rows[0]["reason"].startswith("canary: not better than version 0 by min_gain 0.2"), rows[0]["reason"]
    assert status(gateway)["serving"]["version"] == 0
    gateway.stop()


SAME_TASKS = """
[loop]
tick_s = 0.3
[loop.gate]
offline = false
[loop.canary]
fraction = 0.5
pair_wait_s = inf  # same-context pairs only: a reward whose task never gets the other version never counts
""" + QUICK_FEEDBACK
TASKS = {"reset my password": 0.0, "refund order 17": 0.2, "change my address": 0.45, "cancel my plan": 0.65}


def test_a_better_candidate_is_shown_better_on_pairs_of_the_same_task(tmp_path: Path, vllm: VllmStandIn) -> None:
    """Tasks differ more (0 to 0.65) than the versions do (+0.3 on every task): arrival-order pairs would
    mostly measure which task came; pairs of the same task measure the version, and the test decides on them."""
    gateway = start(tmp_path, vllm, SAME_TASKS)
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
    admin(gateway, "POST", "/aliases/agent/candidates", json={"path": fake_adapter(tmp_path, "cand")})
    wait_for(lambda: status(gateway)["canary"], what="the gate to start the canary")
    tasks = random.Random(11)
    for n in range(200):  # bounded: it takes a few dozen pairs
        task = tasks.choice(list(TASKS))
        model, completion_id, _ = served_by(client, [{"role": "system", "content": "You are a support agent."},
                                                    {"role": "user", "content": task}])
        reward = TASKS[task] + (0.3 if model == "agent@1" else 0.0)
        feedback = httpx.post(f"{gateway.url}/flywheel/v1/feedback", timeout=30,
                              json={"completion_id": completion_id, "reward": reward})
        assert feedback.status_code == 200, feedback.text
        if n % 5 == 4 and status(gateway)["serving"]["version"] == 1:  # status every 5th: it is the slow call
            break
    wait_for(lambda: status(gateway)["serving"]["version"] == 1, what="the promotion")
    version = admin(gateway, "GET", "/aliases/agent/versions")["data"][0]
    online = version["gate"]["online"]
    assert version["status"] == "promoted" and online["decision"] == "better" and online["p_better"] <= 0.05, online
    assert online["pairs"] == online["same_context_pairs"] > 0 and online["arrival_pairs"] == 0, online
    assert online["mean_difference"] == pytest.approx(0.3), online  # every pair: one task, both versions
    assert version["reason"].startswith("canary: better than version 0"), version["reason"]
    gateway.stop()


def ticket_reward(block: str) -> float:
    """The judge's score of an answer (``served by <model> on ticket <n>``): the ticket decides most of it (0 to
    0.6), the version 0.3 more. The judge sees the request once, as shared context: the answer names it."""
    answer = next(m.get("content") or "" for m in reversed(json.loads(block)) if m["role"] == "assistant")
    return int(answer.split("ticket ")[1].split()[0]) % 4 * 0.2 + (0.3 if "agent@1" in answer else 0.0)


def on_ticket(body: dict[str, Any]) -> Reply:
    """The stand-in's answer names its model and the ticket it answers."""
    ticket = body["messages"][-1]["content"].split("#")[1].split(":")[0]
    return Reply(content=f"served by {body['model']} on ticket {ticket}")


@pytest.fixture
def ticket_judge() -> Iterator[ScriptedJudge]:
    with ScriptedJudge(scorer=ticket_reward) as server:
        yield server


def test_unique_forked_traffic_pairs_each_fork_with_the_other_version(tmp_path: Path, vllm: VllmStandIn,
                                                                      ticket_judge: ScriptedJudge) -> None:
    """Every request is a new ticket, no feedback, 10% canary: one fork of each turn is answered by the other
    version and judged with the client's answer, so every turn gives a pair of one context."""
    gateway = start(tmp_path, vllm, ticket_judge.config_toml + """
[groups]
form_every_s = 0.5
fork_fraction = 1.0
fork_k = 1
holdout_fraction = 0
[loop]
tick_s = 0.3
score_every_s = 0.5
[loop.gate]
offline = false
[loop.canary]
fraction = 0.1
pair_wait_s = inf
""")
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
    admin(gateway, "POST", "/aliases/agent/candidates", json={"path": fake_adapter(tmp_path, "cand")})
    wait_for(lambda: status(gateway)["canary"], what="the gate to start the canary")
    vllm.reply = on_ticket
    seen = []
    for ticket in range(200):  # bounded: it takes a few dozen turns
        reply = client.chat.completions.create(model="agent", messages=[
            {"role": "user", "content": f"Ticket #{ticket}: my order has not arrived."}])
        assert len(reply.choices) == 1  # the forks stay the gateway's
        seen.append(reply.choices[0].message.content or "")
        if ticket % 5 == 4 and status(gateway)["serving"]["version"] == 1:
            break
    wait_for(lambda: status(gateway)["serving"]["version"] == 1, what="the promotion", timeout_s=30)
    version = admin(gateway, "GET", "/aliases/agent/versions")["data"][0]
    online = version["gate"]["online"]
    assert version["status"] == "promoted" and online["decision"] == "better", online
    assert online["pairs"] == online["same_context_pairs"] > 0, online
    assert online["mean_difference"] == pytest.approx(0.3), online  # each pair: one ticket, both versions
    assert sum("agent@1" in text for text in seen) < len(seen) / 2  # the client mostly saw the serving version
    answered = [model for event, model in vllm.events if event == "answer"]
    assert answered.count("agent@1") >= online["pairs"]  # the candidate answered a fork of most turns
    gateway.stop()
