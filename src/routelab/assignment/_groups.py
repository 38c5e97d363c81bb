"""Small vectorised helpers for grouping items (tokens by expert), shared by the solvers."""

from __future__ import annotations

import torch
from torch import Tensor


def rank_within_groups(group: Tensor, priority: Tensor | None, num_groups: int, *,
                       counts: Tensor | None = None) -> Tensor:
    """Rank of every item inside its group, 0 for the highest priority.

    Args:
        group: ``[N]`` long group id of each item, in ``[0, num_groups)``.
        priority: ``[N]`` floating priority; ties keep the original item order. ``None``: the
            item order itself (earlier items first), which takes one stable sort of ``group``
            instead of two sorts.
        num_groups: number of groups.
        counts: ``[num_groups]`` long items per group, when the caller has them.

    Returns:
        ``[N]`` long rank of each item within its group.
    """
    if priority is None:
        order = torch.argsort(group, stable=True)
    else:
        order = torch.argsort(priority, descending=True, stable=True)
        order = order[torch.argsort(group[order], stable=True)]
    if counts is None:
        counts = torch.zeros(num_groups, dtype=torch.long, device=group.device)
        counts.scatter_add_(0, group, torch.ones_like(group))
    start = torch.cumsum(counts, 0) - counts
    rank_sorted = torch.arange(group.numel(), device=group.device) - start[group[order]]
    return torch.empty_like(group).scatter_(0, order, rank_sorted)


def slot_table(expert: Tensor, num_experts: int, capacity: int) -> tuple[Tensor, Tensor]:
    """Tokens grouped by their expert into a padded ``[..., k, c]`` table.

    Args:
        expert: ``[B, n]`` long expert of every token; at most ``capacity`` tokens per expert.
        num_experts: ``k``.
        capacity: ``c``.

    Returns:
        ``(holder, counts)``: ``holder`` ``[B, k, c]`` long token ids in increasing order within
        each expert, padded with ``n``; ``counts`` ``[B, k]`` tokens per expert.
    """
    B, n = expert.shape
    k, c = num_experts, capacity
    order = torch.argsort(expert, dim=-1, stable=True)
    sorted_expert = expert.gather(-1, order)
    counts = torch.zeros(B, k, dtype=torch.long, device=expert.device)
    counts.scatter_add_(-1, expert, torch.ones_like(expert))
    start = torch.cumsum(counts, -1) - counts
    rank = torch.arange(n, device=expert.device) - start.gather(-1, sorted_expert)
    holder = torch.full((B, k * c), n, dtype=torch.long, device=expert.device)
    holder.scatter_(-1, sorted_expert * c + rank, order)
    return holder.view(B, k, c), counts
