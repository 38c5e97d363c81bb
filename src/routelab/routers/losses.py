"""Auxiliary load-balancing losses of routers (unweighted; routers multiply by coefficients).

Defined in :mod:`routelab.routing.losses`, their one home; kept importable from here.
"""

from __future__ import annotations

from torch import Tensor

from ..routing import losses as _losses
from ..routing.losses import cv_squared, noisy_topk_load

__all__ = ["cv_squared", "noisy_topk_load", "switch_balance"]


def switch_balance(probs: Tensor, expert: Tensor, candidate: Tensor) -> Tensor:
    """Switch-Transformer balance loss ``E * sum_e f_e P_e`` for top-k routing.

    Args:
        probs: ``[tokens, E]`` router probabilities (differentiable).
        expert: ``[tokens, slots]`` chosen experts.
        candidate: ``[tokens, slots]`` bool, which slots count.

    Returns:
        Scalar; ``1`` when routing and probabilities are uniform. ``f_e`` is the fraction of the
        counted slots that chose ``e`` (not differentiable), ``P_e`` the mean probability: the
        one implementation, :func:`routelab.routing.switch_balance`, with ``fraction_of="slots"``.
    """
    return _losses.switch_balance(probs, expert, candidate, fraction_of="slots")
