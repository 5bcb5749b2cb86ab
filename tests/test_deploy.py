"""deploy/: every file parses, and every ``flywheel`` command, flag, config key and ``FLYWHEEL_*`` variable it uses
exists in the CLI (``gateway/cli/main.py``) and the config schema (``gateway/core/config.py``); docs/deploy.md's
commands too. The images themselves are built and run on GPU machines only (docs/deploy.md says so)."""

from __future__ import annotations

import json
import re
import shlex
import tomllib
import types
import typing
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml
from pydantic import BaseModel

from flywheel.gateway.cli import app
from flywheel.gateway.core.config import CLI_VARIABLES, Settings, load_settings

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
CLI = typer.main.get_command(app)
# FLYWHEEL_* variables the CLI reads itself (not config keys), e.g. FLYWHEEL_ADMIN_KEY.
READ_BY_CODE = CLI_VARIABLES
SHELL_ENDS = {";", "&&", "||", "|", "&", ">", ">>", "<", "(", ")", "done", "fi", "then", "do"}


# -- what a file uses ------------------------------------------------------------------------------------------

def flywheel_commands(script: str) -> list[list[str]]:
    """Each ``flywheel ...`` invocation in a shell script: its words up to the end of the command."""
    found = []
    for line in script.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        words = list(lexer)
        at_start = True  # where a command name stands: first, after an operator, after VAR=value words
        for index, word in enumerate(words):
            assignment_or_exec = ("=" in word and word[0] != "-") or word == "exec"
            starts, at_start = at_start, word in SHELL_ENDS or (at_start and assignment_or_exec)
            if starts and (word == "flywheel" or word.endswith("/bin/flywheel")):
                command = []
                for token in words[index + 1:]:
                    if token in SHELL_ENDS:
                        break
                    command.append(token)
                found.append(command)
    return found


def check_command(words: list[str]) -> None:
    """The subcommand exists and takes every ``--flag`` given."""
    command: Any = CLI
    rest = list(words)
    while hasattr(command, "commands") and rest and not rest[0].startswith("-"):  # a group: the next word
        name = rest.pop(0)
        assert name in command.commands, f"flywheel has no command {name!r} ({' '.join(words)})"
        command = command.commands[name]
    assert command is not CLI, f"no flywheel subcommand in {' '.join(words)!r}"
    options = {opt for param in command.params for opt in (*param.opts, *param.secondary_opts)} | {"--help"}
    for word in rest:
        if word.startswith("--"):
            flag = word.split("=", 1)[0]
            assert flag in options, f"flywheel {command.name} has no option {flag} ({' '.join(words)})"


def _models(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation may hold (``X``, ``X | None``, ``A | B``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [m for arg in typing.get_args(annotation) for m in _models(arg)]
    return []


def check_key(path: list[str], model: type[BaseModel] = Settings) -> None:
    """``path`` (``["capture", "database"]``, ``["engines", "vllm", "base_url"]``) names a config key."""
    name, rest = path[0], path[1:]
    assert name in model.model_fields, f"config: {model.__name__} has no key {name!r}"
    annotation = model.model_fields[name].annotation
    if not rest:
        return
    if typing.get_origin(annotation) is dict:  # engines.<name>, aliases.<name>: a free key, then the value's model
        annotation, rest = typing.get_args(annotation)[1], rest[1:]
        if not rest:
            return
    candidates = _models(annotation)
    assert candidates, f"config: {name!r} is a value, not a table ({'.'.join(path)})"
    errors = []
    for candidate in candidates:
        try:
            check_key(rest, candidate)
            return
        except AssertionError as exc:
            errors.append(str(exc))
    raise AssertionError("; ".join(errors))


def check_toml_keys(table: dict[str, Any], prefix: list[str] | None = None) -> None:
    for key, value in table.items():
        path = [*(prefix or []), key]
        if isinstance(value, dict) and path[-1] not in ("routes", "args", "headers", "extra_litellm_params"):
            check_toml_keys(value, path)
        else:
            check_key(path)


def check_environment(environment: dict[str, Any]) -> None:
    for name in environment:
        if not name.startswith("FLYWHEEL_") or name in READ_BY_CODE:
            continue
        check_key(name.removeprefix("FLYWHEEL_").lower().split("__"))


def dockerfile(path: Path) -> list[tuple[str, str]]:
    """(instruction, arguments) per instruction, continuation lines joined."""
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            instruction, _, args = line.partition(" ")
            out.append((instruction.upper(), args.strip()))
    return out


def exec_form(args: str) -> str:
    """A CMD/HEALTHCHECK argument list as one shell line (``sh -c`` scripts unwrapped)."""
    words = json.loads(args) if args.startswith("[") else shlex.split(args)
    if words[:2] == ["sh", "-c"]:
        return str(words[2])
    return shlex.join(words)


# -- the checkers on themselves ----------------------------------------------------------------------------------

def test_the_checks_catch_what_does_not_exist() -> None:
    with pytest.raises(AssertionError, match="no command"):
        check_command(["serv"])
    with pytest.raises(AssertionError, match="no option --prot"):
        check_command(["serve", "--prot", "8000"])
    check_command(["trajectories", "export", "--format", "openai", "--out", "x.jsonl"])
    with pytest.raises(AssertionError, match="no key 'databse'"):
        check_key(["capture", "databse"])
    with pytest.raises(AssertionError):
        check_key(["engines", "vllm", "base_ulr"])
    check_key(["engines", "vllm", "base_url"])
    assert flywheel_commands("while true; do flywheel train --alias a || echo x; sleep 1; done") == [
        ["train", "--alias", "a"]]
    assert flywheel_commands("sky launch -c flywheel task.yaml\nK=v ~/env/bin/flywheel serve --port 1") == [
        ["serve", "--port", "1"]]
    assert flywheel_commands('exec flywheel trainer --gateway "$URL"') == [["trainer", "--gateway", "$URL"]]


# -- the files -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["flywheel.compose.toml", "flywheel.skypilot.toml", "flywheel.example.toml",
                                  "flywheel.remote-gpu.toml"])
def test_configs_use_only_keys_that_exist_and_load(name: str) -> None:
    path = DEPLOY / name
    check_toml_keys(tomllib.loads(path.read_text()))
    load_settings(path)


def test_gateway_image_is_slim_non_root_and_health_checked() -> None:
    steps = dockerfile(DEPLOY / "Dockerfile.gateway")
    froms = [args for instruction, args in steps if instruction == "FROM"]
    assert froms[-1].startswith("python:3.11-slim")
    users = [args for instruction, args in steps if instruction == "USER"]
    assert users and users[-1] not in ("root", "0")
    installs = " ".join(args for instruction, args in steps if instruction == "RUN" and "pip install" in args)
    assert ".[gateway]" in installs and "[train]" not in installs and "torch" not in installs
    for instruction, args in steps:
        if instruction == "COPY" and "--from" not in args:
            for source in args.split()[:-1]:
                assert (ROOT / source).exists(), f"COPY {source}: not in the repository"
    (health,) = [args for instruction, args in steps if instruction == "HEALTHCHECK"]
    assert "/healthz" in health
    (cmd,) = [exec_form(args) for instruction, args in steps if instruction == "CMD"]
    commands = flywheel_commands(cmd)
    assert commands and commands[0][0] == "serve"
    for command in commands:
        check_command(command)
    check_toml_keys(tomllib.loads((DEPLOY / "flywheel.compose.toml").read_text()))
    envs = dict(word.split("=", 1) for instruction, args in steps if instruction == "ENV" for word in args.split())
    check_environment(envs)


def test_trainer_image_has_cuda_torch_and_runs_the_trainer_worker() -> None:
    steps = dockerfile(DEPLOY / "Dockerfile.trainer")
    assert next(args for instruction, args in steps if instruction == "FROM").startswith("nvidia/cuda:")
    users = [args for instruction, args in steps if instruction == "USER"]
    assert users and users[-1] not in ("root", "0")
    installs = " ".join(args for instruction, args in steps if instruction == "RUN")
    assert "torch" in installs and ".[train]" in installs
    for instruction, args in steps:
        if instruction == "COPY":
            for source in args.split()[:-1]:
                assert (ROOT / source).exists(), f"COPY {source}: not in the repository"
    (cmd,) = [exec_form(args) for instruction, args in steps if instruction == "CMD"]
    commands = flywheel_commands(cmd)
    assert [c[0] for c in commands] == ["trainer"] and "--gateway" in commands[0]
    for command in commands:
        check_command(command)


def test_compose_has_the_stack_with_health_checks_and_a_shared_adapter_volume() -> None:
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"gateway", "vllm", "postgres", "trainer"} <= set(services)
    for name in ("gateway", "vllm", "postgres"):
        assert services[name]["healthcheck"]["test"], name
    vllm = services["vllm"]
    assert "--enable-lora" in vllm["command"]
    assert vllm["environment"]["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    gateway = services["gateway"]
    assert gateway["environment"]["FLYWHEEL_CAPTURE__DATABASE"].startswith("postgresql://")
    assert "postgres" in gateway["depends_on"] and "vllm" in gateway["depends_on"]

    def data_volume(service: dict[str, Any]) -> str:
        (mount,) = [v for v in service["volumes"] if v.split(":")[1] == "/data"]
        return str(mount.split(":")[0])

    shared = {data_volume(services[name]) for name in ("gateway", "vllm", "trainer")}
    assert len(shared) == 1 and shared <= set(compose["volumes"])  # one named volume: the adapters' paths agree
    config = tomllib.loads((DEPLOY / "flywheel.compose.toml").read_text())
    assert config["data_dir"] == "/data" and config["train"]["workers"] is True
    for name, service in services.items():
        build = service.get("build")
        if build:
            assert (DEPLOY / build["context"] / build["dockerfile"]).is_file(), name
        check_environment(service.get("environment") or {})
        command = service.get("command")
        if command:
            script = command[2] if command[:2] == ["sh", "-c"] else shlex.join(command)
            for words in flywheel_commands(script):
                check_command(words)
    assert [c[0] for c in flywheel_commands(services["trainer"]["command"][2])] == ["trainer"]


def test_skypilot_task_runs_vllm_with_lora_and_the_gateway() -> None:
    task = yaml.safe_load((DEPLOY / "skypilot.yaml").read_text())
    assert {"resources", "setup", "run", "envs"} <= set(task)
    assert task["resources"]["accelerators"] and task["resources"]["ports"] == 8000
    assert task["envs"]["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert "--enable-lora" in task["run"]
    check_environment(task["envs"])
    commands = flywheel_commands(task["run"])
    assert [c[0] for c in commands] == ["serve"]
    for words in commands:
        check_command(words)
        if "--config" in words:
            assert (ROOT / words[words.index("--config") + 1]).is_file()


@pytest.mark.parametrize("name", ["skypilot-trainer.yaml", "skypilot-gpu.yaml"])
def test_skypilot_gpu_tasks_run_the_trainer_worker_against_a_gateway(name: str) -> None:
    task = yaml.safe_load((DEPLOY / name).read_text())
    assert {"resources", "setup", "run", "envs"} <= set(task) and task["resources"]["accelerators"]
    assert ".[train]" in task["setup"]
    check_environment(task["envs"])
    commands = flywheel_commands(task["run"])
    assert commands and {c[0] for c in commands} == {"trainer"} and all("--gateway" in c for c in commands)
    for words in commands:
        check_command(words)


def test_the_gpu_task_serves_vllm_with_lora_where_the_gateway_s_adapters_are() -> None:
    task = yaml.safe_load((DEPLOY / "skypilot-gpu.yaml").read_text())
    config = load_settings(DEPLOY / "flywheel.remote-gpu.toml")
    assert task["envs"]["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert "--enable-lora" in task["run"] and "--api-key" in task["run"] and task["resources"]["ports"] == 8001
    assert str(config.data_dir / "adapters") in task["file_mounts"]  # vLLM loads the path the gateway names
    assert config.train.workers and "--shared" in flywheel_commands(task["run"])[0]
    assert config.aliases["agent"].train_model == task["envs"]["MODEL"]


def test_deploy_docs_use_only_commands_and_keys_that_exist() -> None:
    doc = (ROOT / "docs" / "deploy.md").read_text()
    blocks = re.findall(r"```(\w*)\n(.*?)```", doc, flags=re.S)
    commands = [words for kind, body in blocks if kind in ("bash", "sh", "") for words in flywheel_commands(body)]
    assert {"serve", "export-adapter", "train"} <= {c[0] for c in commands}
    for words in commands:
        check_command(words)
    for kind, body in blocks:
        if kind == "toml":
            check_toml_keys(tomllib.loads(body))
    for name in re.findall(r"\b(FLYWHEEL_[A-Z_]+)=", doc):
        check_environment({name: ""})
    for path in re.findall(r"\bdeploy/[\w.-]+", doc):
        assert (ROOT / path).exists(), path
