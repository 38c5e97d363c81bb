"""Routers that balance the load over the batch: BASE, Sinkhorn, Gumbel-Matching (Kool et al. 2021)."""

from __future__ import annotations

import warnings

from torch import Tensor

from .._checks import check_nonneg, check_positive_int, check_tau
from ..estimators.rule import gumbel_matching_routes
from ..estimators.sampling import METHODS
from ..routes import Routes
from ..routing.rules import balanced_routes, sinkhorn_balanced_log_probs, sinkhorn_routes
from .base import ChoosesK, Router

__all__ = ["BASERouter", "GumbelMatchingRouter", "SinkhornRouter"]


class BASERouter(ChoosesK, Router):
    """BASE layers (Lewis et al. 2021): the exact balanced assignment maximising total score.

    (Named after the paper's BASE layers; ``BaseRouter``, its old name, is a deprecated alias.)

    Training: the exact balanced assignment of the batch (Kool et al. eq. 4): with ``k = 1`` one
    expert per token, with ``k > 1`` the exact balanced b-matching (``k`` distinct experts per
    token, :func:`routelab.routing.balanced_routes`); every expert gets the balanced quota, ``floor``
    or ``ceil`` of ``k n / E`` (token, expert) pairs, whatever the layer's buffer capacity
    (dropless included). The combine weight of every slot is ``sigmoid(logit of its expert)`` as in
    BASE layers, so the router learns through the gate. Inference: the greedy top-``k``
    (``argmax`` for ``k = 1``) of Lewis et al. (the default: a token's route depends on its own
    score only, as a causal language model needs), or the balanced solve again
    (``eval_balanced=True``, which makes a token's route depend on its batch-mates).

    Args:
        d_model: token width.
        num_experts: ``E``.
        k: experts per token, ``1 <= k <= E``.
        eval_balanced: whether inference solves the balanced assignment (default ``False``).
    """

    proposes_every_slot = True
    experts_in_range = True
    assigns_every_token = True
    fills_quotas = True

    def __init__(self, d_model: int, num_experts: int, *, k: int = 1, eval_balanced: bool = False) -> None:
        super().__init__(d_model, num_experts, k)
        self.eval_balanced = bool(eval_balanced)

    def route(self, logits: Tensor, capacity: int | None) -> Routes:
        return balanced_routes(logits, capacity, balanced=self.training or self.eval_balanced, k=self.k)


class SinkhornRouter(ChoosesK, Router):
    """Sinkhorn-balanced routing (Kool et al. Sec. 2.3; S-BASE of Clark et al. 2022).

    The router probabilities ``p = softmax(x W)`` are balanced by Sinkhorn over the batch (rows
    sum to 1, columns to ``tokens / E``, in log space, ``sweeps`` row+column sweeps); each token
    takes the ``k`` experts with the largest *balanced* probability, and combines them with the
    *unbalanced* ``p`` (so the router learns through the gate; ``renormalize`` rescales the ``k``
    weights to sum to 1). Balancing only steers the choice: the layer's capacity still drops the
    overflow, if any. At inference the balancing is skipped unless ``eval_balanced``.

    Args:
        d_model: token width.
        num_experts: ``E``.
        k: experts per token.
        sweeps: Sinkhorn sweeps per batch (a fixed budget, as in S-BASE; more sweeps, closer to
            balanced).
        renormalize: rescale the chosen probabilities to sum to 1.
        eval_balanced: balance at inference too.
        balance_coef: weight of the Switch balance loss in ``aux["balance"]``.
    """

    proposes_every_slot = True
    experts_in_range = True

    def __init__(self, d_model: int, num_experts: int, k: int = 1, *, sweeps: int = 20,
                 renormalize: bool = False, eval_balanced: bool = False, balance_coef: float = 0.0) -> None:
        super().__init__(d_model, num_experts, k)
        self.sweeps = check_positive_int("sweeps", sweeps)
        self.renormalize = bool(renormalize)
        self.eval_balanced = bool(eval_balanced)
        self.balance_coef = check_nonneg("balance_coef", balance_coef)

    def balanced_log_probs(self, log_p: Tensor) -> Tensor:
        """``[tokens, E]`` log of the Sinkhorn-balanced probabilities (detached)."""
        return sinkhorn_balanced_log_probs(log_p, self.sweeps)

    def route(self, logits: Tensor, capacity: int | None) -> Routes:
        return sinkhorn_routes(logits, self.k, sweeps=self.sweeps, balanced=self.training or self.eval_balanced,
                               renormalize=self.renormalize, balance_coef=self.balance_coef)


class GumbelMatchingRouter(Router):
    """Stochastic balanced routing by Gumbel-Matching with unbiased importance weights (Kool et al.).

    Training: one expert per token from :func:`routelab.estimators.sample_routes` with
    ``method`` (default ``"gumbel_matching_iw"``: a balanced n x E Gumbel-Matching sample of
    ``softmax(x W / tau)`` at the balanced quota, with importance weights ``p / q`` from the
    exact conditionals, App. D.5). Any method of :data:`routelab.estimators.METHODS` works
    (``"sample_skip_iw"`` etc.). ``gate = p(expert | x)`` (differentiable), ``weight`` the
    importance weight, ``log_prob`` for REINFORCE. The sample balances at the quota
    ``ceil(n / E)`` whatever the layer's buffer capacity. Inference: ``argmax`` (the default; a
    token's route depends on its own score only), or, if ``eval_balanced=True``, the ``tau -> 0``
    limit of its sample: the deterministic assignment of the largest total score with at most
    ``ceil(n / E)`` tokens per expert (BASE's, whose quotas are the floor or ceiling of ``n / E``,
    when ``E`` divides ``n``; otherwise an expert may take fewer than ``floor(n / E)``). Its samples
    are replayed by activation checkpointing (:class:`~routelab.replay.NoiseReplay`).

    Use the layer's ``importance_weighting=True`` to multiply the combine weight by ``weight``:
    the differentiable gating *with importance weights* of Kool et al. Sec. 3.1, which the paper
    calls biased training. The output ``gate * weight * expert(x)`` has expectation
    ``sum_j p_j^2 expert_j(x)``, not the dense mixture ``sum_j p_j expert_j(x)``; unbiased
    estimates of a loss come from :func:`routelab.estimators.reinforce_objective` /
    :func:`~routelab.estimators.gating_objective` with the weights.

    Args:
        d_model: token width.
        num_experts: ``E``.
        tau: proposal temperature ``> 0``.
        method: an estimator of :data:`routelab.estimators.METHODS`.
        sinkhorn: balance the proposal with Sinkhorn first (App. E).
        eval_balanced: whether inference solves the balanced assignment (default ``False``).
        balance_coef: weight of the Switch balance loss in ``aux["balance"]``.
    """

    # Not declared: the skip estimators (``method="sample_skip*"``) leave tokens out in training.
    stochastic = True
    experts_in_range = True
    assigns_every_token = True
    # Not fills_quotas: its quota ceil(n / E) bounds each expert's load from above only (when E does
    # not divide n an expert may take fewer than floor(n / E)); assigns_every_token already refuses
    # a capacity_factor below 1.

    def __init__(self, d_model: int, num_experts: int, *, tau: float = 1.0, method: str = "gumbel_matching_iw",
                 sinkhorn: bool = False, eval_balanced: bool = False, balance_coef: float = 0.0) -> None:
        super().__init__(d_model, num_experts, 1)
        if method not in METHODS:
            raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
        self.tau, self.method, self.sinkhorn = check_tau(tau, positive=True), method, bool(sinkhorn)
        self.eval_balanced = bool(eval_balanced)
        self.balance_coef = check_nonneg("balance_coef", balance_coef)

    def route(self, logits: Tensor, capacity: int | None) -> Routes:
        return gumbel_matching_routes(logits, capacity, method=self.method, tau=self.tau, sinkhorn=self.sinkhorn,
                                      training=self.training, eval_balanced=self.eval_balanced,
                                      balance_coef=self.balance_coef, generator=self.generator)

def __getattr__(name: str) -> type:
    """``BaseRouter``: the deprecated name of :class:`BASERouter` (it read as "the base class")."""
    if name == "BaseRouter":
        warnings.warn("routelab.routers.BaseRouter is deprecated: use BASERouter (the BASE-layers router)",
                      DeprecationWarning, stacklevel=2)
        return BASERouter
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
