"""Two experts (and one) in closed form: the solver's special case, in one place.

With ``k <= 2`` experts the balanced assignment is a selection (no graph search), and its expert
graph has two nodes. :func:`closed_form` is the one switch the solver consults.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._graph import release_arcs

__all__ = ["closed_form", "two_expert_assignment", "two_expert_graph"]


def closed_form(k: int) -> bool:
    """Whether ``k`` experts take the closed-form path of this module (``k <= 2``)."""
    return k <= 2


def two_expert_assignment(S: Tensor, c: int) -> Tensor:
    """Exact solution for ``k <= 2`` by selection (no graph needed).

    With two experts, putting ``m`` tokens on expert 0 is best done with the ``m`` largest
    differences ``d_i = s[i, 0] - s[i, 1]``, and the capacities allow ``n - c <= m <= c``: take
    every positive difference, clamped to that range. (``k = 1``: everything on expert 0.)

    Args:
        S: ``[B, n, k]`` finite scores, ``k <= 2``.
        c: capacity.

    Returns:
        ``[B, n]`` long expert per token.
    """
    B, n, k = S.shape
    if k == 1:
        return torch.zeros((B, n), dtype=torch.long, device=S.device)
    d = S[..., 0] - S[..., 1]
    positive = d > 0
    m = positive.sum(-1).clamp(min=n - c, max=c)  # tokens on expert 0
    on_zero = positive.clone()
    for bound in sorted({n - c, c}):
        rows = ((m == bound) & (positive.sum(-1) != bound)).nonzero().flatten()
        if rows.numel() == 0:
            continue
        dr = d[rows]
        # The bound-th largest value; ties at it are taken in token order up to the bound.
        t = torch.kthvalue(dr, n - bound + 1, dim=-1, keepdim=True).values
        above = dr > t
        tie = dr == t
        room = bound - above.sum(-1, keepdim=True)
        on_zero[rows] = above | (tie & (torch.cumsum(tie, -1) <= room))
    return (~on_zero).long()


def two_expert_graph(S: Tensor, z: Tensor, c: int, big: Tensor) -> Tensor:
    """The expert graph ``[B, 2, 2]`` (float64) of a two-expert assignment, without slot tables."""
    d = (S[..., 0] - S[..., 1]).to(torch.float64)
    inf = float("inf")
    move_01 = d.masked_fill(z != 0, inf).amin(-1)  # cheapest move of a token from 0 to 1
    move_10 = (-d).masked_fill(z != 1, inf).amin(-1)
    move = torch.full((z.shape[0], 2, 2), inf, dtype=torch.float64, device=S.device)
    move[:, 0, 1], move[:, 1, 0] = move_01, move_10
    counts = torch.stack([(z == 0).sum(-1), (z == 1).sum(-1)], dim=-1)
    return torch.minimum(move, release_arcs(counts, c, big))
