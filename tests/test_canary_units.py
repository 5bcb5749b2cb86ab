"""What the canary pairs (store_ops.canary_rewards), on both backends: a fork group's independent answers (not a
sibling drawn without replacement) with the group as their context, and whole conversations by their task key; and
the other arm's sibling of a forked turn, judged with its group but left out of the round."""

from __future__ import annotations

from datetime import timedelta

from sqlmodel import select

from flywheel.capture.groups import GroupingRules, form_groups, training_groups
from flywheel.capture.models import Score, Trajectory, Turn, utcnow
from flywheel.capture.store import Store
from flywheel.capture.turns import CapturedExchange, prepare_turns
from flywheel.gateway.core.config import Settings
from flywheel.gateway.storeproc import store_ops
from flywheel.judge.scoring import groups_for_judge, teaches_nothing
from tests.test_training_batch import START, group, reward, turn


def test_the_canary_pairs_fork_answers_by_group_and_conversations_by_task(store: Store) -> None:
    with store.session() as session:
        for trajectory_id in ("first", "first_sib", "later", "later_sib", "drawn"):
            session.add(Trajectory(id=trajectory_id, alias="agent", status="closed", created_at=START))
        session.add_all([
            turn("first", "f", None, 0), turn("first_sib", "fs", None, 0, source="fork", adapter_version=1,
                                              choice_index=1),
            turn("later", "l", None, 1), turn("later_sib", "ls", None, 0, source="fork", adapter_version=1,
                                              choice_index=1),
            turn("drawn", "d", None, 0, source="fork", adapter_version=1, choice_index=2, inclusion_logprob=-0.5)])
        session.flush()
        group(session, "g_first", "fork", 1, [("first", "f"), ("first_sib", "fs")])
        group(session, "g_later", "fork", 1, [("later", "l"), ("later_sib", "ls"), ("drawn", "d")])
        for group_id, trajectory_id in (("g_first", "first"), ("g_first", "first_sib"), ("g_later", "later"),
                                        ("g_later", "later_sib"), ("g_later", "drawn")):
            reward(session, group_id, trajectory_id, 1.0, 5, source="hook")
        session.add(Trajectory(id="conv", alias="agent", status="closed", task_key="task", created_at=START,
                               closed_at=START, close_reason="idle"))
        session.add(turn("conv", "c", None, 0))
        session.add(Score(id="s_conv", trajectory_id="conv", source="reward", value=0.5,
                          created_at=START + timedelta(minutes=6)))  # a conversation's final reward
        session.commit()
    rows = store_ops.canary_rewards(store, Settings(), "agent", START, [0, 1])
    assert sorted((r.context, r.version, r.order) for r in rows) == [
        ("fork:g_first", 0, "0000"), ("fork:g_first", 1, "0001"),
        ("fork:g_later", 0, "0000"), ("fork:g_later", 1, "0001"),  # the drawn sibling (choice 2) is no sample
        ("task", 0, "conv")]


def forked_exchange(completion_id: str, siblings: int) -> CapturedExchange:
    """A turn forked while a canary runs: the client's answer (version 3), ``siblings`` drawn from the training head
    (version 5) and the last choice answered by the canary's other arm (version 4)."""
    choices = [{"index": i, "message": {"role": "assistant", "content": f"answer {i}"}, "finish_reason": "stop"}
               for i in range(siblings + 2)]
    return CapturedExchange(
        completion_id=completion_id, endpoint="chat.completions", requested_model="agent", alias="agent",
        engine_model="agent@3", adapter_version=3, client_key_id=None,
        request={"model": "agent", "messages": [{"role": "user", "content": f"Where is order {completion_id}?"}]},
        response={"id": completion_id, "choices": choices}, created_at=utcnow(), latency_ms=1.0, client_choices=1,
        explored=(1, 5, "agent@5"), other_arm=(siblings + 1, 4, "agent@4"))


def test_a_canary_pair_is_judged_with_its_fork_group_but_never_trained_on(store: Store) -> None:
    """The fork group holds the other arm's answer beyond max_size (the judge scores the two versions in one call,
    the canary pairs them); min_size and max_size count what a round trains on, and the round reads only that."""
    store.write_turns(prepare_turns(forked_exchange("c_full", siblings=3), None))
    store.write_turns(prepare_turns(forked_exchange("c_short", siblings=2), None))  # three a round could train on
    with store.session() as session:
        formed = form_groups(session, GroupingRules(min_size=4, max_size=4))
        session.commit()
    assert [(g.key, g.size) for g in formed] == [("c_full", 5)]
    with store.session() as session:
        turns = {t.trajectory_id: t for t in session.exec(select(Turn).where(Turn.completion_id == "c_full"))}
        [trained] = training_groups(session, formed)
    pair = next(tid for tid, t in turns.items() if t.canary_pair)
    assert (turns[pair].adapter_version, turns[pair].choice_index) == (4, 4)
    assert sorted(turns[m.trajectory_id].choice_index for m in trained.members) == [0, 1, 2, 3]
    judged = groups_for_judge(store.engine, formed)[formed[0].id]
    assert len(judged.trajectories.trajectories) == 5 and judged.canary_pairs == {pair}
    rows = [{"source": "reward", "trajectory_id": tid, "value": 0.0 if tid == pair else 1.0} for tid in turns]
    assert teaches_nothing(rows, judged.canary_pairs)  # the four trained members tie: untrainable
    assert not teaches_nothing(rows)
