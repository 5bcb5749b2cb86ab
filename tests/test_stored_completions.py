"""OpenAI's Stored Completions API over captured traffic, driven by the official ``openai`` client.

One gateway for the module: the upstream engine on a scripted server (known replies, no
model), two client keys (to prove one never sees the other's completions), a third whose
completions are streams cut short, broken or whole, and an admin key.
Reads see every completion answered before them (the store process catches up first), so
nothing here polls but for the turn of a stream its client left (the gateway notices that later).
(A gateway without client keys, where every completion is visible, is exercised in
``test_export_cli.py``; choices of one completion and forked siblings in ``test_trajectories_api.py``.)
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from openai.pagination import SyncCursorPage
from openai.types.chat import ChatCompletion, ChatCompletionRole, ChatCompletionStoreMessage
from pydantic import TypeAdapter

from tests.conftest import weather_followup
from tests.gateway_process import GatewayProcess
from tests.scripted_openai import Reply, ScriptedOpenAI
from tests.test_errors import assert_openai_error
from tests.waiting import wait_for

KEY_A, KEY_B, KEY_C, ADMIN = "sk-stored-a", "sk-stored-b", "sk-stored-c", "stored-admin"
LONG_STORY = "Once upon a time there was a story that went on and on"


def scripted_reply(body: dict[str, Any]) -> Reply:
    """``weather`` questions get a tool call; ``stall`` and ``break`` a stream that hangs or drops after its
    first words; anything else is echoed."""
    last = body["messages"][-1]
    text = last["content"] if isinstance(last["content"], str) else "".join(p["text"] for p in last["content"])
    if "weather" in text:
        call = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                 "arguments": json.dumps({"city": "Oslo"})}}
        return Reply(content=None, tool_calls=[call], finish_reason="tool_calls")
    if text == "stall":
        return Reply(content=LONG_STORY, stall_after_chunks=3)
    if text == "break":
        return Reply(content=LONG_STORY, break_after_chunks=3)
    return Reply(content=f"echo {text}")


def gateway_config(upstream: ScriptedOpenAI, *keys: str, admin: str) -> str:
    return f"""
[engines.up]
base_url = "{upstream.base_url}"
[aliases.agent]
engine = "up"
base_model = "scripted"
[aliases.other]
engine = "up"
base_model = "scripted"
[routing]
routes = {{ "gpt-4o*" = "agent" }}
[auth]
api_keys = {json.dumps(list(keys))}
admin_key = "{admin}"
"""


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    with ScriptedOpenAI(reply=scripted_reply) as upstream:
        process = GatewayProcess(tmp_path_factory.mktemp("stored"), gateway_config(upstream, KEY_A, KEY_B, KEY_C,
                                                                                   admin=ADMIN)).start()
        yield process
        process.stop()


@pytest.fixture(scope="module")
def client_a(gateway: GatewayProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=KEY_A, max_retries=0)


@pytest.fixture(scope="module")
def client_b(gateway: GatewayProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=KEY_B, max_retries=0)


@pytest.fixture(scope="module")
def client_c(gateway: GatewayProcess) -> openai.OpenAI:
    """Key C's completions are the streams below, apart from the other tests' completions."""
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=KEY_C, max_retries=0)


@pytest.fixture(scope="module")
def made(client_a: openai.OpenAI, client_b: openai.OpenAI) -> dict[str, Any]:
    """Five completions by key A (in order, some tagged), one by key B; listed at once, no waiting."""
    a_ids = []
    for i in range(5):
        tag = {"run": "r1", "i": str(i)} if i % 2 == 0 else {"run": "r2", "i": str(i)}
        model = "gpt-4o" if i < 4 else "other"
        reply = client_a.chat.completions.create(model=model, messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "question "}, {"type": "text", "text": str(i)}]}],
            metadata=tag)
        a_ids.append(reply.id)
        time.sleep(0.01)  # distinct arrival times, so the order is the order of creation
    tool = client_a.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "weather?"}])
    b_id = client_b.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "mine"}]).id
    assert len(client_a.chat.completions.list(limit=100).data) == 6
    assert [c.id for c in client_b.chat.completions.list().data] == [b_id]
    return {"a": a_ids, "tool": tool, "b": b_id}


def test_list_pages_with_the_cursor_in_creation_order(client_a: openai.OpenAI, made: dict[str, Any]) -> None:
    first = client_a.chat.completions.list(limit=2)
    assert [c.id for c in first.data] == made["a"][:2]
    assert first.has_more is True
    raw = first.model_dump()
    assert raw["object"] == "list" and raw["first_id"] == made["a"][0] and raw["last_id"] == made["a"][1]
    everything = [c.id for c in client_a.chat.completions.list(limit=2)]  # auto-paging follows `after`
    assert everything == [*made["a"], made["tool"].id]
    newest_first = [c.id for c in client_a.chat.completions.list(limit=4, order="desc")]
    assert newest_first == everything[::-1]
    after = client_a.chat.completions.list(after=made["a"][2], limit=10)
    assert [c.id for c in after.data] == [*made["a"][3:], made["tool"].id] and after.has_more is False


def test_list_filters_by_metadata_and_model(client_a: openai.OpenAI, made: dict[str, Any]) -> None:
    tagged = client_a.chat.completions.list(metadata={"run": "r1"})
    assert [c.id for c in tagged.data] == [made["a"][0], made["a"][2], made["a"][4]]
    both = client_a.chat.completions.list(metadata={"run": "r1", "i": "2"})
    assert [c.id for c in both.data] == [made["a"][2]]
    assert client_a.chat.completions.list(metadata={"run": "nope"}).data == []
    assert [c.id for c in client_a.chat.completions.list(model="other")] == [made["a"][4]]
    by_alias = [c.id for c in client_a.chat.completions.list(model="agent")]  # the alias matches too
    assert by_alias == [*made["a"][:4], made["tool"].id]


def test_retrieve_rebuilds_the_completion(client_a: openai.OpenAI, made: dict[str, Any]) -> None:
    stored = client_a.chat.completions.retrieve(made["a"][1])
    assert stored.id == made["a"][1] and stored.object == "chat.completion" and stored.model == "gpt-4o"
    assert stored.choices[0].message.content == "echo question 1"
    assert stored.choices[0].message.role == "assistant" and stored.choices[0].finish_reason == "stop"
    assert stored.usage is not None and stored.usage.total_tokens == 8  # the scripted server's usage
    assert stored.model_dump()["metadata"] == {"run": "r2", "i": "1"}
    tool = client_a.chat.completions.retrieve(made["tool"].id)
    assert tool.choices[0].finish_reason == "tool_calls"
    calls = tool.choices[0].message.tool_calls
    assert calls is not None and calls[0].function.name == "get_weather"  # type: ignore[union-attr]
    assert calls[0].function.arguments == made["tool"].choices[0].message.tool_calls[0].function.arguments  # type: ignore


def test_messages_lists_the_request_messages(client_a: openai.OpenAI, made: dict[str, Any]) -> None:
    completion_id = made["a"][3]
    messages = list(client_a.chat.completions.messages.list(completion_id))
    assert [m.id for m in messages] == [f"{completion_id}-0", f"{completion_id}-1"]
    assert messages[0].role == "system" and messages[0].content == "Be brief."
    assert messages[0].content_parts is None
    assert messages[1].content == "question 3"  # text parts joined, the parts kept as sent
    assert [p.model_dump()["text"] for p in messages[1].content_parts or []] == ["question ", "3"]
    page = client_a.chat.completions.messages.list(completion_id, limit=1)
    assert [m.id for m in page.data] == [f"{completion_id}-0"] and page.has_more is True
    newest = client_a.chat.completions.messages.list(completion_id, limit=1, order="desc")
    assert [m.id for m in newest.data] == [f"{completion_id}-1"]


def test_update_replaces_metadata(client_a: openai.OpenAI, made: dict[str, Any]) -> None:
    updated = client_a.chat.completions.update(made["a"][0], metadata={"reviewed": "yes"})
    assert updated.id == made["a"][0] and updated.model_dump()["metadata"] == {"reviewed": "yes"}
    assert client_a.chat.completions.retrieve(made["a"][0]).model_dump()["metadata"] == {"reviewed": "yes"}
    assert [c.id for c in client_a.chat.completions.list(metadata={"reviewed": "yes"})] == [made["a"][0]]
    assert made["a"][0] not in [c.id for c in client_a.chat.completions.list(metadata={"run": "r1"})]


def test_delete_removes_the_completion(client_a: openai.OpenAI, made: dict[str, Any]) -> None:
    deleted = client_a.chat.completions.delete(made["a"][2])
    assert deleted.id == made["a"][2] and deleted.deleted is True and deleted.object == "chat.completion.deleted"
    with pytest.raises(openai.NotFoundError):
        client_a.chat.completions.retrieve(made["a"][2])
    with pytest.raises(openai.NotFoundError):
        client_a.chat.completions.delete(made["a"][2])
    assert made["a"][2] not in [c.id for c in client_a.chat.completions.list(limit=100)]


def test_a_client_key_sees_only_its_own(client_a: openai.OpenAI, client_b: openai.OpenAI,
                                        made: dict[str, Any]) -> None:
    assert [c.id for c in client_b.chat.completions.list(limit=100)] == [made["b"]]
    assert made["b"] not in [c.id for c in client_a.chat.completions.list(limit=100)]
    other = made["a"][1]
    with pytest.raises(openai.NotFoundError):
        client_b.chat.completions.retrieve(other)
    with pytest.raises(openai.NotFoundError):
        client_b.chat.completions.update(other, metadata={"x": "y"})
    with pytest.raises(openai.NotFoundError):
        client_b.chat.completions.delete(other)
    with pytest.raises(openai.NotFoundError):
        client_b.chat.completions.messages.list(other)
    assert client_a.chat.completions.retrieve(other).model_dump()["metadata"] == {"run": "r2", "i": "1"}


def errors_counted(gateway: GatewayProcess) -> Counter[tuple[str, str]]:
    """``flywheel_errors_total`` from the gateway's /metrics, by (code, status)."""
    counts: Counter[tuple[str, str]] = Counter()
    for line in httpx.get(f"{gateway.url}/metrics").text.splitlines():
        if line.startswith("flywheel_errors_total{"):
            labels = dict(part.split("=") for part in line[line.index("{") + 1:line.index("}")].split(","))
            counts[(labels["code"].strip('"'), labels["status"].strip('"'))] = int(float(line.rsplit(" ", 1)[1]))
    return counts


def test_errors_have_openai_shape(gateway: GatewayProcess, made: dict[str, Any]) -> None:
    auth = {"authorization": f"Bearer {KEY_A}"}
    base = f"{gateway.url}/v1/chat/completions"
    before = errors_counted(gateway)
    assert_openai_error(httpx.get(f"{base}/chatcmpl-nope", headers=auth), 404, code="not_found")
    assert_openai_error(httpx.get(base, params={"limit": 0}, headers=auth), 400, param="limit")
    assert_openai_error(httpx.get(base, params={"order": "up"}, headers=auth), 400, param="order")
    assert_openai_error(httpx.get(base, params={"after": "chatcmpl-nope"}, headers=auth), 400, param="after")
    assert_openai_error(httpx.post(f"{base}/{made['a'][1]}", json={}, headers=auth), 400, param="metadata")
    assert_openai_error(httpx.post(f"{base}/{made['a'][1]}", json={"metadata": {"k": 1}}, headers=auth), 400,
                        param="metadata.k")
    too_many = {"metadata": {f"k{i}": "v" for i in range(17)}}
    assert_openai_error(httpx.post(f"{base}/{made['a'][1]}", json=too_many, headers=auth), 400, param="metadata")
    assert_openai_error(httpx.get(base), 401, code="invalid_api_key")
    assert_openai_error(httpx.get(base, headers={"authorization": f"Bearer {ADMIN}"}), 401)
    # Answered by the store process, counted by the gateway: its /metrics shows them like its own errors.
    assert errors_counted(gateway) - before == Counter({
        ("not_found", "404"): 1, ("invalid_api_key", "401"): 2, ("invalid_value", "400"): 4,
        ("missing_required_parameter", "400"): 1, ("invalid_type", "400"): 1})


def test_creating_still_works_on_the_same_path(client_a: openai.OpenAI) -> None:
    """``GET /v1/chat/completions`` lists; ``POST`` still creates."""
    reply = client_a.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "again"}])
    assert reply.choices[0].message.content == "echo again"
    assert client_a.chat.completions.retrieve(reply.id).id == reply.id  # readable as soon as it was answered
    assert reply.id in [c.id for c in client_a.chat.completions.list(order="desc", limit=3)]


def leave_after_first_content(client: openai.OpenAI, messages: list[dict[str, Any]]) -> str:
    """Start a stream, read up to its first piece of content, hang up; the completion id."""
    stream = client.chat.completions.create(model="gpt-4o", messages=messages, stream=True)  # type: ignore[arg-type]
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            stream.close()
            return chunk.id
    raise AssertionError("the stream ended before any content")


def read_to_the_end(client: openai.OpenAI, messages: list[dict[str, Any]]) -> str:
    stream = client.chat.completions.create(model="gpt-4o", messages=messages, stream=True)  # type: ignore[arg-type]
    ids = [chunk.id for chunk in stream]  # every chunk read: the stream ends as the server ended it
    return ids[0]


@pytest.fixture(scope="module")
def streams(client_c: openai.OpenAI) -> dict[str, str]:
    """Key C's streams: one the client cut short (after a tool round trip), one the upstream broke, two
    read to their end; the ids of those stored."""
    cut = leave_after_first_content(client_c, [*weather_followup("call_9"), {"role": "user", "content": "stall"}])
    with pytest.raises(openai.APIError):
        read_to_the_end(client_c, [{"role": "user", "content": "break"}])
    done = read_to_the_end(client_c, [{"role": "user", "content": "all of it"}])
    tool = read_to_the_end(client_c, [{"role": "user", "content": "weather?"}])
    # The disconnect is noticed by the gateway after the client left: wait for its turn to be recorded.
    wait_for(lambda: cut in [c.id for c in client_c.chat.completions.list(limit=100)], "the cut stream's turn")
    return {"cut": cut, "done": done, "tool": tool}


def test_streams_cut_broken_or_whole_list_inside_openais_schema(client_c: openai.OpenAI,
                                                                streams: dict[str, str]) -> None:
    raw = client_c.chat.completions.with_raw_response.list(limit=100)
    page = SyncCursorPage[ChatCompletion].model_validate(raw.http_response.json())  # strict: every enum checked
    listed = raw.parse()  # the broken stream is not among them: an exchange that failed is not captured
    assert [c.id for c in page.data] == [c.id for c in listed.data] == [streams["cut"], streams["done"],
                                                                        streams["tool"]]
    reasons = {c.id: c.choices[0].finish_reason for c in listed.data}
    assert reasons == {streams["cut"]: "length", streams["done"]: "stop", streams["tool"]: "tool_calls"}


def test_a_cut_stream_reads_as_truncated_with_flywheels_reason(client_c: openai.OpenAI,
                                                               streams: dict[str, str]) -> None:
    raw = client_c.chat.completions.with_raw_response.retrieve(streams["cut"])
    ChatCompletion.model_validate(raw.http_response.json())
    choice = raw.parse().choices[0]
    assert choice.finish_reason == "length"  # the answer has no end: cut short, as by a token limit
    assert choice.model_extra == {"flywheel": {"finish_reason": "client_disconnected"}}
    assert choice.message.role == "assistant" and choice.message.content
    assert LONG_STORY.startswith(choice.message.content) and choice.message.content != LONG_STORY
    whole = client_c.chat.completions.retrieve(streams["done"]).choices[0]
    assert whole.finish_reason == "stop" and whole.model_extra == {}  # nothing to add when the model finished
    tool = ChatCompletion.model_validate(client_c.chat.completions.with_raw_response.retrieve(
        streams["tool"]).http_response.json()).choices[0]
    assert tool.message.tool_calls is not None and tool.message.tool_calls[0].type == "function"


def test_a_cut_streams_messages_keep_openais_roles(client_c: openai.OpenAI, streams: dict[str, str]) -> None:
    raw = client_c.chat.completions.messages.with_raw_response.list(streams["cut"])
    data = raw.http_response.json()["data"]
    roles = TypeAdapter(list[ChatCompletionRole]).validate_python([m["role"] for m in data])
    assert roles == ["user", "assistant", "tool", "user"] == [m.role for m in raw.parse().data]
    # OpenAI's model of a stored message only knows the assistant's: the history's tool call passes it
    call = ChatCompletionStoreMessage.model_validate(data[1]).tool_calls
    assert call is not None and call[0].type == "function" and call[0].id == "call_9"
