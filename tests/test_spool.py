"""The spool between two processes: appends racing a take never lose a line (capture/recorder.py: Spool)."""

from __future__ import annotations

import multiprocessing
from datetime import UTC, datetime
from pathlib import Path

from flywheel.capture.recorder import Spool
from flywheel.capture.turns import PreparedTurn


def turn(writer: int, i: int) -> PreparedTurn:
    return PreparedTurn(row={"id": f"turn_{writer}_{i}", "created_at": datetime(2026, 1, 1, tzinfo=UTC)},
                        explicit_trajectory_id=None)


def append_many(path: Path, writer: int, n: int) -> None:
    spool = Spool(path)
    for i in range(n):
        spool.append([turn(writer, i)])


def test_appends_from_two_processes_racing_takes_lose_nothing(tmp_path: Path) -> None:
    path = tmp_path / "spool" / "turns.jsonl"
    spool = Spool(path)
    context = multiprocessing.get_context("spawn")
    writers = [context.Process(target=append_many, args=(path, w, 400)) for w in range(2)]
    for process in writers:
        process.start()
    taken: list[str] = []
    while any(p.is_alive() for p in writers):
        got = spool.take()
        if got is not None:
            moved, turns = got
            taken += [t.row["id"] for t in turns]
            moved.unlink()
    for process in writers:
        process.join()
        assert process.exitcode == 0
    rest = spool.take()
    taken += [t.row["id"] for t in rest[1]] if rest else []
    assert sorted(taken) == sorted(f"turn_{w}_{i}" for w in range(2) for i in range(400))
