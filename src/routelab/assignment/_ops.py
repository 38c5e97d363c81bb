"""Reductions over the experts dimension that stay fast when there are few experts.

PyTorch's CPU kernels reduce a short last dimension (``k = 2`` experts, say) row by row, which
is several times slower than elementwise work over the same data. For ``k <= SMALL_K`` these
helpers combine the ``k`` slices elementwise instead; otherwise they call the usual kernels.
"""

from __future__ import annotations

import torch
from torch import Tensor

SMALL_K = 8


def log_softmax(x: Tensor) -> Tensor:
    """``torch.log_softmax(x, dim=-1)``, computed slice by slice when the last dim is short."""
    k = x.shape[-1]
    if k > SMALL_K:
        return torch.log_softmax(x, dim=-1)
    return x - logsumexp(x).unsqueeze(-1)


def logsumexp(x: Tensor) -> Tensor:
    """``torch.logsumexp(x, dim=-1)`` (``-inf`` for an all ``-inf`` row)."""
    k = x.shape[-1]
    if k > SMALL_K:
        return torch.logsumexp(x, dim=-1)
    top = amax(x)
    safe = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    total = torch.exp(x[..., 0] - safe)
    for j in range(1, k):
        total = total + torch.exp(x[..., j] - safe)
    return safe + torch.log(total)


def amax(x: Tensor) -> Tensor:
    """``x.amax(dim=-1)``."""
    k = x.shape[-1]
    if k > SMALL_K:
        return x.amax(dim=-1)
    top = x[..., 0]
    for j in range(1, k):
        top = torch.maximum(top, x[..., j])
    return top


def argmax(x: Tensor) -> Tensor:
    """``x.argmax(dim=-1)`` (the first maximiser on ties)."""
    k = x.shape[-1]
    if k > SMALL_K:
        return x.argmax(dim=-1)
    top = x[..., 0]
    index = torch.zeros(top.shape, dtype=torch.long, device=x.device)
    for j in range(1, k):
        better = x[..., j] > top
        top = torch.where(better, x[..., j], top)
        index = torch.where(better, torch.full_like(index, j), index)
    return index
