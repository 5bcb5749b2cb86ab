"""Which turns are worth forking (``[groups] fork_turns = "untied"``).

A forked turn whose group ties (every answer the trainer would see scores the same) teaches a round
nothing: it is settled ``untrainable`` when scored, and its siblings cost generation the client never
sees. In an agent's turn after a tool's result, say, the answer may follow from the result however it
is sampled. The scoring job reports, for each fork group it judged, the turn's position (how many
assistant messages came before it) and whether its trained members differ. A turn is then forked with
probability ``fork_fraction`` times the share of the last :data:`WINDOW` groups at its position that
did not tie, never less than :data:`FLOOR` of ``fork_fraction``, so a position that starts to differ
(the policy changed) is seen again. Until a position has :data:`MIN_SEEN` groups it is forked at
``fork_fraction``.

The decision uses only rewards of groups already scored, before the turn is generated, so the canary's
pairs stay valid (docs/loop.md, "Why it stays valid"). Only the replica that runs the loop sees the
scoring job's reports; the others fork at ``fork_fraction``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

WINDOW = 64  # fork groups remembered per alias and position
MIN_SEEN = 16  # fewer than this: fork at the configured rate
FLOOR = 0.1  # a tied position still gets this share of the configured rate


@dataclass
class ForkYield:
    """Per (alias, position), whether each of the latest scored fork groups taught anything."""

    taught: dict[tuple[str, int], deque[bool]] = field(default_factory=dict)

    def record(self, alias: str, position: int, taught: bool) -> None:
        self.taught.setdefault((alias, position), deque(maxlen=WINDOW)).append(taught)

    def share(self, alias: str, position: int) -> float:
        """The share of ``fork_fraction`` at which a turn at ``position`` is forked."""
        seen = self.taught.get((alias, position))
        if seen is None or len(seen) < MIN_SEEN:
            return 1.0
        return max(FLOOR, sum(seen) / len(seen))

    def shares(self, alias: str) -> dict[str, float]:
        """Each position of ``alias`` seen so far and its share, by position as text (a JSON object's keys)."""
        return {str(position): self.share(alias, position) for name, position in sorted(self.taught) if name == alias}
