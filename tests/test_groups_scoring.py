"""Groups, feedback and the scoring job through a real gateway, a scripted upstream and a scripted judge."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from sqlmodel import select
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from flywheel.capture.groups import training_group
from flywheel.capture.models import Group, Score
from flywheel.capture.store import Store
from flywheel.gateway.core.config import load_settings
from flywheel.gateway.core.processes import free_port
from flywheel.gateway.serving.fork_yield import FLOOR, MIN_SEEN
from flywheel.judge.scoring import groups_for_judge, judge_cache_key
from tests.gateway_process import GatewayProcess
from tests.scripted_judge import ScriptedJudge
from tests.scripted_openai import LoopbackServer, Reply, ScriptedOpenAI

ADMIN = {"authorization": "Bearer admin"}


def answer(body: dict[str, Any]) -> Reply:
    """Questions about 'good' things get a good answer, others a bad one (the judge counts 'good')."""
    text = body["messages"][-1]["content"]
    return Reply(content="good good answer" if "good" in text else "bad answer")


@pytest.fixture
def servers() -> Iterator[tuple[ScriptedOpenAI, ScriptedJudge]]:
    with ScriptedOpenAI(reply=answer) as upstream, ScriptedJudge(target=("good", "sample")) as judge:
        yield upstream, judge


def start(tmp: Path, upstream: ScriptedOpenAI, judge: ScriptedJudge, extra: str = "",
          judge_line: str = "", groups_lines: str = "") -> GatewayProcess:
    return GatewayProcess(tmp, f"""
[engines.up]
base_url = "{upstream.base_url}"
[aliases.agent]
engine = "up"
base_model = "scripted"
[auth]
admin_key = "admin"
{judge.config_toml}{judge_line}[groups]
form_every_s = 3600
{groups_lines}[loop.gate]
holdout_fraction = 0.0  # every conversation must form its group
{extra}
""").start()


def read_store(gateway: GatewayProcess) -> Store:
    gateway.stop()
    return Store(gateway.dir / "data" / "flywheel.duckdb")


def test_forked_turn_becomes_a_scored_single_turn_group(tmp_path: Path,
                                                        servers: tuple[ScriptedOpenAI, ScriptedJudge]) -> None:
    upstream, judge = servers
    gateway = start(tmp_path, upstream, judge)
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
    reply = client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "say something"}],
                                           extra_headers={"X-Flywheel-Fork": "2"})
    assert [c.index for c in reply.choices] == [0]  # the client's reply is what it asked for
    assert reply.choices[0].message.content == "bad answer"
    assert reply.usage is not None and reply.usage.completion_tokens == 3  # its own tokens, not the siblings'
    assert upstream.requests[-1]["n"] == 3
    formed = httpx.post(f"{gateway.url}/flywheel/v1/jobs/groups", headers=ADMIN).json()["formed"]
    assert [(g["source"], g["size"]) for g in formed] == [("fork", 3)]
    summary = httpx.post(f"{gateway.url}/flywheel/v1/jobs/score", headers=ADMIN, timeout=60).json()
    assert (summary["scored"], summary["failed"]) == (1, 0)
    assert len(judge.requests) == 1
    store = read_store(gateway)
    with store.session() as session:
        group = session.exec(select(Group)).one()
        assert group.status == "scored"
        batch = training_group(session, group)
    assert [len(m.turns) for m in batch.members] == [1, 1, 1]
    assert sorted(m.reward for m in batch.members) == [0.0, 0.5, 0.5]  # the judge counts "good" and "sample"
    assert {m.turns[0].response_message["content"] for m in batch.members} == {
        "bad answer", "bad answer (sample 1)", "bad answer (sample 2)"}
    # The key the scoring job reads the judge cache by (once per run, for every group) is the one it stored.
    with store.session() as session:
        stored_keys = set(session.exec(select(Score.cache_key).where(Score.source == "ruler")))
    config = load_settings([gateway.config_file]).judge
    assert stored_keys == {judge_cache_key(group, groups_for_judge(store.engine, [group])[group.id], config)}


def test_fork_turns_first_forks_a_conversations_first_turn_only(
        tmp_path: Path, servers: tuple[ScriptedOpenAI, ScriptedJudge]) -> None:
    upstream, judge = servers
    gateway = start(tmp_path, upstream, judge, groups_lines='fork_fraction = 1.0\nfork_k = 2\nfork_turns = "first"\n')
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
    first = [{"role": "user", "content": "say something"}]
    reply = client.chat.completions.create(model="gpt-4o", messages=first)
    assert upstream.requests[-1].get("n") == 3  # the first turn: the client's answer and two siblings
    later = [*first, {"role": "assistant", "content": reply.choices[0].message.content},
             {"role": "user", "content": "and then?"}]
    client.chat.completions.create(model="gpt-4o", messages=later)
    assert upstream.requests[-1].get("n", 1) == 1  # a later turn of the conversation: not forked
    client.chat.completions.create(model="gpt-4o", messages=later, extra_headers={"X-Flywheel-Fork": "2"})
    assert upstream.requests[-1].get("n") == 3  # the header forks any turn
    gateway.stop()


def done_later(body: dict[str, Any]) -> Reply:
    """A conversation's later turn ("then?") is answered "done"; a first one as :func:`answer` does."""
    return Reply(content="done") if body["messages"][-1]["content"] == "then?" else answer(body)


def later_turns_tie(block: str) -> float:
    """The judge's reward: every "done" ties at 0; a first turn's sibling beats the client's answer."""
    return float("sample" in block and "done" not in block)


def test_fork_turns_untied_forks_a_turn_position_whose_groups_tie_at_the_floor(tmp_path: Path) -> None:
    with ScriptedOpenAI(reply=done_later) as upstream, ScriptedJudge(scorer=later_turns_tie) as judge:
        gateway = start(tmp_path, upstream, judge, extra="[loop]\nenabled = false\n",
                        groups_lines='fork_fraction = 1.0\nfork_k = 2\nfork_turns = "untied"\n')
        client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)

        def ask(n: int, later: bool) -> bool:
            """Ask a first or a later turn; whether the gateway forked it."""
            messages = [{"role": "user", "content": f"question {n}"}]
            if later:
                messages += [{"role": "assistant", "content": "an answer"}, {"role": "user", "content": "then?"}]
            client.chat.completions.create(model="agent", messages=messages)
            return bool(upstream.requests[-1].get("n", 1) == 3)

        assert all(ask(n, later) for n in range(MIN_SEEN) for later in (False, True))  # nothing seen yet: all
        admin = {"headers": ADMIN, "timeout": 60}
        httpx.post(f"{gateway.url}/flywheel/v1/loop/run", json={"job": "form_groups"}, **admin).raise_for_status()
        scored = httpx.post(f"{gateway.url}/flywheel/v1/loop/run", json={"job": "score", "alias": "agent"}, **admin)
        assert scored.json()["counts"]["scored"] == 2 * MIN_SEEN
        first = [ask(n, later=False) for n in range(MIN_SEEN, MIN_SEEN + 20)]
        later = [ask(n, later=True) for n in range(MIN_SEEN, MIN_SEEN + 60)]
        shown = httpx.get(f"{gateway.url}/flywheel/v1/status", **admin).json()["aliases"][0]["fork_shares"]
        gateway.stop()
    assert shown == {"0": 1.0, "1": FLOOR}  # the status says how often each turn position is forked
    assert all(first)  # every first-turn group taught something: still forked every time
    assert 0 < sum(later) <= 20  # FLOOR (10%) of 60: a tied position is still looked at, now and then


class RewardEndpoint:
    """A task's reward hook over HTTP on loopback: ``{"messages", "tools", "answer"}`` in, ``{"reward"}`` out."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.port = free_port()

    async def _reward(self, request: Request) -> JSONResponse:
        from tests.variety_task import reward

        body = await request.json()
        self.bodies.append(body)
        return JSONResponse({"reward": reward(body["messages"], body["tools"], body["answer"])})

    def __enter__(self) -> RewardEndpoint:
        self._server = LoopbackServer(Starlette(routes=[Route("/reward", self._reward, methods=["POST"])]), self.port)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.stop()


@pytest.mark.parametrize("hook", ["python", "http"])
def test_a_reward_hook_scores_a_forked_turn_and_feedback_stays_with_the_conversation(
        tmp_path: Path, servers: tuple[ScriptedOpenAI, ScriptedJudge], hook: str) -> None:
    from tests.variety_task import variety

    upstream, judge = servers
    with RewardEndpoint() as endpoint:
        target = "tests.variety_task:reward" if hook == "python" else f"http://127.0.0.1:{endpoint.port}/reward"
        gateway = start(tmp_path, upstream, judge, judge_line=f'reward_hook = "{target}"\n')
        store, rewards, hook_rows, client_trajectory = fork_scored_by_the_hook(gateway)
    store.close()
    assert judge.requests == []  # the hook took the judge's place
    assert rewards == pytest.approx({text: variety(text) for text in ("bad answer", "bad answer (sample 1)",
                                                                        "bad answer (sample 2)")}, rel=1e-6)
    # The client's 1.0 rewards its conversation, not the forked turn the siblings are compared with.
    assert rewards["bad answer"] == pytest.approx(variety("bad answer"), rel=1e-6)
    assert len(hook_rows) == 3 and client_trajectory in {row.trajectory_id for row in hook_rows}
    if hook == "http":  # each call: the turn's context and one answer
        assert len(endpoint.bodies) == 3
        assert all(b["messages"] == [{"role": "user", "content": "say something"}] for b in endpoint.bodies)
        assert {b["answer"]["content"] for b in endpoint.bodies} == set(rewards)


def test_a_hook_that_raises_leaves_its_group_for_the_next_run(
        tmp_path: Path, servers: tuple[ScriptedOpenAI, ScriptedJudge]) -> None:
    upstream, judge = servers
    gateway = start(tmp_path, upstream, judge, judge_line='reward_hook = "tests.variety_task:broken"\n')
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
    client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "say something"}],
                                   extra_headers={"X-Flywheel-Fork": "2"})
    assert len(httpx.post(f"{gateway.url}/flywheel/v1/jobs/groups", headers=ADMIN).json()["formed"]) == 1
    summary = httpx.post(f"{gateway.url}/flywheel/v1/jobs/score", headers=ADMIN, timeout=60).json()
    assert (summary["scored"], summary["failed"]) == (0, 1)
    store = read_store(gateway)
    with store.session() as session:
        assert session.exec(select(Group)).one().status == "closed"
        assert not list(session.exec(select(Score)))
    store.close()


def fork_scored_by_the_hook(gateway: GatewayProcess) -> tuple[Store, dict[str, float], list[Score], str]:
    """One forked turn with feedback on its conversation, grouped and scored; the store, each member's reward by its
    answer, the hook's rows and the client's trajectory."""
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
    reply = client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "say something"}],
                                           extra_headers={"X-Flywheel-Fork": "2"})
    feedback = httpx.post(f"{gateway.url}/flywheel/v1/feedback", json={"completion_id": reply.id, "reward": 1.0})
    assert feedback.status_code == 200, feedback.text
    client_trajectory = feedback.json()["trajectory_id"]
    formed = httpx.post(f"{gateway.url}/flywheel/v1/jobs/groups", headers=ADMIN).json()["formed"]
    assert [(g["source"], g["size"]) for g in formed] == [("fork", 3)]
    summary = httpx.post(f"{gateway.url}/flywheel/v1/jobs/score", headers=ADMIN, timeout=60).json()
    assert (summary["scored"], summary["failed"]) == (1, 0)
    store = read_store(gateway)
    with store.session() as session:
        batch = training_group(session, session.exec(select(Group)).one())
        hook_rows = list(session.exec(select(Score).where(Score.source == "hook")))
    return store, {m.turns[0].response_message["content"]: m.reward for m in batch.members}, hook_rows, \
        client_trajectory


def test_explicit_group_feedback_and_policy(tmp_path: Path, servers: tuple[ScriptedOpenAI, ScriptedJudge]) -> None:
    upstream, judge = servers
    gateway = start(tmp_path, upstream, judge)
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
    ids = []
    for question in ("tell me something good", "tell me something", "something good please"):
        reply = client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": question}],
                                               extra_headers={"X-Flywheel-Group-Id": "run-1"})
        ids.append(reply.id)
    # Feedback by completion id (what every client has) overrides the judge for that member.
    response = httpx.post(f"{gateway.url}/flywheel/v1/feedback", json={"completion_id": ids[0], "label": "bad"})
    assert response.status_code == 200, response.text
    first_trajectory = response.json()["trajectory_id"]
    by_id = httpx.post(f"{gateway.url}/flywheel/v1/feedback", json={"trajectory_id": first_trajectory, "reward": 0.0})
    assert by_id.status_code == 200 and by_id.json()["trajectory_id"] == first_trajectory
    for completion_id in ids[1:]:  # the others are closed by the client without feedback
        trajectory = httpx.post(f"{gateway.url}/flywheel/v1/feedback",
                                json={"completion_id": completion_id, "reward": 0.25}).json()["trajectory_id"]
        assert trajectory != first_trajectory
    bad = httpx.post(f"{gateway.url}/flywheel/v1/feedback", json={"completion_id": ids[0], "label": "meh"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "label"
    unknown = httpx.post(f"{gateway.url}/flywheel/v1/feedback", json={"completion_id": "chatcmpl-nope", "reward": 1})
    assert unknown.status_code == 404
    formed = httpx.post(f"{gateway.url}/flywheel/v1/jobs/groups", headers=ADMIN).json()["formed"]
    assert [(g["source"], g["key"], g["size"]) for g in formed] == [("explicit", "run-1", 3)]
    assert httpx.post(f"{gateway.url}/flywheel/v1/jobs/score", headers=ADMIN, timeout=60).json()["scored"] == 1
    store = read_store(gateway)
    with store.session() as session:
        finals = {s.trajectory_id: (s.value, s.explanation.split(":")[0])  # type: ignore[union-attr]
                  for s in session.exec(select(Score).where(Score.source == "reward"))}
        judged = list(session.exec(select(Score).where(Score.source == "ruler")))
    assert finals[first_trajectory] == (0.0, "feedback")  # feedback_overrides: "bad" beats the judge's 0.67
    assert sorted(v for v, _ in finals.values()) == [0.0, 0.25, 0.25]
    assert len(judged) == 3 and all(s.prompt_version and s.rubric_hash for s in judged)


def test_weighted_policy_and_same_task_groups(tmp_path: Path, servers: tuple[ScriptedOpenAI, ScriptedJudge]) -> None:
    upstream, judge = servers
    gateway = start(tmp_path, upstream, judge, """
[rewards]
policy = "weighted"
judge_weight = 0.5
feedback_weight = 0.5
""")
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
    system = {"role": "system", "content": "You answer questions."}
    completions = []
    for _ in range(2):  # the same task twice: same system prompt and first user message
        reply = client.chat.completions.create(model="gpt-4o", messages=[system, {"role": "user", "content": "good?"}])
        completions.append(reply.id)
    for completion_id, reward in zip(completions, (1.0, 0.0), strict=True):
        httpx.post(f"{gateway.url}/flywheel/v1/feedback", json={"completion_id": completion_id, "reward": reward})
    formed = httpx.post(f"{gateway.url}/flywheel/v1/jobs/groups", headers=ADMIN).json()["formed"]
    assert [(g["source"], g["size"]) for g in formed] == [("task", 2)]
    assert httpx.post(f"{gateway.url}/flywheel/v1/jobs/score", headers=ADMIN, timeout=60).json()["scored"] == 1
    store = read_store(gateway)
    with store.session() as session:
        finals = sorted(s.value for s in session.exec(select(Score).where(Score.source == "reward")))
    judge_score = 3 / 4  # identical attempts are judged once, whole: "good?" + "good good answer" = 3 "good"
    assert finals == pytest.approx([0.5 * judge_score, 0.5 * judge_score + 0.5])


def test_failed_judge_leaves_the_group_unscored(tmp_path: Path, servers: tuple[ScriptedOpenAI, ScriptedJudge]) -> None:
    upstream, judge = servers
    judge.faults.append("http500")
    gateway = start(tmp_path, upstream, judge)
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
    client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}],
                                   extra_headers={"X-Flywheel-Fork": "1"})
    httpx.post(f"{gateway.url}/flywheel/v1/jobs/groups", headers=ADMIN)
    first = httpx.post(f"{gateway.url}/flywheel/v1/jobs/score", headers=ADMIN, timeout=60).json()
    assert (first["scored"], first["failed"]) == (0, 1)
    second = httpx.post(f"{gateway.url}/flywheel/v1/jobs/score", headers=ADMIN, timeout=60).json()
    assert (second["scored"], second["failed"]) == (1, 0)  # tried again, the judge behaves now


def test_cli_groups_and_score_through_the_gateway_and_on_the_file(
        tmp_path: Path, servers: tuple[ScriptedOpenAI, ScriptedJudge]) -> None:
    upstream, judge = servers
    gateway = start(tmp_path, upstream, judge)
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
    for question in ("first", "second"):
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": question}],
                                       extra_headers={"X-Flywheel-Fork": "1"})

    def flywheel(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "flywheel.gateway", *args, "--config", str(gateway.config_file)],
                              capture_output=True, text=True, timeout=120)

    through_api = flywheel("groups", "--gateway", gateway.url, "--admin-key", "admin")
    assert through_api.returncode == 0 and through_api.stdout.strip() == "formed 2 groups (2 fork)"
    database = str(gateway.dir / "data" / "flywheel.duckdb")
    gateway.stop()
    on_file = flywheel("score", "--database", database)
    assert on_file.returncode == 0, on_file.stderr
    assert on_file.stdout.startswith("scored 2/2 groups (4 trajectories), 0 failed")
    assert len(judge.requests) == 2
    again = flywheel("score", "--database", database)
    assert again.stdout.startswith("scored 0/0 groups") and len(judge.requests) == 2


def test_two_scoring_runs_at_once_judge_each_group_once(tmp_path: Path) -> None:
    """The loop's run and ``POST /jobs/score`` may overlap: one waits for the other, so no group is judged twice
    and neither fails writing its rewards (on DuckDB both would mark the same groups scored: a write conflict)."""
    with ScriptedOpenAI(reply=answer) as upstream, ScriptedJudge(target=("good", "sample"), delay_s=0.3) as judge:
        gateway = start(tmp_path, upstream, judge, "[loop]\nscore_every_s = 3600")
        try:
            client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
            for i in range(4):
                client.chat.completions.create(model="agent", messages=[{"role": "user", "content": f"say {i}"}],
                                               extra_headers={"X-Flywheel-Fork": "2"})
            assert len(httpx.post(f"{gateway.url}/flywheel/v1/jobs/groups", headers=ADMIN).json()["formed"]) == 4
            with ThreadPoolExecutor(2) as pool:
                runs = list(pool.map(lambda _: httpx.post(f"{gateway.url}/flywheel/v1/jobs/score", headers=ADMIN,
                                                          timeout=60), range(2)))
            assert [run.status_code for run in runs] == [200, 200], [run.text for run in runs]
            assert sorted(run.json()["scored"] for run in runs) == [0, 4]
            assert len(judge.requests) == 4
        finally:
            gateway.stop()
