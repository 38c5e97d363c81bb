"""Dispatch tokens to the experts and combine expert outputs back, by index.

Two layouts, one per plan:

* :class:`DispatchPlan`: per-expert buffers ``[experts, capacity, d]``, rows past an expert's
  load padded with zeros (for batched matmuls over stacked weights and for any experts module);
* :class:`GroupedPlan`: the kept pairs sorted by expert into ``[tokens * slots, d]`` rows, expert
  ``e``'s rows contiguous and no padding between experts (for grouped matmuls,
  ``torch._grouped_mm``); its sizes are static, so it needs no host synchronisation even when
  routing is dropless.

No Python loop over tokens or experts: dispatch is one gather, combine one gather plus a
weighted sum over slots. Both are differentiable, and their backward passes gather too, by the
plan's inverse map (:mod:`routelab.routing._gather`: no sort, no atomic adds, deterministic).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .._checks import check_capacity, check_positive_int, checks_run, index_tensor, mask_tensor
from ._gather import combine_rows, dispatch_rows

__all__ = ["DispatchPlan", "GroupedPlan"]


class _TokenPlan:
    """What both plans share: the token count they were built for and their argument checks.
    Subclasses hold ``row_of_slot [tokens, slots]``."""

    row_of_slot: Tensor

    @property
    def num_tokens(self) -> int:
        """The number of tokens the plan was built for (``dispatch`` takes exactly that many)."""
        return self.row_of_slot.shape[0]

    def _check_tokens(self, x: object) -> None:
        """TypeError/ValueError unless ``x`` is a 2-D tensor with the plan's token count."""
        if not isinstance(x, Tensor):
            raise TypeError(f"x must be a tensor [tokens, d], got {type(x).__name__}")
        if x.dim() != 2 or x.shape[0] != self.num_tokens:
            raise ValueError(f"x must have shape [tokens={self.num_tokens}, d] (the plan was built for "
                             f"{self.num_tokens} tokens), got {tuple(x.shape)}")

    def _check_combine_weight(self, expert_out: object, weight: object) -> None:
        """TypeError unless both are tensors; ValueError unless ``weight`` is ``[tokens, slots]``."""
        for name, t in (("expert_out", expert_out), ("weight", weight)):
            if not isinstance(t, Tensor):
                raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
        if weight.shape != self.row_of_slot.shape:
            raise ValueError(f"weight must have shape [tokens, slots] = {tuple(self.row_of_slot.shape)}, "
                             f"got {tuple(weight.shape)}")


def _pair_tensors(expert: object, keep: object, position: object, num_experts: object
                  ) -> tuple[Tensor, Tensor, Tensor]:
    """``(expert, keep, position)`` checked as ``[tokens, slots]`` index, mask and index tensors of
    one shape, and ``num_experts`` as a positive int (TypeError/ValueError naming the argument)."""
    expert = index_tensor(expert, "expert")
    keep = mask_tensor(keep, "keep", expert.shape)
    position = index_tensor(position, "position")
    if position.shape != expert.shape:
        raise ValueError(f"position must have the shape of expert [tokens, slots] = {tuple(expert.shape)}, "
                         f"got {tuple(position.shape)}")
    check_positive_int("num_experts", num_experts)
    return expert, keep, position


@dataclass(frozen=True)
class DispatchPlan(_TokenPlan):
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
    def build(cls, expert: Tensor, keep: Tensor, position: Tensor, num_experts: int, capacity: int, *,
              check: bool = True) -> DispatchPlan:
        """Plan from routes after capacity.

        Args:
            expert: ``LongTensor [tokens, slots]``.
            keep: ``BoolTensor [tokens, slots]``; kept pairs must have ``0 <= expert <
                num_experts``, ``0 <= position < capacity``, and distinct (expert, position)
                rows (also two slots of one token).
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
        expert, keep, position = _pair_tensors(expert, keep, position, num_experts)
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
        row = torch.where(placed, position.add(expert, alpha=capacity), rows)  # expert * C + position
        token_of_row = torch.full((rows + 1,), n, dtype=torch.long, device=expert.device)
        token_ids = torch.arange(n, device=expert.device).unsqueeze(-1).expand(n, s)
        token_of_row.scatter_(0, row.reshape(-1), token_ids.reshape(-1))
        if check:
            # Two kept pairs in one row: only one token can own it, so the other reads it back wrong;
            # two slots of one token in one row double-count its gradient in the adjoint gathers.
            per_row = torch.zeros(rows + 1, dtype=torch.long, device=expert.device).scatter_add_(
                0, row.reshape(-1), placed.reshape(-1).long())
            shared = placed & (per_row[row] > 1)
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
                t, j = shared.nonzero()[0].tolist()
                raise ValueError(f"position puts kept pair ({t}, {j}) in the (expert, position) = "
                                 f"({int(expert[t, j])}, {int(position[t, j])}) buffer row with another kept pair "
                                 "(of another token or of another slot of the same one); kept pairs need distinct "
                                 "rows (apply_capacity's positions are)")
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
        self._check_tokens(x)
        return dispatch_rows(x, self.token_of_row, self.row_of_slot).view(self.num_experts, self.capacity, x.shape[-1])

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
        self._check_combine_weight(expert_out, weight)
        if expert_out.dim() != 3 or expert_out.shape[:2] != (self.num_experts, self.capacity):
            raise ValueError(f"expert_out must have shape [E={self.num_experts}, C={self.capacity}, d], "
                             f"got {tuple(expert_out.shape)}")
        return _weighted_rows(expert_out.reshape(-1, expert_out.shape[-1]), self.row_of_slot, self.token_of_row, weight)


def _weighted_rows(rows: Tensor, row_of_slot: Tensor, token_of_row: Tensor, weight: Tensor) -> Tensor:
    """``y_t = sum_s weight[t, s] * rows[row_of_slot[t, s]]``, a pair whose row is ``len(rows)``
    contributing exactly zero (its weight is ignored, inf and NaN included).

    Args:
        rows: ``[R, d]`` expert outputs.
        row_of_slot: ``LongTensor [tokens, slots]`` with values in ``[0, R]``.
        token_of_row: ``LongTensor [R]``, the inverse map (``tokens``: a row of no pair).
        weight: ``[tokens, slots]``.

    Returns:
        ``[tokens, d]`` in ``rows``' dtype.
    """
    # Dropped pairs read the zero row; their weight is zeroed too, so 0 * inf never enters the sum.
    dropped = row_of_slot == rows.shape[0]
    weight = weight.to(rows.dtype).masked_fill(dropped, 0.0)
    return combine_rows(rows, weight, row_of_slot, token_of_row)


@dataclass(frozen=True)
class GroupedPlan(_TokenPlan):
    """The kept (token, slot) pairs sorted by expert, for grouped matmuls.

    There is one row per pair, ``R = tokens * slots`` rows in all. The kept pairs come first,
    expert by expert: expert ``e`` owns rows ``offsets[e-1] <= row < offsets[e]`` (``offsets[-1]``
    for ``e = 0`` read as 0), in the order of their positions in the expert (the order of
    :func:`~routelab.routing.apply_capacity`). Rows from ``offsets[-1]`` on belong to no expert:
    they are the dropped pairs, their input is a zero row and their output is never read, so an
    experts module may leave it uninitialised (``torch._grouped_mm`` does).

    The sizes depend on ``tokens`` and ``slots`` only, never on the routing, so building,
    dispatching and combining need no host synchronisation (the buffers of a dropless
    :class:`DispatchPlan` need the largest load on the host).

    Attributes:
        num_experts: ``E``.
        offsets: ``IntTensor [E]`` (int32, as ``torch._grouped_mm`` takes it): the cumulative
            number of kept pairs of experts ``0..e``.
        token_of_row: ``LongTensor [R]`` — the token of each row; ``tokens`` (a zero row) for the
            rows of no expert.
        expert_of_row: ``LongTensor [R]`` — the expert of each row; ``E`` for the rows of no expert
            (e.g. to index per-expert biases padded with one extra row).
        row_of_slot: ``LongTensor [tokens, slots]`` — the row of each pair; ``R`` (a zero row)
            where the pair is dropped.
    """

    num_experts: int
    offsets: Tensor
    token_of_row: Tensor
    expert_of_row: Tensor
    row_of_slot: Tensor

    @property
    def num_rows(self) -> int:
        """``R = tokens * slots``."""
        return self.token_of_row.shape[0]

    @classmethod
    def build(cls, expert: Tensor, keep: Tensor, position: Tensor, kept: Tensor, num_experts: int) -> GroupedPlan:
        """Plan from a capacity decision.

        Args:
            expert: ``LongTensor [tokens, slots]``.
            keep: ``BoolTensor [tokens, slots]``.
            position: ``LongTensor [tokens, slots]``; the kept pairs of expert ``e`` must hold the
                positions ``0 .. kept[e] - 1``, each once (as
                :func:`~routelab.routing.apply_capacity` returns them: ``decision.position``).
            kept: ``LongTensor [E]``, kept pairs per expert (``decision.kept``).
            num_experts: ``E >= 1``.

        Not value-checked (that would need a host synchronisation): the arguments must come from
        one :class:`~routelab.routing.CapacityDecision`, which guarantees the conditions above.

        Raises:
            TypeError, ValueError: naming the argument, for a wrong type, dtype or shape.
        """
        expert, keep, position = _pair_tensors(expert, keep, position, num_experts)
        if not isinstance(kept, Tensor) or kept.is_floating_point() or kept.dtype == torch.bool:
            raise TypeError(f"kept must be a LongTensor [num_experts] (decision.kept), got "
                            f"{kept.dtype if isinstance(kept, Tensor) else type(kept).__name__}")
        if tuple(kept.shape) != (num_experts,):
            raise ValueError(f"kept must have shape [num_experts={num_experts}], got {tuple(kept.shape)}")
        kept = kept.long()
        n, s = expert.shape
        device = expert.device
        rows = n * s
        ends = kept.cumsum(0)
        starts = ends - kept
        total = ends[-1]
        # The dropped pairs fill the rows after the kept ones, in (token, slot) order; so every
        # row holds exactly one pair (``row`` is a permutation of the rows) and the scatters
        # below write every row of their outputs.
        flat_keep = keep.reshape(-1)
        dropped_rank = (~flat_keep).cumsum(0) - 1
        safe_expert = expert.reshape(-1).clamp(0, num_experts - 1)
        row = torch.where(flat_keep, starts[safe_expert] + position.reshape(-1), total + dropped_rank)
        token_ids = torch.arange(rows, device=device) // s
        token_of_row = torch.empty(rows, dtype=torch.long, device=device)
        token_of_row.scatter_(0, row, torch.where(flat_keep, token_ids, n))
        expert_of_row = torch.empty(rows, dtype=torch.long, device=device)
        expert_of_row.scatter_(0, row, torch.where(flat_keep, safe_expert, num_experts))
        row_of_slot = torch.where(flat_keep, row, rows).view(n, s)
        return cls(num_experts, ends.to(torch.int32), token_of_row, expert_of_row, row_of_slot)

    def dispatch(self, x: Tensor) -> Tensor:
        """Gather tokens into expert-sorted rows.

        Args:
            x: ``[tokens, d]``, the ``tokens`` the plan was built for.

        Returns:
            ``[R, d]``: row ``r`` is ``x[token_of_row[r]]``; the rows of no expert are zero.

        Raises:
            TypeError, ValueError: ``x`` is not a ``[tokens, d]`` tensor with the plan's token count.
        """
        self._check_tokens(x)
        return dispatch_rows(x, self.token_of_row, self.row_of_slot)

    def combine(self, expert_out: Tensor, weight: Tensor) -> Tensor:
        """Weighted sum of every token's expert outputs.

        Args:
            expert_out: ``[R, d]`` expert output per row; the rows of no expert are never read
                (they may hold anything, NaN included).
            weight: ``[tokens, slots]`` combine weight of every pair; a dropped pair's weight is
                ignored, whatever its value (inf and NaN included).

        Returns:
            ``[tokens, d]``: ``y_t = sum_s weight[t, s] * expert_out[row_of_slot[t, s]]``.

        Raises:
            TypeError, ValueError: ``expert_out`` is not ``[R, d]`` or ``weight`` not
                ``[tokens, slots]`` of the plan.
        """
        self._check_combine_weight(expert_out, weight)
        if expert_out.dim() != 2 or expert_out.shape[0] != self.num_rows:
            raise ValueError(f"expert_out must have shape [R={self.num_rows}, d], got {tuple(expert_out.shape)}")
        return _weighted_rows(expert_out, self.row_of_slot, self.token_of_row, weight)
