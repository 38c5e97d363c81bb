"""Dispatch tokens into per-expert buffers and combine expert outputs back, by index.

No Python loop over tokens or experts: dispatch is one gather into a ``[experts, capacity, d]``
buffer, combine one gather plus a weighted sum over slots. Both are differentiable (their
backward passes are the matching scatter-adds).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

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

    @classmethod
    def build(cls, expert: Tensor, keep: Tensor, position: Tensor, num_experts: int, capacity: int) -> DispatchPlan:
        """Plan from routes after capacity.

        Args:
            expert: ``LongTensor [tokens, slots]``.
            keep: ``BoolTensor [tokens, slots]``; kept pairs must have ``position < capacity``
                and distinct (expert, position).
            position: ``LongTensor [tokens, slots]`` row within the expert's buffer.
            num_experts: ``E``.
            capacity: ``C``.
        """
        n, s = expert.shape
        rows = num_experts * capacity
        row = torch.where(keep, expert * capacity + position, torch.full_like(expert, rows))
        token_of_row = torch.full((rows + 1,), n, dtype=torch.long, device=expert.device)
        token_ids = torch.arange(n, device=expert.device).unsqueeze(-1).expand(n, s)
        token_of_row.scatter_(0, row.reshape(-1), token_ids.reshape(-1))
        return cls(num_experts, capacity, token_of_row[:rows], row)

    def dispatch(self, x: Tensor) -> Tensor:
        """Gather tokens into expert buffers.

        Args:
            x: ``[tokens, d]``.

        Returns:
            ``[E, C, d]``; empty rows are zero.
        """
        padded = torch.cat([x, x.new_zeros(1, x.shape[-1])])
        return padded[self.token_of_row].view(self.num_experts, self.capacity, x.shape[-1])

    def combine(self, expert_out: Tensor, weight: Tensor) -> Tensor:
        """Weighted sum of every token's expert outputs.

        Args:
            expert_out: ``[E, C, d]`` expert outputs per buffer row.
            weight: ``[tokens, slots]`` combine weight of every pair (dropped pairs read a zero
                row, so their weight does not matter).

        Returns:
            ``[tokens, d]``: ``y_t = sum_s weight[t, s] * expert_out[row_of_slot[t, s]]``.
        """
        d = expert_out.shape[-1]
        flat = expert_out.reshape(-1, d)
        padded = torch.cat([flat, flat.new_zeros(1, d)])
        picked = padded[self.row_of_slot]  # [tokens, slots, d]
        return torch.einsum("ts,tsd->td", weight.to(picked.dtype), picked)
