"""``flywheel trajectories`` as a user runs it: a subprocess, against a running gateway, then on the file.

The module's gateway (upstream engine on a scripted server, no client keys, an admin key
in its config) records two conversations under explicit trajectory ids, so outputs are
exact. Tests run in file order: first through the running gateway, then, once the
``stopped`` fixture has stopped it, on the DuckDB file it left.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import duckdb
import httpx
import openai
import pytest

from capture.trajectory import Trajectory
from tests.gateway_process import GatewayProcess
from tests.scripted_openai import ScriptedOpenAI, free_port
from tests.test_stored_completions import gateway_config, scripted_reply, wait_until

ADMIN = "cli-admin"
SYSTEM = {"role": "system", "content": "You help travellers."}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    with ScriptedOpenAI(reply=scripted_reply) as upstream:
        process = GatewayProcess(tmp_path_factory.mktemp("cli"), gateway_config(upstream, admin=ADMIN)).start()
        yield process
        process.stop()


@pytest.fixture(scope="module")
def made(gateway: GatewayProcess) -> dict[str, Any]:
    """``trip-1``: a tool-using exchange of two turns; ``chat-2``: one plain turn."""
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="none", max_retries=0)
    trip = {"X-Flywheel-Trajectory-Id": "trip-1"}
    ask = [SYSTEM, {"role": "user", "content": "weather in Oslo?"}]
    client.chat.completions.create(model="gpt-4o", messages=ask, tools=[TOOL], extra_headers=trip)  # type: ignore
    follow = [*ask, {"role": "assistant", "content": None, "tool_calls": [CALL]},
              {"role": "tool", "tool_call_id": "call_1", "content": "grey"}]
    client.chat.completions.create(model="gpt-4o", messages=follow, tools=[TOOL], extra_headers=trip)  # type: ignore
    client.chat.completions.create(model="gpt-4o", messages=[SYSTEM, {"role": "user", "content": "hello"}],
                                   extra_headers={"X-Flywheel-Trajectory-Id": "chat-2"})
    admin = {"authorization": f"Bearer {ADMIN}"}

    def listed() -> dict[str, Any] | None:
        page: dict[str, Any] = httpx.get(f"{gateway.url}/flywheel/v1/trajectories", params={"limit": 50},
                                         headers=admin).json()
        return page if sum(t["turn_count"] for t in page["data"]) == 3 else None

    return {"page": wait_until(listed), "ask": ask, "follow": follow}


def cli_env(**extra: str) -> dict[str, str]:
    """The environment without the caller's FLYWHEEL_* settings or terminal width."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_") and k != "COLUMNS"}
    return {**env, "PYTHONPATH": str(ROOT), **extra}


def flywheel(*args: str | Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m gateway trajectories ARGS``, stdin closed (no terminal to confirm on)."""
    return subprocess.run([sys.executable, "-m", "gateway", "trajectories", *map(str, args)], capture_output=True,
                          text=True, env=env or cli_env(), stdin=subprocess.DEVNULL, timeout=60, cwd=ROOT)


def flywheel_all(*calls: tuple[list[str | Path], dict[str, str] | None]) -> list[subprocess.CompletedProcess[str]]:
    """Several CLI runs at once (each is mostly interpreter start-up)."""
    procs = [subprocess.Popen([sys.executable, "-m", "gateway", "trajectories", *map(str, args)], text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                              env=env or cli_env(), cwd=ROOT) for args, env in calls]
    out = []
    for (args, _), proc in zip(calls, procs, strict=True):
        stdout, stderr = proc.communicate(timeout=60)
        out.append(subprocess.CompletedProcess(args, proc.returncode, stdout, stderr))
    return out


def assert_bad_input(result: subprocess.CompletedProcess[str], says: str) -> None:
    assert result.returncode == 2, (result.args, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], (result.args, result.stderr)


def expected_openai_lines(made: dict[str, Any]) -> list[dict[str, Any]]:
    trip = [SYSTEM, made["ask"][1], {"role": "assistant", "tool_calls": [CALL]},
            {"role": "tool", "content": "grey", "tool_call_id": "call_1"},
            {"role": "assistant", "content": "echo grey"}]
    chat = [SYSTEM, {"role": "user", "content": "hello"}, {"role": "assistant", "content": "echo hello"}]
    return [{"messages": trip, "tools": [TOOL]}, {"messages": chat}]


# -- through the running gateway -------------------------------------------------------------------------------

def test_exports_through_the_gateway(gateway: GatewayProcess, made: dict[str, Any], tmp_path: Path) -> None:
    target = ["--config", gateway.config_file, "--gateway", gateway.url]  # the admin key comes from the config
    as_openai, as_art, as_parquet, listed = flywheel_all(
        (["export", "--format", "openai", "--out", tmp_path / "train.jsonl", *target], None),
        (["export", "--format", "art", "--out", tmp_path / "art.jsonl", "--alias", "agent", *target], None),
        (["export", "--format", "parquet", "--out", tmp_path / "pq", *target], None),
        (["list", "--json", *target], None))
    assert as_openai.returncode == 0, as_openai.stderr
    assert as_openai.stdout == f"exported 2 trajectories (2 branches) as openai to {tmp_path / 'train.jsonl'}\n"
    lines = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    assert lines == expected_openai_lines(made)
    assert as_art.returncode == 0, as_art.stderr
    art = [Trajectory.model_validate_json(line) for line in (tmp_path / "art.jsonl").read_text().splitlines()]
    assert [(t.id, t.reward, len(t.messages_and_choices)) for t in art] == [("trip-1", 0.0, 5), ("chat-2", 0.0, 3)]
    assert art[0].tools == [TOOL] and art[0].messages_and_choices[2]["finish_reason"] == "tool_calls"
    assert as_parquet.returncode == 0, as_parquet.stderr
    assert as_parquet.stdout.startswith("exported 2 trajectories (3 turns) as parquet to ")
    turns = duckdb.sql(f"select trajectory_id, depth from '{tmp_path / 'pq' / 'turns.parquet'}'").fetchall()
    assert sorted(turns) == [("chat-2", 0), ("trip-1", 0), ("trip-1", 1)]
    assert listed.returncode == 0 and json.loads(listed.stdout) == made["page"]  # the API's own page


def test_without_a_target_the_configured_gateway_is_used(gateway: GatewayProcess, made: dict[str, Any]) -> None:
    found = flywheel("show", "trip-1", "--json", "--config", gateway.config_file,
                     env=cli_env(FLYWHEEL_PORT=str(gateway.port)))
    assert found.returncode == 0, found.stderr
    detail = json.loads(found.stdout)
    assert [t["depth"] for t in detail["turns"]] == [0, 1] and detail["branches"] == [[t["id"] for t in
                                                                                      detail["turns"]]]


def test_bad_input_through_the_gateway(gateway: GatewayProcess, made: dict[str, Any], tmp_path: Path) -> None:
    target = ["--config", str(gateway.config_file), "--gateway", gateway.url]
    results = flywheel_all(
        (["export", "--format", "xml", "--out", tmp_path / "x", *target], None),
        (["list", "--since", "last tuesday", *target], None),
        (["show", "nope", *target], None),
        (["delete", *target], None),
        (["delete", "trip-1", *target], None),
        (["list", *target, "--database", tmp_path / "x.duckdb"], None),
        (["list", *target], cli_env(FLYWHEEL_ADMIN_KEY="wrong")),
        (["export", "--out", tmp_path, *target], None))
    says = ["--format must be one of openai, art, parquet", "Invalid value for 'since'", "no trajectory 'nope'",
            "give a trajectory id or --client-key-id", "without --yes", "choose one", "401",
            "is a directory"]
    for result, message in zip(results, says, strict=True):
        assert_bad_input(result, message)


def test_stored_completions_without_client_keys_show_everything(gateway: GatewayProcess,
                                                                made: dict[str, Any]) -> None:
    anyone = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="whoever", max_retries=0)
    assert len(list(anyone.chat.completions.list())) == 3


# -- on the file, once the gateway has stopped --------------------------------------------------------------------

@pytest.fixture(scope="module")
def stopped(gateway: GatewayProcess, made: dict[str, Any]) -> Path:
    gateway.stop()
    return gateway.dir / "data" / "flywheel.duckdb"


def test_list_on_the_file_exact_output(stopped: Path, made: dict[str, Any]) -> None:
    result = flywheel("list", "--database", stopped)
    assert result.returncode == 0, result.stderr
    chat, trip = made["page"]["data"]
    when = {t["id"]: datetime.fromisoformat(t["created_at"]).strftime("%Y-%m-%d %H:%M:%S") for t in (chat, trip)}
    assert result.stdout == (
        "ID       ALIAS   STATUS   TURNS   BRANCHES   REWARD   CREATED (UTC)      \n"
        "──────────────────────────────────────────────────────────────────────────\n"
        f"chat-2   agent   open         1          1        -   {when['chat-2']}\n"
        f"trip-1   agent   open         2          1        -   {when['trip-1']}\n"
        "\n"
        "2 trajectories\n")


def test_file_and_gateway_give_the_same_answers(stopped: Path, made: dict[str, Any], tmp_path: Path) -> None:
    config = str(stopped.parent.parent / "flywheel.toml")
    dead = cli_env(FLYWHEEL_PORT=str(free_port()))  # the configured gateway does not answer: the file is read
    listed, shown, exported, no_gateway = flywheel_all(
        (["list", "--json", "--config", config], dead),
        (["show", "trip-1", "--database", stopped], None),
        (["export", "--format", "openai", "--out", tmp_path / "f.jsonl", "--data-dir", stopped.parent], None),
        (["list", "--gateway", f"http://127.0.0.1:{free_port()}"], None))
    assert listed.returncode == 0, listed.stderr
    assert json.loads(listed.stdout) == made["page"]
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith("trajectory trip-1\n  alias      agent\n  status     open\n")
    assert "calls get_weather" in shown.stdout and "echo grey" in shown.stdout and "branches (1):" in shown.stdout
    assert exported.returncode == 0, exported.stderr
    assert [json.loads(line) for line in (tmp_path / "f.jsonl").read_text().splitlines()] == \
        expected_openai_lines(made)
    assert_bad_input(no_gateway, "no gateway answers")


def test_parquet_from_the_file_matches_the_gateway_export(stopped: Path, tmp_path: Path) -> None:
    direct = flywheel("export", "--format", "parquet", "--out", tmp_path / "direct", "--database", stopped,
                      "--status", "open")
    assert direct.returncode == 0, direct.stderr
    assert direct.stdout == (f"exported 2 trajectories (3 turns) as parquet to {tmp_path / 'direct'}/"
                             f"trajectories.parquet and {tmp_path / 'direct'}/turns.parquet\n")
    rows = duckdb.sql(f"select id, status, turn_count from '{tmp_path / 'direct' / 'trajectories.parquet'}' "
                      "order by id").fetchall()
    assert rows == [("chat-2", "open", 1), ("trip-1", "open", 2)]
    columns = [c[0] for c in duckdb.sql(f"describe select * from '{tmp_path / 'direct' / 'turns.parquet'}'")
               .fetchall()]
    assert "completion_token_ids" in columns and "request_messages" in columns


def test_delete_on_the_file(stopped: Path, tmp_path: Path) -> None:
    locked = duckdb.connect(str(stopped))  # another process holds the file: the CLI says so
    try:
        assert_bad_input(flywheel("list", "--database", stopped), "open in another process")
    finally:
        locked.close()
    deleted = flywheel("delete", "chat-2", "--yes", "--database", stopped)
    assert deleted.returncode == 0, deleted.stderr
    assert deleted.stdout == ("deleted trajectory chat-2: 1 trajectories, 1 turns, 0 scores, 0 feedback, "
                              "0 group memberships\n")
    remaining = flywheel("list", "--json", "--database", stopped)
    assert [t["id"] for t in json.loads(remaining.stdout)["data"]] == ["trip-1"]
    assert_bad_input(flywheel("list", "--data-dir", tmp_path / "empty"), "no store at")
