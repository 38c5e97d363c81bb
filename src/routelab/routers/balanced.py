"""Routers that balance the load over the batch: BASE, Sinkhorn, Gumbel-Matching (Kool et al. 2021)."""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from .._checks import check_positive_int, check_tau, resolve_capacity
from ..assignment import balanced_assignment, sinkhorn_balance
from ..estimators.sampling import METHODS, sample_routes
from ..routes import Routes
from .base import Router
from .losses import switch_balance

__all__ = ["BASERouter", "GumbelMatchingRouter", "SinkhornRouter"]


def _balanced_capacity(n: int, num_experts: int, capacity: int | None, router: str) -> int:
    """The capacity a balanced solve uses: the layer's (at most ``n``), which must hold every token;
    ``ceil(n / E)`` without one (:func:`routelab._checks.resolve_capacity`)."""
    need = -(-n // num_experts)
    return resolve_capacity(n, num_experts, capacity, default="ceil", at_most_tokens=True,
                            fix=f"the {router} router assigns every token: use capacity_factor >= 1 (capacity >= {need})")


class BASERouter(Router):
    """BASE layers (Lewis et al. 2021): the exact balanced assignment maximising total score.

    (Named after the paper's BASE layers; ``BaseRouter``, its old name, is a deprecated alias.)

    Training: ``expert = balanced_assignment(x W, capacity)`` (Kool et al. eq. 4, exact), one
    expert per token, every expert at most ``capacity`` tokens. The combine weight is
    ``sigmoid(logit of the assigned expert)`` as in BASE layers, so the router learns through
    the gate. Inference: the balanced assignment again (``eval_balanced=True``) or the greedy
    ``argmax`` of Lewis et al. (``False``; the layer's capacity may then drop tokens).

    Args:
        d_model: token width.
        num_experts: ``E``.
        eval_balanced: whether inference also solves the balanced assignment.
    """

    def __init__(self, d_model: int, num_experts: int, *, eval_balanced: bool = True) -> None:
        super().__init__(d_model, num_experts, 1)
        self.eval_balanced = bool(eval_balanced)

    def route(self, logits: Tensor, capacity: int | None) -> Routes:
        n, E = logits.shape
        if n == 0:
            expert = torch.zeros(0, dtype=torch.long, device=logits.device)
        elif self.training or self.eval_balanced:
            c = _balanced_capacity(n, E, capacity, "base")
            expert = balanced_assignment(logits.detach(), c)
        else:
            expert = logits.argmax(-1)
        chosen = logits.gather(-1, expert.unsqueeze(-1))
        log_prob = torch.log_softmax(logits, -1).gather(-1, expert.unsqueeze(-1))
        gate = torch.sigmoid(chosen)
        return Routes(expert=expert.unsqueeze(-1), gate=gate, keep=torch.ones_like(gate, dtype=torch.bool),
                      weight=torch.ones_like(gate), log_prob=log_prob)


class SinkhornRouter(Router):
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

    def __init__(self, d_model: int, num_experts: int, k: int = 1, *, sweeps: int = 20,
                 renormalize: bool = False, eval_balanced: bool = False, balance_coef: float = 0.0) -> None:
        super().__init__(d_model, num_experts, k)
        self.k = self.slots
        self.sweeps = check_positive_int("sweeps", sweeps)
        self.renormalize = bool(renormalize)
        self.eval_balanced = bool(eval_balanced)
        self.balance_coef = float(balance_coef)

    def balanced_log_probs(self, log_p: Tensor) -> Tensor:
        """``[tokens, E]`` log of the Sinkhorn-balanced probabilities (detached)."""
        n, E = log_p.shape
        target = torch.full((E,), n / E, dtype=log_p.dtype, device=log_p.device)
        # Stop early once every column is within 1% of its target (selection only needs that).
        out, _ = sinkhorn_balance(log_p.detach().unsqueeze(0), target, tol=0.01 * n / E, max_iter=self.sweeps)
        return out.squeeze(0)

    def route(self, logits: Tensor, capacity: int | None) -> Routes:
        log_p = torch.log_softmax(logits, -1)
        n = logits.shape[0]
        select = self.balanced_log_probs(log_p) if (n and (self.training or self.eval_balanced)) else log_p.detach()
        expert = select.topk(self.k, dim=-1).indices
        log_prob = log_p.gather(-1, expert)
        gate = log_prob.exp()
        if self.renormalize:
            gate = gate / gate.sum(-1, keepdim=True)
        keep = torch.ones_like(expert, dtype=torch.bool)
        aux = {}
        if self.balance_coef and n:
            aux["balance"] = self.balance_coef * switch_balance(log_p.exp(), expert, keep)
        return Routes(expert=expert, gate=gate, keep=keep, weight=torch.ones_like(gate), log_prob=log_prob, aux=aux)


class GumbelMatchingRouter(Router):
    """Stochastic balanced routing by Gumbel-Matching with unbiased importance weights (Kool et al.).

    Training: one expert per token from :func:`routelab.estimators.sample_routes` with
    ``method`` (default ``"gumbel_matching_iw"``: a balanced n x E Gumbel-Matching sample of
    ``softmax(x W / tau)`` under the layer's capacity, with importance weights ``p / q`` from the
    exact conditionals, App. D.5). Any method of :data:`routelab.estimators.METHODS` works
    (``"sample_skip_iw"`` etc.). ``gate = p(expert | x)`` (differentiable), ``weight`` the
    importance weight, ``log_prob`` for REINFORCE. Inference: the deterministic balanced
    assignment (the ``tau -> 0`` limit, BASE) or ``argmax`` if ``eval_balanced=False``.

    Use the layer's ``importance_weighting=True`` to multiply the combine weight by ``weight``
    (the unbiased estimate of the dense mixture of Kool et al. Sec. 3.1).

    Args:
        d_model: token width.
        num_experts: ``E``.
        tau: proposal temperature ``> 0``.
        method: an estimator of :data:`routelab.estimators.METHODS`.
        sinkhorn: balance the proposal with Sinkhorn first (App. E).
        eval_balanced: whether inference solves the balanced assignment.
        balance_coef: weight of the Switch balance loss in ``aux["balance"]``.
    """

    def __init__(self, d_model: int, num_experts: int, *, tau: float = 1.0, method: str = "gumbel_matching_iw",
                 sinkhorn: bool = False, eval_balanced: bool = True, balance_coef: float = 0.0) -> None:
        super().__init__(d_model, num_experts, 1)
        if method not in METHODS:
            raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
        self.tau, self.method, self.sinkhorn = check_tau(tau, positive=True), method, bool(sinkhorn)
        self.eval_balanced = bool(eval_balanced)
        self.balance_coef = float(balance_coef)

    def route(self, logits: Tensor, capacity: int | None) -> Routes:
        n, E = logits.shape
        if n == 0 or not self.training:
            log_p = torch.log_softmax(logits, -1)
            if n and self.eval_balanced:
                expert = balanced_assignment(logits.detach(), _balanced_capacity(n, E, capacity, "gumbel_matching"))
            else:
                expert = log_p.argmax(-1)
            log_prob = log_p.gather(-1, expert.unsqueeze(-1))
            return Routes(expert=expert.unsqueeze(-1), gate=log_prob.exp(),
                          keep=torch.ones_like(log_prob, dtype=torch.bool), weight=torch.ones_like(log_prob),
                          log_prob=log_prob)
        if self.method.startswith("gumbel"):
            c = _balanced_capacity(n, E, capacity, "gumbel_matching")
        else:  # the sampling methods skip what does not fit (sample_routes checks it); "sample" ignores it
            c = resolve_capacity(n, E, capacity, default="ceil")
        r = sample_routes(logits, self.method, tau=self.tau, capacity=c, sinkhorn=self.sinkhorn,
                          generator=self.generator)
        r = r.with_slot_dim()
        r.aux = {"balance": self.balance_coef * r.aux["balance"]} if self.balance_coef else {}
        r.stats = {"weights_clamped": r.stats["weights_clamped"]}
        return r


def __getattr__(name: str) -> type:
    """``BaseRouter``: the deprecated name of :class:`BASERouter` (it read as "the base class")."""
    if name == "BaseRouter":
        warnings.warn("routelab.routers.BaseRouter is deprecated: use BASERouter (the BASE-layers router)",
                      DeprecationWarning, stacklevel=2)
        return BASERouter
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
