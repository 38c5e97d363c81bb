"""Input validation shared by the assignment algorithms.

Every public function of :mod:`routelab.assignment` validates its input here, so that
bad input fails early with a ``ValueError`` that names the argument and says how to fix it.
"""

from __future__ import annotations

import torch
from torch import Tensor


def check_score_matrix(x: Tensor, name: str, *, allow_neg_inf: bool = True) -> None:
    """Check that ``x`` is a floating tensor ``[..., n, k]`` without NaN or +inf.

    ``-inf`` entries are allowed when ``allow_neg_inf`` (they mark forbidden pairs).
    """
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape [..., n, k], got {type(x).__name__}")
    if x.ndim < 2:
        raise ValueError(
            f"{name} must have at least 2 dimensions [..., n, k] (tokens x experts), got shape "
            f"{tuple(x.shape)}; add a trailing experts dimension, e.g. {name}.unsqueeze(-1)"
        )
    if not x.is_floating_point():
        raise ValueError(
            f"{name} must be a floating tensor (float16, bfloat16, float32 or float64), got {x.dtype}; "
            f"use {name}.float()"
        )
    if x.shape[-2] == 0 or x.shape[-1] == 0:
        raise ValueError(f"{name} must have at least one token and one expert, got shape {tuple(x.shape)}")
    if x.numel() == 0:
        return
    # One reduction each: amax propagates NaN and reveals +inf; amin reveals -inf.
    hi = float(x.detach().amax())
    if hi != hi:
        raise ValueError(f"{name} contains NaN; fix the upstream computation (NaN scores have no assignment)")
    if hi == float("inf"):
        raise ValueError(f"{name} contains +inf; clamp it to a finite value (only -inf, a forbidden pair, is allowed)")
    if not allow_neg_inf and float(x.detach().amin()) == float("-inf"):
        raise ValueError(f"{name} contains -inf, which is not allowed here; clamp it to a finite value")


def resolve_capacity(n: int, k: int, capacity: int | None, name: str = "capacity") -> int:
    """The per-expert capacity ``c`` for ``n`` tokens and ``k`` experts.

    ``None`` means the balanced capacity ``n / k``, which requires ``k`` to divide ``n``.
    Raises ``ValueError`` (naming the argument ``name``) for anything but a positive integer
    (an integral float such as ``4.0`` is accepted; ``inf``, NaN, fractions and bools are not)
    and when ``c * k < n`` (some token could not be placed).
    """
    if capacity is None:
        if n % k != 0:
            raise ValueError(
                f"n={n} tokens are not divisible by k={k} experts, so the balanced capacity n/k is not an "
                f"integer; pass {name}=ceil(n/k)={-(-n // k)} (or larger) explicitly"
            )
        return n // k
    if isinstance(capacity, bool):
        raise ValueError(f"{name} must be a positive integer, got the bool {capacity!r}")
    if not isinstance(capacity, int):
        try:
            as_int = int(capacity)
        except (TypeError, ValueError, OverflowError, RuntimeError):
            as_int = None
        if as_int is None or as_int != capacity:
            raise ValueError(f"{name} must be a positive integer (tokens per expert), got {capacity!r}")
        capacity = as_int
    if capacity < 1:
        raise ValueError(f"{name} must be a positive integer, got {capacity}")
    if capacity * k < n:
        raise ValueError(
            f"{name}={capacity} with k={k} experts holds only {capacity * k} tokens but n={n} must be "
            f"placed; use {name} >= ceil(n/k) = {-(-n // k)}"
        )
    return capacity


def check_tau(tau: float) -> float:
    """Temperature ``tau >= 0`` as a float (``0`` means the deterministic limit)."""
    try:
        t = float(tau)
    except (TypeError, ValueError):
        raise ValueError(f"tau must be a non-negative number, got {tau!r}") from None
    if not t >= 0.0 or t == float("inf"):
        raise ValueError(f"tau must be a finite non-negative number, got {tau!r}")
    return t


def check_generator(generator: object, name: str = "generator") -> None:
    """``None`` or a ``torch.Generator``; anything else is a ``TypeError`` naming ``name``."""
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(
            f"{name} must be a torch.Generator or None, got {type(generator).__name__}; "
            f"make one with torch.Generator().manual_seed(seed)"
        )
