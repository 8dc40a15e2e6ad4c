"""The canary statistics against known answers: hand-computed values, a brute-force U over
the expanded samples, and the standard library's normal distribution."""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter
from statistics import NormalDist

import pytest

from inferwatch.canary.stats import binned_mann_whitney, normal_sf, two_proportion_test


def test_normal_tail_matches_the_standard_library() -> None:
    assert normal_sf(0.0) == 0.5
    assert normal_sf(1.959963984540054) == pytest.approx(0.025, abs=1e-12)
    for z in (-3.0, -0.5, 0.7, 2.33, 5.0):
        assert normal_sf(z) == pytest.approx(1.0 - NormalDist().cdf(z), abs=1e-12)


def test_two_proportions_worked_example() -> None:
    # 2% of 1000 against 4% of 1000: pooled 3%, se = sqrt(0.03 * 0.97 * 2/1000) = 0.0076289,
    # z = 0.02 / se = 2.6216, one-sided p = 0.004375.
    t = two_proportion_test(20, 1000, 40, 1000)
    assert t.baseline_ratio == 0.02 and t.canary_ratio == 0.04
    assert t.increase == pytest.approx(0.02)
    assert t.z == pytest.approx(2.62161, abs=1e-5)
    assert t.p_value == pytest.approx(0.004375, abs=1e-6)


def test_two_proportions_direction_and_degenerate_cases() -> None:
    better = two_proportion_test(40, 1000, 20, 1000)  # the canary fails less: one-sided p near 1
    assert better.z == pytest.approx(-2.62161, abs=1e-5) and better.p_value > 0.99
    same = two_proportion_test(10, 500, 10, 500)
    assert same.z == 0.0 and same.p_value == 0.5
    assert two_proportion_test(0, 300, 0, 200).p_value == 0.5  # no errors anywhere: no evidence
    assert two_proportion_test(300, 300, 200, 200).p_value == 0.5
    with pytest.raises(ValueError):
        two_proportion_test(0, 0, 1, 10)
    with pytest.raises(ValueError):
        two_proportion_test(11, 10, 1, 10)


def test_rank_test_textbook_example() -> None:
    # Baseline {1, 2, 3}, canary {4, 5, 6}, one observation per bucket: every canary value is
    # larger, U = 9 = n1 n2; mean 4.5, variance 3*3*7/12 = 5.25, z = 4.5 / sqrt(5.25) = 1.9640,
    # one-sided p = 0.02477.
    t = binned_mann_whitney([1, 1, 1, 0, 0, 0], [0, 0, 0, 1, 1, 1])
    assert t.u == 9.0 and t.effect == 1.0
    assert t.z == pytest.approx(1.96396, abs=1e-5)
    assert t.p_value == pytest.approx(0.024767, abs=1e-6)


def _brute_force(baseline: list[int], canary: list[int]) -> tuple[float, float]:
    """U and z from the expanded samples: pairwise comparisons for U, the sizes of the tie
    groups of the pooled sample for the tie-corrected variance."""
    xs = [i for i, n in enumerate(baseline) for _ in range(n)]
    ys = [i for i, n in enumerate(canary) for _ in range(n)]
    u = sum((y > x) + 0.5 * (y == x) for x, y in itertools.product(xs, ys))
    pooled = xs + ys
    n1, n2, n = len(xs), len(ys), len(pooled)
    ties = sum(t**3 - t for t in Counter(pooled).values())
    var = n1 * n2 / 12 * ((n + 1) - ties / (n * (n - 1)))
    return u, (u - n1 * n2 / 2) / math.sqrt(var)


def test_rank_test_equals_the_brute_force_on_tied_histograms() -> None:
    rng = random.Random(7)
    for _ in range(25):
        buckets = rng.randint(2, 8)
        baseline = [rng.randint(0, 12) for _ in range(buckets)]
        canary = [rng.randint(0, 12) for _ in range(buckets)]
        baseline[0] += 1
        canary[-1] += 1
        t = binned_mann_whitney(baseline, canary)
        u, z = _brute_force(baseline, canary)
        assert t.u == pytest.approx(u)
        assert t.z == pytest.approx(z, abs=1e-9)
        assert t.p_value == pytest.approx(1.0 - NormalDist().cdf(z), abs=1e-9)


def test_rank_test_same_distribution_and_one_bucket() -> None:
    t = binned_mann_whitney([10, 30, 60], [20, 60, 120])  # same shape, twice the traffic
    assert t.effect == pytest.approx(0.5) and t.z == pytest.approx(0.0) and t.p_value == pytest.approx(0.5)
    one = binned_mann_whitney([0, 50, 0], [0, 70, 0])  # every request in one bucket
    assert one.p_value == 0.5 and one.effect == 0.5


def test_rank_test_refuses_what_it_cannot_judge() -> None:
    with pytest.raises(ValueError):
        binned_mann_whitney([1, 2], [1, 2, 3])
    with pytest.raises(ValueError):
        binned_mann_whitney([0, 0], [1, 2])
    with pytest.raises(ValueError):
        binned_mann_whitney([1, -1], [1, 2])
