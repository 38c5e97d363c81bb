"""Expert capacity: how many (token, slot) pairs each expert may process, and who is dropped.

Every MoE layer enforces capacity here, in one place, for every router: a router proposes
slots (``Routes.keep`` marks its candidates), :func:`apply_capacity` keeps at most ``capacity``
candidates per expert and records the skip importance weight of Kool et al. (2021), eq. 3.
Balanced routers (BASE, Gumbel-Matching, batchwise) already respect the capacity, so nothing of
theirs is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .._checks import (
    check_capacity,
    check_capacity_factor,
    check_generator,
    check_positive_int,
    checks_run,
    expert_capacity,
    index_tensor,
    mask_tensor,
    random_tensor,
)
from ..assignment import rank_within_groups

__all__ = [
    "DROP_POLICIES",
    "CapacityDecision",
    "apply_capacity",
    "check_capacity",
    "check_capacity_factor",
    "expert_capacity",
    "random_ranks",
    "random_skip",
    "skip_correction",
]

#: How candidates compete for an expert's capacity.
#: ``position``: first slots before second slots, then earlier tokens first (Switch / GShard);
#: ``score``: larger combine weight first (batch-prioritised routing);
#: ``random``: uniformly at random (the skip estimator of Kool et al., for which eq. 3 is unbiased;
#: the rule is :func:`random_ranks`).
DROP_POLICIES: tuple[str, ...] = ("position", "score", "random")

# check_capacity, check_capacity_factor and expert_capacity (the capacity C of the MoE layer) are
# defined in routelab._checks, next to resolve_capacity (the capacity of a balanced problem), and
# re-exported here as part of routelab.routing.


def skip_correction(load: Tensor, capacity: int) -> Tensor:
    """The skip correction of Kool et al. (2021), eq. 3: ``n_z / min(n_z, C)`` (``0`` where ``n_z = 0``).

    Each expert ``z`` that ``n_z`` candidates chose keeps a uniformly random ``min(n_z, C)`` of
    them; weighting every kept one by this factor makes sums over the kept candidates unbiased
    estimates of the sums over all of them.

    Args:
        load: floating ``n_z`` (any shape), candidates that chose the expert before dropping.
        capacity: ``C >= 0`` (an int; at ``C = 0`` nothing is kept, and the factor of a kept pair is moot).

    Returns:
        The factor, of ``load``'s shape and dtype.

    Raises:
        ValueError: ``capacity`` is not an integer ``>= 0``.
    """
    if checks_run():  # (while torch.compile traces, a dynamic capacity is symbolic: checked by the caller)
        capacity = check_capacity(capacity)
        if capacity is None:
            raise ValueError("capacity must be an integer >= 0, got None (eq. 3 needs the expert's capacity C)")
    # max(min(n_z, C), 1) in one clamp: min(max(n_z, 1), max(C, 1)) is the same for every n_z >= 0
    return load / load.clamp(min=1, max=max(capacity, 1))


def random_ranks(group: Tensor, num_groups: int, generator: torch.Generator | None = None, *,
                 counts: Tensor | None = None) -> Tensor:
    """Rank of every item within its group in a uniformly random order: routelab's one random-drop rule.

    Every item draws one uniform priority ``u ~ U[0, 1)`` (float64, in item order, from
    ``generator``); within a group, items rank by increasing ``u`` (ties, of probability about
    ``1e-14``, to the earlier item): one stable sort of ``group + u``. Keeping the items of rank
    ``< C`` keeps a uniformly random subset of ``min(n_z, C)`` items of every group, the skipping
    of Kool et al. (2021), Sec. 2.1, used by :func:`apply_capacity` (``policy="random"``) and by
    the skipping estimators of :func:`routelab.estimators.sample_routes`.

    Args:
        group: ``[..., N]`` long group of every item, in ``[0, num_groups)``; independent rows.
        num_groups: the number of groups.
        generator: the only source of randomness.
        counts: ``[..., num_groups]`` long items per group, when the caller has them.

    Returns:
        ``[..., N]`` long rank of every item within its group (``0`` first).
    """
    n = group.shape[-1]
    u = random_tensor(torch.rand, group.shape, dtype=torch.float64, device=group.device, generator=generator)
    order = torch.argsort(group.to(torch.float64) + u, dim=-1, stable=True)
    if counts is None:
        counts = torch.zeros((*group.shape[:-1], num_groups), dtype=torch.long, device=group.device)
        counts.scatter_add_(-1, group, torch.ones_like(group))
    start = torch.cumsum(counts, -1) - counts
    rank_sorted = torch.arange(n, device=group.device) - start.gather(-1, group.gather(-1, order))
    return torch.empty_like(order).scatter_(-1, order, rank_sorted)


def random_skip(expert: Tensor, num_experts: int, capacity: int,
                generator: torch.Generator | None = None, *, check: bool = True) -> tuple[Tensor, Tensor]:
    """Every expert keeps at most ``capacity`` of its tokens, a uniformly random subset (:func:`random_ranks`).

    Args:
        expert: ``[..., n]`` long expert of every token (one choice per token), in ``[0, num_experts)``.
        num_experts: ``k``.
        capacity: ``C``.
        generator: the only source of randomness.
        check: check that every ``expert`` is in ``[0, num_experts)`` (one host synchronisation;
            skipped while ``torch.compile`` traces). A caller whose experts are in range by
            construction (a sampler) passes ``False``.

    Returns:
        ``(keep, load)``, both ``[..., n]``: ``keep`` bool, ``load`` long ``n_z``, the number of
        tokens that chose each token's expert before skipping (for :func:`skip_correction`).

    Raises:
        ValueError: a capacity that is not an integer ``>= 0``, ``num_experts < 1``, or (with
            ``check``) an expert out of range, naming the argument.
    """
    if checks_run():  # (while torch.compile traces, a dynamic capacity is symbolic: checked by the caller)
        capacity = check_capacity(capacity)
        if capacity is None:
            raise ValueError("capacity must be an integer >= 0, got None; pass the number of tokens for no limit")
        check_positive_int("num_experts", num_experts)
    if not isinstance(expert, Tensor) or expert.dim() == 0 or expert.dtype == torch.bool \
            or expert.is_floating_point() or expert.is_complex():
        got = f"{expert.dtype} of shape {tuple(expert.shape)}" if isinstance(expert, Tensor) else type(expert).__name__
        raise ValueError(f"expert must be an integer tensor [..., n] (one expert per token), got {got}")
    expert = expert.long()
    if check and expert.numel() and checks_run():
        lo, hi = torch.stack([expert.amin(), expert.amax()]).tolist()
        if lo < 0 or hi >= num_experts:
            raise ValueError(f"expert must hold expert indices in [0, num_experts={num_experts}), got values "
                             f"from {lo} to {hi}")
    counts = torch.zeros((*expert.shape[:-1], num_experts), dtype=torch.long, device=expert.device)
    counts.scatter_add_(-1, expert, torch.ones_like(expert))
    keep = random_ranks(expert, num_experts, generator, counts=counts) < capacity
    return keep, counts.gather(-1, expert)


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


def checked_pairs(expert: Tensor, candidate: Tensor, num_experts: int, *, check: bool = True,
                  score: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``(expert, candidate)`` of :func:`apply_capacity` checked (and ``expert`` read as long).

    The types, dtypes and shapes always (TypeError/ValueError naming the argument, as
    :func:`apply_capacity` documents); with ``check``, also the values in one host sync (skipped
    while ``torch.compile`` traces): every expert in ``[0, num_experts)``, and no NaN in ``score``
    (the priorities of ``policy="score"``, given only for that policy).
    """
    check_positive_int("num_experts", num_experts)
    expert = index_tensor(expert, "expert")
    candidate = mask_tensor(candidate, "candidate", expert.shape)
    if score is not None:
        if not isinstance(score, Tensor):
            raise TypeError(f"score must be a tensor [tokens, slots], got {type(score).__name__}")
        if score.shape != expert.shape or score.is_complex():
            raise ValueError(f"score must be a real tensor of the shape of expert [tokens, slots] = "
                             f"{tuple(expert.shape)}, got {score.dtype} of shape {tuple(score.shape)}")
    if check and expert.numel() and checks_run():
        # One host sync for every value check: min and max of expert, and whether a score is NaN.
        flags = [expert.amin(), expert.amax()]
        if score is not None and score.is_floating_point():
            flags.append(torch.isnan(score).any().long())
        lo, hi, *nan = torch.stack(flags).tolist()
        if lo < 0 or hi >= num_experts:
            raise ValueError(f"expert must hold expert indices in [0, num_experts={num_experts}), got values "
                             f"from {lo} to {hi}")
        if nan and nan[0]:
            raise ValueError("score contains NaN; NaN priorities cannot be ranked (fix the router's gates)")
    return expert, candidate


def apply_capacity(
    expert: Tensor,
    candidate: Tensor,
    capacity: int,
    num_experts: int,
    *,
    policy: str = "position",
    score: Tensor | None = None,
    generator: torch.Generator | None = None,
    check: bool = True,
) -> CapacityDecision:
    """Keep at most ``capacity`` candidate pairs per expert.

    Args:
        expert: ``LongTensor [tokens, slots]`` chosen expert of every slot, each in
            ``[0, num_experts)`` (any integer dtype is accepted and read as long).
        candidate: ``BoolTensor [tokens, slots]`` the router's own selection (False: the slot is
            not used at all, e.g. outside a batchwise mask).
        capacity: ``C >= 0`` pairs per expert (an integer; ValueError otherwise). ``C >= tokens *
            slots`` drops nothing (dropless: pass ``expert.numel()``), in fewer operations.
        num_experts: ``E``, an integer ``>= 1``.
        policy: one of :data:`DROP_POLICIES`.
        score: ``[tokens, slots]`` priority for ``policy="score"`` (larger kept first; no NaN).
        generator: randomness for ``policy="random"`` (no draw where ``C >= tokens * slots``:
            nothing can drop there, and the pairs take the ``"position"`` order).
        check: check the values (expert range, NaN scores; one host synchronisation). ``False``
            is for callers whose experts are valid by construction (the MoE layer with a router
            whose ``check_finite`` is off); an expert outside the range then fails inside an
            index operation instead of with this function's message.

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
    if policy == "score" and score is None:
        raise ValueError("policy='score' needs score= [tokens, slots] priorities")
    expert, candidate = checked_pairs(expert, candidate, num_experts, check=check,
                                      score=score if policy == "score" else None)
    n, s = expert.shape
    device = expert.device
    # Slot-major flattening: all first choices come before all second choices.
    flat_expert = expert.t().reshape(-1)
    flat_cand = candidate.t().reshape(-1)
    group = torch.where(flat_cand, flat_expert, num_experts)
    # Counts by scatter-add, not bincount: a static shape, so torch.compile traces it.
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device)
    counts.scatter_add_(0, group, torch.ones_like(group))
    if policy == "random" and capacity < n * s:
        rank = random_ranks(group, num_experts + 1, generator, counts=counts)
    elif policy in ("position", "random"):  # the slot-major item order itself: one stable sort of the groups
        # (random where nothing can drop: who stays does not depend on the order, so no draw is
        # made and the generator's stream is left as it was)
        rank = rank_within_groups(group, None, num_experts + 1, counts=counts)
    else:
        priority = score.detach().t().reshape(-1).to(torch.float64)
        rank = rank_within_groups(group, priority, num_experts + 1, counts=counts)
    load = counts[:num_experts]
    if capacity >= n * s:
        # No expert can be proposed more than the n * s pairs: nothing drops and every skip
        # factor is 1. The values of the general case below, in one operation instead of nine
        # (the dropless layers' case, whose caller passes n * s).
        keep_flat = flat_cand
        kept = load
        skip_flat = flat_cand.to(torch.float32)
    else:
        keep_flat = flat_cand & (rank < capacity)
        kept = load.clamp(max=capacity)  # (a Python bound: no host-to-device copy, no sync)
        # The factor of every group, the non-candidates' group E included (their keep is False,
        # so it is multiplied by 0): one gather by the group, no clamp of the index.
        factor = skip_correction(counts.to(torch.float32), capacity)
        skip_flat = factor[group] * keep_flat

    def unflat(t: Tensor) -> Tensor:
        return t.reshape(s, n).t()

    return CapacityDecision(
        keep=unflat(keep_flat),
        position=unflat(rank),
        load=load,
        kept=kept,
        skip_weight=unflat(skip_flat),
    )
