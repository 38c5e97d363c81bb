"""Expert capacity: how many (token, slot) pairs each expert may process, and who is dropped.

Every MoE layer enforces capacity here, in one place, for every router: a router proposes
slots (``Routes.keep`` marks its candidates), :func:`apply_capacity` keeps at most ``capacity``
candidates per expert and records the skip importance weight of Kool et al. (2021), eq. 3.
Balanced routers (BASE, Gumbel-Matching, batchwise) already respect the capacity, so nothing of
theirs is dropped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..assignment._checks import check_generator, resolve_capacity
from ..assignment._groups import rank_within_groups
from ..gates.mtl_gate import check_pos, check_positive_int

__all__ = [
    "DROP_POLICIES",
    "CapacityDecision",
    "apply_capacity",
    "check_capacity",
    "check_capacity_factor",
    "expert_capacity",
]

#: How candidates compete for an expert's capacity.
#: ``position``: first slots before second slots, then earlier tokens first (Switch / GShard);
#: ``score``: larger combine weight first (batch-prioritised routing);
#: ``random``: uniformly at random (the skip estimator of Kool et al., for which eq. 3 is unbiased).
DROP_POLICIES: tuple[str, ...] = ("position", "score", "random")


def check_capacity(capacity: int | None, name: str = "capacity") -> int | None:
    """``capacity`` as an ``int >= 0`` (``None`` passes through), else a ValueError naming ``name``.

    The integer rule is the assignment layer's (``resolve_capacity``, its one home): integral
    floats (``4.0``) are accepted; bools, ``inf``, NaN, fractions, negative numbers and
    non-numbers are not. ``0`` is allowed here (an empty batch has capacity 0).
    """
    if capacity is None:
        return None
    if isinstance(capacity, (int, float)) and not isinstance(capacity, bool) and capacity == 0:
        return 0
    return resolve_capacity(0, 1, capacity, name)  # 0 tokens, 1 expert: only the integer rule applies


def check_capacity_factor(capacity_factor: float | None) -> None:
    """ValueError unless ``capacity_factor`` is ``None`` (dropless) or a finite number ``> 0``."""
    if capacity_factor is None:
        return
    if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float)) or not (
        math.isfinite(capacity_factor) and capacity_factor > 0
    ):
        raise ValueError(
            f"capacity_factor must be a finite number > 0 (or None for dropless routing), got {capacity_factor!r}"
        )


def expert_capacity(num_tokens: int, num_experts: int, slots: float, capacity_factor: float | None) -> int:
    """Capacity ``C = ceil(capacity_factor * tokens * slots / experts)``, at most ``tokens``.

    Args:
        num_tokens: tokens in the batch, an integer ``n >= 0`` (``0``: an empty batch).
        num_experts: ``E``, an integer ``>= 1``.
        slots: average experts per token ``k``, a finite number ``> 0`` (``E`` for dense
            softmax gating).
        capacity_factor: ``> 0``; ``None`` means dropless (``C = n``: an expert can take every
            token, since a token never chooses the same expert twice).

    Returns:
        The capacity (``0`` only when there are no tokens). It never exceeds ``n``: a larger
        capacity could not be filled, so the buffer is not padded beyond it.

    Raises:
        ValueError: naming the argument: ``num_tokens`` not an integer ``>= 0``, ``num_experts``
            not an integer ``>= 1``, ``slots`` not a finite number ``> 0``, ``capacity_factor``
            ``<= 0`` or not finite.
    """
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
        raise ValueError(f"num_tokens must be an integer >= 0 (tokens in the batch), got {num_tokens!r}")
    check_positive_int("num_experts", num_experts)
    check_pos("slots", slots)
    if capacity_factor is None:
        return num_tokens
    check_capacity_factor(capacity_factor)
    raw = capacity_factor * num_tokens * slots / num_experts
    if not raw < num_tokens:  # also a huge factor whose product overflows to inf
        return num_tokens
    c = math.ceil(raw - 1e-9)
    return min(max(c, 1 if num_tokens else 0), num_tokens)


def _checks_run() -> bool:
    """Whether the value checks that need a host sync run: always, except while ``torch.compile``
    traces (a data-dependent check there would be a graph break on every call)."""
    return not torch.compiler.is_compiling()


def _index_tensor(t: object, name: str) -> Tensor:
    """``t`` as a ``LongTensor [tokens, slots]``: TypeError/ValueError naming ``name`` unless ``t``
    is a 2-D tensor of an integer dtype (values are checked by the caller)."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a LongTensor [tokens, slots], got {type(t).__name__}")
    if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
        raise ValueError(f"{name} must be an integer tensor (LongTensor [tokens, slots]), got {t.dtype}; "
                         f"indices are whole numbers, e.g. {name}.long() if its values are integral")
    if t.dim() != 2:
        raise ValueError(f"{name} must have 2 dimensions [tokens, slots], got shape {tuple(t.shape)}; "
                         f"for one slot per token use {name}.unsqueeze(-1)")
    return t if t.dtype == torch.long else t.long()


def _mask_tensor(t: object, name: str, shape: torch.Size) -> Tensor:
    """``t`` if it is a ``BoolTensor`` of ``shape``, else a TypeError/ValueError naming ``name``."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a BoolTensor [tokens, slots], got {type(t).__name__}")
    if t.dtype != torch.bool:
        raise ValueError(f"{name} must be a BoolTensor [tokens, slots], got {t.dtype}; use {name} != 0")
    if t.shape != shape:
        raise ValueError(f"{name} must have the shape of expert [tokens, slots] = {tuple(shape)}, "
                         f"got {tuple(t.shape)}")
    return t


@dataclass(frozen=True)
class CapacityDecision:
    """The result of :func:`apply_capacity`.

    Attributes:
        keep: ``BoolTensor [tokens, slots]`` — candidates that fit in their expert.
        position: ``LongTensor [tokens, slots]`` — slot in the expert's buffer (``0 .. C-1``) of
            every kept pair; undefined (but in range ``[0, tokens*slots)``) elsewhere.
        load: ``LongTensor [experts]`` — candidates per expert before dropping (``n_z``).
        kept: ``LongTensor [experts]`` — pairs kept per expert (``min(n_z, C)``).
        skip_weight: ``Tensor [tokens, slots]`` — ``n_z / min(n_z, C)`` for kept pairs, 0 for
            dropped ones (eq. 3 of Kool et al.; unbiased when ``policy="random"``).
    """

    keep: Tensor
    position: Tensor
    load: Tensor
    kept: Tensor
    skip_weight: Tensor


def apply_capacity(
    expert: Tensor,
    candidate: Tensor,
    capacity: int,
    num_experts: int,
    *,
    policy: str = "position",
    score: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> CapacityDecision:
    """Keep at most ``capacity`` candidate pairs per expert.

    Args:
        expert: ``LongTensor [tokens, slots]`` chosen expert of every slot, each in
            ``[0, num_experts)`` (any integer dtype is accepted and read as long).
        candidate: ``BoolTensor [tokens, slots]`` the router's own selection (False: the slot is
            not used at all, e.g. outside a batchwise mask).
        capacity: ``C >= 0`` pairs per expert (an integer; ValueError otherwise).
        num_experts: ``E``, an integer ``>= 1``.
        policy: one of :data:`DROP_POLICIES`.
        score: ``[tokens, slots]`` priority for ``policy="score"`` (larger kept first; no NaN).
        generator: randomness for ``policy="random"``.

    Returns:
        A :class:`CapacityDecision`; ties in priority go to the earlier (slot, token).

    Raises:
        TypeError, ValueError: naming the argument, for a wrong type, dtype or shape, an expert
            outside ``[0, num_experts)``, a NaN score, an unknown policy or a bad capacity. The
            value checks (expert range, NaN score) cost one host synchronisation together and
            are skipped while ``torch.compile`` traces.
    """
    if policy not in DROP_POLICIES:
        raise ValueError(f"unknown drop policy {policy!r}; choose one of {', '.join(DROP_POLICIES)}")
    capacity = check_capacity(capacity)
    if capacity is None:
        raise ValueError("capacity must be a non-negative integer, got None; pass the number of tokens for no limit")
    check_generator(generator)
    check_positive_int("num_experts", num_experts)
    expert = _index_tensor(expert, "expert")
    candidate = _mask_tensor(candidate, "candidate", expert.shape)
    if policy == "score":
        if score is None:
            raise ValueError("policy='score' needs score= [tokens, slots] priorities")
        if not isinstance(score, Tensor):
            raise TypeError(f"score must be a tensor [tokens, slots], got {type(score).__name__}")
        if score.shape != expert.shape or score.is_complex():
            raise ValueError(f"score must be a real tensor of the shape of expert [tokens, slots] = "
                             f"{tuple(expert.shape)}, got {score.dtype} of shape {tuple(score.shape)}")
    if expert.numel() and _checks_run():
        # One host sync for every value check: min and max of expert, and whether a score is NaN.
        flags = [expert.amin(), expert.amax()]
        if policy == "score" and score.is_floating_point():
            flags.append(torch.isnan(score).any().long())
        lo, hi, *nan = torch.stack(flags).tolist()
        if lo < 0 or hi >= num_experts:
            raise ValueError(f"expert must hold expert indices in [0, num_experts={num_experts}), got values "
                             f"from {lo} to {hi}")
        if nan and nan[0]:
            raise ValueError("score contains NaN; NaN priorities cannot be ranked (fix the router's gates)")
    n, s = expert.shape
    device = expert.device
    # Slot-major flattening: all first choices come before all second choices.
    flat_expert = expert.t().reshape(-1)
    flat_cand = candidate.t().reshape(-1)
    group = torch.where(flat_cand, flat_expert, torch.full_like(flat_expert, num_experts))
    if policy == "position":
        priority = -torch.arange(n * s, device=device, dtype=torch.float64)
    elif policy == "score":
        priority = score.detach().t().reshape(-1).to(torch.float64)
    else:
        priority = torch.rand(n * s, generator=generator, device=device, dtype=torch.float64)
    rank = rank_within_groups(group, priority, num_experts + 1)
    keep_flat = flat_cand & (rank < capacity)
    load = torch.bincount(group, minlength=num_experts + 1)[:num_experts]
    kept = torch.minimum(load, torch.as_tensor(capacity, device=device))
    n_z = load.to(torch.float32)
    factor = n_z / kept.clamp(min=1).to(torch.float32)
    skip_flat = torch.where(keep_flat, factor[flat_expert.clamp(max=num_experts - 1)], torch.zeros((), device=device))

    def unflat(t: Tensor) -> Tensor:
        return t.reshape(s, n).t()

    return CapacityDecision(
        keep=unflat(keep_flat),
        position=unflat(rank),
        load=load,
        kept=kept,
        skip_weight=unflat(skip_flat),
    )
