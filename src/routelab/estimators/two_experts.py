"""The estimators of :func:`~routelab.estimators.sample_routes` for two experts, in closed form.

With ``k = 2`` every distribution over the experts of a token is a Bernoulli, determined by one
logit difference ``s = logits[..., 1] - logits[..., 0]``, and Gumbel noise enters only through
the difference of two Gumbels, a standard logistic variable. Working on ``[..., n]`` differences
instead of ``[..., n, 2]`` matrices halves the data and avoids reductions over a length-2 axis,
which PyTorch's CPU kernels do slowly. Each method draws the same distribution as the general
path (the tests compare them), so the contract of :func:`sample_routes` holds unchanged.

* Sampling at temperature ``tau``: ``z = 1[s / tau + L > 0]`` with ``L ~ Logistic(0, 1)``.
* Sinkhorn balancing of the proposal: ``s_q = s / tau + beta`` with the one dual variable
  ``beta`` that :func:`routelab.assignment.sinkhorn_balance` finds for two experts.
* Gumbel-Matching with capacity ``c`` (``n <= 2c``): with perturbed scores ``v = s_q + L``, the
  optimal assignment sends to expert 1 the ``m`` largest ``v`` with ``m = clamp(#{v > 0}, n - c,
  c)``. Given the other tokens' noise, token ``i`` goes to expert 1 exactly when ``v_i > t_i =
  max(o_(c), min(0, o_(n - c)))`` where ``o_(j)`` is the ``j``-th largest ``v`` among the *other*
  tokens, so its conditional (eq. 6) is ``q(z_i = 1 | G_-i) = sigmoid(s_q,i - t_i)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .._checks import random_tensor
from ..assignment import sinkhorn_balance
from ..routes import Routes
from ..routing.capacity import random_skip
from ..routing.losses import switch_balance
from ._record import routes_record, score_limit, skip_correction

__all__ = ["sample_two"]


def _logistic(shape: torch.Size, like: Tensor, generator: torch.Generator | None) -> Tensor:
    """Standard logistic noise ``log u - log(1 - u)`` (the difference of two Gumbels), in ``like``'s dtype.

    ``u`` is drawn in float64 whatever the dtype: its clamp at ``eps = 2.2e-16`` bounds the noise
    at ``|L| <= 36``, so every pair of proposal probability down to about ``1e-16`` (far below
    ``1 / MAX_WEIGHT``) can be sampled. Drawn in float32 the bound was ``15.9``: a pair of
    probability under ``1.2e-7`` was never sampled while its importance weight, under
    :data:`~routelab.estimators.MAX_WEIGHT`, assumed it could be.
    """
    u = random_tensor(torch.rand, shape, dtype=torch.float64, device=like.device, generator=generator)
    eps = torch.finfo(torch.float64).eps
    u = u.clamp(min=eps, max=1.0 - eps)
    return (torch.log(u) - torch.log1p(-u)).to(like.dtype)


def _sinkhorn_shift(s_q: Tensor, tol_rel: float, sweeps: int) -> Tensor:
    """``s_q + beta``: the logit difference of the Sinkhorn-balanced proposal (columns ``n / 2``)."""
    n = s_q.shape[-1]
    log_q = torch.stack([F.logsigmoid(-s_q), F.logsigmoid(s_q)], dim=-1)
    target = torch.full((2,), n / 2, dtype=s_q.dtype, device=s_q.device)
    rel = max(tol_rel, 4 * torch.finfo(s_q.dtype).eps * n**0.5)
    # Finite input and a target strictly inside (0, n): solved by the two-expert Newton iteration.
    x, _ = sinkhorn_balance(log_q, target, tol=rel * n / 2, max_iter=sweeps)
    return x[..., 1] - x[..., 0]


def _skip_two(z: Tensor, c: int, generator: torch.Generator | None) -> tuple[Tensor, Tensor]:
    """Keep at most ``c`` tokens per expert, a uniformly random subset of each expert's tokens
    (:func:`routelab.routing.random_skip` on ``z`` as the expert).

    Returns:
        ``(keep [..., n] bool, load [..., n] long)``: ``load`` is ``n_z``, the number of tokens
        that chose each token's expert.
    """
    return random_skip(z.long(), 2, c, generator)


def _matching(v: Tensor, c: int) -> tuple[Tensor, Tensor]:
    """The optimal two-expert assignment of perturbed scores ``v [..., n]`` and each token's threshold.

    Returns:
        ``(z, t)``: ``z [..., n]`` bool (expert 1), ``t [..., n]`` the value ``v_i`` must exceed
        for token ``i`` to be assigned to expert 1 given the others.
    """
    n = v.shape[-1]
    sorted_v, order = torch.sort(v, dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(n, device=v.device).expand_as(order))
    m = (v > 0).sum(-1, keepdim=True).clamp(min=n - c, max=c)
    z = rank < m
    # j-th largest among the others (1-based j): sorted[j-1] if i ranks below it, else sorted[j].
    inf = torch.full(v.shape[:-1] + (1,), float("inf"), dtype=v.dtype, device=v.device)
    ext = torch.cat([sorted_v, -inf, -inf], dim=-1)  # positions n, n+1: -inf (no constraint)

    def other(j: int) -> Tensor:
        if j <= 0:
            return inf.expand_as(v)  # "at least 0 tokens above": never binding
        at_j_minus_1 = ext[..., j - 1 : j]
        at_j = ext[..., j : j + 1]
        return torch.where(rank >= j, at_j_minus_1, at_j)

    t = torch.maximum(other(c), torch.minimum(torch.zeros_like(v), other(n - c)))
    return z, t


def sample_two(
    logits: Tensor,
    method: str,
    T: Tensor,
    c: int | None,
    sinkhorn: bool,
    generator: torch.Generator | None,
    *,
    sinkhorn_tol: float,
    sinkhorn_sweeps: int,
) -> Routes:
    """:func:`sample_routes` for ``logits [..., n, 2]`` with finite entries; see the module doc.

    Args:
        logits: ``[..., n, 2]`` finite router logits (differentiable).
        method: a method of :data:`~routelab.estimators.METHODS`.
        T: temperature, broadcastable to ``[..., 1, 1]``.
        c: capacity (``None`` only for ``sample``).
        sinkhorn: balance the proposal first.
        generator: the only source of randomness.
        sinkhorn_tol, sinkhorn_sweeps: relative tolerance and iteration cap of the balancing.
    """
    n = logits.shape[-2]
    batch = logits.shape[:-2]
    s = logits[..., 1] - logits[..., 0]  # [..., n], differentiable
    tau = T.squeeze(-1)  # [..., 1] or [1]
    # The proposal's scores, the noise, the matching and the thresholds in float64: float32
    # s / tau + noise at |s| / tau = 1e7 rounds the noise to whole numbers, and the ties went to
    # the lowest index while the conditionals assume continuous noise (a review measured
    # z-scores of 33). Clamped so that a tiny tau gives huge but finite scores (inf - inf would
    # be NaN below).
    lim = score_limit(torch.float64, n, 2)
    s_q = (s.detach().to(torch.float64) / tau.to(torch.float64)).clamp(-lim, lim)
    if sinkhorn:
        s_q = _sinkhorn_shift(s_q, sinkhorn_tol, sinkhorn_sweeps)
    noise = _logistic(s_q.shape, s_q, generator)
    keep = torch.ones(s_q.shape, dtype=torch.bool, device=s_q.device)
    correction = None
    if method.startswith("sample"):
        z = s_q + noise > 0
        s_ref = s_q
        if method != "sample":
            keep, load = _skip_two(z, c, generator)
            correction = skip_correction(method, keep, load.to(s.dtype), c)
    else:
        # With n = 2c each expert takes exactly c tokens whatever the zero point of the scores, so
        # they are centred first (the same assignment): identical tokens' scores are then 0, and
        # the noise decides their order at any tau.
        centre = s_q.mean(-1, keepdim=True) if 2 * c == n else torch.zeros_like(s_q[..., :1])
        z, t = _matching(s_q - centre + noise, c)
        if method == "gumbel_matching_iw":
            s_ref = s_q - centre - t
        elif method == "gumbel_matching_sh":
            s_ref = s_q if sinkhorn else _sinkhorn_shift(s_q, sinkhorn_tol, sinkhorn_sweeps)
        else:
            s_ref = s_q
    sign = torch.where(z, 1.0, -1.0)
    log_q_z = F.logsigmoid(sign.to(s_ref.dtype) * s_ref).to(s.dtype)
    log_p_z = F.logsigmoid(sign.to(s.dtype) * s)
    # Switch balance loss 2 * sum_j f_j P_j, f from the router's argmax (routing.losses): the
    # probabilities of the two experts are sigmoid(-s) and sigmoid(s).
    balance = switch_balance(torch.stack([torch.sigmoid(-s), torch.sigmoid(s)], -1))
    on_one = (z & keep).sum(-1)
    counts = torch.stack([keep.sum(-1) - on_one, on_one], dim=-1)
    return routes_record(z.long(), keep, log_p_z, log_q_z, correction, balance.reshape(batch), counts)
