"""Routing statistics of one batch after capacity: load per expert, dropped fraction, load CV."""

from __future__ import annotations

import torch
from torch import Tensor

from .._checks import device_scalar
from .capacity import CapacityDecision

__all__ = ["load_stats"]


def load_stats(proposed: Tensor, decision: CapacityDecision, capacity: int | Tensor,
               tokens: Tensor | None = None) -> dict[str, Tensor]:
    """The statistics of a routing decision after :func:`~routelab.routing.apply_capacity`.

    Args:
        proposed: ``BoolTensor [tokens, slots]``, the pairs the router proposed (its ``keep``).
        decision: the capacity decision on those pairs.
        capacity: the capacity it was taken under (the buffer rows per expert); an int, or a
            0-dimensional tensor (a dropless layer's largest load, left on the device).
        tokens: ``BoolTensor [tokens]``, the real tokens (``None``: all): padding is no token left
            without an expert (it was never to have one).

    Returns:
        ``tokens_per_expert [E]`` (kept pairs per expert), ``load_cv`` (their coefficient of
        variation, ``std / mean``; 0 with one expert), ``dropped_fraction`` (of the proposed
        pairs, dropped by capacity), ``tokens_dropped`` (fraction of tokens left with no expert),
        ``capacity``; all tensors on the decision's device but ``capacity``.
    """
    kept = decision.kept.to(torch.float32)
    n = proposed.shape[0]
    proposed_pairs = proposed.sum()
    keep = decision.keep
    if kept.numel() <= 1:
        load_cv = kept.new_zeros(())
    else:
        std, mean = torch.std_mean(kept, correction=0)  # (one reduction for both)
        load_cv = std / mean.clamp(min=1e-12)
    return {
        "tokens_per_expert": decision.kept,
        "load_cv": load_cv,
        "dropped_fraction": (proposed_pairs - keep.sum()) / proposed_pairs.clamp(min=1),
        "tokens_dropped": _tokens_without_expert(keep, tokens) if n else kept.new_zeros(()),
        "capacity": capacity if isinstance(capacity, Tensor) else device_scalar(capacity, decision.kept),
    }


def _tokens_without_expert(keep: Tensor, tokens: Tensor | None) -> Tensor:
    """The fraction of the (real) tokens with no kept pair (``keep [n, slots]``, ``tokens [n]``)."""
    without = ~keep.any(-1)
    if tokens is None:
        return without.float().mean()
    return (without & tokens).sum().float() / tokens.sum().clamp(min=1).float()
