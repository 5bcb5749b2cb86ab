"""RULER against a real OpenAI-compatible judge on loopback (``tests/scripted_judge.py``), reached through litellm.

The scripted judge scores each trajectory by how often it says "good", so rankings are
known in advance; it can be told to misbehave request by request. Timeouts, retries and
backoff are small here so the whole module runs in seconds (after litellm's import).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlmodel import Session, SQLModel, col, create_engine, select

from flywheel import judge
from flywheel.capture.models import Score
from flywheel.capture.store import bulk_insert
from flywheel.capture.trajectory import Trajectory, TrajectoryGroup
from flywheel.judge import (
    DEFAULT_RUBRIC,
    JudgeCache,
    JudgeCallError,
    JudgeTimeoutError,
    MalformedAnswerError,
    RewardPolicy,
    ScoreCountError,
    ScoreRangeError,
    TrajectoryIdError,
)
from flywheel.judge.ruler import parse_answer
from tests.scripted_judge import ScriptedJudge

MODEL = "openai/scripted-judge"
FAST: dict[str, Any] = {"timeout_s": 2.0, "max_retries": 2, "backoff_s": 0.01, "backoff_max_s": 0.05}
SYSTEM = {"role": "system", "content": "You are the PREFIX-MARKER-7 assistant. Recommend a restaurant."}
QUESTION = {"role": "user", "content": "Where should I eat tonight?"}
TOOLS = [{"type": "function", "function": {"name": "search_restaurants", "description": "Find restaurants.",
                                            "parameters": {"type": "object", "properties": {}}}}]


def conversation(answer: str) -> list[dict[str, Any]]:
    return [SYSTEM, QUESTION, {"role": "assistant", "content": answer}]


BEST, MIDDLE, WORST = "good food, good wine, good price", "good enough", "no idea"


def make_group(*answers: str, ids: list[str] | None = None, group_id: str | None = "grp_1") -> TrajectoryGroup:
    ids = ids or [f"traj_{i}" for i in range(len(answers))]
    return TrajectoryGroup(id=group_id, trajectories=[
        Trajectory(messages_and_choices=conversation(a), tools=TOOLS, reward=0.25, id=tid)
        for a, tid in zip(answers, ids, strict=True)])


@pytest.fixture
def scripted() -> Iterator[ScriptedJudge]:
    with ScriptedJudge(slow_s=0.6) as server:
        yield server


@pytest.fixture
def engine(tmp_path: Path) -> Any:
    engine = create_engine(f"duckdb:///{tmp_path / 'store.duckdb'}")
    SQLModel.metadata.create_all(engine)
    yield engine
    engine.dispose()


# --------------------------------------------------------------------------- the prompt and a valid answer


async def test_prompt_sends_shared_prefix_once_with_ids_tools_task_and_schema(scripted: ScriptedJudge) -> None:
    await judge.ruler([conversation(a) for a in (BEST, MIDDLE, WORST)], MODEL, tools=TOOLS,
                      task="Pick a place to eat.", api_base=scripted.base_url, api_key="k", **FAST)

    assert len(scripted.requests) == 1
    body = scripted.requests[0]
    system, user = body["messages"][0]["content"], body["messages"][1]["content"]
    assert "Scoring rubric:" in system and DEFAULT_RUBRIC.strip() in system and "3 trajectories" in system
    assert user.count("PREFIX-MARKER-7") == 1 and user.count("Where should I eat tonight?") == 1
    context = user[user.index("<shared_context>"):user.index("</shared_context>")]
    assert "PREFIX-MARKER-7" in context and BEST not in context
    for number, answer in enumerate((BEST, MIDDLE, WORST), start=1):
        start = user.index(f'<trajectory id="{number}">')
        assert answer in user[start:user.index("</trajectory>", start)]
    assert user.count("<trajectory id=") == 3
    assert user.count("search_restaurants") == 1 and "<tools>" in user
    assert "<task>\nPick a place to eat.\n</task>" in user
    assert "tools" not in body  # the schemas are text for the judge to read, not tools it may call
    assert body["response_format"]["type"] == "json_schema"
    schema = body["response_format"]["json_schema"]["schema"]
    assert set(schema["$defs"]["RulerScore"]["required"]) == {"trajectory_id", "explanation", "score"}


async def test_valid_answer_is_parsed_in_order_and_ranks_by_content(scripted: ScriptedJudge) -> None:
    result = await judge.ruler([conversation(a) for a in (MIDDLE, WORST, BEST)], MODEL,
                               api_base=scripted.base_url, api_key="k", **FAST)

    assert [s.trajectory_id for s in result.scores] == ["1", "2", "3"]
    middle, worst, best = (s.score for s in result.scores)
    assert best > middle > worst == 0.0
    assert result.scores[2].explanation == "names the target 3 times"
    assert result.attempts == 1 and not result.cached
    assert result.prompt_tokens > 0 and result.completion_tokens == 60
    assert result.cost_usd is None  # litellm has no price for an unknown model
    assert result.judge_model == MODEL and result.rubric_hash == judge.rubric_hash(DEFAULT_RUBRIC)
    assert result.prompt_version == judge.PROMPT_VERSION and result.cache_key.startswith("ruler_")


async def test_cost_comes_from_litellm_price_map_for_a_known_model(scripted: ScriptedJudge) -> None:
    result = await judge.ruler([conversation(BEST), conversation(WORST)], "openai/gpt-4o-mini",
                               api_base=scripted.base_url, api_key="k", **FAST)
    assert result.cost_usd is not None and result.cost_usd > 0


async def test_score_group_replaces_rewards_and_keeps_the_old_ones(scripted: ScriptedJudge) -> None:
    group = make_group(WORST, BEST, MIDDLE)
    scored = await judge.ruler_score_group(group, MODEL, api_base=scripted.base_url, api_key="k", **FAST)

    assert scored is not None and scored.id == "grp_1"
    rewards = [t.reward for t in scored.trajectories]
    assert rewards[1] > rewards[2] > rewards[0]
    for trajectory in scored.trajectories:
        assert trajectory.metrics["independent_reward"] == 0.25
        assert trajectory.metrics["ruler_score"] == trajectory.reward
        assert trajectory.metadata["ruler"]["explanation"].startswith("names the target")
        assert trajectory.metadata["ruler"]["judge_model"] == MODEL
        assert trajectory.logs and trajectory.logs[-1].startswith("RULER")
    assert scored.metadata["ruler"]["attempts"] == 1 and scored.metadata["ruler"]["prompt_tokens"] > 0
    assert [t.reward for t in group.trajectories] == [0.25] * 3 and not group.trajectories[0].metrics


async def test_fenced_json_is_accepted(scripted: ScriptedJudge) -> None:
    scripted.faults = ["fenced"]
    result = await judge.ruler([conversation(BEST), conversation(WORST)], MODEL, api_base=scripted.base_url,
                               api_key="k", **FAST)
    assert result.attempts == 1 and result.scores[0].score > result.scores[1].score


async def test_empty_input_calls_nobody(scripted: ScriptedJudge) -> None:
    result = await judge.ruler([], MODEL, api_base=scripted.base_url, **FAST)
    assert result.scores == [] and scripted.requests == []


# --------------------------------------------------------------------------- failures: retried, then raised/swallowed

FAULTS = [("malformed", MalformedAnswerError), ("wrong_count", ScoreCountError),
          ("unknown_id", TrajectoryIdError), ("out_of_range", ScoreRangeError), ("http500", JudgeCallError)]


@pytest.mark.parametrize(("fault", "error"), FAULTS)
async def test_persistent_fault_is_retried_then_raised(scripted: ScriptedJudge, fault: str,
                                                       error: type[Exception]) -> None:
    scripted.faults = [fault] * 3
    with pytest.raises(error) as caught:
        await judge.ruler_score_group(make_group(BEST, WORST), MODEL, api_base=scripted.base_url, api_key="k",
                                      **FAST)
    assert len(scripted.requests) == 3  # the first call and max_retries=2 more
    assert isinstance(caught.value, judge.JudgeError) and caught.value.attempts == 3


@pytest.mark.parametrize(("fault", "error"), FAULTS)
async def test_persistent_fault_is_swallowed_as_none(scripted: ScriptedJudge, fault: str,
                                                     error: type[Exception]) -> None:
    scripted.faults = [fault] * 3
    scored = await judge.ruler_score_group(make_group(BEST, WORST), MODEL, swallow_exceptions=True,
                                           api_base=scripted.base_url, api_key="k", **FAST)
    assert scored is None and len(scripted.requests) == 3


async def test_transient_faults_are_retried_and_all_attempts_are_counted(scripted: ScriptedJudge) -> None:
    scripted.faults = ["http500", "malformed"]
    result = await judge.ruler([conversation(BEST), conversation(WORST)], MODEL, api_base=scripted.base_url,
                               api_key="k", **FAST)
    assert len(scripted.requests) == 3 and result.attempts == 3
    assert result.scores[0].score > result.scores[1].score
    assert result.completion_tokens == 2 * 40  # the malformed answer was paid for too; the 500 was not


async def test_timeout_is_retried_then_raised_or_swallowed(scripted: ScriptedJudge) -> None:
    fast_timeout = {**FAST, "timeout_s": 0.2, "max_retries": 1}
    scripted.faults = ["slow", "slow"]
    started = time.monotonic()
    with pytest.raises(JudgeTimeoutError):
        await judge.ruler([conversation(BEST), conversation(WORST)], MODEL, api_base=scripted.base_url,
                          api_key="k", **fast_timeout)
    assert len(scripted.requests) == 2 and time.monotonic() - started < 1.5

    scripted.faults = ["slow", "slow"]
    assert await judge.ruler_score_group(make_group(BEST, WORST), MODEL, swallow_exceptions=True,
                                         api_base=scripted.base_url, api_key="k", **fast_timeout) is None
    assert len(scripted.requests) == 4


async def test_client_errors_are_not_retried(scripted: ScriptedJudge) -> None:
    scripted.faults = ["http400"]
    with pytest.raises(JudgeCallError) as caught:
        await judge.ruler([conversation(BEST), conversation(WORST)], MODEL, api_base=scripted.base_url,
                          api_key="k", **FAST)
    assert not isinstance(caught.value, JudgeTimeoutError) and len(scripted.requests) == 1


def test_parse_answer_names_each_problem() -> None:
    ok = {"trajectory_id": "1", "explanation": "fine", "score": 0.5}
    with pytest.raises(MalformedAnswerError):
        parse_answer(None, ["1"])
    with pytest.raises(MalformedAnswerError):
        parse_answer('{"scores": [{"trajectory_id": "1"}]}', ["1"])
    with pytest.raises(TrajectoryIdError, match="twice"):
        parse_answer(json.dumps({"scores": [ok, ok]}), ["1", "2"])
    with pytest.raises(ScoreRangeError):
        parse_answer(json.dumps({"scores": [{**ok, "score": -0.1}]}), ["1"])
    numeric_id = parse_answer(json.dumps({"scores": [{**ok, "trajectory_id": 1}]}), ["1"])
    assert numeric_id[0].trajectory_id == "1"


# --------------------------------------------------------------------------- identical trajectories


async def test_identical_trajectories_are_judged_once_and_share_the_score(scripted: ScriptedJudge) -> None:
    result = await judge.ruler([conversation(BEST), conversation(WORST), conversation(BEST)], MODEL,
                               api_base=scripted.base_url, api_key="k", **FAST)
    user = scripted.prompts()[0]
    assert user.count("<trajectory id=") == 2 and user.count(BEST) == 1
    assert [s.trajectory_id for s in result.scores] == ["1", "2", "3"]
    assert result.scores[0].score == result.scores[2].score > result.scores[1].score


async def test_all_identical_sends_one_whole_trajectory(scripted: ScriptedJudge) -> None:
    result = await judge.ruler([conversation(MIDDLE)] * 3, MODEL, api_base=scripted.base_url, api_key="k", **FAST)
    user = scripted.prompts()[0]
    assert user.count("<trajectory id=") == 1 and "<shared_context>" not in user and "PREFIX-MARKER-7" in user
    assert len({s.score for s in result.scores}) == 1 and len(result.scores) == 3


async def test_different_tools_travel_with_each_trajectory(scripted: ScriptedJudge) -> None:
    group = make_group(BEST, WORST)
    group.trajectories[1].tools = None
    await judge.ruler_score_group(group, MODEL, api_base=scripted.base_url, api_key="k", **FAST)
    user = scripted.prompts()[0]
    second = user[user.index('<trajectory id="2">'):]
    assert user.count("search_restaurants") == 1 and "<tools>\n[]\n</tools>" in second


# --------------------------------------------------------------------------- cache and concurrency


async def test_cache_answers_a_group_seen_before_without_a_call(scripted: ScriptedJudge, engine: Any) -> None:
    cache = JudgeCache(engine)
    first = await judge.ruler_score_group(make_group(BEST, WORST, MIDDLE), MODEL, cache=cache,
                                          api_base=scripted.base_url, api_key="k", **FAST)
    again = await judge.ruler_score_group(make_group(BEST, WORST, MIDDLE), MODEL, cache=cache,
                                          api_base=scripted.base_url, api_key="k", **FAST)
    assert len(scripted.requests) == 1
    assert first is not None and again is not None
    assert [t.reward for t in again.trajectories] == [t.reward for t in first.trajectories]
    assert again.metadata["ruler"]["cached"] and again.metadata["ruler"]["cost_usd"] == 0.0
    assert again.trajectories[0].metadata["ruler"]["explanation"] == first.trajectories[0].metadata["ruler"][
        "explanation"]

    with Session(engine) as session:
        rows = session.exec(select(Score).order_by(col(Score.id))).all()
    assert len(rows) == 3  # the same group again adds no rows
    assert {r.source for r in rows} == {"ruler"} and len({r.cache_key for r in rows}) == 1
    assert [r.trajectory_id for r in rows] == ["traj_0", "traj_1", "traj_2"] and rows[0].group_id == "grp_1"
    assert rows[0].prompt_tokens > 0 and rows[0].completion_tokens == 60 and rows[1].prompt_tokens == 0
    assert rows[0].judge_model == MODEL and rows[0].rubric_hash == judge.rubric_hash(DEFAULT_RUBRIC)
    assert rows[0].explanation == "names the target 3 times"

    # The same content in another group: no call, but its trajectories get their rows (at no cost).
    other = await judge.ruler_score_group(make_group(BEST, WORST, MIDDLE, ids=["t_a", "t_b", "t_c"], group_id="g2"),
                                          MODEL, cache=cache, api_base=scripted.base_url, api_key="k", **FAST)
    assert other is not None and len(scripted.requests) == 1
    with Session(engine) as session:
        copied = session.exec(select(Score).where(Score.group_id == "g2")).all()
    assert len(copied) == 3 and all(r.prompt_tokens == 0 and r.cost_usd == 0.0 for r in copied)

    # Another rubric is another question: it is paid for.
    await judge.ruler_score_group(make_group(BEST, WORST, MIDDLE), MODEL, rubric="Prefer short answers.",
                                  cache=cache, api_base=scripted.base_url, api_key="k", **FAST)
    assert len(scripted.requests) == 2


async def test_a_deferred_cache_answers_from_memory_and_writes_only_what_it_is_asked_for(
        scripted: ScriptedJudge, engine: Any) -> None:
    cache = JudgeCache(engine, deferred=True)
    first = await judge.ruler_score_group(make_group(BEST, WORST), MODEL, cache=cache,
                                          api_base=scripted.base_url, api_key="k", **FAST)
    other = await judge.ruler_score_group(make_group(BEST, WORST, ids=["t_a", "t_b"], group_id="g2"), MODEL,
                                          cache=cache, api_base=scripted.base_url, api_key="k", **FAST)
    assert first is not None and other is not None and len(scripted.requests) == 1  # the second: from memory
    assert other.metadata["ruler"]["cached"]
    with Session(engine) as session:
        assert session.exec(select(Score)).all() == []  # nothing written yet
    rows = cache.take_unwritten()
    assert [(r["trajectory_id"], r["group_id"]) for r in rows] == [("traj_0", "grp_1"), ("traj_1", "grp_1"),
                                                                   ("t_a", "g2"), ("t_b", "g2")]
    assert rows[0]["prompt_tokens"] > 0 and rows[2]["prompt_tokens"] == 0 and cache.take_unwritten() == []
    with Session(engine) as session:
        bulk_insert(session, Score, rows)
        session.commit()
    again = await judge.ruler_score_group(make_group(BEST, WORST), MODEL, cache=cache,
                                          api_base=scripted.base_url, api_key="k", **FAST)
    assert again is not None and len(scripted.requests) == 1 and cache.take_unwritten() == []  # read back, kept


async def test_a_prefetched_cache_answers_hits_and_misses_from_what_it_read_at_once(
        scripted: ScriptedJudge, engine: Any) -> None:
    group, other = make_group(BEST, WORST), make_group(WORST, BEST)
    await judge.ruler_score_group(group, MODEL, cache=JudgeCache(engine), api_base=scripted.base_url, api_key="k",
                                  **FAST)
    hit, miss = (judge.group_cache_key(g, MODEL) for g in (group, other))
    cache = JudgeCache(engine)
    cache.prefetch([hit, miss])
    with Session(engine) as session:  # gone from the store: what get() answers now was read by prefetch()
        stored = session.exec(select(Score)).all()
        for row in stored:
            session.delete(row)
        session.commit()
    answer = cache.get(hit)
    assert answer is not None and answer.cached and [s.score for s in answer.scores] == [r.value for r in stored]
    assert cache.get(miss) is None
    cache.put(miss, answer, ["t_x", "t_y"], "g_x")  # written: asked again, the key is read from the store
    assert cache.get(miss) is not None


async def test_concurrent_equal_groups_pay_once(scripted: ScriptedJudge, engine: Any) -> None:
    scripted.delay_s = 0.1
    cache = JudgeCache(engine)
    results = await asyncio.gather(*(judge.ruler_score_group(make_group(BEST, WORST), MODEL, cache=cache,
                                                             api_base=scripted.base_url, api_key="k", **FAST)
                                     for _ in range(3)))
    assert all(r is not None for r in results) and len(scripted.requests) == 1


async def test_semaphore_caps_calls_in_flight(scripted: ScriptedJudge) -> None:
    scripted.delay_s = 0.15
    semaphore = asyncio.Semaphore(2)
    groups = [make_group(BEST + " extra" * i, WORST) for i in range(5)]
    results = await asyncio.gather(*(judge.ruler_score_group(g, MODEL, semaphore=semaphore,
                                                             api_base=scripted.base_url, api_key="k", **FAST)
                                     for g in groups))
    assert all(r is not None for r in results)
    assert len(scripted.requests) == 5 and scripted.max_in_flight == 2


def test_cache_key_depends_on_what_the_judge_is_asked() -> None:
    candidates = [judge.Candidate(conversation(BEST)), judge.Candidate(conversation(WORST))]
    key = judge.ruler_cache_key(candidates, MODEL)
    assert key == judge.ruler_cache_key([judge.Candidate(conversation(BEST)), judge.Candidate(conversation(WORST))],
                                        MODEL, extra_litellm_params={"api_base": "http://elsewhere/v1"})
    assert key != judge.ruler_cache_key(candidates[::-1], MODEL)
    assert key != judge.ruler_cache_key(candidates, "openai/other")
    assert key != judge.ruler_cache_key(candidates, MODEL, rubric="Be strict.")
    assert key != judge.ruler_cache_key(candidates, MODEL, task="A task.")
    assert key != judge.ruler_cache_key(candidates, MODEL, extra_litellm_params={"reasoning_effort": "high"})


# --------------------------------------------------------------------------- rubrics


def test_rubric_override_task_beats_alias_beats_default() -> None:
    config = {"default": "D", "aliases": {"agent": "A", "blank": "  "}, "tasks": {"task_1": "T"}}
    assert judge.resolve_rubric(config, alias="agent", task="task_1") == "T"
    assert judge.resolve_rubric(config, alias="agent", task="task_other") == "A"
    assert judge.resolve_rubric(config, alias="other", task=None) == "D"
    assert judge.resolve_rubric(config, alias="blank") == "D"  # a blank override falls through
    assert judge.resolve_rubric({"aliases": {"agent": "A"}}, alias="x") == DEFAULT_RUBRIC
    assert judge.resolve_rubric(None, alias="agent") == DEFAULT_RUBRIC
    assert judge.resolve_rubric(judge.RubricConfig(tasks={"t": "T"}), task="t") == "T"


def test_rubric_hash_is_stable_and_sensitive() -> None:
    assert judge.rubric_hash("Be fair.") == judge.rubric_hash("  Be fair.\n")
    assert judge.rubric_hash("Be fair.") != judge.rubric_hash("Be strict.")
    assert len(judge.rubric_hash(DEFAULT_RUBRIC)) == 16


def test_judge_config_gives_call_arguments() -> None:
    config = judge.JudgeConfig.model_validate({"model": "hosted_vllm/q", "api_base": "http://h/v1",
                                               "api_key": "sk-secret-xyz", "rubrics": {"aliases": {"agent": "A"}}})
    kwargs = config.call_kwargs()
    assert kwargs["api_key"] == "sk-secret-xyz" and kwargs["api_base"] == "http://h/v1" and "model" not in kwargs
    assert "sk-secret-xyz" not in repr(config) and judge.resolve_rubric(config.rubrics, alias="agent") == "A"


# --------------------------------------------------------------------------- feedback and combination policies


def test_feedback_reward_explicit_reward_wins_over_label() -> None:
    assert judge.feedback_reward(label="good") == 1.0
    assert judge.feedback_reward(label=" BAD ") == 0.0
    assert judge.feedback_reward(reward=0.3, label="good") == 0.3
    for bad in ({}, {"label": "meh"}, {"reward": float("nan")}):
        with pytest.raises(judge.InvalidFeedbackError):
            judge.feedback_reward(**bad)


def test_combination_policies() -> None:
    overrides, only, weighted = (RewardPolicy(policy="feedback_overrides"), RewardPolicy(policy="judge_only"),
                                 RewardPolicy(policy="weighted", judge_weight=3, feedback_weight=1))
    assert judge.combine_rewards(0.4, 1.0, overrides) == judge.FinalReward(1.0, "feedback")
    assert judge.combine_rewards(0.4, None, overrides) == judge.FinalReward(0.4, "ruler")
    assert judge.combine_rewards(None, None, overrides) is None
    assert judge.combine_rewards(0.4, 1.0, only) == judge.FinalReward(0.4, "ruler")
    assert judge.combine_rewards(None, 1.0, only) is None
    mixed = judge.combine_rewards(0.4, 1.0, weighted)
    assert mixed is not None and mixed.source == "weighted" and mixed.value == pytest.approx(0.55)
    assert judge.combine_rewards(None, 1.0, weighted) == judge.FinalReward(1.0, "feedback")
    assert judge.combine_rewards(0.4, None, weighted) == judge.FinalReward(0.4, "ruler")
    assert judge.combine_rewards(0.4, 0.0) == judge.FinalReward(0.0, "feedback")  # the default overrides
    with pytest.raises(ValueError):
        RewardPolicy(policy="weighted", judge_weight=0, feedback_weight=0)
    with pytest.raises(ValueError):
        RewardPolicy(policy="judge_only", judge_weight=-1)


def test_apply_rewards_to_a_scored_group() -> None:
    group = make_group(BEST, WORST, MIDDLE)
    for trajectory, score in zip(group.trajectories, (0.9, 0.1, None), strict=True):
        if score is not None:
            trajectory.metrics["ruler_score"] = score
    final = judge.apply_rewards(group, {"traj_1": 1.0, "traj_2": 0.0}, RewardPolicy())
    assert [t.reward for t in final.trajectories] == [0.9, 1.0, 0.0]
    assert [t.metadata["reward_source"] for t in final.trajectories] == ["ruler", "feedback", "feedback"]
    assert final.trajectories[1].metrics["feedback_reward"] == 1.0
    judged_only = judge.apply_rewards(group, {"traj_2": 0.0}, RewardPolicy(policy="judge_only"))
    assert judged_only.trajectories[2].metadata["reward_source"] is None
    assert judged_only.trajectories[2].reward == 0.25  # left as it was; the trainer skips it
    assert group.trajectories[1].reward == 0.25  # the input is not changed


# --------------------------------------------------------------------------- packaging and the benchmark


def test_import_judge_does_not_import_litellm() -> None:
    code = "import sys, judge; assert 'litellm' not in sys.modules, 'litellm imported eagerly'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])


def test_kendall_tau_and_pairwise_accuracy() -> None:
    from bench.ruler_agreement import kendall_tau_b, pairwise_agreement

    assert kendall_tau_b([1, 2, 3], [10, 20, 30]) == 1.0
    assert kendall_tau_b([1, 2, 3], [3, 2, 1]) == -1.0
    assert kendall_tau_b([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(4 / 6)
    assert kendall_tau_b([1, 1, 2], [1, 2, 3]) == pytest.approx(2 / 6**0.5)  # scipy's tau-b gives 0.8165
    assert kendall_tau_b([1, 2, 3], [5, 5, 5]) is None
    assert pairwise_agreement([1.0, 0.5, 0.0], [0.9, 0.9, 0.1]) == (2.5, 3)
    assert pairwise_agreement([1.0, 1.0], [0.2, 0.8]) == (0.0, 0)


def test_agreement_bench_runs_against_the_scripted_stand_in(capsys: pytest.CaptureFixture[str],
                                                             tmp_path: Path) -> None:
    from bench.ruler_agreement import main

    out_file = tmp_path / "agreement.json"
    summary = main(["--scripted", "--timeout-s", "5", "--json", str(out_file)])
    printed = capsys.readouterr().out
    assert "SCRIPTED STAND-IN" in printed and "pooled pairwise accuracy" in printed
    assert summary["groups_judged"] == summary["groups_total"] == 5 and summary["pairs"] > 0
    assert summary["pairwise_accuracy"] == pytest.approx(17.5 / 24)  # the keyword-counting stand-in's, exactly
    assert json.loads(out_file.read_text())["scripted"] is True
