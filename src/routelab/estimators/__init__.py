"""Routing estimators (layer 3): routing decisions under capacity and their training signals.

* :func:`sample_routes` — the six sampling methods of Kool et al. (2021), Sec. 3, returning a
  :class:`~routelab.routes.Routes` with importance weights (finite, at most :data:`MAX_WEIGHT`).
* :func:`gumbel_matching_routes` — the routing rule of the Gumbel-Matching router (balanced
  samples of :func:`sample_routes` in training, the balanced assignment at inference).
* :mod:`.signals` — the REINFORCE surrogate with an EMA baseline (eq. 2), differentiable gating
  (Sec. 3.1) and the Switch load-balancing loss.
"""

from .rule import gumbel_matching_routes
from .sampling import CAPPED_METHODS, MAX_WEIGHT, METHODS, UNBIASED_METHODS, sample_routes, switch_balance_loss
from .signals import EMABaseline, gating_objective, reinforce_objective

__all__ = [
    "CAPPED_METHODS",
    "EMABaseline",
    "MAX_WEIGHT",
    "METHODS",
    "UNBIASED_METHODS",
    "gating_objective",
    "gumbel_matching_routes",
    "reinforce_objective",
    "sample_routes",
    "switch_balance_loss",
]
