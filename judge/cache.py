"""The judge's cache: its answers live in the store's ``scores`` table, keyed by content hash.

    cache = JudgeCache(engine)                       # a SQLAlchemy engine on the store
    scored = await ruler_score_group(group, "openai/o3", cache=cache)

One judging of a group is a *batch* of :class:`~flywheel.capture.models.Score` rows, one per
trajectory in group order, all with ``source="ruler"`` and the same ``cache_key``
(:func:`~flywheel.judge.ruler.ruler_cache_key`: judge model + rubric hash + prompt version + task +
the canonical JSON of the messages and tools). Row ids are ``rs_<batch>_<position>``, so a
batch reads back in order without a position column. The batch's first row carries the
call's tokens and cost; the others hold 0 tokens and a NULL cost, so ``SUM`` over the
table is what was really spent. A batch written for a cache hit (same content, other
trajectories) costs nothing and says so.

The rows are also the audit trail of the judge's scores: value, explanation, judge model,
rubric hash. Database calls are short synchronous statements on the caller's thread. A cache made
with ``deferred=True`` (the scoring job's) keeps new batches in memory until :meth:`take_unwritten`,
so they go in with the caller's own transaction: one write per scoring run, not one per judged group.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Iterable, Sequence
from contextlib import asynccontextmanager
from typing import Any

from sqlalchemy import Engine
from sqlmodel import Session, col, select

from flywheel.capture.linker import chunks
from flywheel.capture.models import Score
from flywheel.capture.store import bulk_insert
from flywheel.judge.rubric import PROMPT_VERSION
from flywheel.judge.ruler import RulerResult, RulerScore

SOURCE = "ruler"


def _batch_and_position(row_id: str) -> tuple[str, int]:
    """``rs_<batch>_<position>`` -> (batch, position)."""
    batch, _, position = row_id.rpartition("_")
    return batch, int(position)


def _by_batch(rows: Iterable[Score]) -> defaultdict[str, dict[str, list[Score]]]:
    """Rows by cache key, then by batch, each batch in position order."""
    found: defaultdict[str, dict[str, list[Score]]] = defaultdict(dict)
    for row in sorted(rows, key=lambda row: _batch_and_position(row.id)):
        found[row.cache_key or ""].setdefault(_batch_and_position(row.id)[0], []).append(row)
    return found


def placeholder_trajectory_id(position: int) -> str:
    """The id stored for an in-memory trajectory that has none: its label in the prompt."""
    return f"#{position + 1}"


class JudgeCache:
    """Judge answers stored as ``scores`` rows; :meth:`get` by content key, :meth:`put` after a call."""

    def __init__(self, engine: Engine, *, deferred: bool = False) -> None:
        self.engine = engine
        self.deferred = deferred
        self._unwritten: dict[str, list[Score]] = {}  # deferred batches by key, each the key's first batch
        self._deferred_rows: list[Score] = []  # every deferred batch's rows, in the order they were put
        self._fetched: dict[str, dict[str, list[Score]]] = {}  # prefetch()'s stored batches by key, misses too
        self._claims: dict[str, asyncio.Lock] = {}
        self._claimants: defaultdict[str, int] = defaultdict(int)

    @asynccontextmanager
    async def claim(self, key: str) -> AsyncIterator[None]:
        """Hold ``key`` while checking, calling and storing, so concurrent equal groups pay once.

        Only within this process (one event loop); the store is single-writer anyway.
        """
        lock = self._claims.setdefault(key, asyncio.Lock())
        self._claimants[key] += 1
        try:
            async with lock:
                yield
        finally:
            self._claimants[key] -= 1
            if not self._claimants[key]:  # last one out forgets the key
                del self._claimants[key]
                del self._claims[key]

    def _batches(self, session: Session, key: str) -> dict[str, list[Score]]:
        if key in self._fetched:
            return self._fetched[key]
        rows = session.exec(select(Score).where(Score.cache_key == key, Score.source == SOURCE)).all()
        return _by_batch(rows)[key]

    def prefetch(self, keys: Iterable[str]) -> None:
        """Read the stored batches of all ``keys`` at once: :meth:`get` then answers them, hit or miss, from memory."""
        wanted = sorted(set(keys) - self._fetched.keys())
        with Session(self.engine) as session:
            for chunk in chunks(wanted, 500):
                found = _by_batch(session.exec(select(Score).where(col(Score.cache_key).in_(chunk),
                                                                   Score.source == SOURCE)).all())
                self._fetched.update({key: found[key] for key in chunk})

    def get(self, key: str) -> RulerResult | None:
        """The stored answer for ``key`` (``cached=True``, no usage: nothing is paid now), or ``None``."""
        if key in self._unwritten:
            batches = {"unwritten": self._unwritten[key]}
        else:
            with Session(self.engine) as session:
                batches = self._batches(session, key)
        # Every batch under one key holds the same answer (later ones copy the first); any will do.
        for rows in batches.values():
            positions = [_batch_and_position(row.id)[1] for row in rows]
            if positions != list(range(len(rows))):
                continue  # not a whole batch (should not happen: batches are written in one transaction)
            scores = [RulerScore(trajectory_id=str(i + 1), explanation=row.explanation or "", score=row.value)
                      for i, row in enumerate(rows)]
            return RulerResult(scores=scores, judge_model=rows[0].judge_model or "",
                               rubric_hash=rows[0].rubric_hash or "", prompt_version=PROMPT_VERSION,
                               cache_key=key, cost_usd=0.0, cached=True)
        return None

    def put(self, key: str, result: RulerResult, trajectory_ids: Sequence[str | None],
            group_id: str | None = None, *, none_stored: bool = False) -> list[Score]:
        """Store ``result`` as one batch of rows; a batch already stored for the same trajectories is kept.

        ``trajectory_ids[i]`` is the store id of the trajectory scored by ``result.scores[i]``;
        ``None`` (an in-memory trajectory) is stored as ``#<i+1>``. ``none_stored``: :meth:`get` found no
        batch for ``key`` under the caller's :meth:`claim`, so none is looked for again. Returns the batch's rows.
        """
        if len(trajectory_ids) != len(result.scores):
            raise ValueError(f"{len(trajectory_ids)} trajectory ids for {len(result.scores)} scores")
        ids = [tid or placeholder_trajectory_id(i) for i, tid in enumerate(trajectory_ids)]
        with Session(self.engine, expire_on_commit=False) as session:
            stored = {} if none_stored else self._batches(session, key)
            for rows in [*stored.values(), self._unwritten.get(key, [])]:
                if rows and [row.trajectory_id for row in rows] == ids and rows[0].group_id == group_id:
                    return rows  # the same group again: never two batches for one judging
            batch = f"rs_{uuid.uuid4().hex[:16]}"
            rows = []
            for position, (trajectory_id, score) in enumerate(zip(ids, result.scores, strict=True)):
                carries_usage = position == 0 and not result.cached
                fields: dict[str, Any] = {
                    "id": f"{batch}_{position:04d}", "trajectory_id": trajectory_id, "group_id": group_id,
                    "source": SOURCE, "value": score.score, "explanation": score.explanation,
                    "judge_model": result.judge_model, "rubric_hash": result.rubric_hash, "cache_key": key,
                    "prompt_tokens": result.prompt_tokens if carries_usage else 0,
                    "completion_tokens": result.completion_tokens if carries_usage else 0,
                    "cost_usd": (result.cost_usd if carries_usage else None) if not result.cached else 0.0,
                    "prompt_version": result.prompt_version,
                }
                rows.append(Score(**fields))
            if self.deferred:
                self._unwritten.setdefault(key, rows)  # a later batch under the key holds the same answer
                self._deferred_rows.extend(rows)
                return rows
            bulk_insert(session, Score, [row.model_dump() for row in rows])  # one insert, not the ORM's flush
            session.commit()
        self._fetched.pop(key, None)  # read again when asked: it holds this batch now
        return rows

    def take_unwritten(self) -> list[dict[str, Any]]:
        """The deferred batches' rows, for the caller to insert (``bulk_insert``) in its transaction; forgotten here."""
        rows = [row.model_dump() for row in self._deferred_rows]
        for key in self._unwritten:
            self._fetched.pop(key, None)  # read again when asked: the caller is writing its batch
        self._deferred_rows.clear()
        self._unwritten.clear()
        return rows
