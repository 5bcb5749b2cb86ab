"""``gather_trajectory_groups``: run many groups of rollouts at once, with a progress bar (ART's semantics)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable

from flywheel.progress import GatherContext, gathering
from flywheel.trajectories import TrajectoryGroup

__all__ = ["gather_trajectory_groups"]

AfterEach = Callable[[TrajectoryGroup], Awaitable[TrajectoryGroup | list[TrajectoryGroup] | None]]


async def gather_trajectory_groups(groups: Iterable[Awaitable[TrajectoryGroup]], *, pbar_desc: str | None = "gather",
                                   max_exceptions: int | float = 0, max_metrics: int | None = None,
                                   after_each: AfterEach | None = None) -> list[TrajectoryGroup]:
    """Await every group concurrently and return the groups that came through, in input order.

    Args:
        groups: awaitables of groups, typically ``TrajectoryGroup(rollout(model, s) for _ in range(n))``.
        pbar_desc: the progress bar's label (on stderr); it counts rollouts and shows running means
            of the reward and of every metric.
        max_exceptions: rollouts (or whole groups) that may raise before the gather raises too, as a
            count or as a fraction (``0 < x < 1``) of all rollouts. A failed rollout is kept in its
            group's ``exceptions``; a group that raised as a whole is dropped.
        max_metrics: show at most this many metrics in the bar.
        after_each: awaited with each finished group (e.g. RULER scoring); it may return the group,
            a replacement, ``None`` to drop it, or a list of groups to put in its place.
    """
    awaitables = list(groups)
    context = GatherContext(max_exceptions=max_exceptions, max_metrics=max_metrics,
                            total=sum(getattr(g, "_num_trajectories", 1) for g in awaitables))

    async def one(awaitable: Awaitable[TrajectoryGroup]) -> TrajectoryGroup | list[TrajectoryGroup] | None:
        counts_itself = hasattr(awaitable, "_num_trajectories")  # a pending TrajectoryGroup reports each rollout
        try:
            group = await awaitable
        except Exception:
            context.failed()
            if context.too_many_exceptions():
                raise
            return None
        if not counts_itself:
            for trajectory in group:
                context.record(trajectory.reward, trajectory.metrics)
            context.advance(1)
        return group if after_each is None else await after_each(group)

    with gathering(context, pbar_desc):
        tasks = [asyncio.ensure_future(one(awaitable)) for awaitable in awaitables]
        try:
            results = await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            raise
    gathered: list[TrajectoryGroup] = []
    for result in results:
        if isinstance(result, list):
            gathered.extend(result)
        elif result is not None:
            gathered.append(result)
    return gathered
