"""The sequential test behind the canary and the rollback monitor: testing by betting on paired rewards.

The loop looks at the A/B numbers every few seconds for as long as a canary runs. A t-test
re-run at every look would promote a candidate that is no better far more often than its
nominal 5% (every look is another chance to cross the line by luck; ``tests/test_abtest.py``
measures it). This test stays valid under continuous monitoring: its false-promotion rate is
at most ``alpha`` however often and however long one looks.

Data. Rewards are clipped to ``[low, high]`` and rescaled to [0, 1]. The k-th finished
conversation of the candidate is paired with the k-th of the baseline (arrival order), giving
``d_k = r_candidate - r_baseline`` in [-1, 1], independent and identically distributed with mean
``delta`` when traffic is split at random (which the canary does).

The test (Shekhar & Ramdas, "Nonparametric two-sample testing by betting", 2023; Waudby-Smith &
Ramdas, "Estimating means of bounded random variables by betting", 2023). To show
``delta > m`` (``m = -margin``: better, or not worse by more than the margin), a gambler starts
with wealth 1 and bets a fraction ``lambda_k`` of it on each pair::

    K_n = prod_{k<=n} (1 + lambda_k * (d_k - m)),   0 <= lambda_k <= 1 / (2 * (1 + m))

where ``lambda_k`` is chosen from the pairs before k only (online Newton step). Under the null
``delta <= m`` each factor has mean <= 1, so K is a nonnegative supermartingale and, by Ville's
inequality, ``P(sup_n K_n >= 1/alpha) <= alpha``: declaring "better" the first time
``K_n >= 1/alpha`` is wrong with probability at most alpha, whenever one looks. The mirror
bet on ``-(d_k - m')`` shows "worse". The anytime-valid p-value is ``min(1, 1 / max_{k<=n} K_k)``.
Both bets grow fast when the effect is large and adapt to the variance by themselves.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

Decision = Literal["better", "worse", "continue", "max_pairs"]

_ONS_STEP = 2 / (2 - math.log(3))  # online Newton step's learning rate for bets on [-1, 1]-valued payoffs


@dataclass
class BettingEProcess:
    """Wealth of a gambler betting that pairs ``d`` (in [-1, 1]) have a mean above ``null_mean``.

    ``sign=-1`` bets on a mean below it instead. ``wealth`` is an e-process: at most ``1/alpha`` with
    probability at least ``1 - alpha`` under the null, at every step.
    """

    null_mean: float = 0.0
    sign: int = 1
    wealth: float = 1.0
    peak: float = 1.0
    bet: float = 0.0  # lambda for the next pair
    _curvature: float = 1.0  # 1 + sum of squared gradients (online Newton step)

    @property
    def max_bet(self) -> float:
        # The payoff x = sign * (d - m) is at least -(1 + |m|); half of 1 / (1 + |m|) keeps a bad pair from
        # costing more than half the wealth.
        return 0.5 / (1 + abs(self.null_mean))

    def update(self, d: float) -> None:
        x = self.sign * (d - self.null_mean)  # the payoff per unit bet
        self.wealth *= 1 + self.bet * x
        self.peak = max(self.peak, self.wealth)
        gradient = x / (1 + self.bet * x)  # d/d(lambda) of log(1 + lambda * x)
        self._curvature += gradient * gradient
        self.bet = min(self.max_bet, max(0.0, self.bet + _ONS_STEP * gradient / self._curvature))

    @property
    def p_value(self) -> float:
        """Anytime-valid: P(this peak or higher under the null) <= this, by Ville's inequality."""
        return min(1.0, 1.0 / self.peak)


@dataclass
class SequentialTest:
    """Candidate vs baseline on paired rewards: "better" (or not worse by ``margin``), "worse", or continue.

    ``alpha`` bounds each error: declaring better when the candidate is not (by more than the
    margin), and declaring worse when it is not. ``max_pairs`` ends the test with ``"max_pairs"``.
    """

    alpha: float = 0.05
    margin: float = 0.0
    max_pairs: int = 2000
    low: float = 0.0
    high: float = 1.0
    pairs: int = 0
    sum_d: float = 0.0
    better: BettingEProcess = field(init=False)
    worse: BettingEProcess = field(init=False)

    def __post_init__(self) -> None:
        margin = self.margin / (self.high - self.low)  # in rescaled units
        self.better = BettingEProcess(null_mean=-margin, sign=1)
        self.worse = BettingEProcess(null_mean=-margin if self.margin else 0.0, sign=-1)

    def _scaled(self, reward: float) -> float:
        return (min(self.high, max(self.low, reward)) - self.low) / (self.high - self.low)

    def add(self, candidate: float, baseline: float) -> None:
        d = self._scaled(candidate) - self._scaled(baseline)
        self.pairs += 1
        self.sum_d += d
        self.better.update(d)
        self.worse.update(d)

    def add_all(self, candidate: Iterable[float], baseline: Iterable[float]) -> Decision:
        """Pair the two streams in order (the longer one's tail waits for partners) and decide."""
        for c, b in zip(candidate, baseline, strict=False):
            if self.decision() != "continue":
                break
            self.add(c, b)
        return self.decision()

    def decision(self) -> Decision:
        if self.better.wealth >= 1 / self.alpha:
            return "better"
        if self.worse.wealth >= 1 / self.alpha:
            return "worse"
        if self.pairs >= self.max_pairs:
            return "max_pairs"
        return "continue"

    @property
    def mean_difference(self) -> float:
        """Mean paired difference, in reward units."""
        return self.sum_d / self.pairs * (self.high - self.low) if self.pairs else math.nan

    def summary(self) -> dict[str, float | int | str]:
        return {"test": "paired betting e-process (online Newton step), anytime-valid",
                "alpha": self.alpha, "margin": self.margin, "pairs": self.pairs,
                "mean_difference": self.mean_difference if self.pairs else 0.0,
                "e_better": self.better.wealth, "e_worse": self.worse.wealth,
                "p_better": self.better.p_value, "p_worse": self.worse.p_value, "decision": self.decision()}
