"""One loop across replicas: two gateways on one real PostgreSQL store elect one leader (the advisory lock in
``gateway/serving/loop/leader.py``); only it runs the loop's jobs, the other follows what the store says serves,
and takes the loop over when the leader is killed.

The engine is the vLLM stand-in (``tests/vllm_standin.py``) both replicas share, as they would share one
vLLM server; the store is a database on the session's PostgreSQL server (``tests/postgres.py``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.gateway_process import GatewayProcess
from tests.test_loop_versions import admin, fake_adapter, served_by, start
from tests.vllm_standin import VllmStandIn
from tests.waiting import wait_for

FOLLOW_S = 0.5  # replicas.follow_s and campaign_s: a switch or a takeover within about this


def replica(tmp_path: Path, vllm: VllmStandIn, database: str, name: str) -> GatewayProcess:
    return start(tmp_path, vllm, f"""
[capture]
database = "{database}"
[replicas]
follow_s = {FOLLOW_S}
campaign_s = {FOLLOW_S}
""", name=name)


def role(gateway: GatewayProcess) -> str:
    value: str = admin(gateway, "GET", "/status")["replica"]["role"]
    return value


def run_job(gateway: GatewayProcess, job: str) -> dict[str, Any]:
    return admin(gateway, "POST", "/loop/run", json={"job": job})


def run_by_hand(gateway: GatewayProcess, job: str) -> dict[str, Any]:
    """A job run through the admin API once the loop's own run of it is over: a new leader runs its jobs at once,
    and a run asked for meanwhile answers "busy"."""
    def finished() -> dict[str, Any] | None:
        result = run_job(gateway, job)
        return None if result["status"] == "busy" else result

    return wait_for(finished, f"{job} run by hand", 30)


def test_one_leader_runs_the_loop_the_other_follows_and_takes_over_when_it_dies(tmp_path: Path, vllm: VllmStandIn,
                                                                                  postgres_url: str) -> None:
    first = replica(tmp_path, vllm, postgres_url, "first")
    second = replica(tmp_path, vllm, postgres_url, "second")
    try:
        assert (role(first), role(second)) == ("leader", "follower")  # the first to campaign holds the lock
        assert run_job(first, "close_idle")["status"] == "idle"  # run: nothing to close yet
        assert run_job(second, "close_idle")["status"] == "follower"  # a follower never runs the loop's jobs

        # A version promoted on the leader: the follower serves it too, through the store, within follow_s.
        candidate = admin(first, "POST", "/aliases/agent/candidates", json={"path": fake_adapter(tmp_path, "v1")})
        admin(first, "POST", "/aliases/agent/promote", json={"version": candidate["version"]})
        switched_at = time.monotonic()
        follower = openai.OpenAI(base_url=f"{second.url}/v1", api_key="x", max_retries=0)
        wait_for(lambda: served_by(follower)[0] == "agent@1", "the follower to serve the promoted version", 30)
        # Bounded by follow_s plus the engine's answer (generous here: two CPUs shared with other tests).
        assert time.monotonic() - switched_at < FOLLOW_S + 10

        # The leader dies without a word (SIGKILL): its connection closes, the lock is free, the follower leads.
        assert first.proc is not None
        first.proc.kill()
        first.proc.wait(timeout=30)
        killed_at = time.monotonic()
        wait_for(lambda: role(second) == "leader", "the follower to take the loop over", 30)
        assert time.monotonic() - killed_at < FOLLOW_S + 10
        assert run_by_hand(second, "close_idle")["status"] == "idle"
        assert served_by(follower)[0] == "agent@1"  # the promotion outlives its leader

        # A replica that joins now follows the new leader.
        third = replica(tmp_path, vllm, postgres_url, "third")
        try:
            assert role(third) == "follower"
            assert served_by(openai.OpenAI(base_url=f"{third.url}/v1", api_key="x", max_retries=0))[0] == "agent@1"
        finally:
            third.stop()
    finally:
        first.stop()
        second.stop()


def test_a_stopped_leader_hands_over_at_once(tmp_path: Path, vllm: VllmStandIn, postgres_url: str) -> None:
    """SIGTERM: the leader closes its connection on the way out, so the follower's next campaign takes over."""
    first = replica(tmp_path, vllm, postgres_url, "first")
    second = replica(tmp_path, vllm, postgres_url, "second")
    try:
        assert (role(first), role(second)) == ("leader", "follower")
        first.stop()
        wait_for(lambda: role(second) == "leader", "the follower to take the loop over", 30)
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{first.url}/healthz", timeout=2)
    finally:
        first.stop()
        second.stop()
