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
from typer.testing import CliRunner

from flywheel.capture.trajectory import Trajectory
from flywheel.gateway.cli import app
from flywheel.gateway.core.processes import free_port
from tests.gateway_process import GatewayProcess
from tests.scripted_openai import ScriptedOpenAI
from tests.test_stored_completions import gateway_config, scripted_reply

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
    """``trip-1``: a tool-using exchange of two turns; ``chat/2``: one plain turn."""
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="none", max_retries=0)
    trip = {"X-Flywheel-Trajectory-Id": "trip-1"}
    ask = [SYSTEM, {"role": "user", "content": "weather in Oslo?"}]
    client.chat.completions.create(model="gpt-4o", messages=ask, tools=[TOOL], extra_headers=trip)  # type: ignore
    follow = [*ask, {"role": "assistant", "content": None, "tool_calls": [CALL]},
              {"role": "tool", "tool_call_id": "call_1", "content": "grey"}]
    client.chat.completions.create(model="gpt-4o", messages=follow, tools=[TOOL], extra_headers=trip)  # type: ignore
    client.chat.completions.create(model="gpt-4o", messages=[SYSTEM, {"role": "user", "content": "hello"}],  # type: ignore
                                   extra_headers={"X-Flywheel-Trajectory-Id": "chat/2"})
    admin = {"authorization": f"Bearer {ADMIN}"}

    page: dict[str, Any] = httpx.get(f"{gateway.url}/flywheel/v1/trajectories", params={"limit": 50},
                                     headers=admin).json()
    assert sum(t["turn_count"] for t in page["data"]) == 3  # every turn in, no waiting
    return {"page": page, "ask": ask, "follow": follow}


def cli_env(**extra: str) -> dict[str, str]:
    """The environment without the caller's FLYWHEEL_* settings or terminal width."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_") and k != "COLUMNS"}
    return {**env, "PYTHONPATH": str(ROOT), **extra}


def flywheel(*args: str | Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m flywheel.gateway trajectories ARGS``, stdin closed (no terminal to confirm on)."""
    return subprocess.run([sys.executable, "-m", "flywheel.gateway",
                           "trajectories", *map(str, args)], capture_output=True,
                          text=True, env=env or cli_env(), stdin=subprocess.DEVNULL, timeout=60, cwd=ROOT)


def flywheel_all(*calls: tuple[list[str | Path], dict[str, str] | None]) -> list[subprocess.CompletedProcess[str]]:
    """Several CLI runs at once (each is mostly interpreter start-up)."""
    procs = [subprocess.Popen([sys.executable, "-m", "flywheel.gateway", "trajectories", *map(str, args)], text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                              env=env or cli_env(), cwd=ROOT) for args, env in calls]
    out = []
    for (args, _), proc in zip(calls, procs, strict=True):
        stdout, stderr = proc.communicate(timeout=60)
        out.append(subprocess.CompletedProcess(args, proc.returncode, stdout, stderr))
    return out


def invoke(*args: str | Path, env: dict[str, str] | None = None) -> Any:
    """The same commands in-process (typer's runner): as quick as a function call."""
    return CliRunner().invoke(app, ["trajectories", *map(str, args)], env=env)


def assert_bad_input(result: subprocess.CompletedProcess[str], says: str) -> None:
    assert result.returncode == 2, (result.args, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], (result.args, result.stderr)


def rows(sql: str) -> list[Any]:
    return duckdb.execute(sql).fetchall()


def expected_openai_lines(made: dict[str, Any]) -> list[dict[str, Any]]:
    trip = [SYSTEM, made["ask"][1], {"role": "assistant", "tool_calls": [CALL]},
            {"role": "tool", "content": "grey", "tool_call_id": "call_1"},
            {"role": "assistant", "content": "echo grey"}]
    chat = [SYSTEM, {"role": "user", "content": "hello"}, {"role": "assistant", "content": "echo hello"}]
    return [{"messages": trip, "tools": [TOOL]}, {"messages": chat}]


# -- through the running gateway -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def through_gateway(gateway: GatewayProcess, made: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
                    ) -> dict[str, Any]:
    """CLI runs against the running gateway: two real subprocesses (at once), the rest in-process."""
    out = tmp_path_factory.mktemp("exports")
    target: list[str | Path] = ["--config", gateway.config_file, "--gateway", gateway.url]  # admin key: the config's
    runs: dict[str, Any] = dict(zip(("openai", "list"), flywheel_all(
        (["export", "--format", "openai", "--out", out / "train.jsonl", *target], None),
        (["list", "--json", *target], None)), strict=True))
    runs["art"] = invoke("export", "--format", "art", "--out", out / "art.jsonl", "--alias", "agent", *target)
    runs["parquet"] = invoke("export", "--format", "parquet", "--out", out / "pq", *target)
    runs["show"] = invoke("show", "trip-1", "--json", "--config", gateway.config_file,
                          env={"FLYWHEEL_PORT": str(gateway.port)})  # no --gateway: the configured one answers
    runs["wrong_key"] = invoke("list", *target, env={"FLYWHEEL_ADMIN_KEY": "wrong"})
    return {"out": out, **runs}


def test_openai_export_through_the_gateway(through_gateway: dict[str, Any], made: dict[str, Any]) -> None:
    result, out = through_gateway["openai"], through_gateway["out"]
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"exported 2 trajectories (2 branches) as openai to {out / 'train.jsonl'}\n"
    lines = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    assert lines == expected_openai_lines(made)


def test_art_export_through_the_gateway(through_gateway: dict[str, Any]) -> None:
    result, out = through_gateway["art"], through_gateway["out"]
    assert result.exit_code == 0, result.stderr
    art = [Trajectory.model_validate_json(line) for line in (out / "art.jsonl").read_text().splitlines()]
    assert [(t.id, t.reward, len(t.messages_and_choices)) for t in art] == [("trip-1", 0.0, 5), ("chat/2", 0.0, 3)]
    assert art[0].tools == [TOOL] and art[0].messages_and_choices[2]["finish_reason"] == "tool_calls"
    assert art[0].messages_and_choices[2]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"


def test_parquet_export_through_the_gateway(through_gateway: dict[str, Any]) -> None:
    result, out = through_gateway["parquet"], through_gateway["out"]
    assert result.exit_code == 0, result.stderr
    assert result.stdout == (f"exported 2 trajectories (3 turns) as parquet to {out / 'pq' / 'trajectories.parquet'}"
                             f" and {out / 'pq' / 'turns.parquet'}\n")
    turns = duckdb.execute(f"select trajectory_id, depth from '{out / 'pq' / 'turns.parquet'}'").fetchall()
    assert sorted(turns) == [("chat/2", 0), ("trip-1", 0), ("trip-1", 1)]
    assert "fetching" in result.stderr and "2/2" in result.stderr  # the progress bar went to stderr


def test_list_and_show_through_the_gateway(through_gateway: dict[str, Any], made: dict[str, Any]) -> None:
    listed, shown = through_gateway["list"], through_gateway["show"]
    assert listed.returncode == 0 and json.loads(listed.stdout) == made["page"]  # the admin API's own page
    assert shown.exit_code == 0, shown.stderr  # no --gateway: the configured host and port answered
    detail = json.loads(shown.stdout)
    assert [t["depth"] for t in detail["turns"]] == [0, 1]
    assert detail["branches"] == [[t["id"] for t in detail["turns"]]]
    wrong = through_gateway["wrong_key"]  # $FLYWHEEL_ADMIN_KEY wins over the config
    assert wrong.exit_code == 2 and wrong.stderr.startswith("error: gateway answered 401"), wrong.stderr


def test_bad_input_is_one_line_and_exit_2(gateway: GatewayProcess, made: dict[str, Any], tmp_path: Path) -> None:
    target: list[str | Path] = ["--config", gateway.config_file, "--gateway", gateway.url]
    cases: list[tuple[list[str | Path], str]] = [
        (["export", "--format", "xml", "--out", tmp_path / "x", *target], "--format must be one of openai, art"),
        (["export", "--out", tmp_path, *target], "is a directory"),
        (["list", "--since", "last tuesday", *target], "Invalid value for 'since'"),
        (["show", "nope", *target], "no trajectory 'nope'"),
        (["delete", *target], "give a trajectory id or --client-key-id"),
        (["delete", "trip-1", *target], "without --yes"),
        (["list", *target, "--database", tmp_path / "x.duckdb"], "choose one"),
        (["list", "--gateway", f"http://127.0.0.1:{free_port()}"], "no gateway answers"),
        (["list", "--data-dir", tmp_path / "empty"], "no store at"),
    ]
    for args, says in cases:
        result = invoke(*args)
        assert result.exit_code == 2, (args, result.stdout, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], (args, result.stderr)


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
    when = {t["id"]: datetime.fromisoformat(t["created_at"]).strftime("%Y-%m-%d %H:%M:%S")
            for t in made["page"]["data"]}
    assert result.stdout == (
        "ID       ALIAS   STATUS   TURNS   BRANCHES   REWARD   CREATED (UTC)      \n"
        "─────────────────────────────────────────────────────────────────────────\n"
        f"chat/2   agent   open         1          1        -   {when['chat/2']}\n"
        f"trip-1   agent   open         2          1        -   {when['trip-1']}\n"
        "2 trajectories\n")


def test_file_gives_what_the_gateway_gave(stopped: Path, made: dict[str, Any], through_gateway: dict[str, Any],
                                          tmp_path: Path) -> None:
    config = stopped.parent.parent / "flywheel.toml"
    listed = invoke("list", "--json", "--config", config, env={"FLYWHEEL_PORT": str(free_port())})  # none answers
    assert listed.exit_code == 0, listed.stderr
    assert json.loads(listed.stdout) == made["page"]
    exported = invoke("export", "--format", "openai", "--out", tmp_path / "f.jsonl", "--data-dir", stopped.parent)
    assert exported.exit_code == 0, exported.stderr
    assert (tmp_path / "f.jsonl").read_text() == (through_gateway["out"] / "train.jsonl").read_text()
    direct = invoke("export", "--format", "parquet", "--out", tmp_path / "pq", "--database", stopped,
                    "--status", "open")
    assert direct.exit_code == 0, direct.stderr
    for name in ("trajectories.parquet", "turns.parquet"):  # a direct COPY and the gateway's scratch copy agree
        here, there = tmp_path / "pq" / name, through_gateway["out"] / "pq" / name
        assert rows(f"describe from '{here}'") == rows(f"describe from '{there}'")
        assert rows(f"(from '{here}' except from '{there}') union all (from '{there}' except from '{here}')") == []
    shown = invoke("show", "trip-1", "--database", stopped)
    assert shown.exit_code == 0, shown.stderr
    assert shown.stdout.startswith("trajectory trip-1\n  alias      agent\n  status     open\n")
    assert "calls get_weather" in shown.stdout and "echo grey" in shown.stdout and "branches (1):" in shown.stdout


def test_delete_on_the_file(stopped: Path) -> None:
    locked = duckdb.connect(str(stopped))  # another process holds the file: the CLI says so
    try:
        assert_bad_input(flywheel("list", "--database", stopped), "open in another process")
    finally:
        locked.close()
    deleted = invoke("delete", "chat/2", "--yes", "--database", stopped)
    assert deleted.exit_code == 0, deleted.stderr
    assert deleted.stdout == ("deleted trajectory chat/2: 1 trajectory, 1 turn, 0 scores, 0 feedback, "
                              "0 group memberships\n")
    remaining = invoke("list", "--json", "--database", stopped)
    assert [t["id"] for t in json.loads(remaining.stdout)["data"]] == ["trip-1"]
