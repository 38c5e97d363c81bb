"""The MAE report's paired comparisons and seed-spread tie threshold (routelab.experiments.mae.compare).

Oracle: the statistics module (sample standard deviation) and scipy's Student-t quantile on the same
numbers, and the rule the module documents (holds below the 95 % t interval, t(0.975, n - 1) s.e., does
not hold above it, inconclusive within).
"""

from __future__ import annotations

import math
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats as scipy_stats

from routelab.experiments.mae.compare import less_verdict, paired, pooled_dof, pooled_sd, single_verdict

finite = st.floats(-10, 10, allow_nan=False)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.lists(st.tuples(finite, finite), min_size=2, max_size=6))
def test_paired_threshold_is_the_95_percent_t_bound_of_the_differences(pairs) -> None:
    a, b = [x for x, _ in pairs], [y for _, y in pairs]
    p = paired(a, b)
    d = [x - y for x, y in pairs]
    assert p.diffs == pytest.approx(d) and p.mean == pytest.approx(statistics.fmean(d), abs=1e-12)
    t = scipy_stats.t.ppf(0.975, len(d) - 1)
    assert p.threshold == pytest.approx(t * statistics.stdev(d) / math.sqrt(len(d)), abs=1e-12)
    v = less_verdict(p)
    if p.mean < -p.threshold:
        assert v == "holds"
    elif p.mean > p.threshold:
        assert v == "does not hold"
    else:
        assert v.startswith("inconclusive")


def test_verdicts_on_hand_made_seeds() -> None:
    # three seeds, a always about 1 below b with a small spread: holds
    assert less_verdict(paired([1.0, 2.0, 3.0], [2.1, 2.9, 4.0])) == "holds"
    assert less_verdict(paired([2.1, 2.9, 4.0], [1.0, 2.0, 3.0])) == "does not hold"
    # signs disagree across seeds: the mean is inside the t interval
    assert less_verdict(paired([1.0, 3.0, 2.0], [2.0, 2.0, 2.1])).startswith("inconclusive")
    # mean difference -1 with s.e. 0.5/sqrt(3) = 0.289 (t = 3.46): beyond a fixed 2 s.e., not beyond the
    # 95 % t bound of 2 degrees of freedom (4.30 s.e. = 1.24): inconclusive
    assert less_verdict(paired([0.0, 0.5, 1.0], [1.5, 1.5, 1.5])).startswith("inconclusive")
    # one seed: no spread, the sign decides and the verdict says so
    assert less_verdict(paired([1.0], [2.0])) == "holds (one seed, no spread: sign only)"
    assert less_verdict(paired([3.0], [2.0])) == "does not hold (one seed, no spread: sign only)"


def test_paired_rejects_unpaired_input() -> None:
    with pytest.raises(ValueError, match="one value per seed"):
        paired([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="one value per seed"):
        paired([], [])


@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.lists(st.lists(finite, min_size=1, max_size=5), min_size=1, max_size=4))
def test_pooled_sd_matches_the_pooled_variance_formula(groups) -> None:
    big = [g for g in groups if len(g) > 1]
    got = pooled_sd(groups)
    if not big:
        assert got is None
        return
    dof = sum(len(g) - 1 for g in big)
    want = math.sqrt(sum(statistics.variance(g) * (len(g) - 1) for g in big) / dof)
    assert got == pytest.approx(want, rel=1e-9, abs=1e-12)
    assert pooled_dof(groups) == dof


def test_single_runs_use_the_seed_spread() -> None:
    """The tie threshold of two single runs is the 95 % t bound of their difference: t(0.975, dof) sqrt(2) sd."""
    t = scipy_stats.t.ppf(0.975, 8) * math.sqrt(2) * 0.01
    assert single_verdict(1.0, 1.0 + t * 1.01, 0.01, 8) == "holds (one seed)"
    assert single_verdict(1.0 + t * 1.01, 1.0, 0.01, 8) == "does not hold (one seed)"
    assert single_verdict(1.0, 1.0 + t * 0.99, 0.01, 8).startswith("inconclusive")
    assert single_verdict(1.0, 1.5, None, 0) == "holds (one seed, no spread: sign only)"
    with pytest.raises(ValueError, match="dof must be at least 1"):
        single_verdict(1.0, 1.5, 0.01, 0)


def test_a_difference_of_differences_of_four_single_runs_uses_twice_the_seed_spread() -> None:
    """(a - b) - (c - d) of four independent single runs has standard deviation 2 sd, not sqrt(2) sd
    (review: claims 16 and 20 used sqrt 2, threshold 0.150 instead of 0.212 nats)."""
    t = scipy_stats.t.ppf(0.975, 8) * 2 * 0.01
    assert single_verdict(1.0, 1.0 + t * 1.01, 0.01, 8, runs=4) == "holds (one seed)"
    assert single_verdict(1.0, 1.0 + t * 0.99, 0.01, 8, runs=4).startswith("inconclusive")
    with pytest.raises(ValueError, match="runs must be a positive integer"):
        single_verdict(1.0, 1.5, 0.01, 8, runs=0)
