"""The pieces every estimator of :func:`~routelab.estimators.sample_routes` shares: the skip
correction of the importance weight and the :class:`~routelab.Routes` record itself."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..routes import Routes
from ..routing.capacity import skip_correction as eq3_correction

#: The largest importance weight :func:`~routelab.estimators.sample_routes` returns; larger ones
#: (a proposal that all but missed the router's mass) are clamped here and counted in
#: ``stats["weights_clamped"]``. Far above any weight of a useful estimate (a weight of 1e8 means
#: the proposal put a hundred-millionth of the router's probability on that choice), and small
#: enough that weight x activation stays finite in float32 for activations up to about 1e30 (the
#: ``MoE`` combine multiplies expert outputs by it; 1e30 overflowed there at activations of 1e10).
MAX_WEIGHT = 1e8
_LOG_MAX_WEIGHT = math.log(MAX_WEIGHT)


def score_limit(dtype: torch.dtype, n: int, k: int) -> float:
    """``finfo.max / (16 max(n, k))``: how far below a row's best pair a scaled score may be floored.

    Any pair that far below has proposal probability 0 in every float format, and a sum of ``n``
    such scores stays finite, so the balanced solvers can take them as finite scores.
    """
    return torch.finfo(dtype).max / (16 * max(n, k))


def skip_correction(method: str, keep: Tensor, load: Tensor, capacity: int) -> Tensor:
    """``[..., n]`` factor on the importance weight of a skipping method.

    ``sample_skip_iw``: ``n_z / min(n_z, c)`` (eq. 3, unbiased; its one home is
    :func:`routelab.routing.skip_correction`); ``sample_skip``: ``n / n_kept`` (the plain average
    over kept tokens, biased).

    Args:
        method: ``"sample_skip"`` or ``"sample_skip_iw"``.
        keep: ``[..., n]`` bool, kept tokens.
        load: ``[..., n]`` floating ``n_z``, tokens that chose each token's expert before skipping.
        capacity: ``c``.
    """
    if method == "sample_skip_iw":
        return eq3_correction(load, capacity)
    kept = keep.sum(-1, keepdim=True).clamp(min=1).to(load.dtype)
    return (keep.shape[-1] / kept).expand_as(load)


def routes_record(expert: Tensor, keep: Tensor, log_p_z: Tensor, log_q_z: Tensor, correction: Tensor | None,
                  balance: Tensor, counts: Tensor, unreachable: Tensor | None = None) -> Routes:
    """The single-choice :class:`~routelab.Routes` ``[..., n, 1]`` of a sample.

    Args:
        expert: ``[..., n]`` long chosen experts.
        keep: ``[..., n]`` bool.
        log_p_z: ``[..., n]`` router log-probability of the chosen expert (differentiable).
        log_q_z: ``[..., n]`` proposal log-probability the weight corrects for.
        correction: ``[..., n]`` extra factor of the weight (the skip correction), or ``None`` (1).
        balance: ``[...]`` Switch balance loss.
        counts: ``[..., k]`` kept tokens per expert.
        unreachable: ``[...]`` router mass per token on pairs the weight's reference probability
            gives 0 (:func:`unreachable_mass`), or ``None`` (0: it gives every pair of ``p > 0``
            a positive probability).

    Returns:
        Routes with one slot per token (per-slot fields ``[..., n, 1]``),
        ``weight = (p_z / q_z) * correction`` (0 where skipped, detached), computed
        in log space and clamped at :data:`MAX_WEIGHT` (``stats["weights_clamped"]`` counts the
        clamped kept weights per instance; ``p_z = 0`` gives weight 0 whatever ``q_z``),
        ``gate = p_z``, ``log_prob = log p_z``, ``stats["unreachable_mass"]`` ``[...]``.
    """
    log_w = log_p_z.detach() - log_q_z.detach()
    if correction is not None:
        log_w = log_w + torch.log(correction)
    # -inf - (-inf) (p = q = 0: a pair only a balanced sample can force) is weight 0, as are skipped tokens.
    log_w = log_w.nan_to_num_(nan=-math.inf, posinf=math.inf, neginf=-math.inf).masked_fill_(~keep, -math.inf)
    clamped = (log_w > _LOG_MAX_WEIGHT).sum(-1)
    # exp of the clamped log rounds to just below MAX_WEIGHT in float32: clamp the weight itself too.
    weight = log_w.clamp_(max=_LOG_MAX_WEIGHT).exp_().clamp_(max=MAX_WEIGHT)
    return Routes(
        expert=expert.unsqueeze(-1),
        gate=log_p_z.exp().unsqueeze(-1),
        keep=keep.unsqueeze(-1),
        weight=weight.unsqueeze(-1),
        log_prob=log_p_z.unsqueeze(-1),
        aux={"balance": balance},
        stats={"tokens_per_expert": counts, "dropped_fraction": (~keep).float().mean(-1),
               "weights_clamped": clamped,
               "unreachable_mass": torch.zeros_like(balance, dtype=log_p_z.dtype) if unreachable is None
               else unreachable.to(log_p_z.dtype)},
    )


def unreachable_mass(log_p: Tensor, log_q: Tensor) -> Tensor:
    """``[...]``: the router probability per token, ``(1/n) sum_ij p_ij [q_ij = 0]``, on the pairs
    the weight's reference probability ``q`` (``[..., n, k]``, log) gives 0 while ``p`` does not.

    An importance-weighted estimate never sees those pairs: its expectation misses ``p_ij h_ij``
    there, so it is unbiased only where this is 0. Gumbel-Matching's conditionals give it when
    forbidden (``-inf``) pairs and the capacity force a token off an expert it has probability
    for (token 0 may only use expert 0, capacity 1: token 1 never gets expert 0).
    """
    missed = (log_q == float("-inf")) & (log_p > float("-inf"))
    return (log_p.detach().exp() * missed).sum((-2, -1)) / max(log_p.shape[-2], 1)
