"""The MAE report's paired comparisons and seed-spread tie threshold (routelab.experiments.mae.compare).

Oracle: the statistics module (sample standard deviation) on the same numbers, and the rule the
module documents (holds below -2 s.e., does not hold above +2 s.e., inconclusive between).
"""

from __future__ import annotations

import math
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from routelab.experiments.mae.compare import less_verdict, paired, pooled_sd, single_verdict

finite = st.floats(-10, 10, allow_nan=False)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.lists(st.tuples(finite, finite), min_size=2, max_size=6))
def test_paired_threshold_is_two_standard_errors_of_the_differences(pairs) -> None:
    a, b = [x for x, _ in pairs], [y for _, y in pairs]
    p = paired(a, b)
    d = [x - y for x, y in pairs]
    assert p.diffs == pytest.approx(d) and p.mean == pytest.approx(statistics.fmean(d), abs=1e-12)
    assert p.threshold == pytest.approx(2 * statistics.stdev(d) / math.sqrt(len(d)), abs=1e-12)
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
    # signs disagree across seeds: the mean is inside 2 s.e.
    assert less_verdict(paired([1.0, 3.0, 2.0], [2.0, 2.0, 2.1])).startswith("inconclusive")
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


def test_single_runs_use_the_seed_spread() -> None:
    t = 2 * math.sqrt(2) * 0.01
    assert single_verdict(1.0, 1.0 + t * 1.01, 0.01) == "holds (one seed)"
    assert single_verdict(1.0 + t * 1.01, 1.0, 0.01) == "does not hold (one seed)"
    assert single_verdict(1.0, 1.0 + t * 0.99, 0.01).startswith("inconclusive")
    assert single_verdict(1.0, 1.5, None) == "holds (one seed, no spread: sign only)"
