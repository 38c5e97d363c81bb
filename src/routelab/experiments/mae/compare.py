"""Comparisons of the MAE report over paired seeds, with the tie threshold set from their spread.

Every variant is trained at the same seeds (same initial shared weights, same batches), so a
claim "a < b" is judged on the per-seed differences ``d_s = a_s - b_s``: it holds when their mean
is below ``-2 s.e.`` (``s.e.`` = sample std of the ``d_s`` / sqrt(n)), does not hold when it is
above ``+2 s.e.``, and is inconclusive in between. A comparison of two single runs (one seed) is
judged against the seed spread of the variants trained at every seed: the tie threshold is
``2 * sqrt(2) * s`` with ``s`` the pooled within-variant standard deviation over seeds (the
standard deviation of a difference of two independent runs is ``sqrt(2) s``). With one seed in
all (the quick form) there is no spread: the verdict is the sign of the difference, labelled so.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..kit.claims import HOLDS, NOT_HOLD
from ..kit.stats import mean_se

__all__ = ["INCONCLUSIVE", "Paired", "less_verdict", "paired", "pooled_sd", "single_verdict"]

INCONCLUSIVE = "inconclusive"
ONE_SEED = "one seed, no spread: sign only"


@dataclass(frozen=True)
class Paired:
    """Per-seed differences ``a_s - b_s`` of a paired comparison.

    Attributes:
        diffs: the differences, one per seed.
        mean: their mean.
        threshold: ``2 s.e.`` of the mean (``None`` with one seed).
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
    return Paired(diffs, st.mean, None if st.se is None else 2.0 * st.se)


def less_verdict(p: Paired) -> str:
    """Verdict of the claim ``a < b`` from its paired differences (see the module docstring)."""
    if p.threshold is None:
        return f"{HOLDS if p.mean < 0 else NOT_HOLD} ({ONE_SEED})"
    if abs(p.mean) <= p.threshold:
        return f"{INCONCLUSIVE} (|mean difference| {abs(p.mean):.3g} <= 2 s.e. {p.threshold:.3g})"
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


def single_verdict(a: float, b: float, sd: float | None) -> str:
    """Verdict of the claim ``a < b`` for two single runs, tie threshold ``2 sqrt(2) sd``
    (``sd`` from :func:`pooled_sd`; ``None``: sign only, labelled)."""
    if sd is None:
        return f"{HOLDS if a < b else NOT_HOLD} ({ONE_SEED})"
    t = 2.0 * math.sqrt(2.0) * sd
    if abs(a - b) <= t:
        return f"{INCONCLUSIVE} (|difference| {abs(a - b):.3g} <= seed-spread threshold {t:.3g}; one seed)"
    return f"{HOLDS if a < b else NOT_HOLD} (one seed)"
