"""The loop's warm training child (serving/loop/training_child.py): one process per alias takes round after round,
keeping the base model loaded; a round asked while one runs is refused at once; one that dies mid-round is recorded
failed and the next round starts a fresh one. Real gateways on the tiny model, real GRPO rounds in the real child."""

from __future__ import annotations

import json
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import psutil

from tests.gateway_process import GatewayProcess
from tests.support import tiny_loop_config
from tests.test_loop_faults import training_children, versions
from tests.test_loop_versions import QUICK_FEEDBACK
from tests.waiting import wait_for

QUESTION = [{"role": "user", "content": "Who are you?"}]
JUDGE_OFF = "[judge]\nenabled = false\n" + QUICK_FEEDBACK


def capture_group(gateway: GatewayProcess, group_id: str) -> None:
    """Four answers in one explicit group, rewards 1, 0, 1, 0 (trainable whatever was said), grouped and scored."""
    for reward in (1.0, 0.0, 1.0, 0.0):
        reply = httpx.post(f"{gateway.url}/v1/chat/completions", timeout=60, headers={"X-Flywheel-Group-Id": group_id},
                           json={"model": "agent", "messages": QUESTION, "temperature": 1.0})
        httpx.post(f"{gateway.url}/flywheel/v1/feedback", timeout=60,
                   json={"completion_id": reply.json()["id"], "reward": reward}).raise_for_status()


def score(gateway: GatewayProcess) -> None:
    httpx.post(f"{gateway.url}/flywheel/v1/jobs/groups", timeout=60).raise_for_status()
    httpx.post(f"{gateway.url}/flywheel/v1/jobs/score", timeout=120).raise_for_status()


def train(gateway: GatewayProcess) -> dict[str, Any]:
    """One round now through the admin API: the loop's child trains the scored groups."""
    answer = httpx.post(f"{gateway.url}/flywheel/v1/aliases/agent/train", timeout=600, json={"promote": True})
    assert answer.status_code == 200, answer.text
    body: dict[str, Any] = answer.json()
    return body


def test_two_rounds_run_in_one_child_and_the_second_keeps_the_base_model(tmp_path: Path, tiny_model: Path) -> None:
    gateway = GatewayProcess(tmp_path, tiny_loop_config(tiny_model, JUDGE_OFF)).start()
    try:
        rounds, pids = [], []
        for n in range(2):
            capture_group(gateway, f"g{n}")
            score(gateway)
            rounds.append(train(gateway))
            pids.append([p.pid for p in training_children(gateway)])
        assert pids[0] == pids[1] and len(pids[0]) == 1, pids  # the child answered and stayed up for the next round
        assert [r["version"] for r in rounds] == [1, 2] and all(r["status"] == "finished" for r in rounds)
        assert rounds[0]["metrics"]["charts/model_load_seconds"] > 0
        assert rounds[1]["metrics"]["charts/model_load_seconds"] == 0
        cached = [json.loads((Path(r["adapter_path"]) / "flywheel_round.json").read_text())
                  ["config"]["derived"]["base_model_cached"] for r in rounds]
        assert cached == [False, True]
        recorded = {v["version"]: v for v in versions(gateway)}
        assert {1, 2} <= recorded.keys() and recorded[2]["status"] == "promoted"
        assert recorded[1]["metrics"]["samples/groups_trained"] == recorded[2]["metrics"]["samples/groups_trained"] == 1
    finally:
        gateway.stop()
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
                   for pid in pids[0])  # stopped with the gateway


def test_a_round_asked_while_one_runs_is_refused_at_once(tmp_path: Path, tiny_model: Path) -> None:
    gateway = GatewayProcess(tmp_path, tiny_loop_config(tiny_model, JUDGE_OFF)).start()
    try:
        capture_group(gateway, "g0")
        score(gateway)
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(train, gateway)
            wait_for(lambda: training_children(gateway), what="the first round's child")  # started inside its round
            second = httpx.post(f"{gateway.url}/flywheel/v1/aliases/agent/train", timeout=60, json={})
            assert second.status_code == 409 and "one round at a time" in second.text, second.text
            assert first.result()["status"] == "finished"
    finally:
        gateway.stop()


def test_a_child_killed_mid_round_is_recorded_failed_and_the_next_round_starts_a_fresh_one(
        tmp_path: Path, tiny_model: Path) -> None:
    gateway = GatewayProcess(tmp_path, tiny_loop_config(tiny_model, JUDGE_OFF + """
[groups]
form_every_s = 0.5
[loop]
tick_s = 0.5
score_every_s = 0.5
min_groups = 1
[loop.gate]
offline = false
[loop.canary]
enabled = false
""")).start()
    try:
        capture_group(gateway, "g0")
        first = wait_for(lambda: training_children(gateway), what="a training child")[0]
        wait_for(lambda: [v for v in versions(gateway) if v["status"] == "training"], timeout_s=300,
                 what="the child to reserve its version")
        first.send_signal(signal.SIGKILL)  # dies without a word while the loop waits for its reply
        failed = wait_for(lambda: [v for v in versions(gateway) if v["status"] == "failed"], what="the failed round")
        assert "the training process exited with -9;" in failed[0]["reason"]
        promoted = wait_for(lambda: [v for v in versions(gateway) if v["status"] == "promoted"], timeout_s=300,
                            what="the next round, in a fresh child, promoted")[0]
        assert promoted["version"] == failed[0]["version"] + 1
        # the dead round's group is trained, not lost (a task group of the same requests may have formed too)
        assert promoted["metrics"]["samples/groups_trained"] >= 1
        assert [p.pid for p in training_children(gateway)] != [first.pid]
    finally:
        gateway.stop()


def test_a_round_with_nothing_to_train_or_a_bad_argument_reserves_nothing_and_starts_no_child(
        tmp_path: Path, tiny_model: Path) -> None:
    gateway = GatewayProcess(tmp_path, tiny_loop_config(tiny_model, JUDGE_OFF)).start()
    try:
        refused = httpx.post(f"{gateway.url}/flywheel/v1/aliases/agent/train", timeout=60,
                             json={"args": {"max_stepz": 3}})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "args", refused.text
        assert "GRPOArgs has no field 'max_stepz'" in refused.json()["error"]["message"]
        nothing = httpx.post(f"{gateway.url}/flywheel/v1/aliases/agent/train", timeout=60, json={})
        assert nothing.status_code == 200 and (nothing.json()["status"], nothing.json()["version"]) == ("skipped", None)
        assert versions(gateway) == [] and training_children(gateway) == []
    finally:
        gateway.stop()
