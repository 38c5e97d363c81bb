"""Reductions over the experts dimension that stay fast when there are few experts.

PyTorch's CPU kernels reduce a short last dimension (``k = 2`` experts, say) row by row, which
is several times slower than elementwise work over the same data. For ``k <= SMALL_K`` these
helpers combine the ``k`` slices elementwise instead; otherwise they call the usual kernels.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._tuning import TUNING

SMALL_K = TUNING.small_k


def log_softmax(x: Tensor) -> Tensor:
    """``torch.log_softmax(x, dim=-1)``, computed slice by slice when the last dim is short."""
    k = x.shape[-1]
    if k > SMALL_K:
        return torch.log_softmax(x, dim=-1)
    # (x - max) - log(sum): subtracting the maximum first keeps the normalisation exact at any
    # magnitude (max + log(sum) would round log(sum) away once |max| >> 1).
    top = amax(x)
    safe = torch.where(torch.isinf(top), torch.zeros_like(top), top).unsqueeze(-1)
    shifted = x - safe
    total = torch.exp(shifted[..., 0])
    for j in range(1, k):
        total = total + torch.exp(shifted[..., j])
    return shifted - torch.log(total).unsqueeze(-1)


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
    """``x.argmax(dim=-1)`` (the first maximiser on ties) for NaN-free ``x``: with ``k <= SMALL_K``
    a NaN is never picked (torch picks it); every caller passes finite or ``-inf`` scores."""
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


def top_two(x: Tensor, work: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The largest entry of every row, its index (the first on ties) and the second largest.

    ``x.max(dim=-1)`` with indices and a masked copy are several times slower on CPU than the
    elementwise passes used here: ``sign(x - max) + 1`` is 1 exactly at the maxima (``x - max``
    is exactly 0 there) and 0 elsewhere; a product with ``0, 1, ..., k - 1`` gives the index of a
    unique maximum, and subtracting a large multiple of it hides the maximum from a second
    ``amax``. Rows with tied maxima (rare) are redone with ``argmax``; their second value is the
    maximum itself.

    Args:
        x: ``[..., k]`` floating tensor without NaN or ``+inf``; ``-inf`` entries (excluded
            choices) take the exact ``max(dim)`` path, as do scores spanning most of the
            float range.
        work: scratch tensor of ``x``'s shape and dtype (overwritten).

    Returns:
        ``(first, index, second)``, each ``[...]``; ``second`` is ``-inf`` when ``k = 1``.
    """
    k = x.shape[-1]
    first = x.amax(dim=-1)
    spread = (first - x.amin(dim=-1)).amax() + 1.0 if x.numel() else torch.ones((), dtype=x.dtype)
    if k < 2 or not bool(spread <= torch.finfo(x.dtype).max / 4):
        # One expert, -inf entries or scores spanning most of the float range (the mask below
        # would overflow).
        first, index = x.max(dim=-1)
        second = (
            x.scatter(-1, index.unsqueeze(-1), float("-inf")).amax(dim=-1)
            if k > 1
            else torch.full_like(first, float("-inf"))
        )
        return first, index, second
    top = torch.sub(x, first.unsqueeze(-1), out=work).sign_().add_(1.0)  # 1 at the maxima
    ties = top.sum(-1) > 1.5
    positions = torch.arange(k, dtype=x.dtype, device=x.device)
    index = (top @ positions).long()
    # Hide the maxima: anything below -(spread + 1) is smaller than every other entry.
    second = top.mul_(-2.0 * spread).add_(x).amax(dim=-1)
    if bool(ties.any()):
        index = torch.where(ties, x.argmax(dim=-1), index)
        second = torch.where(ties, first, second)
    return first, index, second
