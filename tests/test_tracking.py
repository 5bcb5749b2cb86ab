"""Experiment tracking: the loop's rounds, gate results and reward per version in W&B's offline run files.

W&B runs offline (no network, no key); the test reads the run file it wrote (``run-<id>.wandb``: W&B's
LevelDB-style log of protobuf records, decoded with the record types wandb ships) after the gateway
stopped, which finishes the runs.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from wandb.proto import wandb_internal_pb2

from tests.loop_story import tell
from tests.scripted_judge import ScriptedJudge
from tests.vllm_standin import VllmStandIn

_BLOCK = 32768  # the log's block size; a record never straddles a block's 7-byte-or-less tail
_HEADER = struct.Struct("<IHB")  # crc32, length, chunk type (full, first, middle, last)


def wandb_records(path: Path) -> Iterator[Any]:
    """The protobuf records of a ``.wandb`` file, chunks reassembled and checksums checked."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", "not a W&B run file"
    position, pending = 7, b""
    while position + _HEADER.size <= len(data):
        if _BLOCK - position % _BLOCK < _HEADER.size:  # block padding
            position += _BLOCK - position % _BLOCK
            continue
        checksum, length, kind = _HEADER.unpack_from(data, position)
        if length == 0 and kind == 0:
            break
        chunk = data[position + _HEADER.size:position + _HEADER.size + length]
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF == checksum, "corrupt record"
        position += _HEADER.size + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def history(run_dir: Path) -> list[dict[str, Any]]:
    """Every ``run.log`` row of the run, in order."""
    (run_file,) = run_dir.glob("run-*.wandb")
    rows = []
    for record in wandb_records(run_file):
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows


@pytest.fixture
def servers() -> Iterator[tuple[VllmStandIn, ScriptedJudge]]:
    with VllmStandIn() as vllm, ScriptedJudge() as judge:
        yield vllm, judge


@pytest.mark.slow  # a whole loop story, about a minute: the default run's budget (docs/engineering-notes.md)
def test_rounds_gates_and_rewards_per_version_reach_wandb(tmp_path: Path,
                                                         servers: tuple[VllmStandIn, ScriptedJudge]) -> None:
    tracking_dir = tmp_path / "wandb-files"
    story = tell(tmp_path, *servers, f'[tracking]\nreport_to = ["wandb"]\nmode = "offline"\n'
                                     f'project = "flywheel-test"\ndir = "{tracking_dir}"', full=False)
    metrics = httpx.get(f"{story.gateway.url}/metrics", timeout=10).text
    stored_rewards = httpx.get(f"{story.gateway.url}/flywheel/v1/status", headers={"authorization": "Bearer admin"},
                               timeout=60).json()["aliases"][0]["reward_by_version"]["versions"]
    story.gateway.stop()  # finishes the W&B runs: their files are complete
    (run_dir,) = (tracking_dir / "wandb").glob("offline-run-*")
    rows = history(run_dir)
    rejected, promoted = story.versions["rejected"], story.versions["promoted"]
    rounds = {row["version"]: row for row in rows if "losses/loss" in row}
    assert rounds[rejected]["losses/loss"] == 0.92 and rounds[rejected]["reward/mean"] == 0.41
    assert rounds[promoted]["losses/loss"] == 0.61 and rounds[promoted]["losses/approx_kl"] == 0.05
    online = {row["version"]: row for row in rows if "gate/online/p_better" in row}  # the last record per version
    assert online[promoted]["gate/online/p_better"] <= 0.05 and online[promoted]["gate/online/pairs"] >= 1
    assert online[rejected]["gate/online/p_worse"] <= 0.05
    assert any(row.get("gate/monitor/finished") == 1 and row["version"] == promoted for row in rows)
    serving = [row["serving/version"] for row in rows if "serving/version" in row]
    assert serving == [0, promoted, 0]  # base model, the promotion, the monitor's rollback
    live = [row for row in rows if "live_reward/mean" in row and row["version"] == promoted]
    last = live[-1] if live else {}
    assert 1 <= last["live_reward/n"] <= stored_rewards[str(promoted)]["n"]  # logged as the store counted them
    assert last["live_reward/low"] < last["live_reward/mean"] < last["live_reward/high"]
    assert 'flywheel_tracking_records_total{outcome="logged"}' in metrics
    assert 'flywheel_tracking_records_total{outcome="dropped"} 0.0' in metrics
    assert 'flywheel_tracking_records_total{outcome="failed"} 0.0' in metrics
