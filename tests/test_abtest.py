"""The canary's sequential test, simulated on reward streams (numbers only, no model).

Continuous monitoring: the test is checked after every pair, as the loop does every tick.
A/A streams (both arms drawn from one distribution) must declare "better" at most ``alpha``
of the time; a naive t-test re-run at every look, simulated on the same streams, exceeds its
nominal 5% by far — which shows the simulation can see the inflation the test must avoid.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable

import pytest

from flywheel.gateway.serving.loop.abtest import SequentialTest

Draw = Callable[[random.Random], float]

ALPHA = 0.05
RUNS = 600
MAX_PAIRS = 300


def bernoulli(p: float) -> Draw:
    return lambda rng: 1.0 if rng.random() < p else 0.0


def three_valued(right: float) -> Draw:
    """The demo's rewards: 1 for the right tool, 0.1 for a well-formed wrong one, 0 for garbage."""
    return lambda rng: 1.0 if rng.random() < right else (0.1 if rng.random() < 0.9 else 0.0)


def run_test(candidate: Draw, baseline: Draw, seed: int, *, margin: float = 0.0) -> str:
    rng = random.Random(seed)
    test = SequentialTest(alpha=ALPHA, margin=margin, max_pairs=MAX_PAIRS)
    while test.decision() == "continue":
        test.add(candidate(rng), baseline(rng))
    return test.decision()


def naive_t_test_promotes(candidate: Draw, baseline: Draw, seed: int) -> bool:
    """A one-sided Welch t-test at 5%, re-run after every pair from the 10th on: promotes at the first crossing."""
    rng = random.Random(seed)
    ours: list[float] = []
    theirs: list[float] = []
    for n in range(1, MAX_PAIRS + 1):
        ours.append(candidate(rng))
        theirs.append(baseline(rng))
        if n < 10:
            continue
        spread = math.sqrt(statistics.variance(ours) / n + statistics.variance(theirs) / n)
        if spread > 0 and (statistics.fmean(ours) - statistics.fmean(theirs)) / spread > 1.645:
            return True
    return False


@pytest.mark.parametrize("draw", [bernoulli(0.5), bernoulli(0.2), three_valued(0.3)],
                         ids=["bernoulli-0.5", "bernoulli-0.2", "three-valued"])
def test_false_promotions_on_a_a_streams_stay_under_alpha(draw: Draw) -> None:
    promoted = sum(run_test(draw, draw, seed) == "better" for seed in range(RUNS))
    # The bound is alpha; three standard errors of a 600-run estimate leave room for simulation noise only.
    assert promoted / RUNS <= ALPHA + 3 * math.sqrt(ALPHA * (1 - ALPHA) / RUNS), promoted


def test_the_naive_repeated_t_test_would_inflate_false_promotions() -> None:
    draw = bernoulli(0.5)
    promoted = sum(naive_t_test_promotes(draw, draw, seed) for seed in range(RUNS))
    assert promoted / RUNS > 2 * ALPHA, promoted  # far above its nominal 5%: what continuous looks do


def test_a_clearly_better_candidate_is_promoted_and_a_worse_one_rejected() -> None:
    better = [run_test(three_valued(0.5), three_valued(0.25), seed) for seed in range(100)]
    assert better.count("better") >= 90, better.count("better")
    worse = [run_test(three_valued(0.25), three_valued(0.5), seed) for seed in range(100)]
    assert worse.count("worse") >= 90 and worse.count("better") == 0, (worse.count("worse"), worse.count("better"))


def test_non_inferiority_margin_promotes_an_equal_candidate() -> None:
    same = bernoulli(0.5)
    with_margin = [run_test(same, same, seed, margin=0.15) for seed in range(100)]
    without = [run_test(same, same, seed) for seed in range(100)]
    assert with_margin.count("better") >= 80  # "not worse by more than 0.15" is shown for equal arms
    assert without.count("better") <= 10


def test_p_values_and_rewards_outside_the_range_are_handled() -> None:
    test = SequentialTest(alpha=0.05, low=0.0, high=10.0)
    for _ in range(50):
        test.add(12.0, -3.0)  # clipped to the range: 10 vs 0
    assert test.decision() == "better"
    assert test.better.p_value <= 0.05 and test.worse.p_value == 1.0
    assert test.mean_difference == pytest.approx(10.0)
