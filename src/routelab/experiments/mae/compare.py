"""Comparisons of the MAE report over paired seeds, with the tie threshold set from their spread.

Every variant is trained at the same seeds (same initial shared weights, same batches), so a
claim "a < b" is judged on the per-seed differences ``d_s = a_s - b_s``: it holds when their mean
is below ``-t s.e.``, does not hold when it is above ``+t s.e.``, and is inconclusive in between
(``s.e.`` = sample std of the ``d_s`` / sqrt(n); ``t = t(0.975, n - 1)``: the 95 % Student-t interval,
i.e. a two-sided paired t-test at 5 %; 4.30 at 3 seeds). A comparison of two single runs (one seed) is
judged against the seed spread of the variants trained at every seed: the tie threshold is
``t(0.975, dof) * sqrt(2) * s`` with ``s`` the pooled within-variant standard deviation over seeds and
``dof`` its degrees of freedom (the standard deviation of a difference of two independent runs is
``sqrt(2) s``). With one seed in all (the quick form) there is no spread: the verdict is the sign of the
difference, labelled so.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..._checks import check_positive_int
from ..kit.claims import HOLDS, INCONCLUSIVE, NOT_HOLD
from ..kit.stats import mean_se, spread_bound, t_quantile

__all__ = ["INCONCLUSIVE", "Paired", "less_verdict", "paired", "pooled_dof", "pooled_sd", "single_threshold",
           "single_verdict"]

ONE_SEED = "one seed, no spread: sign only"


@dataclass(frozen=True)
class Paired:
    """Per-seed differences ``a_s - b_s`` of a paired comparison.

    Attributes:
        diffs: the differences, one per seed.
        mean: their mean.
        threshold: the half-width of the 95 % Student-t interval of the mean, ``t(0.975, n - 1) s.e.``
            (``None`` with one seed).
    """

    diffs: tuple[float, ...]
    mean: float
    threshold: float | None


def paired(a: Sequence[float], b: Sequence[float]) -> Paired:
    """The paired differences of ``a`` and ``b`` (same seeds, same order).

    Raises:
        ValueError: if ``a`` and ``b`` differ in length or are empty.
    """
    if len(a) != len(b) or not a:
        raise ValueError(f"a and b must hold one value per seed, same seeds; got {len(a)} and {len(b)} values.")
    diffs = tuple(float(x) - float(y) for x, y in zip(a, b, strict=True))
    st = mean_se(diffs)
    return Paired(diffs, st.mean, None if st.se is None else spread_bound(st))


def less_verdict(p: Paired) -> str:
    """Verdict of the claim ``a < b`` from its paired differences (see the module docstring)."""
    if p.threshold is None:
        return f"{HOLDS if p.mean < 0 else NOT_HOLD} ({ONE_SEED})"
    if abs(p.mean) <= p.threshold:
        return (f"{INCONCLUSIVE} (|mean difference| {abs(p.mean):.3g} <= 95 % t bound {p.threshold:.3g}, "
                f"{len(p.diffs)} seeds)")
    return HOLDS if p.mean < 0 else NOT_HOLD


def pooled_sd(groups: Sequence[Sequence[float]]) -> float | None:
    """Pooled within-group sample standard deviation (groups of one value are left out);
    ``None`` when no group has two values."""
    ss, dof = 0.0, 0
    for g in groups:
        if len(g) < 2:
            continue
        m = sum(g) / len(g)
        ss += sum((x - m) ** 2 for x in g)
        dof += len(g) - 1
    return math.sqrt(ss / dof) if dof else None


def pooled_dof(groups: Sequence[Sequence[float]]) -> int:
    """The degrees of freedom of :func:`pooled_sd` of ``groups``: the sum of ``len(g) - 1`` over the groups
    of two values or more (0: no spread)."""
    return sum(len(g) - 1 for g in groups if len(g) >= 2)


def single_threshold(sd: float, dof: int, runs: int = 2) -> float:
    """The tie threshold of a difference of two single runs: the half-width of its 95 % Student-t interval,
    ``t(0.975, dof) * sqrt(2) * sd`` (``sd``, ``dof``: :func:`pooled_sd`, :func:`pooled_dof`); of a
    difference of differences of four single runs (``runs=4``), ``t * 2 * sd``: a signed sum of ``runs``
    independent runs has the standard deviation ``sqrt(runs) * sd``.

    Raises:
        ValueError: when ``dof`` is not positive (no seed spread: judge by the sign instead).
    """
    if dof < 1:
        raise ValueError(f"dof must be at least 1 (pooled_dof of groups with a seed spread), got {dof}; without a "
                         "seed spread judge by the sign (sd=None).")
    check_positive_int("runs", runs)
    return t_quantile(dof) * math.sqrt(runs) * sd


def single_verdict(a: float, b: float, sd: float | None, dof: int, runs: int = 2) -> str:
    """Verdict of the claim ``a < b`` for two single runs, tie threshold :func:`single_threshold`
    (``sd`` and ``dof`` from :func:`pooled_sd` and :func:`pooled_dof`; ``sd`` ``None``: sign only, labelled);
    ``runs=4`` where ``a`` and ``b`` are each a difference of two single runs.

    Raises:
        ValueError: when ``sd`` is given with ``dof`` below 1.
    """
    if sd is None:
        return f"{HOLDS if a < b else NOT_HOLD} ({ONE_SEED})"
    t = single_threshold(sd, dof, runs)
    if abs(a - b) <= t:
        return f"{INCONCLUSIVE} (|difference| {abs(a - b):.3g} <= seed-spread threshold {t:.3g}; one seed)"
    return f"{HOLDS if a < b else NOT_HOLD} (one seed)"
