"""Mean ± standard error over runs (seeds, repetitions), as every report prints it."""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass

__all__ = ["Stat", "beyond_spread", "mean_se", "paired_difference"]


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


def beyond_spread(stat: Stat, spread: float = 2.0) -> int | None:
    """Which side of 0 a mean difference is on, beyond ``spread`` standard errors.

    Returns:
        ``-1`` (below ``-spread * se``), ``+1`` (above ``spread * se``), ``0`` (within: a tie at this
        seed spread), or ``None`` when nothing was measured. With one value (no standard error) its
        sign decides, as a single run's comparison can do no better.
    """
    if stat.n == 0 or not math.isfinite(stat.mean):
        return None
    bound = spread * stat.se if stat.se is not None else 0.0
    if stat.mean < -bound:
        return -1
    if stat.mean > bound:
        return 1
    return 0
