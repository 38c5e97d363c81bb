"""The smooth-step function of Hazimeh et al. (2021), Sec. 3.1.3."""

from __future__ import annotations

import math

import torch

__all__ = ["smooth_step", "check_gamma"]


def check_gamma(gamma: float) -> float:
    """Return ``gamma`` as a float if it is finite and > 0, else raise ValueError."""
    if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not math.isfinite(gamma) \
            or gamma <= 0:
        raise ValueError(f"gamma must be a finite number > 0 (the smooth-step width), got {gamma!r}.")
    return float(gamma)


def smooth_step(t: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """Cubic smooth-step S(t), element-wise (any shape -> same shape).

    S(t) = 0 for t <= -gamma/2, 1 for t >= gamma/2, and -2/gamma^3 t^3 + 3/(2 gamma) t + 1/2
    in between; continuously differentiable, with S'(±gamma/2) = 0, so that outside the band
    the gradient is exactly zero (this is what lets DSelect-k become exactly sparse).

    Args:
        t: any real tensor.
        gamma: the width of the fractional region, > 0 (official default 1).

    Raises:
        ValueError: if gamma <= 0 or not finite.
    """
    gamma = check_gamma(gamma)
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"t must be a torch.Tensor, got {type(t).__name__}.")
    half = gamma / 2.0
    cubic = (-2.0 / gamma**3) * t**3 + (3.0 / (2.0 * gamma)) * t + 0.5
    return torch.where(t <= -half, torch.zeros_like(t), torch.where(t >= half, torch.ones_like(t), cubic))
