"""n x k Gumbel-Matching sampling and its conditionals (Kool et al. 2021, Sec. 2.2, App. D.3-D.5).

A Gumbel-Matching sample is the balanced assignment (eq. 4) for the perturbed scores
``s = logits / tau + g`` with i.i.d. standard Gumbel noise ``g``. Its per-token marginals are
intractable, but the conditionals given the other tokens' noise are not (eq. 7-9):

    log q(z_i = j | A, G_-i) = log_softmax_j( logits[i, j] / tau - d*[j, z_i] )

where ``z`` is the optimal assignment and ``d*`` the all-pairs shortest paths of the optimal
assignment's expert graph (:mod:`routelab.assignment.balanced`): forcing token ``i`` into expert
``j`` costs ``s[i, z_i] - s[i, j]`` plus the cheapest way ``d*[j, z_i]`` to pass a token from
``j`` back to the slot ``i`` left (eq. 7). The noise ``g_i`` cancels, so the conditionals do not
depend on it. Cost: ``O(nk + k^3)`` per instance on top of the solve, not ``n k`` re-solves.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ._checks import check_score_matrix, check_tau
from .balanced import solve_balanced
from ._ops import log_softmax
from .shortest_paths import floyd_warshall

__all__ = ["GumbelMatching", "gumbel_matching", "base_assignment", "sample_gumbel"]


@dataclass
class GumbelMatching:
    """A Gumbel-Matching sample with everything needed for importance weights.

    Attributes:
        expert: ``[..., n]`` long, the sampled balanced assignment.
        conditional_log_probs: ``[..., n, k]``, ``log q(z_i = j | A, G_-i)`` (eq. 9); each row is a
            normalised distribution over experts; ``-inf`` for forbidden pairs.
        scores: ``[..., n, k]`` the perturbed scores ``logits / tau + gumbels`` that were maximised.
        gumbels: ``[..., n, k]`` the Gumbel noise used (zeros when ``tau == 0``).
        shortest_paths: ``[..., k, k]`` ``d*`` of the optimal expert graph (float64), whose
            arcs move one token or release a free slot (:mod:`routelab.assignment.balanced`).
        capacity: capacity per expert that was enforced.
        tau: the temperature.
    """

    expert: Tensor
    conditional_log_probs: Tensor
    scores: Tensor
    gumbels: Tensor
    shortest_paths: Tensor
    capacity: int
    tau: float

    def log_prob_of_sample(self) -> Tensor:
        """``[..., n]`` conditional log-probability ``log q(z_i | A, G_-i)`` of each sampled expert."""
        return self.conditional_log_probs.gather(-1, self.expert.unsqueeze(-1)).squeeze(-1)


def sample_gumbel(shape: torch.Size | tuple[int, ...], *, dtype: torch.dtype = torch.float32,
                  device: torch.device | str | None = None, generator: torch.Generator | None = None) -> Tensor:
    """I.i.d. standard Gumbel noise ``-log(-log U)``, drawn only through ``generator``."""
    u = torch.rand(shape, dtype=dtype, device=device, generator=generator)
    tiny = torch.finfo(dtype).tiny
    return -torch.log(-torch.log(u.clamp(min=tiny, max=1.0 - torch.finfo(dtype).eps)))


def gumbel_matching(
    logits: Tensor,
    *,
    tau: float = 1.0,
    capacity: int | None = None,
    gumbels: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> GumbelMatching:
    """Sample a balanced assignment from the n x k Gumbel-Matching distribution, with conditionals.

    Args:
        logits: ``[..., n, k]`` unnormalised log-probabilities ``a[i, j]`` (``-inf`` forbids a pair).
        tau: temperature (> 0); ``tau = 0`` is the deterministic BASE-layers assignment
            (no noise; the conditionals are then the one-hot limit).
        capacity: tokens per expert; default ``n / k`` (``k`` must divide ``n``).
        gumbels: ``[..., n, k]`` noise to use instead of sampling it (for reproducing a sample or
            testing); must be finite. Ignored when ``tau == 0``.
        generator: the only source of randomness when ``gumbels`` is not given.

    Returns:
        :class:`GumbelMatching` with ``expert`` ``[..., n]`` and ``conditional_log_probs``
        ``[..., n, k]``.
    """
    check_score_matrix(logits, "logits")
    t = check_tau(tau)
    if gumbels is not None:
        if not isinstance(gumbels, Tensor) or gumbels.shape != logits.shape:
            got = tuple(gumbels.shape) if isinstance(gumbels, Tensor) else type(gumbels).__name__
            raise ValueError(f"gumbels must be a tensor with the shape of logits {tuple(logits.shape)}, got {got}")
        if not bool(torch.isfinite(gumbels).all()):
            raise ValueError("gumbels must be finite (sample them with routelab.assignment.sample_gumbel)")
        g = gumbels.to(dtype=logits.dtype, device=logits.device)
        if t == 0.0:
            g = torch.zeros_like(logits)  # the deterministic limit uses no noise
    elif t == 0.0:
        g = torch.zeros_like(logits)
    else:
        g = sample_gumbel(logits.shape, dtype=logits.dtype, device=logits.device, generator=generator)
    a = logits.detach()
    scaled = a if t == 0.0 else a / t
    scores = scaled if t == 0.0 else scaled + g
    sol = solve_balanced(scores, capacity, name="logits")
    n, k = logits.shape[-2], logits.shape[-1]
    d = floyd_warshall(sol.arc_cost)  # [B, k, k], float64
    z = sol.expert  # [B, n]
    # d_to[b, i, j] = d*[j, z_i]: cheapest way to refill the slot token i leaves.
    d_to = d.transpose(-1, -2).gather(1, z.unsqueeze(-1).expand(-1, -1, k))
    if t == 0.0:
        # tau -> 0 limit of log_softmax((a - tau * d) / tau): mass on the maximisers of a - d.
        val = scaled.reshape(-1, n, k).to(torch.float64) - d_to
        best = val.amax(-1, keepdim=True)
        hit = (val >= best - 1e-9 * best.abs().clamp(min=1.0))
        log_q = torch.where(hit, -torch.log(hit.sum(-1, keepdim=True).to(torch.float64)), torch.full_like(val, float("-inf")))
    else:
        log_q = log_softmax(scaled.reshape(-1, n, k).to(torch.float64) - d_to)
    batch = logits.shape[:-2]
    return GumbelMatching(
        expert=z.view(*batch, n),
        conditional_log_probs=log_q.to(logits.dtype).view(*batch, n, k),
        scores=scores,
        gumbels=g,
        shortest_paths=d.view(*batch, k, k),
        capacity=sol.capacity,
        tau=t,
    )


def base_assignment(logits: Tensor, capacity: int | None = None) -> Tensor:
    """The deterministic balanced assignment of BASE layers (Lewis et al. 2021).

    The ``tau -> 0`` limit of :func:`gumbel_matching`: the exact maximiser of
    ``sum_i logits[i, z_i]`` under the capacity, i.e. :func:`balanced_assignment` of the logits.

    Args:
        logits: ``[..., n, k]`` router scores.
        capacity: tokens per expert; default ``n / k``.

    Returns:
        ``[..., n]`` long expert per token.
    """
    check_score_matrix(logits, "logits")
    return solve_balanced(logits, capacity, name="logits").expert.view(logits.shape[:-1])
