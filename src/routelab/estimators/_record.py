"""The pieces every estimator of :func:`~routelab.estimators.sample_routes` shares: the skip
correction of the importance weight and the :class:`~routelab.Routes` record itself."""

from __future__ import annotations

import torch
from torch import Tensor

from ..routes import Routes


def skip_correction(method: str, keep: Tensor, load: Tensor, capacity: int) -> Tensor:
    """``[..., n]`` factor on the importance weight of a skipping method.

    ``sample_skip_iw``: ``n_z / min(n_z, c)`` (eq. 3, unbiased); ``sample_skip``: ``n / n_kept``
    (the plain average over kept tokens, biased).

    Args:
        method: ``"sample_skip"`` or ``"sample_skip_iw"``.
        keep: ``[..., n]`` bool, kept tokens.
        load: ``[..., n]`` floating ``n_z``, tokens that chose each token's expert before skipping.
        capacity: ``c``.
    """
    if method == "sample_skip_iw":
        return load / load.clamp(max=capacity)
    kept = keep.sum(-1, keepdim=True).clamp(min=1).to(load.dtype)
    return (keep.shape[-1] / kept).expand_as(load)


def routes_record(expert: Tensor, keep: Tensor, log_p_z: Tensor, log_q_z: Tensor, correction: Tensor,
                  balance: Tensor, counts: Tensor) -> Routes:
    """The single-choice :class:`~routelab.Routes` of a sample.

    Args:
        expert: ``[..., n]`` long chosen experts.
        keep: ``[..., n]`` bool.
        log_p_z: ``[..., n]`` router log-probability of the chosen expert (differentiable).
        log_q_z: ``[..., n]`` proposal log-probability the weight corrects for.
        correction: ``[..., n]`` extra factor of the weight (skip correction, else 1).
        balance: ``[...]`` Switch balance loss.
        counts: ``[..., k]`` kept tokens per expert.

    Returns:
        Routes with ``weight = (p_z / q_z) * correction`` (0 where skipped, detached),
        ``gate = p_z``, ``log_prob = log p_z``.
    """
    weight = (torch.exp(log_p_z.detach() - log_q_z) * correction).masked_fill(~keep, 0.0).detach()
    return Routes(
        expert=expert,
        gate=log_p_z.exp(),
        keep=keep,
        weight=weight,
        log_prob=log_p_z,
        aux={"balance": balance},
        stats={"tokens_per_expert": counts, "dropped_fraction": (~keep).float().mean(-1)},
        single=True,
    )
