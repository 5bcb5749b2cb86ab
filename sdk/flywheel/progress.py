"""The progress of a gather: a rich progress bar, running metric means, and the exception budget."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn


@dataclass
class GatherContext:
    """What one ``gather_trajectory_groups`` call counts; rollouts outside a gather share a silent default.

    ``max_exceptions``: how many rollouts may fail before the gather fails too, as a count (``3``)
    or as a fraction of all rollouts (``0.1``); 0 means none may.
    """

    max_exceptions: int | float = 0
    total: int = 0
    max_metrics: int | None = None
    exceptions: int = 0
    sums: dict[str, float] = field(default_factory=dict)
    counts: Counter[str] = field(default_factory=Counter)
    progress: Progress | None = None
    task: TaskID | None = None

    def record(self, reward: float, metrics: Mapping[str, float | int | bool]) -> None:
        """Add a finished trajectory's reward and metrics to the running means."""
        for name, value in {"reward": reward, **metrics}.items():
            self.sums[name] = self.sums.get(name, 0.0) + float(value)
            self.counts[name] += 1

    def advance(self, rollouts: int) -> None:
        if self.progress is None or self.task is None:
            return
        self.progress.update(self.task, advance=rollouts, metrics=self.summary())

    def failed(self) -> None:
        """Count a failed rollout (or group); raise-worthy when the budget is spent (see too_many_exceptions)."""
        self.exceptions += 1
        self.advance(0)

    def too_many_exceptions(self) -> bool:
        if 0 < self.max_exceptions < 1 and self.total:
            return self.exceptions / self.total > self.max_exceptions
        return self.exceptions > self.max_exceptions

    def summary(self) -> str:
        names = list(self.sums)[: self.max_metrics] if self.max_metrics is not None else list(self.sums)
        parts = [f"{name}={self.sums[name] / max(1, self.counts[name]):.3g}" for name in names]
        if self.exceptions:
            parts.append(f"exceptions={self.exceptions}")
        return " ".join(parts)


_context: ContextVar[GatherContext | None] = ContextVar("flywheel_gather", default=None)


def current() -> GatherContext:
    """The active gather's context, or a fresh silent one that allows no exception (ART's default)."""
    return _context.get() or GatherContext()


@contextlib.contextmanager
def gathering(context: GatherContext, description: str | None) -> Iterator[GatherContext]:
    """Make ``context`` the active one and show its progress bar on stderr until the block ends."""
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("{task.fields[metrics]}"))
    with Progress(*columns, console=Console(stderr=True)) as progress:
        context.progress = progress
        context.task = progress.add_task(description or "", total=context.total, metrics="")
        token = _context.set(context)
        try:
            yield context
        finally:
            _context.reset(token)
