"""Mean ± standard error over runs (seeds, repetitions), as every report prints it, and the rule by which
the reports judge a difference against its seed spread.

The rule (:data:`SPREAD_RULE`): a mean difference of ``n`` values counts as beyond the spread when it lies
outside the two-sided 95 % Student-t interval ``± t(0.975, n - 1) · s.e.`` (:func:`spread_bound`), i.e. when
the paired t-test rejects a zero difference at the 5 % level. A fixed "2 s.e." would not do: at 3 seeds
(2 degrees of freedom) a null difference lands beyond 2 s.e. 18 % of the time; the t bound is 4.30 s.e.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass

__all__ = ["CONFIDENCE", "SPREAD_RULE", "Stat", "beyond_spread", "difference_bound", "mean_se", "paired_difference",
           "spread_bound", "spread_note", "t_quantile"]

CONFIDENCE = 0.95
"""The two-sided confidence of the interval a difference is judged against."""

SPREAD_RULE = "the 95 % Student-t interval of the mean (n − 1 degrees of freedom for n seeds)"
"""The criterion's wording, for the reports' text: a difference "beyond" it is significant at 5 %."""


@dataclass(frozen=True)
class Stat:
    """Mean and standard error of the finite values of a sample.

    Attributes:
        mean: the mean (``nan`` when there is no value).
        se: the standard error, sample std / sqrt(n) (``None`` for fewer than two values).
        n: the number of values.
        non_finite: the NaN/inf values left out (a run that diverged), which :meth:`fmt` shows.
    """

    mean: float
    se: float | None
    n: int
    non_finite: int = 0

    def fmt(self, digits: int = 2, scale: float = 1.0) -> str:
        """``"mean ± se"`` (each times ``scale``, e.g. 100 for percent), ``"mean"`` for one value,
        ``"—"`` for none; with ``" (k non-finite left out)"`` where NaN/inf values were."""
        left_out = f" ({self.non_finite} non-finite left out)" if self.non_finite else ""
        if self.n == 0:
            return "—" + left_out
        m = f"{self.mean * scale:.{digits}f}"
        return (m if self.se is None else f"{m} ± {self.se * scale:.{digits}f}") + left_out


def mean_se(values: Iterable[float | None]) -> Stat:
    """The :class:`Stat` of ``values``; ``None`` (a run without that measurement) and non-finite
    values (a run that diverged: counted in :attr:`Stat.non_finite`) are left out."""
    given = [float(v) for v in values if v is not None]
    vals = [v for v in given if math.isfinite(v)]
    n, bad = len(vals), len(given) - len(vals)
    if n == 0:
        return Stat(float("nan"), None, 0, bad)
    mean = sum(vals) / n
    if n == 1:
        return Stat(mean, None, 1, bad)
    var = sum((v - mean) ** 2 for v in vals) / (n - 1)
    return Stat(mean, math.sqrt(var / n), n, bad)


def paired_difference(a: Mapping[Hashable, float | None], b: Mapping[Hashable, float | None]) -> Stat:
    """Mean ± s.e. of ``a[seed] - b[seed]`` over the seeds both have a finite value for.

    Args:
        a, b: a measurement by seed (``None`` or non-finite: that run has none, e.g. it failed).

    Returns:
        The :class:`Stat` of the paired differences (``n = 0``: no seed measured by both), with the
        seeds whose value on either side is NaN/inf counted in ``non_finite``.
    """
    diffs, bad = [], 0
    for seed in a.keys() & b.keys():
        va, vb = a[seed], b[seed]
        if va is None or vb is None:
            continue
        if math.isfinite(va) and math.isfinite(vb):
            diffs.append(float(va) - float(vb))
        else:
            bad += 1
    stat = mean_se(diffs)
    return Stat(stat.mean, stat.se, stat.n, bad)


def _check_confidence(confidence: float) -> None:
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), e.g. 0.95 for a 95 % interval; got {confidence!r}.")


def t_quantile(df: float, confidence: float = CONFIDENCE) -> float:
    """The two-sided critical value ``t((1 + confidence) / 2, df)`` of Student's t (4.30 for 2 df at 95 %).

    Raises:
        ValueError: when ``df`` is not positive (fewer than two values have no spread) or ``confidence``
            is not in (0, 1).
    """
    from scipy import stats  # here: importing scipy.stats takes a while, and most callers of this module need none

    _check_confidence(confidence)
    if not df > 0:
        raise ValueError(f"df must be positive (n - 1 for n >= 2 values), got {df!r}.")
    return float(stats.t.ppf(0.5 + confidence / 2.0, df))


def spread_bound(stat: Stat, confidence: float = CONFIDENCE) -> float:
    """The half-width of ``stat``'s two-sided Student-t interval: ``t((1 + confidence) / 2, n - 1) · se``.

    ``0.0`` when ``stat`` has no standard error (fewer than two values): then the sign alone decides, as a
    single run's comparison can do no better. A zero standard error (identical values) gives 0 as well.
    """
    if stat.se is None:
        return 0.0
    return t_quantile(stat.n - 1, confidence) * stat.se


def difference_bound(a: Stat, b: Stat, confidence: float = CONFIDENCE) -> float | None:
    """The half-width of the Student-t interval of ``a.mean - b.mean`` for two *independent* (unpaired)
    samples: ``t((1 + confidence) / 2, df) · sqrt(a.se² + b.se²)`` with the Welch-Satterthwaite ``df``
    (the interval of ``scipy.stats.ttest_ind(..., equal_var=False)``).

    Returns:
        The bound; ``None`` when either side has no standard error (fewer than two values); ``0.0`` when
        both standard errors are 0.
    """
    if a.se is None or b.se is None:
        return None
    va, vb = a.se**2, b.se**2
    if va + vb == 0.0:
        return 0.0
    df = (va + vb) ** 2 / (va**2 / (a.n - 1) + vb**2 / (b.n - 1))
    return t_quantile(df, confidence) * math.sqrt(va + vb)


def spread_note(stat: Stat, scale: float = 1.0, digits: int = 3, unit: str = "seeds",
                confidence: float = CONFIDENCE, label: str | None = None) -> str:
    """``"95 % t bound 0.123 (4.30 s.e., 3 seeds)"``: :func:`spread_bound` of ``stat`` at ``confidence`` times
    ``scale`` (e.g. 100 for percent points), for a report's measured text; ``"1 seed"`` (``unit`` singular:
    the ``s`` dropped) without a standard error. ``label`` names the bound (default ``"95 % t bound"`` at
    95 %, e.g. ``"one-sided 5 % t bound"`` for the 90 % two-sided quantile a one-sided test reads)."""
    if stat.se is None:
        return f"{stat.n} {unit if stat.n != 1 else unit.removesuffix('s')}"
    t = t_quantile(stat.n - 1, confidence)
    name = label if label is not None else f"{100 * confidence:g} % t bound"
    return f"{name} {scale * t * stat.se:.{digits}g} ({t:.2f} s.e., {stat.n} {unit})"


def beyond_spread(stat: Stat, confidence: float = CONFIDENCE) -> int | None:
    """Which side of 0 a mean difference is on, beyond its two-sided Student-t interval
    (:func:`spread_bound`: ``t((1 + confidence) / 2, n - 1)`` standard errors, 4.30 at 3 values and 95 %).

    Returns:
        ``-1`` (below ``-bound``), ``+1`` (above ``bound``), ``0`` (within: not distinguishable from no
        difference at this seed spread), or ``None`` when nothing was measured. With one value (no standard
        error) or a zero standard error the bound is 0 and the sign decides (0 itself: ``0``).

    Raises:
        ValueError: when ``confidence`` is not in (0, 1).
    """
    _check_confidence(confidence)
    if stat.n == 0 or not math.isfinite(stat.mean):
        return None
    bound = spread_bound(stat, confidence)
    if stat.mean < -bound:
        return -1
    if stat.mean > bound:
        return 1
    return 0
