"""``[train] workers``: the gateway's loop never trains itself; a trainer worker (``flywheel train --gateway``, a
real GRPO round on the tiny model in its own process) gets a batch only when the loop would train, and the
loop's gate takes what it reports. The engine is the vLLM stand-in, which loads the new version.

``flywheel trainer`` is the long-running worker of another machine: two of them run against one gateway,
train in their own scratch directories, download the version they continue from and upload the one
they trained; they never take the same round. The upload route takes version archives only."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from flywheel.trainer import adapters
from tests.gateway_process import GatewayProcess
from tests.test_loop_versions import ADMIN, admin, status
from tests.vllm_standin import BASE, VllmStandIn
from tests.waiting import wait_for


def worker(gateway: GatewayProcess, *args: str) -> tuple[dict[str, Any], str]:
    """One ``flywheel train`` run as a worker on another machine would: the admin API only. Its last line (JSON),
    and all it printed."""
    done = subprocess.run([sys.executable, "-m", "flywheel.gateway",
                           "train", "--alias", "agent", "--gateway", gateway.url,
                           "--json", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "FLYWHEEL_ADMIN_KEY": "admin"}, cwd=gateway.dir)
    assert done.returncode == 0, done.stdout + done.stderr
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result, done.stdout


def workers_config(vllm: VllmStandIn, tiny_model: Path) -> str:
    return f"""
[engines.vllm]
base_url = "{vllm.base_url}"
[aliases.agent]
engine = "vllm"
base_model = "{BASE}"
train_model = "{tiny_model}"
[auth]
admin_key = "admin"
[judge]
enabled = false
[groups]
form_every_s = 0.5
[train]
workers = true
[train.args]
precision = "fp32"
max_steps = 1
gradient_accumulation_steps = 1
max_prompt_tokens = 128
max_completion_tokens = 32
[loop]
tick_s = 0.5
score_every_s = 0.5
min_groups = 2
[loop.gate]
offline = false
[loop.canary]
enabled = false
"""


def send_groups(gateway: GatewayProcess, first: int, count: int) -> None:
    """``count`` explicit groups of two conversations, rewards 0 and 1; feedback closes each conversation."""
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
    for index in range(2 * first, 2 * (first + count)):
        reply = client.chat.completions.create(
            model="agent", messages=[{"role": "user", "content": "name a colour"}],
            extra_headers={"X-Flywheel-Group-Id": f"colours-{index // 2}"})
        feedback = httpx.post(f"{gateway.url}/flywheel/v1/feedback", headers=ADMIN, timeout=30,
                              json={"completion_id": reply.id, "reward": float(index % 2)})
        assert feedback.status_code == 200, feedback.text


@pytest.mark.slow  # real rounds in worker processes, most of a minute each
def test_a_worker_trains_only_when_the_loop_would_and_the_gate_takes_its_round(tmp_path: Path, vllm: VllmStandIn,
                                                                                 tiny_model: Path) -> None:
    gateway = GatewayProcess(tmp_path, workers_config(vllm, tiny_model)).start()
    try:
        assert worker(gateway)[0]["status"] == "nothing"  # no scored group yet: nothing handed out
        send_groups(gateway, 0, 2)
        wait_for(lambda: status(gateway)["pending"]["scored_groups"] == 2, "the loop to score both groups")
        # Due now, but the gateway does not train itself: its train job says so.
        wait_for(lambda: "wait for a trainer worker" in ((status(gateway)["jobs"].get("train") or {}).get("detail")
                                                         or ""), "the loop's train job to see a round due")
        assert [row["status"] for row in admin(gateway, "GET", "/aliases/agent/versions")["data"]] == []

        # The round as on a multi-GPU box, through accelerate's launcher (one CPU process here): the same code.
        accelerate = Path(sys.executable).parent / "accelerate"
        round_, printed = worker(gateway, "--launch", f"{accelerate} launch --num_processes 1 --cpu")
        assert '"seconds":' in printed  # flywheel.trainer.grpo's own summary: the round ran in the launched process
        assert (round_["status"], round_["version"], round_["groups"]) == ("finished", 1, 2), round_
        assert (Path(round_["adapter_path"]) / "adapter_config.json").is_file()
        # The loop's gate (offline and canary off here) promotes what the worker reported; the engine loads it.
        wait_for(lambda: status(gateway)["serving"]["version"] == 1, "the loop to promote the worker's round")
        assert "agent@1" in vllm.loras
        assert worker(gateway)[0]["status"] == "nothing"  # the groups are trained: nothing handed out twice
        # Two workers never train one alias at once: a reservation while a version is in flight is refused.
        assert admin(gateway, "POST", "/training/versions", json={"alias": "agent"})["version"] == 2
        second = httpx.post(f"{gateway.url}/flywheel/v1/training/versions", headers=ADMIN, timeout=30,
                            json={"alias": "agent"})
        assert second.status_code == 400 and "one round at a time" in second.text, second.text
    finally:
        gateway.stop()


def trainer_worker(gateway: GatewayProcess, workdir: Path, base_model: Path) -> subprocess.Popen[str]:
    """``flywheel trainer`` as on a GPU box: its own scratch directory and copy of the base weights, the gateway
    reached over HTTP only."""
    workdir.mkdir(parents=True)
    shutil.copytree(base_model, workdir / "base")
    return subprocess.Popen([sys.executable, "-m", "flywheel.gateway",
                             "trainer", "--gateway", gateway.url, "--admin-key",
                             "admin", "--workdir", str(workdir / "scratch"), "--base-model", str(workdir / "base"),
                             "--poll-s", "0.3"], cwd=workdir, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)


@pytest.mark.slow  # real rounds in worker processes, most of a minute each
def test_trainer_workers_download_train_and_upload_and_never_share_a_round(tmp_path: Path, vllm: VllmStandIn,
                                                                            tiny_model: Path) -> None:
    gateway = GatewayProcess(tmp_path, workers_config(vllm, tiny_model)).start()
    workers = [trainer_worker(gateway, tmp_path / f"worker-{n}", tiny_model) for n in (1, 2)]
    try:
        for round_, version in ((0, 1), (1, 2)):  # the second round continues from the first one's adapter
            send_groups(gateway, 2 * round_, 2)
            wait_for(lambda v=version: status(gateway)["serving"]["version"] == v,
                     f"a worker's round to become version {version} and serve", timeout_s=300)
        rows = {row["version"]: row for row in admin(gateway, "GET", "/aliases/agent/versions")["data"]}
        assert sorted(rows) == [1, 2] and rows[1]["status"] == "retired" and rows[2]["status"] == "promoted", rows
        assert "agent@2" in vllm.loras
        # Uploaded, not written in place: the gateway's copy is byte for byte what a worker trained in its scratch.
        served = Path(rows[2]["path"])
        assert served.parent == gateway.dir / "data" / "adapters" / "agent"
        weights = (served / adapters.ADAPTER_WEIGHTS).read_bytes()
        trained_in = [w for w in (tmp_path / "worker-1" / "scratch", tmp_path / "worker-2" / "scratch")
                      if (w / "agent" / "2" / adapters.ADAPTER_WEIGHTS).is_file()
                      and (w / "agent" / "2" / adapters.ADAPTER_WEIGHTS).read_bytes() == weights]
        assert len(trained_in) == 1, "version 2's weights are not the ones a worker trained"
        record = adapters.read_round_file(served)
        assert record["init_adapter"] == str(trained_in[0] / "agent" / "current"), record["init_adapter"]
        assert record["version"] == 2 and rows[2]["metrics"]["charts/optimizer_resumed"] == 1.0  # with v1's AdamW
        assert record["base_model"] == str(trained_in[0].parent / "base")  # the worker's copy of the weights ...
        assert rows[2]["base_model"] == str(tiny_model)  # ... recorded under the gateway's name
        runs = [{g["group_id"] for g in adapters.read_round_file(Path(rows[v]["path"]))["data"]["groups"]}
                for v in (1, 2)]
        assert runs[0] and runs[1] and not runs[0] & runs[1], runs  # no group trained twice
    finally:
        outputs = []
        for process in workers:
            process.send_signal(signal.SIGTERM)
            outputs.append(process.communicate(timeout=120)[0])
        gateway.stop()
    assert [process.returncode for process in workers] == [0, 0], outputs
    trained = [int(out.rsplit("trainer worker stopped: ", 1)[1].split()[0]) for out in outputs]
    assert sum(trained) == 2, outputs  # two rounds in all: none was trained by both


def test_the_upload_route_takes_a_reserved_version_s_archive_and_nothing_else(tmp_path: Path, vllm: VllmStandIn,
                                                                               tiny_model: Path) -> None:
    gateway = GatewayProcess(tmp_path, workers_config(vllm, tiny_model)).start()
    try:
        reserved = admin(gateway, "POST", "/training/versions", json={"alias": "agent"})
        url = f"{gateway.url}/flywheel/v1/training/adapters/agent/{reserved['version']}"

        def put(members: dict[str, bytes], kind: int = tarfile.REGTYPE) -> httpx.Response:
            buffer = io.BytesIO()
            with tarfile.open(fileobj=buffer, mode="w") as tar:
                for name, data in members.items():
                    info = tarfile.TarInfo(name)
                    info.type, info.size = kind, len(data) if kind == tarfile.REGTYPE else 0
                    info.linkname = "/etc/passwd" if kind == tarfile.SYMTYPE else ""
                    tar.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)
            return httpx.put(url, content=buffer.getvalue(), headers=ADMIN, timeout=30)

        lora = json.dumps({"peft_type": "LORA", "r": 8}).encode()
        for members, kind, named in (
                ({"../../escape.json": b"{}"}, tarfile.REGTYPE, "../../escape.json"),
                ({"hook.py": b"import os"}, tarfile.REGTYPE, "hook.py"),
                ({adapters.ADAPTER_WEIGHTS: b""}, tarfile.SYMTYPE, adapters.ADAPTER_WEIGHTS),
                ({adapters.ADAPTER_CONFIG: b'{"peft_type": "PROMPT_TUNING"}', adapters.ADAPTER_WEIGHTS: b""},
                 tarfile.REGTYPE, "LORA")):
            refused = put(members, kind)
            assert refused.status_code == 400 and named in refused.json()["error"]["message"], refused.text
        assert httpx.put(url, content=b"not a tar", headers=ADMIN, timeout=30).status_code == 400
        assert not any(Path(reserved["path"]).parent.glob("**/*.py")) and not (tmp_path / "escape.json").exists()
        assert not adapters.is_complete(reserved["path"])  # nothing half written

        assert put({adapters.ADAPTER_CONFIG: lora, adapters.ADAPTER_WEIGHTS: b""}).status_code == 200
        again = put({adapters.ADAPTER_CONFIG: lora, adapters.ADAPTER_WEIGHTS: b""})
        assert again.status_code == 409 and again.json()["error"]["code"] == "version_not_training", again.text
        fetched = httpx.get(url, headers=ADMIN, timeout=30)
        assert fetched.status_code == 200
        with tarfile.open(fileobj=io.BytesIO(fetched.content)) as tar:
            assert sorted(tar.getnames()) == sorted([adapters.ADAPTER_CONFIG, adapters.ADAPTER_WEIGHTS])
        missing = httpx.get(f"{gateway.url}/flywheel/v1/training/adapters/agent/99", headers=ADMIN, timeout=30)
        assert missing.status_code == 404 and missing.json()["error"]["param"] == "version"
        assert httpx.get(url, timeout=30).status_code == 401  # loopback, but the gateway has an admin key
    finally:
        gateway.stop()


def test_flywheel_trainer_refuses_what_it_cannot_do_in_one_line(tmp_path: Path, vllm: VllmStandIn,
                                                                  tiny_model: Path) -> None:
    from flywheel.gateway.core.processes import free_port

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "flywheel.gateway",
                               "trainer", *args], capture_output=True, text=True,
                              timeout=120, cwd=tmp_path)

    nobody = run("--gateway", f"http://127.0.0.1:{free_port()}", "--once")
    assert nobody.returncode == 2 and nobody.stderr.startswith("error: no gateway answers"), nobody.stderr
    assert "Traceback" not in nobody.stderr
    gateway = GatewayProcess(tmp_path / "gw", workers_config(vllm, tiny_model)).start()
    try:
        wrong = run("--gateway", gateway.url, "--admin-key", "admin", "--alias", "nope", "--once")
        assert wrong.returncode == 2 and "no alias named 'nope'" in wrong.stderr, wrong.stderr
        for flags, said in ((["--set", "learning_rat=1e-5"], "GRPOArgs has no field 'learning_rat'"),
                            (["--launch", "accelerate launch --config_file 'x"], "--launch: No closing quotation")):
            refused = run("--gateway", gateway.url, "--admin-key", "admin", *flags, "--once")
            assert refused.returncode == 2 and said in refused.stderr and "Traceback" not in refused.stderr, \
                refused.stderr
        once = run("--gateway", gateway.url, "--admin-key", "admin", "--once")  # nothing due: it asks and exits
        assert once.returncode == 0 and "0 rounds trained, 0 failed" in once.stdout, once.stdout + once.stderr
    finally:
        gateway.stop()
