"""The statistics of canary analysis, on what Prometheus keeps: counts, not samples.

Two tests, both one-sided (is the canary *worse*?):

- ``two_proportion_test``: the pooled two-proportion z-test for server-error ratios.
- ``binned_mann_whitney``: the Mann-Whitney U test over two histograms with the same bucket
  bounds, in the spirit of Kayenta's judge. Prometheus keeps only bucket counts, so every
  observation inside one bucket is a tie: each gets the bucket's mid-rank, and the variance
  carries the tie correction. With one observation per bucket this is the textbook test.

Both use the normal approximation; callers require minimum counts before trusting it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


def normal_sf(z: float) -> float:
    """P(Z > z) for a standard normal Z."""
    return 0.5 * math.erfc(z / math.sqrt(2.0))


@dataclass(frozen=True, slots=True)
class ProportionTest:
    z: float
    p_value: float  # one-sided: P(a difference this large | the canary is no worse)
    baseline_ratio: float
    canary_ratio: float

    @property
    def increase(self) -> float:
        return self.canary_ratio - self.baseline_ratio


def two_proportion_test(
    baseline_events: int, baseline_n: int, canary_events: int, canary_n: int
) -> ProportionTest:
    """One-sided pooled z-test of H1: the canary's event ratio is above the baseline's."""
    if baseline_n <= 0 or canary_n <= 0:
        raise ValueError("both samples need at least one observation")
    if not (0 <= baseline_events <= baseline_n and 0 <= canary_events <= canary_n):
        raise ValueError("events must be between 0 and the number of observations")
    p1, p2 = baseline_events / baseline_n, canary_events / canary_n
    pooled = (baseline_events + canary_events) / (baseline_n + canary_n)
    se = math.sqrt(pooled * (1.0 - pooled) * (1.0 / baseline_n + 1.0 / canary_n))
    if se == 0.0:  # no events at all, or only events: the samples cannot differ
        return ProportionTest(0.0, 0.5 if p1 == p2 else (0.0 if p2 > p1 else 1.0), p1, p2)
    z = (p2 - p1) / se
    return ProportionTest(z, normal_sf(z), p1, p2)


@dataclass(frozen=True, slots=True)
class RankTest:
    u: float  # U of the canary: pairs (canary, baseline) where the canary is slower, ties half
    z: float
    p_value: float  # one-sided: P(U this large | the canary is no slower)
    n_baseline: int
    n_canary: int

    @property
    def effect(self) -> float:
        """U / (n1 n2): the probability that a canary request is slower than a baseline
        request (ties count half); 0.5 means no difference."""
        return self.u / (self.n_baseline * self.n_canary)


def binned_mann_whitney(baseline: Sequence[int], canary: Sequence[int]) -> RankTest:
    """One-sided Mann-Whitney U test of H1: canary observations tend to be larger.

    ``baseline`` and ``canary`` are per-bucket counts (not cumulative) over the same
    ordered buckets. Exact U with mid-ranks; normal approximation with tie correction."""
    if len(baseline) != len(canary):
        raise ValueError("both histograms need the same buckets")
    if any(x < 0 for x in (*baseline, *canary)):
        raise ValueError("bucket counts cannot be negative")
    n1, n2 = sum(baseline), sum(canary)
    if n1 == 0 or n2 == 0:
        raise ValueError("both histograms need at least one observation")
    n = n1 + n2
    u = 0.0
    below = 0  # baseline observations in lower buckets
    ties = 0.0
    for b, c in zip(baseline, canary, strict=True):
        u += c * (below + b / 2.0)
        below += b
        t = b + c
        ties += t**3 - t
    mean = n1 * n2 / 2.0
    var = n1 * n2 / 12.0 * ((n + 1) - ties / (n * (n - 1))) if n > 1 else 0.0
    if var <= 0.0:  # every observation in one bucket: no evidence either way
        return RankTest(u, 0.0, 0.5, n1, n2)
    z = (u - mean) / math.sqrt(var)
    return RankTest(u, z, normal_sf(z), n1, n2)
