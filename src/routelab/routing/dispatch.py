"""Dispatch tokens into per-expert buffers and combine expert outputs back, by index.

No Python loop over tokens or experts: dispatch is one gather into a ``[experts, capacity, d]``
buffer, combine one gather plus a weighted sum over slots. Both are differentiable (their
backward passes are the matching scatter-adds).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .._checks import check_capacity, check_positive_int, checks_run, index_tensor, mask_tensor

__all__ = ["DispatchPlan"]


@dataclass(frozen=True)
class DispatchPlan:
    """Where every kept (token, slot) pair sits in the expert buffers.

    Attributes:
        num_experts: ``E``.
        capacity: ``C``, rows per expert buffer.
        token_of_row: ``LongTensor [E * C]`` — the token in each buffer row; ``tokens`` (one
            past the last token, a zero row) where the row is empty.
        row_of_slot: ``LongTensor [tokens, slots]`` — the buffer row of each pair; ``E * C`` (a
            zero row) where the pair is dropped.
    """

    num_experts: int
    capacity: int
    token_of_row: Tensor
    row_of_slot: Tensor

    @property
    def num_tokens(self) -> int:
        """The number of tokens the plan was built for (``dispatch`` takes exactly that many)."""
        return self.row_of_slot.shape[0]

    @classmethod
    def build(cls, expert: Tensor, keep: Tensor, position: Tensor, num_experts: int, capacity: int, *,
              check: bool = True) -> DispatchPlan:
        """Plan from routes after capacity.

        Args:
            expert: ``LongTensor [tokens, slots]``.
            keep: ``BoolTensor [tokens, slots]``; kept pairs must have ``0 <= expert <
                num_experts``, ``0 <= position < capacity``, and pairs of different tokens
                distinct (expert, position).
            position: ``LongTensor [tokens, slots]`` row within the expert's buffer.
            num_experts: ``E >= 1``.
            capacity: ``C >= 0``.
            check: check those value conditions of the kept pairs (one host synchronisation,
                skipped anyway while ``torch.compile`` traces). ``False`` is for callers whose
                positions come straight from :func:`~routelab.routing.apply_capacity`, which
                guarantees them (the MoE layer); a violated condition would then route a token to
                another expert's row silently.

        Raises:
            TypeError, ValueError: naming the argument, for a wrong type, dtype or shape, a kept
                pair outside the buffers, or two kept pairs in the same buffer row.
        """
        expert = index_tensor(expert, "expert")
        keep = mask_tensor(keep, "keep", expert.shape)
        position = index_tensor(position, "position")
        if position.shape != expert.shape:
            raise ValueError(f"position must have the shape of expert [tokens, slots] = {tuple(expert.shape)}, "
                             f"got {tuple(position.shape)}")
        check_positive_int("num_experts", num_experts)
        capacity = check_capacity(capacity)
        if capacity is None:
            raise ValueError("capacity must be an integer >= 0 (rows per expert buffer), got None")
        n, s = expert.shape
        rows = num_experts * capacity
        check = check and expert.numel() > 0 and checks_run()
        if check:
            bad_expert = keep & ((expert < 0) | (expert >= num_experts))
            bad_position = keep & ((position < 0) | (position >= capacity))
            placed = keep & ~bad_expert & ~bad_position
        else:
            placed = keep
        row = torch.where(placed, expert * capacity + position, torch.full_like(expert, rows))
        token_of_row = torch.full((rows + 1,), n, dtype=torch.long, device=expert.device)
        token_ids = torch.arange(n, device=expert.device).unsqueeze(-1).expand(n, s)
        token_of_row.scatter_(0, row.reshape(-1), token_ids.reshape(-1))
        if check:
            # Two kept pairs in one row: only one token can own it, so the other reads it back wrong.
            shared = placed & (token_of_row[row] != token_ids)
            bad_e, bad_p, bad_shared = torch.stack([bad_expert.any(), bad_position.any(), shared.any()]).tolist()
            if bad_e:
                t, j = bad_expert.nonzero()[0].tolist()
                raise ValueError(f"expert[{t}, {j}] = {int(expert[t, j])} is kept but outside [0, num_experts="
                                 f"{num_experts})")
            if bad_p:
                t, j = bad_position.nonzero()[0].tolist()
                raise ValueError(f"position[{t}, {j}] = {int(position[t, j])} is kept but outside the expert's "
                                 f"buffer [0, capacity={capacity}); build positions with apply_capacity")
            if bad_shared:
                raise ValueError("position puts kept pairs of two tokens in the same (expert, position) buffer "
                                 "row; kept pairs need distinct rows (apply_capacity's positions are)")
        return cls(num_experts, capacity, token_of_row[:rows], row)

    @classmethod
    def from_rows(cls, row_of_slot: Tensor, num_experts: int, capacity: int) -> DispatchPlan:
        """The plan whose pair ``(t, s)`` sits in buffer row ``row_of_slot[t, s]`` (``E * C``: dropped).

        For callers whose rows are valid by construction (expert parallelism lays out received
        tokens and returned outputs with it): no value checks, distinct rows assumed.

        Args:
            row_of_slot: ``LongTensor [tokens, slots]`` with values in ``[0, E * C]``.
            num_experts: ``E >= 1``.
            capacity: ``C >= 0``.
        """
        row_of_slot = index_tensor(row_of_slot, "row_of_slot")
        check_positive_int("num_experts", num_experts)
        capacity = check_capacity(capacity)
        if capacity is None:
            raise ValueError("capacity must be an integer >= 0 (rows per expert buffer), got None")
        rows = num_experts * capacity
        n, s = row_of_slot.shape
        token_of_row = torch.full((rows + 1,), n, dtype=torch.long, device=row_of_slot.device)
        token_ids = torch.arange(n, device=row_of_slot.device).unsqueeze(-1).expand(n, s)
        token_of_row.scatter_(0, row_of_slot.reshape(-1), token_ids.reshape(-1))
        return cls(num_experts, capacity, token_of_row[:rows], row_of_slot)

    def dispatch(self, x: Tensor) -> Tensor:
        """Gather tokens into expert buffers.

        Args:
            x: ``[tokens, d]``, the ``tokens`` the plan was built for.

        Returns:
            ``[E, C, d]``; empty rows are zero.

        Raises:
            TypeError, ValueError: ``x`` is not a ``[tokens, d]`` tensor with the plan's token count.
        """
        if not isinstance(x, Tensor):
            raise TypeError(f"x must be a tensor [tokens, d], got {type(x).__name__}")
        if x.dim() != 2 or x.shape[0] != self.num_tokens:
            raise ValueError(f"x must have shape [tokens={self.num_tokens}, d] (the plan was built for "
                             f"{self.num_tokens} tokens), got {tuple(x.shape)}")
        padded = torch.cat([x, x.new_zeros(1, x.shape[-1])])
        return padded[self.token_of_row].view(self.num_experts, self.capacity, x.shape[-1])

    def combine(self, expert_out: Tensor, weight: Tensor) -> Tensor:
        """Weighted sum of every token's expert outputs.

        Args:
            expert_out: ``[E, C, d]`` expert outputs per buffer row.
            weight: ``[tokens, slots]`` combine weight of every pair; a dropped pair's weight is
                ignored, whatever its value (inf and NaN included).

        Returns:
            ``[tokens, d]``: ``y_t = sum_s weight[t, s] * expert_out[row_of_slot[t, s]]``.

        Raises:
            TypeError, ValueError: ``expert_out`` is not ``[E, C, d]`` or ``weight`` not
                ``[tokens, slots]`` of the plan.
        """
        for name, t in (("expert_out", expert_out), ("weight", weight)):
            if not isinstance(t, Tensor):
                raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
        if expert_out.dim() != 3 or expert_out.shape[:2] != (self.num_experts, self.capacity):
            raise ValueError(f"expert_out must have shape [E={self.num_experts}, C={self.capacity}, d], "
                             f"got {tuple(expert_out.shape)}")
        if weight.shape != self.row_of_slot.shape:
            raise ValueError(f"weight must have shape [tokens, slots] = {tuple(self.row_of_slot.shape)}, "
                             f"got {tuple(weight.shape)}")
        d = expert_out.shape[-1]
        flat = expert_out.reshape(-1, d)
        padded = torch.cat([flat, flat.new_zeros(1, d)])
        picked = padded[self.row_of_slot]  # [tokens, slots, d]
        # Dropped pairs read the zero row; their weight is zeroed too, so 0 * inf never enters the sum.
        dropped = self.row_of_slot == flat.shape[0]
        weight = weight.to(picked.dtype).masked_fill(dropped, 0.0)
        return torch.einsum("ts,tsd->td", weight, picked)
