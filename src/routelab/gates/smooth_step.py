"""The smooth-step function of Hazimeh et al. (2021), Sec. 3.1.3."""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

from .._checks import ArgumentTypeError, _real_number

__all__ = ["GAMMA_RANGE", "smooth_step", "check_gamma"]


#: The widths :func:`smooth_step` accepts: wide enough a range for any use, narrow enough that
#: ``gamma`` and ``gamma / 2`` are normal float32 numbers (the band is computed in float32 or wider).
GAMMA_RANGE = (1e-30, 1e30)


def check_gamma(gamma: Any) -> float:
    """Return ``gamma`` as a float if it is a real number in :data:`GAMMA_RANGE` (a Python or NumPy
    scalar or a 0-dim real tensor, not a bool, as :func:`routelab._checks.check_pos` takes), else
    raise ValueError."""
    lo, hi = GAMMA_RANGE
    v = _real_number(gamma)
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or not lo <= v <= hi:
        raise ValueError(f"gamma must be a finite number in [{lo:g}, {hi:g}] (the smooth-step width, > 0), "
                         f"got {gamma!r}.")
    return float(v)


def smooth_step(t: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """Cubic smooth-step S(t), element-wise (any shape -> same shape and dtype).

    S(t) = 0 for t <= -gamma/2, 1 for t >= gamma/2, and -2/gamma^3 t^3 + 3/(2 gamma) t + 1/2
    in between; continuously differentiable, with S'(±gamma/2) = 0, so that outside the band
    the gradient is exactly zero (this is what lets DSelect-k become exactly sparse).

    The cubic is evaluated on ``u = clamp(t, -gamma/2, gamma/2) / gamma`` as ``u (3/2 - 2 u^2) +
    1/2``, so it never sees a large ``t``: value and gradient are exact 0/1 and 0 outside the
    band and finite everywhere, in every dtype (float16 and bfloat16 are computed in float32 and
    returned in their own dtype). Where a value inside the band rounds to exactly 0 or 1 in the
    output dtype, its gradient is 0 too (binary means no gradient, whatever the rounding). NaN
    propagates.

    Args:
        t: any real floating tensor.
        gamma: the width of the fractional region, a real number in :data:`GAMMA_RANGE` (official
            default 1; a NumPy scalar or a 0-dim tensor is taken as its number).

    Raises:
        ValueError: if gamma is not a finite number in :data:`GAMMA_RANGE`, or ``t`` is not a
            floating tensor.
        TypeError: if ``t`` is not a tensor (an ``ArgumentTypeError``, also a ValueError).
    """
    gamma = check_gamma(gamma)
    if not isinstance(t, torch.Tensor):
        raise ArgumentTypeError(f"t must be a torch.Tensor, got {type(t).__name__}; convert it with "
                                "torch.as_tensor(t).")
    if not t.is_floating_point():
        raise ValueError(f"t must be a floating tensor, got {t.dtype}; use t.float().")
    work = t if t.dtype in (torch.float32, torch.float64) else t.float()
    half = gamma / 2.0
    # The "double where": the polynomial only ever sees the clamped input, so the branch that the
    # outer where discards has a finite gradient (0 * finite, never 0 * inf = NaN).
    u = work.clamp(-half, half) / gamma
    cubic = u * (1.5 - 2.0 * u * u) + 0.5
    out = torch.where(work <= -half, torch.zeros_like(work), torch.where(work >= half, torch.ones_like(work), cubic))
    out = out if out.dtype == t.dtype else out.to(t.dtype)
    # Just inside the band the value can round to exactly 0 or 1 (float32: within ~1e-4 gamma of
    # the edge; bfloat16: ~1e-2) while the cubic's slope is not 0. There the derivative is set to 0,
    # as outside: "S binary means S' = 0" (Sec. 3.1.3) holds in every dtype, so a selector or weight
    # that is exactly 0 gets no gradient (what skipping its expert assumes).
    return torch.where((out == 0) | (out == 1), out.detach(), out)
