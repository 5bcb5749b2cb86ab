"""Charts as server-rendered SVG (no JavaScript): reward per version over time, traffic per version.

Data is bucketed over a time range into :class:`Timeline` slots; each version is a series with a
colour class (``series-N`` in ``static/dashboard.css``), so a legend and the chart agree. The SVG
scales to its container (``viewBox``) and draws with presentation attributes and classes only (the
dashboard's CSP allows no inline style).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime

from markupsafe import Markup, escape

WIDTH, HEIGHT = 640, 240
LEFT, RIGHT, TOP, BOTTOM = 48, 14, 14, 34
PALETTE = 8


def series_class(version: int) -> str:
    return f"series-{version % PALETTE}"


@dataclass
class Timeline:
    """``slots`` equal buckets from ``start`` to ``end`` (unix seconds)."""

    start: float
    end: float
    slots: int = 24

    @classmethod
    def covering(cls, times: Iterable[float], window_start: float, now: float, *, slots: int = 24,
                 min_slot_s: float = 1.0) -> Timeline:
        """From the first data point inside the window (or the window's start, when there is none) to now;
        a slot is never narrower than ``min_slot_s`` (the data's own resolution)."""
        inside = [t for t in times if t >= window_start]
        start = min(inside) if inside else window_start
        end = max(now, start + slots * min_slot_s)
        return cls(start=max(window_start, end - max(end - start, slots * min_slot_s)), end=end, slots=slots)

    def slot(self, moment: float) -> int | None:
        if not self.start <= moment <= self.end:
            return None
        return min(self.slots - 1, int((moment - self.start) / (self.end - self.start) * self.slots))

    def label(self, slot: int) -> str:
        moment = self.start + (slot + 0.5) * (self.end - self.start) / self.slots
        span = self.end - self.start
        pattern = "%H:%M:%S" if span <= 3600 else "%H:%M" if span <= 2 * 86400 else "%m-%d"
        return datetime.fromtimestamp(moment, tz=UTC).strftime(pattern)


def _x(timeline: Timeline, slot: float) -> float:
    return LEFT + (slot + 0.5) / timeline.slots * (WIDTH - LEFT - RIGHT)


def _frame(title: str, y_ticks: list[tuple[float, str]], timeline: Timeline) -> list[str]:
    parts = [f'<svg class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" aria-label="{escape(title)}">',
             f"<title>{escape(title)}</title>"]
    for y, label in y_ticks:
        parts.append(f'<line class="grid" x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y:.1f}" y2="{y:.1f}"/>')
        parts.append(f'<text class="tick" x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{escape(label)}</text>')
    for slot in range(0, timeline.slots, max(1, timeline.slots // 6)):
        parts.append(f'<text class="tick" x="{_x(timeline, slot):.1f}" y="{HEIGHT - 8}" '
                     f'text-anchor="middle">{escape(timeline.label(slot))}</text>')
    return parts


def reward_chart(points: list[tuple[float, int, float]], timeline: Timeline) -> Markup:
    """Mean reward per slot and version, a line per version: ``points`` are (time, version, reward)."""
    sums: dict[int, dict[int, list[float]]] = {}
    for moment, version, reward in points:
        slot = timeline.slot(moment)
        if slot is not None:
            sums.setdefault(version, {}).setdefault(slot, []).append(reward)
    low, high = min([0.0, *(r for _, _, r in points)]), max([1.0, *(r for _, _, r in points)])

    def y(value: float) -> float:
        return TOP + (high - value) / (high - low) * (HEIGHT - TOP - BOTTOM)

    parts = _frame("Mean reward per version over time",
                   [(y(v), f"{v:g}") for v in (low, (low + high) / 2, high)], timeline)
    for version, slots in sorted(sums.items()):
        coords = [(_x(timeline, s), y(sum(v) / len(v)), len(v)) for s, v in sorted(slots.items())]
        css = series_class(version)
        if len(coords) > 1:
            path = " ".join(f"{x:.1f},{py:.1f}" for x, py, _ in coords)
            parts.append(f'<polyline class="line {css}" points="{path}"/>')
        for x, py, n in coords:
            parts.append(f'<circle class="dot {css}" cx="{x:.1f}" cy="{py:.1f}" r="4">'
                         f"<title>version {version}: mean of {n}</title></circle>")
    parts.append("</svg>")
    return Markup("".join(parts))


def traffic_chart(counts: list[tuple[float, int, int]], timeline: Timeline) -> Markup:
    """Answered requests per slot, stacked by version: ``counts`` are (time, version, turns)."""
    per_slot: dict[int, dict[int, int]] = {}
    for moment, version, turns in counts:
        slot = timeline.slot(moment)
        if slot is not None:
            per_slot.setdefault(slot, {})
            per_slot[slot][version] = per_slot[slot].get(version, 0) + turns
    top = max([1, *(sum(v.values()) for v in per_slot.values())])

    def y(value: float) -> float:
        return TOP + (top - value) / top * (HEIGHT - TOP - BOTTOM)

    parts = _frame("Answered requests per version over time", [(y(v), f"{v:g}") for v in (0, top / 2, top)],
                   timeline)
    bar = (WIDTH - LEFT - RIGHT) / timeline.slots * 0.8
    for slot, versions in sorted(per_slot.items()):
        stacked = 0
        for version, turns in sorted(versions.items()):
            x = _x(timeline, slot) - bar / 2
            parts.append(f'<rect class="bar {series_class(version)}" x="{x:.1f}" y="{y(stacked + turns):.1f}" '
                         f'width="{bar:.1f}" height="{y(stacked) - y(stacked + turns):.1f}">'
                         f"<title>version {version}: {turns}</title></rect>")
            stacked += turns
    parts.append("</svg>")
    return Markup("".join(parts))
