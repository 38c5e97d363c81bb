"""The start of the exact solver: a feasible assignment by rounds of greedy proposals."""

from __future__ import annotations

import torch
from torch import Tensor

from ._groups import rank_within_groups
from ._ops import top_two
from ._workspace import SCORES_B, scratch

__all__ = ["initial_assignment"]


def initial_assignment(S: Tensor, c: int) -> Tensor:
    """A feasible assignment by rounds of proposals (greedy, no token is moved once placed).

    Every unplaced token proposes to its best expert with a free slot; each expert accepts the
    proposals with the largest margin (best minus second best score) up to its free capacity.
    Every proposal goes to an expert with a free slot (full experts are at ``-inf`` and the
    scores are finite), and an expert accepts ``min(proposals, free slots) >= 1`` of them; so a
    round either places every pending token or fills at least one expert, and this ends within
    ``k + 1`` rounds (the loop's bound; running past it raises ``RuntimeError``).

    Args:
        S: ``[B, n, k]`` finite scores.
        c: capacity, ``c * k >= n``.

    Returns:
        ``[B, n]`` long expert per token.
    """
    B, n, k = S.shape
    dev = S.device
    z = torch.full((B, n), -1, dtype=torch.long, device=dev)
    free = torch.full((B, k), c, dtype=torch.long, device=dev)
    pb = torch.arange(B, device=dev).repeat_interleave(n)  # pending (batch, token) pairs
    pi = torch.arange(n, device=dev).repeat(B)
    rows = S.reshape(B * n, k)
    first = True
    for _ in range(k + 1):
        if pb.numel() == 0:
            return z
        if first:  # every expert is free and every token pending: all n x k scores
            first = False
            w1, j, w2 = top_two(rows, scratch(SCORES_B, rows.shape, S.dtype, dev))
        else:  # the few tokens left, with the full experts at -inf
            full = torch.zeros((B, k), dtype=S.dtype, device=dev).masked_fill_(free == 0, float("-inf"))
            W = rows.index_select(0, pb * n + pi) + full.index_select(0, pb)
            w1, j, w2 = top_two(W, torch.empty_like(W))
        tied = (w1 == w2).nonzero().view(-1)
        if tied.numel():
            j = j.clone()
            j[tied] = _spread_ties(rows.index_select(0, pb[tied] * n + pi[tied]), w1[tied], pi[tied], free, pb[tied])
        margin = torch.where(torch.isinf(w2), torch.full_like(w1, float("inf")), w1 - w2)
        group = pb * k + j
        # Experts proposed to no more than their free slots accept everything; only the others
        # rank their proposals (few, when the start comes from good prices).
        room = free.view(-1)[group]
        ok = torch.bincount(group, minlength=B * k)[group] <= room
        contested = (~ok).nonzero().view(-1)
        if contested.numel():
            rank = rank_within_groups(group[contested], margin[contested], B * k)
            ok[contested] = rank < room[contested]
        z[pb[ok], pi[ok]] = j[ok]
        free.view(-1).scatter_add_(0, group[ok], torch.full_like(group[ok], -1))
        pb, pi = pb[~ok], pi[~ok]
    if pb.numel() == 0:
        return z
    raise RuntimeError("balanced_assignment: the start placed no token in a round; please report this input")


def _spread_ties(W: Tensor, best: Tensor, token: Tensor, free: Tensor, inst: Tensor) -> Tensor:
    """For tokens with several best experts, pick one of them in turn by token index.

    Taking the first maximiser would send every tied token to the same expert, which fills up
    and sends the rest round by round (``k`` rounds for all-equal scores); token ``i`` with
    ``t`` tied maxima takes the ``(i mod t)``-th of them instead. Any of them is as good for
    the objective; experts without room are not candidates.

    Args:
        W: ``[r, k]`` the tied tokens' scores.
        best: ``[r]`` their maximum.
        token: ``[r]`` their token index.
        free: ``[B, k]`` free slots per expert.
        inst: ``[r]`` their batch instance.

    Returns:
        ``[r]`` long chosen expert.
    """
    top = (W == best.unsqueeze(-1)) & (free.index_select(0, inst) > 0)
    order = top.long().cumsum(-1)  # 1, 2, ... at the maxima
    count = order[:, -1].clamp(min=1)
    want = token % count + 1
    return (order == want.unsqueeze(-1)).long().argmax(dim=-1)
