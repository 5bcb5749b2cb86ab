"""The offline gate's decision from its per-context scores, and what the loop makes of it."""

from __future__ import annotations

import pytest

from flywheel.gateway.serving.loop.gate import gate_decision, loss_p_value
from flywheel.gateway.serving.loop.scheduler import offline_verdict


@pytest.mark.parametrize(("wins", "ties", "contexts", "decision"), [
    (0, 24, 24, "inconclusive"),  # every greedy answer the same: 0.5 by ties alone, nothing learned
    (1, 23, 24, "passed"),
    (0, 23, 24, "inconclusive"),  # one loss among ties: p = 0.5, noise, not evidence
    (0, 19, 24, "failed"),  # five losses, no win: p = 1/32
    (12, 0, 24, "passed"),
    (11, 0, 24, "inconclusive"),  # 11 wins, 13 losses
    (5, 0, 24, "failed"),  # 19 losses of 24: p < 0.01
])
def test_the_win_rate_passes_and_only_significant_losses_fail(
        wins: int, ties: int, contexts: int, decision: str) -> None:
    assert gate_decision(wins, ties, contexts, threshold=0.5, fail_alpha=0.05) == decision


def test_the_loss_p_value_is_the_one_sided_sign_test() -> None:
    assert loss_p_value(0, 1) == 0.5
    assert loss_p_value(0, 5) == 1 / 32
    assert loss_p_value(3, 3) == 42 / 64  # P(X >= 3), X ~ Binomial(6, 1/2)
    assert loss_p_value(0, 0) == 1.0
    # fail_alpha = 1 restores "below the win rate fails", whatever the losses
    assert gate_decision(0, 23, 24, threshold=0.5, fail_alpha=1.0) == "failed"


def test_an_inconclusive_gate_leaves_the_decision_to_the_canary_or_rejects_without_one() -> None:
    tied = {"contexts": 24, "wins": 0, "ties": 24, "win_rate": 0.5, "threshold": 0.5,
            "decision": "inconclusive", "passed": False}
    assert offline_verdict(tied, canary=True) == (False, "offline gate inconclusive: all 24 contexts tie, "
                                                         "the canary decides")
    assert offline_verdict(tied, canary=False) == (True, "offline gate inconclusive: all 24 contexts tie "
                                                         "and no canary to decide")
    lost = {**tied, "wins": 0, "ties": 0, "losses": 24, "win_rate": 0.0, "decision": "failed"}
    assert offline_verdict(lost, canary=True) == (True, "offline gate: win rate 0.00 < 0.50")
    lost_p = {**lost, "loss_p_value": 2 ** -24}
    assert offline_verdict(lost_p, canary=True) == (True, "offline gate: win rate 0.00 < 0.50 "
                                                          "(24 losses vs 0 wins: p=0.000)")
    one_loss = {**tied, "ties": 23, "losses": 1, "win_rate": 23 / 48, "loss_p_value": 0.5}
    assert offline_verdict(one_loss, canary=True) == (
        False, "offline gate inconclusive: win rate 0.48, losses not significant (1 losses vs 0 wins: p=0.500), "
               "the canary decides")
    recorded_before_decisions = {"contexts": 8, "win_rate": 0.75, "threshold": 0.5, "passed": True}
    assert offline_verdict(recorded_before_decisions, canary=False) == (False, "")
    assert offline_verdict(None, canary=False) == (False, "")
