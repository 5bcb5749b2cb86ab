"""Rewritten histories on a real store file: what the linker records, how a branch reads back, what training
makes of it, and the corners of the rules (explicit ids, closed trajectories, spooled turns from before).

Store tests run on DuckDB (the default store) and on SQLite, which takes the generic write
path PostgreSQL takes (executemany, JSON read back already decoded or as text).
"""

from __future__ import annotations

from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from sqlmodel import col, select

from flywheel.capture import queries
from flywheel.capture.batches import BranchTurn, GroupMember, TrainingGroup
from flywheel.capture.export import art_trajectories, openai_examples
from flywheel.capture.groups import branch_messages, branch_turns
from flywheel.capture.history import branch_conversation, history_edits
from flywheel.capture.models import Trajectory, Turn
from flywheel.capture.store import Store
from flywheel.capture.turns import CapturedExchange, PreparedTurn, prepare_turns
from flywheel.trainer.samples import build_samples

T0 = datetime(2026, 11, 1, tzinfo=UTC)
SYSTEM = {"role": "system", "content": "You plan trips."}


def exchange(i: int, messages: list[dict[str, Any]], answer: str, **tags: str) -> CapturedExchange:
    response = {"id": f"chatcmpl-{i}", "choices": [{"index": 0, "finish_reason": "stop",
                                                    "message": {"role": "assistant", "content": answer}}]}
    return CapturedExchange(completion_id=f"chatcmpl-{i}", endpoint="chat.completions", requested_model="m",
                            alias="a", engine_model="m", adapter_version=0, client_key_id=None,
                            request={"model": "m", "messages": messages}, response=response,
                            created_at=T0 + timedelta(seconds=i), latency_ms=1.0, **tags)  # type: ignore[arg-type]


def timed(minute: int) -> dict[str, str]:
    return {"role": "system", "content": f"You plan trips. It is 10:{minute:02d}."}


def converse(store: Store, system: Any, questions: list[str], *, start: int = 0, **tags: str) -> list[dict[str, Any]]:
    """One conversation, one batch per request; ``system(i)`` is the i-th request's system prompt."""
    history: list[dict[str, Any]] = []
    for i, question in enumerate(questions):
        history.append({"role": "user", "content": question})
        answer = f"Answer {start + i}: a considered reply about {question.lower()}"
        store.write_turns(prepare_turns(exchange(start + i, [system(i), *history], answer, **tags), None))
        history.append({"role": "assistant", "content": answer})
    return history


def stored(store: Store) -> list[Turn]:
    with store.session() as session:
        return list(session.exec(select(Turn).order_by(col(Turn.created_at))).all())


def test_an_explicit_trajectory_finds_its_parent_by_the_tail(store: Store) -> None:
    """Inside an explicit trajectory a retry with a rewritten history branches from the turn it continues,
    not from the trajectory's latest turn."""
    history = converse(store, timed, ["Lisbon?", "Two nights."], trajectory_id="run-1")
    retried = [timed(9), *history[:2], {"role": "user", "content": "Three nights."}]
    store.write_turns(prepare_turns(exchange(9, retried, "Booked three."), None))  # untagged: the tail rule
    store.write_turns(prepare_turns(exchange(10, retried, "Booked three, again.", trajectory_id="run-1"), None))
    first, second, untagged, tagged = stored(store)
    assert [t.link_rule for t in (first, second, untagged, tagged)] == ["explicit", "explicit", "tail", "explicit"]
    assert second.parent_turn_id == untagged.parent_turn_id == tagged.parent_turn_id == first.id
    assert {t.trajectory_id for t in (first, second, untagged, tagged)} == {"run-1"}
    assert tagged.parent_message_index == 2
    assert tagged.history_edits == {"system_changed": True, "dropped": 0, "rewritten": 0, "added": 0}
    with store.session() as session:
        assert session.get(Trajectory, "run-1").branch_count == 3  # type: ignore[union-attr]


def test_a_closed_trajectory_is_continued_by_the_tail_into_a_new_one(store: Store) -> None:
    history = converse(store, timed, ["Lisbon?"])
    first = stored(store)[0]
    store.close_trajectory(first.trajectory_id)
    store.write_turns(prepare_turns(exchange(5, [timed(5), *history, {"role": "user", "content": "More."}],
                                             "More plans."), None))
    _, later = stored(store)
    assert later.link_rule == "tail" and later.parent_turn_id == first.id
    assert later.trajectory_id != first.trajectory_id  # closed ones are never reopened by the linker


def test_a_branch_reads_back_as_the_conversation_that_happened(store: Store) -> None:
    """A window drops the opening; the judge's transcript keeps it, and each message in its first form."""
    history = converse(store, lambda i: SYSTEM, ["Lisbon?", "Two nights."])
    windowed = [SYSTEM, *history[-2:], {"role": "user", "content": "Dinner too."}]
    store.write_turns(prepare_turns(exchange(7, windowed, "Table for two."), None))
    turns = stored(store)
    assert turns[-1].history_edits == {"system_changed": False, "dropped": 2, "rewritten": 0, "added": 0}
    with store.session() as session:
        branch = branch_turns(session, turns[-1].id)
    assert branch_messages(branch) == [SYSTEM, *history, {"role": "user", "content": "Dinner too."},
                                       {"role": "assistant", "content": "Table for two."}]
    assert turns[-1].request_messages == windowed  # what the model saw is what training uses


def test_history_edits_count_what_changed_and_a_request_without_the_answer_adds_itself_whole() -> None:
    previous = [SYSTEM, {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert history_edits(previous, previous) is None
    assert history_edits(previous, [{"role": "user", "content": "note"}, *previous]) == {
        "system_changed": False, "dropped": 0, "rewritten": 0, "added": 1}
    assert history_edits(previous, [{"role": "system", "content": "new"}, previous[2]]) == {
        "system_changed": True, "dropped": 1, "rewritten": 0, "added": 0}
    first = Turn(id="t1", trajectory_id="x", completion_id="c", requested_model="m", alias="a", engine_model="m",
                 h_ctx="", h_out="", request_messages=previous[:2], response_message=previous[2])
    fresh = [SYSTEM, {"role": "user", "content": "start over"}]
    second = Turn(id="t2", trajectory_id="x", completion_id="c", requested_model="m", alias="a", engine_model="m",
                  h_ctx="", h_out="", request_messages=fresh, response_message={"role": "assistant", "content": "ok"},
                  history_edits={"system_changed": False, "dropped": 2, "rewritten": 0, "added": 0})
    messages, answers = branch_conversation([first, second])
    assert messages == [*previous, *fresh, {"role": "assistant", "content": "ok"}] and answers == [2, 5]


def test_a_turn_spooled_before_tail_links_is_written_and_linked(store: Store) -> None:
    """A spool line from before schema version 4 has no parent tag and no answer hashes: it still goes in."""
    first = prepare_turns(exchange(1, [SYSTEM, {"role": "user", "content": "Lisbon?"}], "Where in Lisbon?"), None)
    old = first[0].to_json()
    del old["parent_trajectory_id"]
    for column in ("h_answer", "h_replied_to"):
        del old["row"][column]
    store.write_turns([PreparedTurn.from_json(old)], skip_stored=True)
    follow = [SYSTEM, {"role": "user", "content": "Lisbon?"}, {"role": "assistant", "content": "Where in Lisbon?"},
              {"role": "user", "content": "Alfama."}]
    store.write_turns(prepare_turns(exchange(2, follow, "Alfama it is."), None))
    written, linked = stored(store)
    assert written.h_answer is None and written.link_rule == "new"
    assert (linked.link_rule, linked.parent_turn_id) == ("prefix", written.id)


def test_training_starts_a_new_sequence_where_the_history_was_rewritten(tiny_model: Path, tmp_path: Path) -> None:
    """``trainer/samples.py`` appends a turn only when its prompt continues the sequence: a conversation
    with a changing system prompt trains as one sequence per turn, a verbatim one as one sequence."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    store = Store(tmp_path / "s.duckdb")
    try:
        converse(store, timed, ["Lisbon?", "Two nights.", "Dinner too."])
        converse(store, lambda i: SYSTEM, ["Lisbon?", "Two nights.", "Dinner too."], start=10)
        turns = stored(store)
        with store.session() as session:
            rewritten, verbatim = (branch_turns(session, t.id) for t in turns if t.depth == 2)
    finally:
        store.close()
    assert [t.link_rule for t in rewritten] == ["new", "tail", "tail"]
    assert [t.link_rule for t in verbatim] == ["new", "prefix", "prefix"]
    members = [GroupMember(trajectory_id=branch[0].trajectory_id, reward=reward, turns=[
        BranchTurn(request_messages=t.request_messages or [], response_message=t.response_message or {},
                   turn_id=t.id) for t in branch]) for branch, reward in ((rewritten, 1.0), (verbatim, 0.0))]
    batch = build_samples([TrainingGroup(group_id="g", source="task", alias="a", members=members)], tokenizer,
                          max_prompt_tokens=1024, max_completion_tokens=512)
    by_member = {m: [s for s in batch.samples if s.member_index == m] for m in (0, 1)}
    assert [(s.part, s.turns) for s in by_member[0]] == [(0, 1), (1, 1), (2, 1)]
    assert [(s.part, s.turns) for s in by_member[1]] == [(0, 3)]
    assert len({s.advantage for s in by_member[0]}) == 1  # every sequence keeps the member's advantage


def test_exports_read_a_rewritten_branch_back_whole_with_each_answer_a_choice(store: Store) -> None:
    history = converse(store, timed, ["Lisbon?", "Two nights.", "Dinner too."])  # a new system prompt each time
    (trajectory,) = queries.list_trajectories(store).data
    detail = queries.trajectory_detail(store, trajectory["id"])
    assert detail is not None
    (example,) = openai_examples(detail)
    assert example["messages"] == [timed(0), *history]
    (art,) = art_trajectories(detail)
    choices = [i for i, item in enumerate(art.messages_and_choices) if "finish_reason" in item]
    assert choices == [2, 4, 6]
    assert [art.messages_and_choices[i]["message"] for i in choices] == history[1::2]


def test_a_retry_that_two_identical_conversations_could_have_made_starts_its_own_trajectory(store: Store) -> None:
    """Identical conversations claim one trajectory each; a retry that matches both is not branched into either."""
    opening = [SYSTEM, {"role": "user", "content": "Lisbon?"}]
    follow = [*opening, {"role": "assistant", "content": "Which part?"}, {"role": "user", "content": "Alfama."}]
    counts: Counter[str] = Counter()
    for i in range(2):
        store.write_turns(prepare_turns(exchange(i, opening, "Which part?"), None), counts=counts)
    for i in range(2, 4):
        store.write_turns(prepare_turns(exchange(i, follow, "Alfama it is."), None), counts=counts)
    store.write_turns(prepare_turns(exchange(4, follow, "Alfama, again."), None), counts=counts)
    turns = stored(store)
    assert [t.link_rule for t in turns] == ["new", "new", "prefix", "prefix", "new"]
    assert len({t.trajectory_id for t in turns[2:4]}) == 2 and turns[4].parent_turn_id is None
    assert counts == Counter(link_new=3, link_prefix=2, tail_ambiguous=1)
