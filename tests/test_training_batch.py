"""What a training round reads (training_records.training_batch): every scored group of the alias, each member
one branch with its latest reward, read for all groups at once and equal to reading each group by itself
(capture.groups.training_group); how recording the round settles them; and its version: refused while another
round trains, a candidate that supersedes older ones once recorded. On both backends: a real DuckDB file and a
real PostgreSQL database. The store interface's ``open_round`` reads and reserves a round in one call."""

from __future__ import annotations

from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlmodel import select

from flywheel.capture.batches import TrainingGroup
from flywheel.capture.groups import training_group
from flywheel.capture.models import Group, GroupMember, Score, Trajectory, Turn, utcnow
from flywheel.capture.store import Store
from flywheel.gateway.core.config import Settings
from flywheel.gateway.core.store_api import OpenedRound
from flywheel.gateway.storeproc import store_ops, versions
from flywheel.gateway.storeproc.store_api_local import LocalStore
from flywheel.gateway.storeproc.training_records import record_training, training_batch
from flywheel.gateway.storeproc.versions import VersionError
from flywheel.trainer.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from flywheel.trainer.grpo_args import RoundResult

START = utcnow() - timedelta(hours=1)


def turn(trajectory_id: str, turn_id: str, parent: str | None, depth: int, **extra: Any) -> Turn:
    return Turn(id=turn_id, trajectory_id=trajectory_id, parent_turn_id=parent, depth=depth,
                completion_id=f"c_{turn_id}", requested_model="agent", alias="agent", engine_model="m",
                request_messages=[{"role": "user", "content": f"to {turn_id}"}],
                response_message={"role": "assistant", "content": f"answer {turn_id}"},
                prompt_token_ids=[1, 2, depth], completion_token_ids=[3, depth], completion_logprobs=[-0.5, -0.25],
                finish_reason="stop", h_ctx="ctx", h_out=f"out_{turn_id}", **extra)


def group(session: Any, group_id: str, source: str, minutes: int, members: list[tuple[str, str | None]],
          status: str = "scored", alias: str = "agent") -> None:
    session.add(Group(id=group_id, source=source, key=group_id, alias=alias, status=status, size=len(members),
                      created_at=START + timedelta(minutes=minutes)))
    for trajectory_id, leaf in members:
        session.add(GroupMember(group_id=group_id, trajectory_id=trajectory_id, leaf_turn_id=leaf))


def reward(session: Any, group_id: str, trajectory_id: str, value: float, minutes: int,
           source: str = "reward") -> None:
    session.add(Score(id=f"s_{group_id}_{trajectory_id}_{minutes}_{source}", trajectory_id=trajectory_id,
                      group_id=group_id, source=source, value=value, created_at=START + timedelta(minutes=minutes)))


def fill(store: Store) -> None:
    """Conversations (a branched one, one whose branch starts in another trajectory), one-turn attempts, a forked
    turn deep in a conversation, a member without a leaf; groups of another alias and already trained."""
    with store.session() as session:
        for trajectory_id in ("conv1", "conv2", "conv3", "one1", "one2", "deep", "sib", "other", "done"):
            session.add(Trajectory(id=trajectory_id, alias="agent", status="closed", created_at=START))
        session.add_all([
            turn("conv1", "c1a", None, 0), turn("conv1", "c1b", "c1a", 1), turn("conv1", "c1c", "c1b", 2),
            turn("conv1", "c1x", "c1b", 2),  # a second answer at the same place: a branch not taken
            turn("conv2", "c2a", None, 0, params={"temperature": 0.5}), turn("conv2", "c2b", "c2a", 1),
            turn("conv3", "c3b", "c1a", 1, tools=[{"type": "function", "function": {"name": "f"}}]),  # from conv1
            turn("one1", "o1", None, 0), turn("one2", "o2", None, 0),
            turn("deep", "d1", None, 0), turn("deep", "d2", "d1", 1), turn("sib", "d2s", "d1", 1, source="fork"),
            turn("other", "x1", None, 0), turn("done", "y1", None, 0)])
        group(session, "g_conv", "task", 3, [("conv1", "c1c"), ("conv2", "c2b"), ("conv3", "c3b")])
        group(session, "g_one", "explicit", 1, [("one2", "o2"), ("one1", "o1"), ("conv2", None)])
        group(session, "g_fork", "fork", 2, [("deep", "d2"), ("sib", "d2s")])
        group(session, "g_other", "explicit", 4, [("other", "x1")], alias="other")
        group(session, "g_done", "explicit", 5, [("done", "y1")], status="trained")
        reward(session, "g_conv", "conv1", 0.25, 10)
        reward(session, "g_conv", "conv1", 0.75, 11)  # scored again: the latest counts
        reward(session, "g_conv", "conv2", 0.5, 10)
        reward(session, "g_conv", "conv3", 0.9, 10, source="ruler")  # not a final reward: 0.0
        reward(session, "g_one", "one1", 1.0, 10)
        reward(session, "g_one", "one2", -1.0, 10)
        reward(session, "g_fork", "deep", 0.125, 10)
        reward(session, "g_fork", "sib", 0.375, 10)
        session.commit()


def shape(groups: list[TrainingGroup]) -> list[tuple[str, str, list[tuple[str, list[str | None], float]]]]:
    return [(g.group_id, g.source, [(m.trajectory_id, [t.turn_id for t in m.turns], m.reward) for m in g.members])
            for g in groups]


def test_a_batch_reads_every_group_as_reading_each_alone(store: Store) -> None:
    fill(store)
    batch = training_batch(store, "agent", max_groups=10, order="oldest")
    assert shape(batch) == [
        ("g_one", "explicit", [("one2", ["o2"], -1.0), ("one1", ["o1"], 1.0)]),  # no leaf: no member
        ("g_fork", "fork", [("deep", ["d2"], 0.125), ("sib", ["d2s"], 0.375)]),  # the forked turns alone
        ("g_conv", "task", [("conv1", ["c1a", "c1b", "c1c"], 0.75), ("conv2", ["c2a", "c2b"], 0.5),
                            ("conv3", ["c1a", "c3b"], 0.0)]),
    ]
    with store.session() as session:
        alone = [training_group(session, g) for g in (session.get(Group, b.group_id) for b in batch) if g]
    assert batch == alone  # every field of every turn, not just the shape above
    conv2 = batch[2].members[1].turns[0]
    assert (conv2.params, conv2.prompt_token_ids, conv2.completion_logprobs) == ({"temperature": 0.5}, [1, 2, 0],
                                                                                 [-0.5, -0.25])
    assert batch[2].members[2].turns[1].tools == [{"type": "function", "function": {"name": "f"}}]
    assert [g.to_json() for g in batch] == [asdict(g) for g in batch]  # what the admin API carries
    assert [TrainingGroup.from_json(g.to_json()) for g in batch] == batch


def test_a_batch_takes_the_newest_or_the_oldest_and_only_the_groups_asked(store: Store) -> None:
    fill(store)
    assert [g.group_id for g in training_batch(store, "agent", max_groups=2)] == ["g_fork", "g_conv"]
    assert [g.group_id for g in training_batch(store, "agent", max_groups=2, order="oldest")] == ["g_one", "g_fork"]
    asked = training_batch(store, "agent", max_groups=10, group_ids=["g_conv", "g_one", "g_done", "g_other"])
    assert [g.group_id for g in asked] == ["g_one", "g_conv"]  # scored groups of the alias only
    assert training_batch(store, "nobody", max_groups=10) == []


def test_recording_a_round_settles_every_scored_group_it_was_given(store: Store, tmp_path: Path) -> None:
    fill(store)
    given = [g.group_id for g in training_batch(store, "agent", max_groups=10)] + ["g_done", "g_gone"]
    version = store_ops.reserve_version(store, Settings(data_dir=tmp_path), "agent", base_model="m").version
    now = utcnow()
    skipped = RoundResult("skipped", None, None, {}, [], {}, ["g_conv"], {}, "m", None, now, now)  # as reported
    assert record_training(store, "agent", skipped, version=version, parent_version=None, promote=False,
                           batch_group_ids=given) is None
    with store.session() as session:
        statuses = {g.id: g.status for g in session.exec(select(Group))}
    assert statuses == {"g_conv": "trained", "g_one": "untrainable", "g_fork": "untrainable",
                        "g_done": "trained", "g_other": "scored"}  # no group trained twice, none fetched forever
    assert training_batch(store, "agent", max_groups=10) == []


def test_a_round_s_version_is_refused_while_another_trains_and_its_record_supersedes_older_candidates(
        store: Store, tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path)

    def reserve(**checks: bool) -> int:
        return store_ops.reserve_version(store, settings, "agent", base_model="m", **checks).version

    def finish(version: int) -> None:
        """The round of ``version`` wrote its adapter and is recorded: a candidate."""
        path = store_ops.adapter_dir(settings, "agent", version)
        path.mkdir(parents=True)
        (path / ADAPTER_CONFIG).write_text('{"peft_type": "LORA"}')
        (path / ADAPTER_WEIGHTS).write_bytes(b"")
        now = utcnow()
        result = RoundResult("finished", path, None, {}, [], {}, [], {}, "m", None, now, now)
        assert record_training(store, "agent", result, version=version, parent_version=None, promote=False,
                               batch_group_ids=[]) is not None

    first = reserve(one_round=True)
    with pytest.raises(VersionError, match=f"version {first} in flight: one round at a time"):
        reserve(one_round=True)  # one round at a time, whichever process asks
    finish(first)
    second = reserve(one_round=True)  # a candidate waits for its gate: the next round trains meanwhile
    with pytest.raises(VersionError, match=f"version {first} in flight"):
        reserve(alone=True)  # trainer workers: nothing in flight
    finish(second)
    rows = {row.version: row for row in store_ops.list_versions(store, settings, "agent")}
    assert (rows[first].status, rows[first].reason) == ("rejected", f"superseded by version {second} before its gate")
    assert rows[second].status == "candidate"


async def test_opening_a_round_reads_its_batch_and_head_and_reserves_its_version_in_one_call(
        store: Store, tmp_path: Path) -> None:
    fill(store)
    settings = Settings(data_dir=tmp_path)
    local = LocalStore(store, settings)
    assert await local.open_round("nobody", "m", max_groups=10) == OpenedRound(groups=[])
    assert store_ops.list_versions(store, settings, "nobody") == []  # no scored group: nothing reserved
    with store.session() as session:
        served = versions.reserve(session, "agent", path_of=lambda n: store_ops.adapter_dir(settings, "agent", n),
                                  base_model="m", status="candidate")
        Path(served.path).mkdir(parents=True)
        versions.promote(session, "agent", served.version, reason="a test")
    opened = await local.open_round("agent", "m", max_groups=2)
    assert [g.group_id for g in opened.groups] == ["g_fork", "g_conv"]
    assert opened.head is not None and opened.head.version == served.version
    assert opened.reserved is not None
    assert (opened.reserved.version, opened.reserved.status, opened.reserved.parent_version, opened.reserved.path) == \
        (served.version + 1, "training", served.version, str(store_ops.adapter_dir(settings, "agent", 2)))
    with pytest.raises(VersionError, match=f"version {opened.reserved.version} in flight: one round at a time"):
        await local.open_round("agent", "m", max_groups=2)
