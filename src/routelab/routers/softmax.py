"""Dense softmax gating: every token goes to every expert with weight ``softmax(x W)``."""

from __future__ import annotations

from torch import Tensor

from .._checks import check_nonneg
from ..routes import Routes
from ..routing.rules import softmax_routes
from .base import Router

__all__ = ["SoftmaxRouter"]


class SoftmaxRouter(Router):
    """Dense gating ``G(x) = softmax(x W_g)`` (Shazeer et al. 2017, eq. 15), ``E`` slots per token.

    Every slot is a candidate; with ``capacity_factor >= 1`` the layer drops nothing (capacity is
    sized for ``E`` slots per token), so the MoE computes every expert on every token.

    Args:
        d_model: token width.
        num_experts: ``E``.
        importance_coef: weight of ``CV(sum_x G(x))^2`` in ``aux["importance"]`` (0: no loss).
    """

    proposes_every_slot = True
    experts_in_range = True

    def __init__(self, d_model: int, num_experts: int, *, importance_coef: float = 0.0) -> None:
        super().__init__(d_model, num_experts, num_experts)
        self.importance_coef = check_nonneg("importance_coef", importance_coef)

    def route(self, logits: Tensor, capacity: int | None) -> Routes:
        return softmax_routes(logits, importance_coef=self.importance_coef)
