"""Mean ± standard error over runs (seeds, repetitions), as every report prints it."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["Stat", "mean_se"]


@dataclass(frozen=True)
class Stat:
    """Mean and standard error of the finite values of a sample.

    Attributes:
        mean: the mean (``nan`` when there is no value).
        se: the standard error, sample std / sqrt(n) (``None`` for fewer than two values).
        n: the number of values.
    """

    mean: float
    se: float | None
    n: int

    def fmt(self, digits: int = 2, scale: float = 1.0) -> str:
        """``"mean ± se"`` (each times ``scale``, e.g. 100 for percent), ``"mean"`` for one value,
        ``"—"`` for none."""
        if self.n == 0:
            return "—"
        m = f"{self.mean * scale:.{digits}f}"
        return m if self.se is None else f"{m} ± {self.se * scale:.{digits}f}"


def mean_se(values: Iterable[float | None]) -> Stat:
    """The :class:`Stat` of ``values``; ``None`` and non-finite values (a run without that
    measurement) are left out."""
    vals = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    n = len(vals)
    if n == 0:
        return Stat(float("nan"), None, 0)
    mean = sum(vals) / n
    if n == 1:
        return Stat(mean, None, 1)
    var = sum((v - mean) ** 2 for v in vals) / (n - 1)
    return Stat(mean, math.sqrt(var / n), n)
