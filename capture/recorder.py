"""The recorder: turns reach the store in batches, off the request path, and are never dropped.

- ``submit`` puts one exchange, still the JSON line the gateway streamed, on a bounded
  ``asyncio.Queue`` and returns at once.
- One writer task takes batches (up to ``batch_size`` turns or ``batch_wait_s`` after
  the first, or at once when a reader calls ``flush``); a worker thread parses,
  prepares and writes each in one transaction. Parsing waits for the worker: on the
  event loop it cost more, and the parsed dicts would sit in the queue for the cyclic
  garbage collector to walk again and again (docs/engineering-notes.md).
- When the queue is full, or a batch cannot be written, turns go (redacted) to an
  append-only spool file; they are re-ingested once the store accepts writes again.
  Re-ingesting is idempotent: turn ids are fixed before the spool, and stored ids are
  skipped.
- ``record_feedback`` hands over a client's feedback: it rides the batch that holds the lines submitted
  before it, written in the same transaction after their turns, and is answered when that batch commits;
  so a feedback costs no transaction and no early write of its own.
- ``drain`` (SIGTERM, shutdown) writes whatever is queued before the process exits.
- With ``link_wait_s`` (several gateway replicas on one PostgreSQL store), a turn whose last
  answer is not stored yet is held back and tried again with each batch, at least every
  ``batch_wait_s``, for up to ``link_wait_s`` (``capture/linker.py: ParentWait``; one behind an older held
  turn of its conversation waits for that one first).

Durability: a turn is durable once its batch commits (or it is spooled), at most ``batch_wait_s``
plus one batch's write time after ``submit`` (plus ``link_wait_s`` for a held turn). Every submitted
line is numbered; ``durable`` is the highest number up to which every line is durable, and
``on_durable`` hears each advance: the store process acknowledges the gateway's stream with it, and the
gateway keeps what is not acknowledged yet, so a SIGKILL of this process loses nothing (docs/capture.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import gc
import itertools
import logging
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import orjson

from flywheel.capture.feedback import FeedbackBatch, FeedbackItem, Recorded
from flywheel.capture.linker import ParentWait
from flywheel.capture.redaction import Redactor
from flywheel.capture.store import Store
from flywheel.capture.turns import PreparedTurn, prepare_lines

log = logging.getLogger("flywheel.recorder")


class Spool:
    """An append-only JSON-lines file of prepared turns the store could not take yet.

    Two processes append to it (the gateway, when the store process cannot take a turn; the
    store process, when the database cannot) and one takes it: ``flock`` on the file orders
    them, and an appender that opened the file before a take moved it aside writes again to
    the new one, so no line lands in a file already read.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def append(self, turns: list[PreparedTurn]) -> None:
        lines = b"".join(orjson.dumps(t.to_json()) + b"\n" for t in turns)
        while True:
            with self.path.open("ab") as spool:
                fcntl.flock(spool, fcntl.LOCK_EX)
                if not self._is_current(spool):
                    continue  # taken while we waited for the lock: append to the new file
                spool.write(lines)
                spool.flush()
                return

    def pending(self) -> bool:
        return self.path.exists() and self.path.stat().st_size > 0

    def take(self) -> tuple[Path, list[PreparedTurn]] | None:
        """Move the spool aside and read it; the caller deletes the moved file once written."""
        if not self.pending():
            return None
        taken = self.path.with_suffix(f".ingesting-{time.time_ns()}")
        with self.path.open("rb") as spool:
            fcntl.flock(spool, fcntl.LOCK_EX)  # no append is half-written while the file moves
            if not self._is_current(spool):
                return None
            self.path.rename(taken)
        return taken, self.read(taken)

    def leftovers(self) -> list[Path]:
        """Files moved aside by a take() whose write never finished (a crash): ingest them too."""
        return sorted(self.path.parent.glob(self.path.stem + ".ingesting-*"))

    def keep(self, turns: list[PreparedTurn], stats: Counter[str]) -> None:
        """Append ``turns``, counting them in ``stats`` as spooled, or as failed (lost) when even the
        spool cannot be written."""
        try:
            self.append(turns)
            stats["spooled"] += len(turns)
        except OSError:
            log.exception("spool write failed: %d turns lost", len(turns))
            stats["failed"] += len(turns)

    @staticmethod
    def read(path: Path) -> list[PreparedTurn]:
        return [PreparedTurn.from_json(orjson.loads(line)) for line in path.read_bytes().splitlines() if line.strip()]

    def _is_current(self, spool: BinaryIO) -> bool:
        """Whether the open file is still the one at ``path`` (a take() may have moved it)."""
        try:
            return os.stat(self.path).st_ino == os.fstat(spool.fileno()).st_ino
        except FileNotFoundError:
            return False


class FeedbackNotWritten(RuntimeError):
    """The batch a feedback rode could not be written to the store (its turns were spooled): not recorded."""

    def __init__(self) -> None:
        super().__init__("the store cannot be written to right now; the feedback was not recorded: send it again")


@dataclass(frozen=True)
class Waiting:
    """A feedback waiting for its batch: ``after``, the number of the last line submitted before it."""

    after: int
    item: FeedbackItem
    future: asyncio.Future[Recorded | None]


class Recorder:
    """Queue, writer task, spool and counters for captured turns, and the feedback that rides their batches."""

    def __init__(self, store: Store, spool: Spool, *, redactor: Redactor | None, queue_size: int, batch_size: int,
                 batch_wait_s: float, retry_s: float, link_wait_s: float = 0.0) -> None:
        self.store = store
        self.spool = spool
        self.redactor = redactor
        self.batch_size = batch_size
        self.batch_wait_s = batch_wait_s
        self.retry_s = retry_s
        # CapturedExchange lines, each with its number (``accepted`` when it was submitted)
        self.queue: asyncio.Queue[tuple[int, bytes]] = asyncio.Queue(maxsize=queue_size)
        self.accepted = 0  # lines submitted so far
        self.durable = 0  # every line numbered up to this is written, spooled, or failed for good
        self.on_durable: Callable[[int], None] | None = None
        # Turns queued, written, spooled, reingested, failed; how they were linked (link_*), evidence refused;
        # write transactions (batches) and the feedback they recorded
        self.stats: Counter[str] = Counter()
        self.store_ok = True
        self._task: asyncio.Task[None] | None = None
        self._retry_task: asyncio.Task[None] | None = None
        self._collecting: list[tuple[int, bytes]] = []  # the batch being filled (drain writes it too)
        self._writing: asyncio.Future[None] | None = None  # the batch being written (drain awaits it)
        self._write_now = asyncio.Event()  # set by flush(): write the batch being collected at once
        self._wake = asyncio.Event()  # set by record_feedback(): a batch is due even if no line comes
        self.waiting = ParentWait(link_wait_s)  # turns whose parent another replica may still be writing
        self._next: asyncio.Future[tuple[int, bytes]] | None = None  # the queue read in progress (kept over timeouts)
        self._held_lines: dict[str, int] = {}  # a held turn's id: its line's number (it is not durable yet)
        self._feedback: list[Waiting] = []  # feedback for the next batches, in arrival order
        self._taken = 0  # the number of the last line taken into a batch

    def submit(self, line: bytes) -> None:
        """Hand over a finished exchange (:meth:`CapturedExchange.to_line`); never blocks, never raises.
        Its number is ``accepted`` right after."""
        self.accepted += 1
        try:
            self.queue.put_nowait((self.accepted, line))
            self.stats["queued"] += 1
        except asyncio.QueueFull:
            self.spool.keep(prepare_lines([line], self.redactor, self.stats), self.stats)
        except Exception:  # capture must never fail a client request
            log.exception("could not capture an exchange (%d bytes)", len(line))
            self.stats["failed"] += 1

    def record_feedback(self, item: FeedbackItem) -> asyncio.Future[Recorded | None]:
        """Feedback on what was submitted so far: written with the batch holding those lines, after their turns.
        The future is what it recorded (None: no trajectory of the client's matched) once that batch commits,
        or :class:`FeedbackNotWritten` when the batch could not be written to the store."""
        future: asyncio.Future[Recorded | None] = asyncio.get_running_loop().create_future()
        self._feedback.append(Waiting(self.accepted, item, future))
        self._wake.set()
        return future

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="flywheel-recorder")
        self._retry_task = asyncio.create_task(self._reingest_loop(), name="flywheel-spool")

    async def drain(self) -> None:
        """Write everything queued and held (and try the spool once), then stop.

        A held turn still waits for its parent meanwhile (at most ``link_wait_s``): in a rolling restart the
        replica that answered it may be writing it right now."""
        for task in (self._task, self._retry_task):
            if task is not None:
                task.cancel()
        if self._writing is not None:
            await self._writing  # shielded from the cancel above: let the batch in flight commit
        batch, self._collecting = self._collecting, []
        if self._next is not None and self._next.done() and not self._next.cancelled():
            batch.append(self._next.result())  # read from the queue just before the cancel
        while not self.queue.empty():
            batch.append(self.queue.get_nowait())
        feedback, self._feedback = self._feedback, []
        if batch or feedback:
            await self._write(batch, feedback)
        while len(self.waiting):
            await asyncio.sleep(self.batch_wait_s)
            await self._write([])
        await self.reingest()

    async def flush(self, timeout_s: float = 10.0) -> None:
        """Write everything submitted so far now (or spool it), waiting at most ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        if self._unwritten():
            self._write_now.set()  # a reader is waiting: do not wait for the batch to fill
        while (self._unwritten() or self._writing is not None) and time.monotonic() < deadline:
            await asyncio.sleep(0.005)

    def _unwritten(self) -> bool:
        """Whether a line or a feedback waits for a batch. A line the pending read took off the queue is on its way
        to the batch (``_run`` resumes a step later)."""
        return (not self.queue.empty() or (self._next is not None and self._next.done()) or bool(self._collecting)
                or bool(self._feedback))

    async def _run(self) -> None:
        while True:
            # Held turns are tried again every batch_wait_s even when no new turn comes.
            line = await self._read(self.batch_wait_s if len(self.waiting) else None)
            if line is not None:
                self._collecting.append(line)
            if (line is not None or self._feedback) and self.queue.qsize() < self.batch_size - 1 \
                    and not self._write_now.is_set():
                with contextlib.suppress(TimeoutError):  # let the batch fill: one timer per batch, not per turn
                    await asyncio.wait_for(self._write_now.wait(), self.batch_wait_s)
            self._write_now.clear()
            self._wake.clear()
            if self._next is not None and self._next.done():  # a read woken by feedback took a line meanwhile
                self._collecting.append(self._next.result())
                self._next = None
            while len(self._collecting) < self.batch_size and not self.queue.empty():
                self._collecting.append(self.queue.get_nowait())
            batch, self._collecting = self._collecting, []
            self._writing = asyncio.ensure_future(self._write(batch, self._riding(batch)))
            await asyncio.shield(self._writing)
            self._writing = None

    async def _read(self, timeout_s: float | None) -> tuple[int, bytes] | None:
        """The next line from the queue, or None after ``timeout_s`` or when feedback arrives; the read stays
        pending for the next call (a cancelled ``queue.get`` could drop a line it had just taken)."""
        if self._next is None:
            self._next = asyncio.ensure_future(self.queue.get())
        woken: asyncio.Future[Any] = asyncio.ensure_future(self._wake.wait())
        reading: asyncio.Future[Any] = self._next
        try:
            await asyncio.wait({reading, woken}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            woken.cancel()
        if not self._next.done():
            return None
        line, self._next = self._next.result(), None
        return line

    def _riding(self, batch: list[tuple[int, bytes]]) -> list[Waiting]:
        """The feedback a batch carries: on lines up to its last one, or all of it once no line is left to take
        (a line the queue could not hold went to the spool, never to a batch)."""
        if batch:
            self._taken = batch[-1][0]
        drained = self.queue.empty() and not (self._next is not None and self._next.done())
        riding = [w for w in self._feedback if drained or w.after <= self._taken]
        self._feedback = [w for w in self._feedback if not (drained or w.after <= self._taken)]
        return riding

    async def _write(self, batch: list[tuple[int, bytes]], feedback: list[Waiting] | None = None) -> None:
        carried = FeedbackBatch([w.item for w in feedback or []])
        try:
            self.stats.update(await asyncio.to_thread(self._persist, batch, carried))
        except Exception:  # the writer task must outlive any batch: a dead one would leave every later turn queued
            log.exception("could not write or spool a batch of %d exchanges", len(batch))
            self.stats["failed"] += len(batch)
        if batch:
            self._advance(batch[-1][0])
        for waiting, recorded in itertools.zip_longest(feedback or [], carried.recorded):
            if waiting is None or waiting.future.done():  # a caller that gave up waiting
                continue
            if len(carried.recorded) == len(carried.items):
                waiting.future.set_result(recorded)
            else:
                waiting.future.set_exception(FeedbackNotWritten())

    def _advance(self, last: int) -> None:
        """Lines up to ``last`` (the batch just written) are durable, but for those with a turn still held."""
        held = self.waiting.ids()
        self._held_lines = {turn_id: line for turn_id, line in self._held_lines.items() if turn_id in held}
        durable = min([last, *(line - 1 for line in self._held_lines.values())])
        if durable > self.durable:
            self.durable = durable
            if self.on_durable is not None:
                self.on_durable(durable)

    def _persist(self, batch: list[tuple[int, bytes]], feedback: FeedbackBatch) -> Counter[str]:
        """Parse, prepare and write (or spool) one batch on the worker thread; returns what became of its turns.

        Everything the batch allocates dies here, on this thread, by reference counting: the cyclic
        garbage collector is off meanwhile, as it would only walk those objects again and again.
        """
        gc.disable()
        try:
            return self._prepare_and_write(batch, feedback)
        finally:
            gc.enable()

    def _prepare_and_write(self, batch: list[tuple[int, bytes]], feedback: FeedbackBatch) -> Counter[str]:
        outcome: Counter[str] = Counter()
        prepared = self.waiting.take() + self._prepare(batch, outcome)  # held ones first: oldest
        if self.store_ok:
            try:
                outcome["written"] += self.store.write_turns(prepared, counts=outcome, waiting=self.waiting,
                                                             feedback=feedback if feedback.items else None)
                outcome["batches"] += 1
                outcome["feedback"] += sum(recorded is not None for recorded in feedback.recorded)
                return outcome
            except Exception as exc:
                log.warning("store write failed (%s: %s); %d turns go to the spool", type(exc).__name__, exc,
                            len(prepared))
                self.store_ok = False
        self.spool.keep(prepared, outcome)
        return outcome

    def _prepare(self, batch: list[tuple[int, bytes]], outcome: Counter[str]) -> list[PreparedTurn]:
        """The batch's turns; where turns may be held (``link_wait_s``), each turn's line number is noted too."""
        if not self.waiting.wait_s:
            return prepare_lines([line for _, line in batch], self.redactor, outcome)
        prepared: list[PreparedTurn] = []
        for number, line in batch:
            turns = prepare_lines([line], self.redactor, outcome)
            self._held_lines.update((turn.row["id"], number) for turn in turns)  # _advance keeps the held ones
            prepared += turns
        return prepared

    async def _reingest_loop(self) -> None:
        while True:
            await asyncio.sleep(self.retry_s)
            await self.reingest()

    async def reingest(self) -> int:
        """Write spooled turns to the store; on failure they stay spooled. Returns turns written."""
        total = 0
        for leftover in self.spool.leftovers():
            total += await self._ingest_file(leftover, self.spool.read(leftover))
        taken = self.spool.take()
        if taken is not None:
            total += await self._ingest_file(*taken)
        return total

    async def _ingest_file(self, path: Path, turns: list[PreparedTurn]) -> int:
        links: Counter[str] = Counter()
        try:
            written = await asyncio.to_thread(self.store.write_turns, turns, skip_stored=True, counts=links)
        except Exception as exc:
            log.info("store still not writable (%s); %d turns stay spooled", type(exc).__name__, len(turns))
            self.store_ok = False
            try:
                self.spool.append(turns)
            except OSError:
                return 0  # the moved-aside file stays; leftovers() picks it up next time
            path.unlink(missing_ok=True)
            return 0
        path.unlink(missing_ok=True)
        self.store_ok = True
        self.stats["reingested"] += written
        self.stats.update(links)
        if written:
            log.info("re-ingested %d spooled turns", written)
        return written
