"""The sequential test behind the canary and the rollback monitor: testing by betting on paired rewards.

The loop looks at the A/B numbers every few seconds for as long as a canary runs. A t-test
re-run at every look would promote a candidate that is no better far more often than its
nominal 5% (every look is another chance to cross the line by luck; ``tests/test_abtest.py``
measures it). This test stays valid under continuous monitoring: its false-promotion rate is
at most ``alpha`` however often and however long one looks.

Data. Rewards are clipped to ``[low, high]`` and rescaled to [0, 1]; each pair gives
``d_k = r_candidate - r_baseline`` in [-1, 1]. Rewards vary far more between contexts (requests)
than between versions, so :func:`pair_finished` pairs a candidate reward with a baseline reward
from the *same context* (task key, or fork group): the context's share of the variance cancels.
A reward that waits ``wait_s`` for such a partner in vain is paired in arrival order instead.

Why that pairing keeps the test valid under continuous monitoring: pairs depend only on when each
reward became known, its arm and its context (never on a reward's value), and are formed walking
those events in time order, so a pair never changes and every look sees a prefix of one sequence;
no reward enters two pairs. Arms are assigned at random before anything is generated, so under the
null each new ``d_k`` has mean <= m given the past and K below is one supermartingale. A pair's kind
is known before its rewards, so each kind may bet its own fraction.

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

A third bet, on ``-(d_k - g)`` with ``g = min_gain``, shows "not better by g" (futility): wrong with
probability at most alpha when the candidate is in truth better by g or more. Without it a candidate
whose gain lies between 0 and what the traffic can resolve is never decided; with it every candidate
is, sooner or later: a gain above 0 is shown, or one below g is (which of the two first is a race
only when the true gain lies between them, where both statements are true).
"""

from __future__ import annotations

import math
from collections import defaultdict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

Decision = Literal["better", "worse", "not_better", "continue", "max_pairs"]
TEST_DECISIONS = ("better", "worse", "not_better")  # what the test itself decides (not max_pairs, not a hand-over)

_ONS_STEP = 2 / (2 - math.log(3))  # online Newton step's learning rate for bets on [-1, 1]-valued payoffs


@dataclass
class _Bettor:
    """Online Newton step's state for one kind of pair: the next bet and the curvature so far."""

    bet: float = 0.0  # lambda for the next pair
    curvature: float = 1.0  # 1 + sum of squared gradients


@dataclass
class BettingEProcess:
    """Wealth of a gambler betting that pairs ``d`` (in [-1, 1]) have a mean above ``null_mean``.

    ``sign=-1`` bets on a mean below it instead. ``wealth`` is an e-process: at most ``1/alpha`` with
    probability at least ``1 - alpha`` under the null, at every step. Each ``kind`` of pair (same context,
    arrival order) has its own bet, sized to its own variance; the wealth is one.
    """

    null_mean: float = 0.0
    sign: int = 1
    wealth: float = 1.0
    peak: float = 1.0
    bettors: dict[str, _Bettor] = field(default_factory=dict)

    @property
    def max_bet(self) -> float:
        # The payoff x = sign * (d - m) is at least -(1 + |m|); half of 1 / (1 + |m|) keeps a bad pair from
        # costing more than half the wealth.
        return 0.5 / (1 + abs(self.null_mean))

    def update(self, d: float, kind: str = "") -> None:
        bettor = self.bettors.setdefault(kind, _Bettor())
        x = self.sign * (d - self.null_mean)  # the payoff per unit bet
        self.wealth *= 1 + bettor.bet * x
        self.peak = max(self.peak, self.wealth)
        gradient = x / (1 + bettor.bet * x)  # d/d(lambda) of log(1 + lambda * x)
        bettor.curvature += gradient * gradient
        bettor.bet = min(self.max_bet, max(0.0, bettor.bet + _ONS_STEP * gradient / bettor.curvature))

    @property
    def p_value(self) -> float:
        """Anytime-valid: P(this peak or higher under the null) <= this, by Ville's inequality."""
        return min(1.0, 1.0 / self.peak)


@dataclass(frozen=True)
class Finished:
    """A finished unit of a canary (a conversation, or a fork's answer): when its reward became known (epoch
    seconds), its arm, its context (task key, fork group; None: none to share) and its reward."""

    at: float
    candidate: bool
    context: str | None
    reward: float


@dataclass(frozen=True)
class Pair:
    candidate: float
    baseline: float
    kind: str  # "context": the same context on both arms; "arrival": paired in arrival order


def pair_finished(rows: Iterable[Finished], *, now: float, wait_s: float) -> list[Pair]:
    """Pairs in the order they were formed, by walking arrivals and waits in time order up to ``now``.

    An arriving reward pairs with the oldest reward of the other arm waiting in its context; else it waits,
    ``wait_s`` at most (``inf``: for ever). When its wait ends unpaired it is dropped if its context had
    another reward (either arm) within ``wait_s`` of it, else (a context seen once) it joins its arm's
    arrival-order queue and pairs with the other arm's oldest there. That rule ignores arms, so both arms'
    queues hold the same kind of contexts (a rule such as "found no partner" would not: with a 10% canary
    a candidate reward lacks one mostly in rare contexts). Rewards are never looked at: see the module.
    """
    items = [r for r in sorted(rows, key=lambda r: r.at) if r.at <= now]  # stable: the caller's order breaks ties
    seen: dict[str | None, float] = {}
    last_of: dict[str | None, int] = {}
    crowded = [False] * len(items)  # another reward of the same context within wait_s, either side
    for index, item in enumerate(items):
        if item.context in seen and item.at - seen[item.context] <= wait_s:
            crowded[index] = True
            crowded[last_of[item.context]] = True
        seen[item.context] = item.at
        last_of[item.context] = index
    waiting: dict[tuple[str | None, bool], deque[int]] = defaultdict(deque)
    expiring: deque[tuple[float, int]] = deque()  # (when its wait ends, index), in arrival order
    unmatched: dict[bool, deque[int]] = {True: deque(), False: deque()}
    paired: set[int] = set()
    pairs: list[Pair] = []

    def pair(one: int, other: int, kind: str) -> None:
        paired.update((one, other))
        first, second = items[one], items[other]
        ours, theirs = (first, second) if first.candidate else (second, first)
        pairs.append(Pair(ours.reward, theirs.reward, kind))

    def in_arrival_order(index: int) -> None:
        others = unmatched[not items[index].candidate]
        if others:
            pair(index, others.popleft(), "arrival")
        else:
            unmatched[items[index].candidate].append(index)

    def end_waits(until: float) -> None:
        while expiring and expiring[0][0] <= until:
            index = expiring.popleft()[1]
            if index not in paired:
                item = items[index]
                waiting[(item.context, item.candidate)].popleft()  # the oldest of its context: waits end in order
                if not crowded[index]:
                    in_arrival_order(index)

    for index, item in enumerate(items):
        end_waits(math.nextafter(item.at, -math.inf))  # a partner arriving as the wait ends still pairs
        partners = waiting[(item.context, not item.candidate)]
        if item.context is None:
            in_arrival_order(index)
        elif partners:
            pair(index, partners.popleft(), "context")
        else:
            waiting[(item.context, item.candidate)].append(index)
            expiring.append((item.at + wait_s, index))
    end_waits(now)
    return pairs


@dataclass
class SequentialTest:
    """Candidate vs baseline on paired rewards: "better" (or not worse by ``margin``), "worse", "not_better"
    (by ``min_gain``, when set), or continue.

    ``alpha`` bounds each error: declaring better when the candidate is not (by more than the
    margin), declaring worse when it is not, and declaring it not better by ``min_gain`` when it is.
    ``max_pairs`` ends the test with ``"max_pairs"``.
    """

    alpha: float = 0.05
    margin: float = 0.0
    max_pairs: int = 2000
    low: float = 0.0
    high: float = 1.0
    min_gain: float | None = None  # in reward units; None: no futility bet
    pairs: int = 0
    sum_d: float = 0.0
    sum_d2: float = 0.0
    kinds: dict[str, int] = field(default_factory=dict)  # pairs of each kind
    better: BettingEProcess = field(init=False)
    worse: BettingEProcess = field(init=False)
    not_better: BettingEProcess | None = field(init=False)

    def __post_init__(self) -> None:
        margin = self.margin / (self.high - self.low)  # in rescaled units
        self.better = BettingEProcess(null_mean=-margin, sign=1)
        self.worse = BettingEProcess(null_mean=-margin if self.margin else 0.0, sign=-1)
        self.not_better = (BettingEProcess(null_mean=self.min_gain / (self.high - self.low), sign=-1)
                           if self.min_gain is not None else None)

    def _scaled(self, reward: float) -> float:
        return (min(self.high, max(self.low, reward)) - self.low) / (self.high - self.low)

    def add(self, candidate: float, baseline: float, kind: str = "") -> None:
        d = self._scaled(candidate) - self._scaled(baseline)
        self.pairs += 1
        self.sum_d += d
        self.sum_d2 += d * d
        self.kinds[kind] = self.kinds.get(kind, 0) + 1
        self.better.update(d, kind)
        self.worse.update(d, kind)
        if self.not_better is not None:
            self.not_better.update(d, kind)

    def add_pairs(self, pairs: Iterable[Pair]) -> Decision:
        """Add pairs in the order they were formed until the test decides."""
        for one in pairs:
            if self.decision() != "continue":
                break
            self.add(one.candidate, one.baseline, one.kind)
        return self.decision()

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
        if self.not_better is not None and self.not_better.wealth >= 1 / self.alpha:
            return "not_better"
        if self.pairs >= self.max_pairs:
            return "max_pairs"
        return "continue"

    @property
    def mean_difference(self) -> float:
        """Mean paired difference, in reward units."""
        return self.sum_d / self.pairs * (self.high - self.low) if self.pairs else math.nan

    @property
    def standard_error(self) -> float:
        """The mean paired difference's standard error, in reward units (a measurement, not the test)."""
        if self.pairs < 2:
            return math.nan
        variance = max(0.0, self.sum_d2 - self.sum_d * self.sum_d / self.pairs) / (self.pairs - 1)
        return math.sqrt(variance / self.pairs) * (self.high - self.low)

    def summary(self) -> dict[str, float | int | str | None]:
        futility = self.not_better
        return {"test": "paired betting e-process (online Newton step), anytime-valid",
                "alpha": self.alpha, "margin": self.margin, "pairs": self.pairs,
                "mean_difference": self.mean_difference if self.pairs else 0.0,
                "standard_error": self.standard_error if self.pairs >= 2 else None,
                "same_context_pairs": self.kinds.get("context", 0), "arrival_pairs": self.kinds.get("arrival", 0),
                "e_better": self.better.wealth, "e_worse": self.worse.wealth,
                "p_better": self.better.p_value, "p_worse": self.worse.p_value, "min_gain": self.min_gain,
                "e_not_better": futility.wealth if futility else None,
                "p_not_better": futility.p_value if futility else None, "decision": self.decision()}
