"""kit.stats: a difference is judged against its two-sided 95 % Student-t interval, t(0.975, n - 1) s.e.

Oracle: scipy.stats (``ttest_rel``, ``ttest_ind(equal_var=False)``, ``t.ppf``) on the same numbers. A review found
the old fixed "2 s.e." rule called a null difference real in 18 % of trials at 3 seeds.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats as scipy_stats

from routelab.experiments.kit.stats import (
    Stat,
    beyond_spread,
    difference_bound,
    mean_se,
    paired_difference,
    spread_bound,
    spread_note,
    t_quantile,
)


def test_spread_bound_is_the_student_t_half_width() -> None:
    rng = np.random.default_rng(0)
    for n in (2, 3, 5, 10):
        x = rng.normal(0.3, 2.0, n)
        stat = mean_se(x.tolist())
        want = scipy_stats.t.ppf(0.975, n - 1) * scipy_stats.sem(x)
        assert spread_bound(stat) == pytest.approx(want, rel=1e-12)
    assert t_quantile(2) == pytest.approx(4.30265272975, rel=1e-10)  # tables: 4.303


def test_beyond_spread_is_the_paired_t_test_at_5_percent() -> None:
    """Side of 0 beyond the bound <=> scipy's paired t-test rejects at 5 %, with the sign of the mean difference."""
    rng = np.random.default_rng(1)
    checked = 0
    for trial in range(400):
        n = int(rng.integers(2, 7))
        a = rng.normal(0.0, 1.0, n)
        b = a + rng.normal(rng.choice([0.0, 0.5, 2.0]), 1.0, n)
        res = scipy_stats.ttest_rel(a, b)
        if abs(res.pvalue - 0.05) < 1e-9:  # on the boundary either side is right
            continue
        side = beyond_spread(paired_difference(dict(enumerate(a)), dict(enumerate(b))))
        assert side == (int(np.sign(res.statistic)) if res.pvalue < 0.05 else 0), (trial, a, b, res)
        checked += 1
    assert checked > 390


def test_a_null_difference_is_beyond_the_bound_5_percent_of_the_time_at_3_seeds() -> None:
    """Monte Carlo: paired differences of 3 seeds drawn from N(0, 1); the old 2 s.e. rule gave 0.18."""
    rng = np.random.default_rng(2)
    trials = 4000
    hits = sum(beyond_spread(mean_se(rng.normal(0.0, 1.0, 3).tolist())) != 0 for _ in range(trials))
    rate = hits / trials
    assert abs(rate - 0.05) < 0.015, rate  # s.e. of the rate 0.0034: 4.4 s.e. of room


def test_difference_bound_is_welchs_t_test_at_5_percent() -> None:
    rng = np.random.default_rng(3)
    for _ in range(200):
        a = rng.normal(0.0, rng.uniform(0.5, 2.0), int(rng.integers(2, 6)))
        b = rng.normal(rng.choice([0.0, 1.0, 3.0]), rng.uniform(0.5, 2.0), int(rng.integers(2, 6)))
        res = scipy_stats.ttest_ind(a, b, equal_var=False)
        if abs(res.pvalue - 0.05) < 1e-9:
            continue
        bound = difference_bound(mean_se(a.tolist()), mean_se(b.tolist()))
        assert (abs(a.mean() - b.mean()) > bound) == (res.pvalue < 0.05)


def test_without_a_spread_the_sign_decides() -> None:
    """One value (no s.e.) or identical values (s.e. 0): the bound is 0, the sign decides; 0 itself is a tie."""
    assert spread_bound(Stat(0.3, None, 1)) == 0.0 and beyond_spread(Stat(0.3, None, 1)) == 1
    assert beyond_spread(Stat(-0.3, None, 1)) == -1
    assert beyond_spread(mean_se([0.5, 0.5, 0.5])) == 1 and spread_bound(mean_se([0.5, 0.5, 0.5])) == 0.0
    assert beyond_spread(mean_se([0.0, 0.0])) == 0
    assert beyond_spread(Stat(math.nan, None, 0)) is None
    assert difference_bound(Stat(1.0, None, 1), mean_se([1.0, 2.0])) is None
    assert difference_bound(mean_se([1.0, 1.0]), mean_se([2.0, 2.0])) == 0.0
    assert spread_note(Stat(0.3, None, 1)) == "1 seed"


def test_bad_confidence_or_df_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match="confidence must be in"):
        beyond_spread(mean_se([1.0, 2.0]), confidence=95)
    with pytest.raises(ValueError, match="df must be positive"):
        t_quantile(0)


def test_spread_note_states_the_bound() -> None:
    d = mean_se([1.0, 2.0, 3.0])  # se = 1/sqrt(3)
    bound = scipy_stats.t.ppf(0.975, 2) / math.sqrt(3)
    assert spread_note(d, scale=100) == f"95 % t bound {100 * bound:.3g} (4.30 s.e., 3 seeds)"
