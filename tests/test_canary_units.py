"""What the canary pairs (store_ops.canary_rewards), on both backends: a fork group's independent answers (not a
sibling drawn without replacement) with the group as their context, and whole conversations by their task key."""

from __future__ import annotations

from datetime import timedelta

from flywheel.capture.models import Score, Trajectory
from flywheel.capture.store import Store
from flywheel.gateway.core.config import Settings
from flywheel.gateway.storeproc import store_ops
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
