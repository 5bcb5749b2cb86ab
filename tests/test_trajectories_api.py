"""The trajectories admin API through a real gateway, and the store-level rules under it on a real file.

The gateway runs the upstream engine on a scripted server, with two client keys and an
admin key. Four conversations are made with the plain ``openai`` client; one of them is
rewound, so it has two branches. The tests read, filter, export, close and finally
delete them (the deletes come last: the module's tests share the gateway, in file order).
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import duckdb
import httpx
import openai
import pytest
from openai.types.chat import ChatCompletion
from openai.types.chat.chat_completion import Choice

from flywheel.capture import queries
from flywheel.capture.export import art_trajectories, export_parquet, openai_examples
from flywheel.capture.models import Feedback, Group, GroupMember, Score, Trajectory, Turn
from flywheel.capture.queries import TrajectoryFilter
from flywheel.capture.store import Store
from flywheel.capture.trajectory import Trajectory as ArtTrajectory
from tests.gateway_process import GatewayProcess
from tests.scripted_openai import ScriptedOpenAI
from tests.test_errors import assert_openai_error
from tests.test_stored_completions import gateway_config, scripted_reply

KEY_A, KEY_B, ADMIN = "sk-traj-a", "sk-traj-b", "traj-admin"
SYSTEM = {"role": "system", "content": "You are terse."}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    with ScriptedOpenAI(reply=scripted_reply) as upstream:
        process = GatewayProcess(tmp_path_factory.mktemp("traj"), gateway_config(upstream, KEY_A, KEY_B,
                                                                                 admin=ADMIN)).start()
        yield process
        process.stop()


@pytest.fixture(scope="module")
def admin(gateway: GatewayProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=f"{gateway.url}/flywheel/v1", headers={"authorization": f"Bearer {ADMIN}"},
                      timeout=30) as client:
        yield client


def say(client: openai.OpenAI, messages: list[dict[str, Any]], model: str = "gpt-4o",
        **headers: str) -> list[dict[str, Any]]:
    """One request; returns the conversation with the answer appended."""
    reply = client.chat.completions.create(model=model, messages=messages,  # type: ignore[arg-type]
                                           extra_headers=headers or None)
    return [*messages, {"role": "assistant", "content": reply.choices[0].message.content}]


@pytest.fixture(scope="module")
def made(gateway: GatewayProcess, admin: httpx.Client) -> dict[str, str]:
    """conv1 (key A, task T1, rewound: 3 turns, 2 branches), conv2 (key A, alias other), conv3 and conv4 (key B)."""
    a = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=KEY_A, max_retries=0)
    b = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=KEY_B, max_retries=0)
    task = {"X-Flywheel-Task": "T1"}
    first = say(a, [SYSTEM, {"role": "user", "content": "plan a trip"}], **task)
    say(a, [*first, {"role": "user", "content": "to Rome"}], **task)
    say(a, [*first, {"role": "user", "content": "to Oslo instead"}], **task)  # rewound: a branch
    say(a, [SYSTEM, {"role": "user", "content": "other alias"}], model="other")
    third = say(b, [SYSTEM, {"role": "user", "content": "key b talks"}])
    say(b, [*third, {"role": "user", "content": "more"}])
    say(b, [SYSTEM, {"role": "user", "content": "key b again"}])

    newest_first: list[dict[str, Any]] = admin.get("/trajectories").json()["data"]  # every turn in, no waiting
    assert sum(t["turn_count"] for t in newest_first) == 7
    assert len(newest_first) == 4
    conv4, conv3, conv2, conv1 = (t["id"] for t in newest_first)
    return {"conv1": conv1, "conv2": conv2, "conv3": conv3, "conv4": conv4}


def ids(response: httpx.Response) -> list[str]:
    assert response.status_code == 200, response.text
    return [t["id"] for t in response.json()["data"]]


def test_list_is_newest_first_with_a_cursor(admin: httpx.Client, made: dict[str, str]) -> None:
    everything = ids(admin.get("/trajectories"))
    assert everything == [made["conv4"], made["conv3"], made["conv2"], made["conv1"]]
    first = admin.get("/trajectories", params={"limit": 3}).json()
    assert first["has_more"] is True and first["object"] == "list" and first["last_id"] == made["conv2"]
    rest = admin.get("/trajectories", params={"limit": 3, "after": first["last_id"]}).json()
    assert [t["id"] for t in rest["data"]] == [made["conv1"]] and rest["has_more"] is False
    assert ids(admin.get("/trajectories", params={"order": "asc"})) == everything[::-1]
    row = first["data"][0]
    assert row["object"] == "trajectory" and row["reward"] is None and row["has_reward"] is False


def test_list_filters(admin: httpx.Client, made: dict[str, str]) -> None:
    def listed(**params: str) -> list[str]:
        return ids(admin.get("/trajectories", params=params))

    assert listed(alias="other") == [made["conv2"]]
    assert listed(task="T1") == [made["conv1"]]
    assert listed(status="open", alias="agent") == [made["conv4"], made["conv3"], made["conv1"]]
    key_b = admin.get(f"/trajectories/{made['conv3']}").json()["client_key_id"]
    assert listed(client_key_id=key_b) == [made["conv4"], made["conv3"]]
    assert listed(has_reward="true") == []
    assert len(listed(has_reward="false")) == 4
    assert len(listed(since="1h")) == 4 and listed(until="1h") == []
    created = datetime.fromisoformat(admin.get(f"/trajectories/{made['conv2']}").json()["created_at"])
    assert listed(since=created.isoformat()) == [made["conv4"], made["conv3"], made["conv2"]]
    assert listed(until=created.isoformat()) == [made["conv1"]]
    assert listed(since=str(created.timestamp() - 3600), until=str(created.timestamp())) == [made["conv1"]]


def test_show_has_turns_in_order_and_branches(admin: httpx.Client, made: dict[str, str]) -> None:
    shown = admin.get(f"/trajectories/{made['conv1']}").json()
    assert shown["turn_count"] == 3 and shown["branch_count"] == 2 and shown["task_key"] == "T1"
    t1, t2, t3 = shown["turns"]
    assert [t["response_message"]["content"] for t in shown["turns"]] == \
        ["echo plan a trip", "echo to Rome", "echo to Oslo instead"]
    assert t2["parent_turn_id"] == t3["parent_turn_id"] == t1["id"] and t1["parent_turn_id"] is None
    assert shown["branches"] == [[t1["id"], t2["id"]], [t1["id"], t3["id"]]]
    assert shown["scores"] == [] and shown["feedback"] == []
    assert set(Turn.model_fields) <= set(t1)  # every column


def test_export_formats(admin: httpx.Client, made: dict[str, str]) -> None:
    as_openai = admin.get(f"/trajectories/{made['conv1']}/export", params={"format": "openai"})
    assert as_openai.headers["content-type"].startswith("application/x-ndjson")
    lines = [httpx.Response(200, content=line).json() for line in as_openai.content.splitlines()]
    assert [m["content"] for m in lines[1]["messages"]] == \
        ["You are terse.", "plan a trip", "echo plan a trip", "to Oslo instead", "echo to Oslo instead"]
    assert len(lines) == 2 and "tools" not in lines[0]
    art = admin.get(f"/trajectories/{made['conv1']}/export", params={"format": "art"})
    branches = [ArtTrajectory.model_validate_json(line) for line in art.content.splitlines()]
    assert [b.leaf_turn_id for b in branches] == [b[-1] for b in
                                                 admin.get(f"/trajectories/{made['conv1']}").json()["branches"]]
    choices = [m for m in branches[0].messages_and_choices if "finish_reason" in m]
    assert [c["message"]["content"] for c in choices] == ["echo plan a trip", "echo to Rome"]
    assert branches[0].reward == 0.0 and branches[0].metadata["trajectory_id"] == made["conv1"]


def test_close_is_for_the_owning_client_key(gateway: GatewayProcess, made: dict[str, str],
                                            admin: httpx.Client) -> None:
    url = f"{gateway.url}/flywheel/v1/trajectories/{made['conv1']}/close"
    assert_openai_error(httpx.post(url, headers={"authorization": f"Bearer {KEY_B}"}), 404, code="not_found")
    assert_openai_error(httpx.post(url, headers={"authorization": f"Bearer {ADMIN}"}), 401)
    closed = httpx.post(url, headers={"authorization": f"Bearer {KEY_A}"})
    assert closed.status_code == 200 and closed.json()["status"] == "closed"
    assert closed.json()["close_reason"] == "client" and closed.json()["closed_at"]
    again = httpx.post(f"{gateway.url}/flywheel/v1/trajectories/{made['conv2']}/close", json={"reason": "done"},
                       headers={"authorization": f"Bearer {KEY_A}"})
    assert again.json()["close_reason"] == "done"
    assert ids(admin.get("/trajectories", params={"status": "closed"})) == [made["conv2"], made["conv1"]]


def test_admin_errors(gateway: GatewayProcess, admin: httpx.Client) -> None:
    base = f"{gateway.url}/flywheel/v1/trajectories"
    assert_openai_error(httpx.get(base), 401)
    assert_openai_error(httpx.get(base, headers={"authorization": f"Bearer {KEY_A}"}), 401)
    assert_openai_error(admin.get("/trajectories", params={"since": "yesterday-ish"}), 400, param="since")
    assert_openai_error(admin.get("/trajectories", params={"has_reward": "maybe"}), 400, param="has_reward")
    assert_openai_error(admin.get("/trajectories", params={"limit": 5000}), 400, param="limit")
    assert_openai_error(admin.get("/trajectories", params={"after": "traj_nope"}), 400, param="after")
    assert_openai_error(admin.delete("/trajectories"), 400, param="client_key_id")
    assert_openai_error(admin.get("/trajectories/traj_nope"), 404, code="not_found")
    assert_openai_error(admin.delete("/trajectories/traj_nope"), 404, code="not_found")
    assert_openai_error(admin.get("/trajectories/traj_nope/export"), 404, code="not_found")
    assert_openai_error(admin.get("/trajectories/traj_nope/export", params={"format": "csv"}), 400, param="format")


def test_delete_by_id_then_by_client_key(admin: httpx.Client, made: dict[str, str]) -> None:
    deleted = admin.delete(f"/trajectories/{made['conv2']}").json()
    assert deleted["deleted"] is True and deleted["rows"]["turns"] == 1 and deleted["rows"]["trajectories"] == 1
    assert_openai_error(admin.get(f"/trajectories/{made['conv2']}"), 404)
    key_b = admin.get(f"/trajectories/{made['conv3']}").json()["client_key_id"]
    gone = admin.delete("/trajectories", params={"client_key_id": key_b}).json()
    assert gone["rows"]["trajectories"] == 2 and gone["rows"]["turns"] == 3 and gone["client_key_id"] == key_b
    assert ids(admin.get("/trajectories")) == [made["conv1"]]


# -- the same rules on a DuckDB file, with scores, feedback and groups (no gateway) ------------------------------

def turn(turn_id: str, trajectory_id: str, parent: str | None, depth: int, at: datetime, *,
         messages: list[dict[str, Any]], answer: str, key: str | None = "key_a", finish_reason: str = "stop") -> Turn:
    return Turn(id=turn_id, trajectory_id=trajectory_id, parent_turn_id=parent, depth=depth,
                completion_id=f"c-{turn_id}", created_at=at, requested_model="gpt-4o", alias="agent",
                engine_model="agent", client_key_id=key,
                request_messages=messages, response_message={"role": "assistant", "content": answer},
                finish_reason=finish_reason, prompt_tokens=3, completion_tokens=2, h_ctx="x", h_out=f"h-{turn_id}")


@pytest.fixture
def tree_store(tmp_path: Path) -> Iterator[Store]:
    """traj_t: t1 -> t2 -> t3 and t1 -> t4 (cut short by its client; scored twice, with feedback, in a group);
    traj_u: u1 (key b)."""
    store = Store(tmp_path / "tree.duckdb")
    at = datetime(2025, 1, 1, tzinfo=UTC)
    u = [{"role": "user", "content": "q"}]
    a1 = [*u, {"role": "assistant", "content": "a1"}]
    a2 = [*a1, {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}]
    with store.session() as session:
        session.add(Trajectory(id="traj_t", alias="agent", client_key_id="key_a", created_at=at, turn_count=4,
                               branch_count=2, latest_turn_id="t4"))
        session.add(Trajectory(id="traj_u", alias="agent", client_key_id="key_b", created_at=at + timedelta(1),
                               turn_count=1))
        session.add(turn("t1", "traj_t", None, 0, at, messages=u, answer="a1"))
        session.add(turn("t2", "traj_t", "t1", 1, at + timedelta(seconds=1), messages=[*a1, {"role": "user",
                                                                                          "content": "q2"}],
                         answer="a2"))
        session.add(turn("t3", "traj_t", "t2", 2, at + timedelta(seconds=2), messages=[*a2, {"role": "user",
                                                                                          "content": "q3"}],
                         answer="a3"))
        session.add(turn("t4", "traj_t", "t1", 1, at + timedelta(seconds=3), messages=[*a1, {"role": "user",
                                                                                          "content": "q4"}],
                         answer="a4", finish_reason="client_disconnected"))
        session.add(turn("u1", "traj_u", None, 0, at + timedelta(1), messages=u, answer="b", key="key_b"))
        session.add(Score(id="s1", trajectory_id="traj_t", source="ruler", value=0.25, created_at=at))
        session.add(Score(id="s2", trajectory_id="traj_t", source="ruler", value=0.75, created_at=at + timedelta(1)))
        session.add(Feedback(id="f1", trajectory_id="traj_t", reward=1.0, client_key_id="key_a"))
        session.add(Group(id="g1", source="explicit", key="k", alias="agent", size=2))
        session.add(GroupMember(group_id="g1", trajectory_id="traj_t"))
        session.add(GroupMember(group_id="g1", trajectory_id="traj_u"))
        session.commit()
    yield store
    store.close()


def test_file_rewards_branches_and_exports(tree_store: Store, tmp_path: Path) -> None:
    rewarded = queries.list_trajectories(tree_store, TrajectoryFilter(has_reward=True)).data
    assert [(t["id"], t["reward"], t["has_reward"]) for t in rewarded] == [("traj_t", 0.75, True)]
    assert [t["id"] for t in queries.list_trajectories(tree_store, TrajectoryFilter(has_reward=False)).data] \
        == ["traj_u"]
    detail = queries.trajectory_detail(tree_store, "traj_t")
    assert detail is not None and detail["branches"] == [["t1", "t2", "t3"], ["t1", "t4"]]
    assert [len(e["messages"]) for e in openai_examples(detail)] == [6, 4]
    art = art_trajectories(detail)
    assert art[0].reward == 0.75 and [m.get("message", m)["content"] for m in art[0].messages_and_choices] == \
        ["q", "a1", "q2", "a2", "q3", "a3"]
    assert sum("finish_reason" in m for m in art[0].messages_and_choices) == 3  # the model's own answers
    cut = Choice.model_validate(art[1].messages_and_choices[-1])  # as ART (OpenAI's Choice) reads it
    assert cut.finish_reason == "length" and cut.model_extra == {"flywheel": {"finish_reason": "client_disconnected"}}
    written = export_parquet(tree_store, tmp_path / "pq", TrajectoryFilter(has_reward=True))
    assert (written.trajectories, written.turns) == (1, 4)
    rows = duckdb.execute(f"select id, parent_turn_id from '{written.turns_path}' order by id").fetchall()
    assert rows == [("t1", None), ("t2", "t1"), ("t3", "t2"), ("t4", "t1")]
    assert duckdb.execute(f"select id from '{written.trajectories_path}'").fetchall() == [("traj_t",)]


def test_file_delete_keeps_the_tree_connected(tree_store: Store) -> None:
    assert queries.delete_completion(tree_store, "c-t2", "key_b") is False  # another key's completion
    assert queries.delete_completion(tree_store, "c-t2", "key_a") is True
    detail = queries.trajectory_detail(tree_store, "traj_t")
    assert detail is not None and detail["branches"] == [["t1", "t3"], ["t1", "t4"]]  # t3 moved up to t1
    assert (detail["turn_count"], detail["branch_count"], detail["latest_turn_id"]) == (3, 2, "t4")
    counts = queries.delete_trajectory(tree_store, "traj_t")
    assert counts is not None and counts.to_json() == {"trajectories": 1, "turns": 3, "scores": 2, "feedback": 1,
                                                       "group_members": 1}
    with tree_store.session() as session:
        assert session.get(Group, "g1").size == 1  # type: ignore[union-attr]
    assert queries.delete_trajectory(tree_store, "traj_t") is None
    assert queries.delete_client_data(tree_store, "key_b").trajectories == 1
    assert queries.list_trajectories(tree_store).data == []


def test_file_completion_choices_exclude_forked_siblings(tree_store: Store) -> None:
    """Each choice of a completion is a turn; forked siblings share the id but the client never saw them."""
    at = datetime(2025, 1, 3, tzinfo=UTC)
    with tree_store.session() as session:
        for index, source in ((1, "client"), (2, "fork")):
            extra = turn(f"t4-{index}", "traj_t", "t1", 1, at, messages=[{"role": "user", "content": "q4"}],
                         answer=f"other {index}")
            extra.completion_id, extra.choice_index, extra.source = "c-t4", index, source
            session.add(extra)
        session.commit()
    completion = queries.get_completion(tree_store, "c-t4", queries.EVERY_KEY)
    assert completion is not None
    assert [(c["index"], c["message"]["content"]) for c in completion["choices"]] == [(0, "a4"), (1, "other 1")]
    choices = ChatCompletion.model_validate(completion).choices  # only the cut choice says so
    assert [(c.finish_reason, c.model_extra) for c in choices] == [
        ("length", {"flywheel": {"finish_reason": "client_disconnected"}}), ("stop", {})]
    assert completion["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    assert queries.get_completion(tree_store, "c-t4", "key_b") is None
    listed = queries.list_completions(tree_store, "key_a", queries.CompletionFilter(model="agent"))
    assert [c["id"] for c in listed.data] == ["c-t1", "c-t2", "c-t3", "c-t4"]
