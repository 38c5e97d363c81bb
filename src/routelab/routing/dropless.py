"""A dropless layer's capacity decision and grouped plan from one sort (speed machinery of ``MoE.plan``).

Where the limit is every proposed pair (a dropless layer on the grouped layout) nothing can drop,
and the two general steps compute the same thing twice: :func:`~routelab.routing.apply_capacity`
ranks the pairs of every expert in (slot, token) order with one stable sort of their expert ids,
and :meth:`GroupedPlan.build <routelab.routing.GroupedPlan.build>` then places each kept pair at
``starts[e] + rank``, which is its index in that same sort. :func:`decide_and_plan_dropless`
reads both from the sort itself: 20 operators where the two steps take 37 at one slot, 25 against
45 at two (views excluded; a GPU layer at d_model 1024 is bound by the host's launches,
docs/gpu-profile-h200.md). Its decision and plan
equal theirs field for field (``tests/routing/test_dropless.py``), except where the value of a
non-candidate pair is documented as arbitrary: its ``position`` (in range) and which of the last
rows, the rows of no expert, it takes.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .capacity import CapacityDecision, checked_pairs
from .dispatch import GroupedPlan

__all__ = ["decide_and_plan_dropless"]


def decide_and_plan_dropless(expert: Tensor, candidate: Tensor, num_experts: int, *,
                             check: bool = True) -> tuple[CapacityDecision, GroupedPlan]:
    """``apply_capacity(expert, candidate, expert.numel(), num_experts)`` (the ``"position"``
    policy; ``"random"`` draws nothing at that limit and gives the same) and the
    :class:`GroupedPlan` built from it, in one pass.

    Args:
        expert: ``LongTensor [tokens, slots]``, each in ``[0, num_experts)``.
        candidate: ``BoolTensor [tokens, slots]``, the router's own selection.
        num_experts: ``E >= 1``.
        check: check the experts' range (one host synchronisation), as ``apply_capacity``.

    Returns:
        ``(decision, plan)``: every candidate kept (``keep = candidate``, skip weights 1 on the
        candidates and 0 elsewhere, ``kept = load``), and the rows of the kept pairs sorted by
        expert, in (slot, token) order within an expert.

    Raises:
        TypeError, ValueError: as :func:`~routelab.routing.apply_capacity`.
    """
    expert, candidate = checked_pairs(expert, candidate, num_experts, check=check)
    n, s = expert.shape
    rows = n * s
    E = num_experts
    # Slot-major pairs (all first choices, then all second ones), as apply_capacity orders them;
    # the pairs that are not candidates form group E, after every expert.
    flat_expert = expert.t().reshape(-1)
    flat_cand = candidate.t().reshape(-1)
    group = torch.where(flat_cand, flat_expert, E)
    counts = torch.zeros(E + 1, dtype=torch.long, device=expert.device)
    counts.scatter_add_(0, group, torch.ones_like(group))
    sorted_group, pair_of_row = torch.sort(group, stable=True)
    ends = counts.cumsum(0)
    starts = ends - counts
    row_of_pair = torch.empty_like(group).scatter_(0, pair_of_row, torch.arange(rows, device=expert.device))
    # A pair's rank among its expert's pairs is its row less the expert's first row.
    position = row_of_pair - starts[group]
    token_of_row = (pair_of_row % max(n, 1)).masked_fill_(sorted_group == E, n)
    row_of_slot = torch.where(flat_cand, row_of_pair, rows).view(s, n).t().contiguous()
    load = counts[:E]

    def unflat(t: Tensor) -> Tensor:  # slot-major [s * n] -> [n, s]
        return t.reshape(s, n).t()

    decision = CapacityDecision(keep=unflat(flat_cand), position=unflat(position), load=load, kept=load,
                                skip_weight=unflat(flat_cand.to(torch.float32)))
    plan = GroupedPlan(E, ends[:E].to(torch.int32), token_of_row, sorted_group, row_of_slot)
    return decision, plan
