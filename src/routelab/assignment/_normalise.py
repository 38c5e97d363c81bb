"""Bringing scores of any magnitude to a fixed range before the solvers touch them.

The balanced assignment is invariant under two changes of the scores ``s[i, j]``:

* a **per-row shift** ``s[i, j] - m_i`` (every token takes exactly one expert, so the objective
  changes by the constant ``sum_i m_i``), and
* a **positive scale** ``2^-e s`` (a power of two, so that scaling is exact in floating point
  until values fall below the smallest normal number).

The solvers therefore work on ``2^-e (s - m)`` with ``m_i`` the row maximum and ``e`` chosen per
instance so that the largest *spread* ``max_i (max_j s[i, j] - min_j s[i, j])`` lies in
``(1/2, 1]``. Magnitude alone then can never overflow an exponent, a variance or a penalty, and
the rounding guard of the optimality certificate scales with the spread (the size of the
differences the objective depends on), not with ``max |s|``: a common offset of ``1e5`` or
near-ties ``1 + 1e-7 x`` are solved exactly. The shift itself is computed in the scores' dtype;
its rounding error is at most half an ulp of the *shifted* value, i.e. relative to the spread.

:func:`perturbed_scores` does the same for the Gumbel-perturbed scores ``a / tau + g`` of
Gumbel-Matching without ever forming them, so that ``tau = 1e-30`` or ``1e300``-scale logits
cannot overflow either.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["compute_dtype", "ldexp", "normalise_scores", "perturbed_scores"]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the solvers compute in: float32 for half-precision input, else ``dtype``."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def ldexp(x: Tensor, e: Tensor, bound: int | None = None) -> Tensor:
    """``x * 2^e`` per instance, exact until the result leaves the normal range.

    ``torch.ldexp`` forms ``2^e`` as one number, which overflows (``0 * inf = NaN``) or underflows
    (``-inf * 0 = NaN``) for exponents beyond the dtype's range; here the factor is applied in
    chunks that are always normal numbers, so ``0`` stays ``0``, ``-inf`` stays ``-inf`` and
    results beyond the range become ``+-inf`` or ``0`` as the exact product would round.

    Args:
        x: ``[B, ...]`` floating tensor.
        e: ``[B]`` integer exponents.
        bound: ``max |e|`` (or more) when the caller knows it on the host; ``None``: read from
            ``e`` (one host synchronisation when ``e`` is on a GPU).

    Returns:
        ``[B, ...]`` tensor of ``x``'s dtype (``x`` itself when every exponent is 0).
    """
    if e.numel() == 0:
        return x
    if bound is None:
        lo, hi = torch.stack(torch.aminmax(e.to(torch.long))).tolist()  # one host synchronisation
        bound = max(-lo, hi)
    return _ldexp_bounded(x, e, bound)


def _ldexp_bounded(x: Tensor, e: Tensor, bound: int) -> Tensor:
    """:func:`ldexp` given ``bound >= max |e|`` (known on the host: no synchronisation)."""
    if bound == 0:
        return x
    chunk = _chunk(x.dtype)
    rem = e.to(torch.long).view((-1,) + (1,) * (x.ndim - 1))
    for _ in range(-(-bound // chunk)):  # 3 rounds at most for any exponent routelab forms
        step = rem.clamp(min=-chunk, max=chunk)
        x = x * torch.pow(2.0, step.to(x.dtype))
        rem = rem - step
    return x


def _chunk(dtype: torch.dtype) -> int:
    """The largest ``c`` with ``2^c`` and ``2^-c`` normal numbers of ``dtype`` (with margin)."""
    return int(math.log2(torch.finfo(dtype).max)) - 2


def _exponent(x: Tensor) -> Tensor:
    """``[B]`` long ``e`` with ``x`` in ``[2^(e-1), 2^e)`` for ``x > 0``; ``0`` where ``x == 0``."""
    return torch.where(
        x > 0, torch.frexp(x).exponent.to(torch.long), torch.zeros((), dtype=torch.long, device=x.device)
    )


def _finite_row_max(S: Tensor) -> Tensor:
    """``[..., n, 1]`` row maximum of the finite entries (0 for an all ``-inf`` row)."""
    top = S.amax(dim=-1, keepdim=True)
    return torch.where(torch.isneginf(top), torch.zeros((), dtype=S.dtype, device=S.device), top)


def normalise_scores(S: Tensor, out: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``2^-e (S - rowmax)``: every row's maximum is 0, the largest spread lies in ``[1/2, 1)``.

    Args:
        S: ``[B, n, k]`` float32/float64 scores, ``-inf`` allowed (kept as ``-inf``).
        out: optional ``[B, n, k]`` buffer for the result.

    Returns:
        ``(normalised, e)``: the ``[B, n, k]`` scores and the ``[B]`` long exponent with
        ``S - rowmax = 2^e * normalised`` (up to the shift's rounding). Instances whose entries
        are all equal keep ``e = 0``.
    """
    if S.shape[0] == 0:
        return S.clone(), torch.zeros(0, dtype=torch.long, device=S.device)
    e_pre = 0
    # Two passes at most: the second only when a spread beyond the dtype's range made the shift
    # overflow; a quarter of every score (exact) cannot overflow.
    for attempt in range(2):
        shifted = torch.sub(S, _finite_row_max(S), out=out) if out is not None else S - _finite_row_max(S)
        spread = -shifted.amin(dim=(-2, -1))
        e = _exponent(spread)
        # One host synchronisation in the usual case: is there a -inf, and the exponents' range.
        has_inf, lo, hi = torch.stack([torch.isinf(spread).any().long(), e.min(), e.max()]).tolist()
        if not has_inf:
            break
        forbidden = torch.isneginf(S)  # forbidden pairs, or a shift that overflowed
        if attempt == 0 and bool((torch.isneginf(shifted) != forbidden).any()):
            S, e_pre = S * 0.25, 2
            continue
        spread = -shifted.masked_fill(forbidden, 0.0).amin(dim=(-2, -1))
        e = _exponent(spread)
        lo, hi = torch.stack([e.min(), e.max()]).tolist()
        break
    bound = max(-lo, hi)
    if 0 < bound <= _chunk(S.dtype):  # the usual case: one multiplication, in place
        shifted = shifted.mul_(torch.pow(2.0, (-e).to(S.dtype)).view(-1, 1, 1))
    else:
        shifted = _ldexp_bounded(shifted, -e, bound)
    return shifted, e + e_pre


def perturbed_scores(a: Tensor, tau: float, g: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """Normalised Gumbel-Matching scores ``a / tau + g`` without forming them.

    With ``a`` row-shifted and scaled to ``2^ea * a'`` (``a'`` in ``[-1, 0]``) and
    ``tau = m 2^et`` (``m`` in ``[1/2, 1)``), ``a / tau = 2^(ea - et) a' / m``. Both parts are
    brought to a common exponent ``E`` at which neither exceeds 2 in magnitude:

        a / tau + g = 2^E (A + G) + row constants,   A = 2^(ea - et - E) a' / m,   G = 2^-E g.

    Args:
        a: ``[B, n, k]`` float32/float64 logits, ``-inf`` allowed.
        tau: temperature ``> 0`` (``0``: no noise, ``A`` is the normalised ``a``).
        g: ``[B, n, k]`` finite Gumbel noise, or ``None`` when ``tau == 0``.

    Returns:
        ``(A + G, A, E)``: the ``[B, n, k]`` normalised perturbed scores, their noise-free part
        (``-inf`` at forbidden pairs) and the ``[B]`` long exponent ``E``.
    """
    a_norm, ea = normalise_scores(a)
    if g is None or tau == 0.0:
        return a_norm, a_norm, ea
    m, et = math.frexp(tau)
    e_g = _exponent(
        g.abs().amax(dim=(-2, -1)) if g.numel() else torch.zeros(a.shape[0], dtype=a.dtype, device=a.device)
    )
    E = torch.maximum(ea - et + 1, e_g)
    A = ldexp(a_norm / m, ea - et - E)
    G = ldexp(g, -E)
    return A + G, A, E
