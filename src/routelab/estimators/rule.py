"""The routing rule of the Gumbel-Matching router: balanced samples with importance weights."""

from __future__ import annotations

import torch
from torch import Tensor

from .._checks import check_nonneg, check_tau
from ..routes import Routes
from ..routing.eager import eager
from ..routing.masks import masked_rule
from ..routing.rules import _check_logits, balanced_assignment, balanced_capacity
from .sampling import METHODS, sample_routes

# Gumbel-Matching samples are solver calls: they run eagerly under torch.compile (routing/eager.py).
_sample_routes = eager(sample_routes)

__all__ = ["gumbel_matching_routes"]


@masked_rule("logits")
def gumbel_matching_routes(logits: Tensor, capacity: int | None = None, *, method: str = "gumbel_matching_iw",
                           tau: float = 1.0, sinkhorn: bool = False, training: bool = True,
                           eval_balanced: bool = False, balance_coef: float = 0.0,
                           generator: torch.Generator | None = None) -> Routes:
    """Stochastic balanced routing by Gumbel-Matching with unbiased importance weights (Kool et al.).

    A routing rule of :mod:`routelab.routing.rules`' kind (pure; randomness from ``generator``).
    Training: one expert per token from :func:`sample_routes` with ``method`` (default
    ``"gumbel_matching_iw"``: a balanced Gumbel-Matching sample of ``softmax(logits / tau)`` under
    ``capacity``, importance weights ``p / q`` from the exact conditionals, App. D.5; the sampling
    methods skip what does not fit). ``gate = p(expert | x)``, ``weight`` the importance weight,
    ``log_prob`` for REINFORCE, ``stats["weights_clamped"]`` and ``stats["unreachable_mass"]``. The
    sample balances at the quota ``ceil(tokens / E)`` whatever the layer's buffer capacity
    (:func:`balanced_capacity`).
    Inference (``training=False``): ``argmax`` of the logits (each token by its own score, so
    its route depends on no other token; the default), or the deterministic balanced
    assignment at the same quota ``ceil(tokens / E)`` (the ``tau -> 0`` limit; BASE's floor/ceil
    quotas only when ``E`` divides ``tokens``) when ``eval_balanced=True``. ``mask``
    (``[tokens]``, ``True`` = real) routes the masked tokens nowhere
    (:mod:`routelab.routing.masks`).

    Args:
        logits: ``[tokens, E]`` float32 router logits (finite).
        capacity: the layer's buffer capacity per expert (``None``: no limit); it must hold the
            quota ``ceil(tokens / E)``.
        method: an estimator of :data:`METHODS`.
        tau: proposal temperature ``> 0``.
        sinkhorn: balance the proposal with Sinkhorn first (App. E).
        training: sample (else the deterministic assignment).
        eval_balanced: whether inference solves the balanced assignment (default ``False``:
            ``argmax``, independent of the batch).
        balance_coef: weight of the Switch balance loss in ``aux["balance"]``.
        generator: the only source of randomness.

    Returns:
        ``Routes [tokens, 1]``.
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    tau = check_tau(tau, positive=True)
    balance_coef = check_nonneg("balance_coef", balance_coef)
    n, E = _check_logits(logits).shape
    if n == 0 or not training:
        log_p = torch.log_softmax(logits, -1)
        if n and eval_balanced:
            expert = balanced_assignment(logits.detach(), balanced_capacity(n, E, capacity, "gumbel_matching"))
        else:
            expert = log_p.argmax(-1)
        log_prob = log_p.gather(-1, expert.unsqueeze(-1))
        r = Routes(expert=expert.unsqueeze(-1), gate=log_prob.exp(),
                   keep=torch.ones_like(log_prob, dtype=torch.bool), weight=torch.ones_like(log_prob),
                   log_prob=log_prob)
        if training:  # a batch without tokens: the training keys, at 0 (logs keyed by name keep them)
            zero = logits.new_zeros(())
            r.aux = {"balance": zero} if balance_coef else {}
            r.stats = {"weights_clamped": zero.long(), "unreachable_mass": zero}
        return r
    # Every estimator of Kool et al. samples under a capacity that can hold the batch (the skip
    # methods skip what does not fit; "sample" ignores it): capacity_factor >= 1.
    c = balanced_capacity(n, E, capacity, "gumbel_matching")
    r = _sample_routes(logits, method, tau=tau, capacity=c, sinkhorn=sinkhorn, generator=generator)
    r.aux = {"balance": balance_coef * r.aux["balance"]} if balance_coef else {}
    r.stats = {name: r.stats[name] for name in ("weights_clamped", "unreachable_mass")}
    return r
