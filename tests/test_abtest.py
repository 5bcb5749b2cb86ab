"""The canary's sequential test, simulated on reward streams (numbers only, no model).

Continuous monitoring: the test is checked after every pair, as the loop does every tick.
A/A streams (both arms drawn from one distribution) must declare "better" at most ``alpha``
of the time; a naive t-test re-run at every look, simulated on the same streams, exceeds its
nominal 5% by far — which shows the simulation can see the inflation the test must avoid.

Same-context pairing (``pair_finished``) is simulated on traffic whose contexts differ far more than
the versions do: requests repeat tasks of very different difficulty, the canary gets a share of them.
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
import statistics
from collections.abc import Callable

import pytest

from flywheel.gateway.serving.loop.abtest import Finished, SequentialTest, pair_finished

Draw = Callable[[random.Random], float]

ALPHA = 0.05
RUNS = 600
MAX_PAIRS = 300


def bernoulli(p: float) -> Draw:
    return lambda rng: 1.0 if rng.random() < p else 0.0


def three_valued(right: float) -> Draw:
    """The demo's rewards: 1 for the right tool, 0.1 for a well-formed wrong one, 0 for garbage."""
    return lambda rng: 1.0 if rng.random() < right else (0.1 if rng.random() < 0.9 else 0.0)


def run_test(candidate: Draw, baseline: Draw, seed: int, *, margin: float = 0.0,
             min_gain: float | None = None) -> str:
    rng = random.Random(seed)
    test = SequentialTest(alpha=ALPHA, margin=margin, max_pairs=MAX_PAIRS, min_gain=min_gain)
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


def test_min_gain_decides_an_equal_candidate_without_more_false_promotions() -> None:
    same = bernoulli(0.5)
    ends = [run_test(same, same, seed, min_gain=0.15) for seed in range(RUNS)]
    assert ends.count("better") / RUNS <= ALPHA + 3 * math.sqrt(ALPHA * (1 - ALPHA) / RUNS), ends.count("better")
    without = [run_test(same, same, seed) for seed in range(RUNS)]
    assert without.count("max_pairs") >= 0.8 * RUNS, without.count("max_pairs")  # undecided: no futility bet
    assert ends.count("not_better") >= 0.75 * RUNS, ends.count("not_better")
    assert ends.count("max_pairs") <= 0.2 * RUNS, ends.count("max_pairs")


@pytest.mark.parametrize("baseline", [0.2, 0.5])
def test_a_candidate_better_by_exactly_min_gain_is_called_not_better_at_most_alpha(baseline: float) -> None:
    gain = 0.15
    ends = [run_test(bernoulli(baseline + gain), bernoulli(baseline), seed, min_gain=gain) for seed in range(RUNS)]
    called = ends.count("not_better")
    assert called / RUNS <= ALPHA + 3 * math.sqrt(ALPHA * (1 - ALPHA) / RUNS), called
    assert ends.count("better") >= 0.5 * RUNS, ends.count("better")


def test_p_values_and_rewards_outside_the_range_are_handled() -> None:
    test = SequentialTest(alpha=0.05, low=0.0, high=10.0)
    for _ in range(50):
        test.add(12.0, -3.0)  # clipped to the range: 10 vs 0
    assert test.decision() == "better"
    assert test.better.p_value <= 0.05 and test.worse.p_value == 1.0
    assert test.mean_difference == pytest.approx(10.0)


def test_the_summary_measures_the_mean_difference_and_its_standard_error_in_reward_units() -> None:
    rng = random.Random(3)
    pairs = [(rng.uniform(2.0, 10.0), rng.uniform(0.0, 8.0)) for _ in range(40)]
    test = SequentialTest(alpha=0.05, low=0.0, high=10.0)
    assert test.summary()["standard_error"] is None
    for candidate, baseline in pairs:
        test.add(candidate, baseline)
    differences = [c - b for c, b in pairs]
    summary = test.summary()
    assert summary["mean_difference"] == pytest.approx(statistics.fmean(differences))
    assert summary["standard_error"] == pytest.approx(statistics.stdev(differences) / math.sqrt(len(pairs)))


def task_traffic(seed: int, *, requests: int, gain: float, fraction: float, tasks: int = 200,
                 zipf: bool = True) -> list[Finished]:
    """One reward a second from ``tasks`` tasks of very different difficulty (mean reward 0.9 for the first down
    to 0.05 for the last), a little noise within a task; ``zipf``: a few frequent tasks and many rare (harder)
    ones, else all equally frequent. The candidate (``fraction`` of requests) earns ``gain`` more on each."""
    rng = random.Random(seed)
    cumulative = list(itertools.accumulate(1 / (k + 1) if zipf else 1.0 for k in range(tasks)))
    rows = []
    for second in range(requests):
        task = bisect.bisect(cumulative, rng.random() * cumulative[-1])
        candidate = rng.random() < fraction
        reward = 0.9 - 0.85 * task / tasks + (gain if candidate else 0.0) + rng.gauss(0, 0.05)
        rows.append(Finished(at=float(second), candidate=candidate, context=f"task-{task}", reward=reward))
    return rows


def decide(rows: list[Finished], *, same_context: bool, wait_s: float = math.inf, max_pairs: int = MAX_PAIRS) -> str:
    """The decision of a test looking after every pair (a pair, once formed, never changes: see below)."""
    test = SequentialTest(alpha=ALPHA, max_pairs=max_pairs)
    if same_context:
        return test.add_pairs(pair_finished(rows, now=math.inf, wait_s=wait_s))
    return test.add_all([r.reward for r in rows if r.candidate], [r.reward for r in rows if not r.candidate])


@pytest.mark.parametrize(("fraction", "wait_s"), [(0.5, math.inf), (0.1, 30.0)],
                         ids=["half-same-context-only", "canary-10pct-with-arrival-fallback"])
def test_same_context_pairing_keeps_a_a_false_promotions_under_alpha(fraction: float, wait_s: float) -> None:
    runs, requests = 400, int(MAX_PAIRS / fraction * 1.2)
    promoted = sum(decide(task_traffic(seed, requests=requests, gain=0.0, fraction=fraction), same_context=True,
                          wait_s=wait_s) == "better" for seed in range(runs))
    assert promoted / runs <= ALPHA + 3 * math.sqrt(ALPHA * (1 - ALPHA) / runs), promoted


def test_pairs_once_formed_never_change_as_rewards_arrive() -> None:
    rows = task_traffic(5, requests=600, gain=0.0, fraction=0.3, tasks=40)
    final = pair_finished(rows, now=math.inf, wait_s=20.0)
    kinds = {p.kind for p in final}
    assert kinds == {"context", "arrival"}, kinds  # both kinds happen in this traffic
    for now in range(0, 640, 7):  # a look every 7 s sees what had arrived by then: a prefix of the final pairs
        seen = pair_finished([r for r in rows if r.at <= now], now=now, wait_s=20.0)
        assert seen == final[:len(seen)], now
    used = [r.reward for p in final for r in rows if r.reward in (p.candidate, p.baseline)]
    assert len(used) == len(set(used)) == 2 * len(final)  # no reward is in two pairs


def test_same_context_pairs_decide_where_arrival_order_pairs_cannot() -> None:
    """Context-heavy variance (40 tasks from 0.9 to 0.05, noise 0.05) and a modest gain of 0.05, at the traffic of
    a small deployment: 200 pairs at most."""
    runs, max_pairs = 200, 200
    streams = [task_traffic(seed, requests=int(max_pairs / 0.3 * 1.2), gain=0.05, fraction=0.3, tasks=40, zipf=False)
               for seed in range(runs)]
    by_context = sum(decide(rows, same_context=True, wait_s=60.0, max_pairs=max_pairs) == "better" for rows in streams)
    by_arrival = sum(decide(rows, same_context=False, max_pairs=max_pairs) == "better" for rows in streams)
    print(f"better within {max_pairs} pairs: same context {by_context}/{runs}, arrival order {by_arrival}/{runs}")
    assert by_context >= 0.9 * runs and by_context >= 3 * by_arrival, (by_context, by_arrival)
