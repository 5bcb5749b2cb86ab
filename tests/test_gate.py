"""The offline gate's decision from its per-context scores, and what the loop makes of it."""

from __future__ import annotations

import pytest

from flywheel.gateway.serving.loop.gate import gate_decision
from flywheel.gateway.serving.loop.scheduler import offline_verdict


@pytest.mark.parametrize(("wins", "ties", "contexts", "decision"), [
    (0, 24, 24, "inconclusive"),  # every greedy answer the same: 0.5 by ties alone, nothing learned
    (1, 23, 24, "passed"),
    (0, 23, 24, "failed"),  # one loss among ties
    (12, 0, 24, "passed"),
    (11, 0, 24, "failed"),
])
def test_all_ties_are_inconclusive_and_other_outcomes_keep_the_win_rate_rule(
        wins: int, ties: int, contexts: int, decision: str) -> None:
    assert gate_decision(wins, ties, contexts, threshold=0.5) == decision


def test_an_inconclusive_gate_leaves_the_decision_to_the_canary_or_rejects_without_one() -> None:
    tied = {"contexts": 24, "wins": 0, "ties": 24, "win_rate": 0.5, "threshold": 0.5,
            "decision": "inconclusive", "passed": False}
    assert offline_verdict(tied, canary=True) == (False, "offline gate inconclusive: all 24 contexts tie, "
                                                         "the canary decides")
    assert offline_verdict(tied, canary=False) == (True, "offline gate inconclusive: all 24 contexts tie "
                                                         "and no canary to decide")
    lost = {**tied, "wins": 0, "ties": 0, "win_rate": 0.0, "decision": "failed"}
    assert offline_verdict(lost, canary=True) == (True, "offline gate: win rate 0.00 < 0.50")
    recorded_before_decisions = {"contexts": 8, "win_rate": 0.75, "threshold": 0.5, "passed": True}
    assert offline_verdict(recorded_before_decisions, canary=False) == (False, "")
    assert offline_verdict(None, canary=False) == (False, "")
