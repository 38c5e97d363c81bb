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

    Raises:
        TypeError, ValueError: naming the argument, for a ``group`` that is not a 1-D integer
            tensor, a ``priority`` of another shape, or ``num_groups < 1``. The ids' range is not
            checked (that would take a host synchronisation).
    """
    if not isinstance(group, Tensor) or group.dtype == torch.bool or group.is_floating_point() or group.is_complex():
        got = group.dtype if isinstance(group, Tensor) else type(group).__name__
        raise TypeError(f"group must be an integer tensor [N] of group ids, got {got}")
    if group.dim() != 1:
        raise ValueError(f"group must be 1-D [N], got shape {tuple(group.shape)}")
    if priority is not None and (not isinstance(priority, Tensor) or priority.shape != group.shape):
        got = tuple(priority.shape) if isinstance(priority, Tensor) else type(priority).__name__
        raise ValueError(f"priority must be None or a tensor of group's shape {tuple(group.shape)}, got {got}")
    if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 1:
        raise ValueError(f"num_groups must be an integer >= 1, got {num_groups!r}")
    group = group.long()
    if priority is None:
        sorted_group, order = torch.sort(group, stable=True)
    else:
        by_priority = torch.argsort(priority, descending=True, stable=True)
        sorted_group, within = torch.sort(group[by_priority], stable=True)
        order = by_priority[within]
    if counts is None:
        counts = torch.zeros(num_groups, dtype=torch.long, device=group.device)
        counts.scatter_add_(0, group, torch.ones_like(group))
    start = torch.cumsum(counts, 0) - counts
    rank_sorted = torch.arange(group.numel(), device=group.device) - start[sorted_group]
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
