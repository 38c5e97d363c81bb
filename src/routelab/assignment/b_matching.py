"""Exact balanced b-matching: ``k`` distinct experts per token, balanced loads (BASE with top-k).

Problem: given scores ``s[i, j]`` of ``n`` tokens for ``E`` experts and ``k <= E`` slots per token,

    maximise  sum_ij s[i, j] x[i, j]   subject to   x[i, j] in {0, 1},
              sum_j x[i, j] = k  for every token i,      lo <= sum_i x[i, j] <= hi  for every expert j,

with the quotas ``lo = floor(k n / E)``, ``hi = ceil(k n / E)`` (every expert takes ``k n / E``
pairs when ``E`` divides ``k n``, else ``floor`` or ``ceil`` of it, whichever maximises the
score) or, with an explicit ``capacity``, ``lo = 0``, ``hi = capacity`` (as in
:func:`~routelab.assignment.balanced_assignment`). It is a min-cost flow (source -> token, ``k``
units; token -> expert, one unit at cost ``-s``; expert -> sink within ``[lo, hi]``), so the LP
relaxation is integral and the solution is exact.

Algorithm (App. D.2 of Kool et al. 2021 for ``k = 1``, generalised to ``k`` slots and two-sided
quotas):

1. **Start.** Every token takes its ``k`` best experts under expert prices ``u``,
   ``top-k_j s[i, j] - u_j`` (:func:`._b_start.start_b_matching`, a few steps on the dual;
   ties spread over the experts); the loads may leave the
   quotas.
2. **Expert graph** on the ``E`` experts. The *move* arc ``a -> b`` costs
   ``min { s[i, a] - s[i, b] : i holds a and not b }``, the cheapest way to move one (token,
   expert) pair from ``a`` to ``b``. The *release* arc ``a -> b`` (``a`` below ``hi``, ``b``
   above ``lo``) ends a chain of moves in ``a`` and starts one at ``b``: it costs 0, minus a
   large ``M`` for each of ``a`` below ``lo`` and ``b`` above ``hi`` (the sink node of the flow
   contracted away; the ``-M`` makes repairing the quotas come first). The b-matching is within
   the quotas and optimal iff this graph has no negative cycle (min-cost-flow optimality). An
   out-of-quota start always has one: if ``a`` is below ``lo`` some ``c`` is above it, holds a
   token ``a`` does not, and ``a -> c -> a`` costs less than ``-M + spread``.
3. **Cycle cancelling.** Bellman-Ford from a virtual source finds node-disjoint negative cycles
   (:func:`._cycles.find_negative_cycles`, shared with ``k = 1``), and every cycle is cancelled
   as many times as it stays negative, the ``t``-th time with every move arc's ``t``-th
   cheapest token and every release arc's ``t``-th unit of load (:func:`._cycles.cycle_units`,
   :func:`._b_tables.push_along_cycles`: a token on two arcs of the round still ends with ``k``
   distinct experts). Repeat until Bellman-Ford converges.

For ``k > E / 2`` the complement is solved instead: the ``E - k`` experts every token does *not*
take, at scores ``-s`` and loads within ``[n - hi, n - lo]`` (the same problem; the move table
has ``(E - k) n E`` entries instead of ``k n E``).

Forbidden pairs (``-inf`` scores) get a finite penalty: if the optimum still uses one, no
feasible b-matching exists and a ``ValueError`` is raised. The scores are first row-shifted and
scaled by a power of two (:mod:`._normalise`; a row shift changes every solution's value by the
same ``k m_i``), so any magnitude is safe.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._checks import check_k, check_plain_tensor, check_score_matrix, resolve_capacity
from ._b_start import repair_quotas, start_b_matching
from ._b_tables import move_table, push_along_cycles, tables_from_held
from ._cycles import cycle_ids, cycle_tolerance, find_negative_cycles, phase_tolerance
from ._graph import release_arcs, release_weight
from ._normalise import compute_dtype, normalise_scores
from .balanced import _working_scores

__all__ = ["b_matching_quotas", "balanced_b_matching"]


def b_matching_quotas(n: int, num_experts: int, k: int, capacity: int | None = None) -> tuple[int, int]:
    """The load bounds ``(lo, hi)`` of every expert in a b-matching of ``n`` tokens, ``k`` slots each.

    ``capacity=None``: ``(floor(k n / E), ceil(k n / E))``. Else ``(0, min(capacity, n))``, and
    ``capacity`` must hold every pair: ``capacity * E >= k n`` (a ValueError naming ``capacity``).
    """
    pairs = k * n
    if capacity is None:
        return pairs // num_experts, -(-pairs // num_experts)
    need = -(-pairs // num_experts)
    c = resolve_capacity(pairs, num_experts, capacity, fix=f"use capacity >= ceil(k*n/E) = {need}",
                         counts=("(token, expert) pairs", f"k*n={k}*{n}={pairs}", f"E={num_experts}"))
    return 0, min(c, n)


def balanced_b_matching(scores: Tensor, k: int, capacity: int | None = None, *, name: str = "scores") -> Tensor:
    """The exact maximiser of the total score with ``k`` distinct experts per token, balanced loads.

    Every token gets ``k`` distinct experts; every expert gets ``k n / E`` (token, expert) pairs
    (``floor`` or ``ceil`` of it when ``E`` does not divide ``k n``, whichever scores more), or
    at most ``capacity`` pairs when it is given; the total score ``sum`` over the chosen pairs is
    maximal (module docstring: the problem and the algorithm). ``k = 1`` is the balanced
    assignment of :func:`~routelab.assignment.balanced_assignment` with floor/ceil quotas.

    **Exact** means: no other feasible b-matching beats it by more than the rounding of the
    scores' dtype relative to their spread, ``k n (E + 1) 4 eps max_i (max_j s_ij - min_j s_ij)``,
    at any magnitude and under any common or per-token offset. float16 and bfloat16 scores are
    solved in float32 (converted exactly). **Ties**: among equally good b-matchings one is
    returned deterministically (no random draw: the same scores in the same dtype give the same
    answer); which one is unspecified, and the same values in float32 and float64 may break a
    tie differently. **Complexity**: every cancelling round costs ``O(k n E)`` (the move table)
    plus ``O(E^3)`` (Bellman-Ford); the number of rounds depends on how close the start's prices
    are (a few to a few tens for random scores; the loop is bounded and raises if exceeded).

    Args:
        scores: ``[..., n, E]`` floating scores of ``n`` tokens for ``E`` experts, batched over the
            leading dimensions (which may be empty). ``-inf`` marks a forbidden (token, expert) pair.
        k: experts per token, ``1 <= k <= E``.
        capacity: optional upper bound on every expert's load (then no lower bound);
            ``capacity * E >= k n``.
        name: the argument's name in error messages.

    Returns:
        ``[..., n, k]`` long tensor: every token's ``k`` distinct experts, by descending score
        (equal scores by increasing expert index).

    Raises:
        ValueError: NaN or +inf scores, fewer than two dimensions, ``k`` not in ``[1, E]``,
            ``capacity * E < k n``, or ``-inf`` entries that leave no feasible b-matching.
    """
    check_score_matrix(scores, name)
    check_plain_tensor(scores, name, "the balanced b-matching solver")
    n, E = scores.shape[-2], scores.shape[-1]
    check_k(k, E)
    lo, hi = b_matching_quotas(n, E, k, capacity)
    flat = scores.detach().reshape(-1, n, E)
    B, dev = flat.shape[0], scores.device
    if B == 0:
        return torch.zeros((*scores.shape[:-1], k), dtype=torch.long, device=dev)
    original = flat.to(compute_dtype(scores.dtype))
    if k == E:  # every token takes every expert: the only b-matching
        held = torch.ones(original.shape, dtype=torch.bool, device=dev)
    else:
        normalised, _ = normalise_scores(original)
        S, forbidden, scale = _working_scores(normalised, pairs=k * n)
        with torch.inference_mode():
            if 2 * k > E:  # the complement: the E - k experts a token does not take (a smaller table)
                held = ~_solve(torch.neg(S), E - k, n - hi, n - lo, scale, forbidden, complement=True)
            else:
                held = _solve(S, k, lo, hi, scale, forbidden)
        held = held.clone()  # a normal tensor (not an inference tensor) from here on
        if forbidden is not None:
            used = (forbidden & held).flatten(1).any(-1)
            if bool(used.any()):
                raise ValueError(
                    f"{name}: the -inf (forbidden) entries leave no feasible b-matching with k={k} experts per "
                    f"token and loads in [{lo}, {hi}] (batch instance(s) {used.nonzero().flatten().tolist()[:5]}): "
                    f"some set of tokens is allowed on too few experts. Allow more (token, expert) pairs"
                    + (" or raise the capacity" if capacity is not None else "")
                )
    if bool(torch.isneginf(original.masked_fill(~held, 0.0)).any()):  # k == E with a -inf entry
        raise ValueError(f"{name}: with k={k} = E every token takes every expert, but some pairs are -inf (forbidden)")
    key = original.masked_fill(~held, float("-inf"))
    order = torch.argsort(key, dim=-1, descending=True, stable=True)[..., :k]
    return order.view(*scores.shape[:-1], k)


def _solve(S: Tensor, k: int, lo: int, hi: int, scale: Tensor, forbidden: Tensor | None = None, *,
           complement: bool = False) -> Tensor:
    """``[B, n, E]`` bool optimal pairs for the finite normalised scores ``S`` (steps 1-3), any
    quotas ``0 <= lo <= hi <= n`` with ``E lo <= k n <= E hi``.

    ``forbidden``: ``[B, n, E]`` bool, the pairs whose score is a forbidden pair's penalty
    (:func:`.balanced._working_scores`), or None; ``complement``: ``S`` is the complement's, whose
    held pairs are the ones *not* taken (a forbidden pair is then in use where it is not held).
    While an instance uses one, its cycles are judged at the rounding of the penalty's magnitude
    (:func:`._cycles.phase_tolerance`)."""
    B, n, E = S.shape
    dev = S.device
    # 1. start: the k best experts of every token under approximate prices
    prices, held = start_b_matching(S, k, lo, hi)
    held = repair_quotas(S, held, lo, hi, max_rounds=4 * E + 16)  # bulk moves into the quotas (greedy)
    slots = _slots(int(held.sum(1).max()), hi)
    t = tables_from_held(S, held, slots)
    # 2.-3. cancel negative cycles of the expert graph until there is none
    exact = cycle_tolerance(scale, E).to(torch.float64)
    limit = (2 * (E + 1) * scale).to(torch.float64).unsqueeze(-1)  # a finite label: E + 1 arcs of size 2 scale
    coarse = cycle_tolerance(S.abs().amax(dim=(-2, -1)), E).to(torch.float64) if forbidden is not None else None
    big = release_weight(S)
    running = torch.ones(B, dtype=torch.bool, device=dev)
    dist = -prices.to(torch.float64)
    max_rounds = 10 * k * n * E + 100  # every round strictly improves; this only guards against bugs
    for _ in range(max_rounds):
        most = int(t.counts.max())
        if most >= slots and slots < hi:  # an expert fills its slots: make room (a round fills free slots only)
            slots = _slots(most, hi)
            t = tables_from_held(S, t.held, slots)
        move, move_arc = move_table(t)
        arc = torch.minimum(move_arc, release_arcs(t.counts, hi, big, lower=lo))
        in_use = None if forbidden is None else ((~t.held if complement else t.held) & forbidden).flatten(1).any(-1)
        tol, dist = phase_tolerance(exact, coarse, in_use, dist, limit)
        optimal, cycle_nodes, pred, dist = find_negative_cycles(arc, tol, running, dist)
        running &= ~optimal
        if not bool(running.any()):
            if bool(((t.counts < lo) | (t.counts > hi)).any()):
                raise RuntimeError("balanced_b_matching: a load outside its quota without a negative cycle")
            return t.held
        inst, v = cycle_nodes.nonzero(as_tuple=True)
        u = pred[inst, v]
        release = move_arc[inst, u, v] > arc[inst, u, v]  # release arcs move nothing
        # Every cycle is pushed as many units as stay negative, within the quotas and the tables.
        push_along_cycles(t, move, inst, u, v, cycle_ids(pred, inst, v, E), release, tol, lo, hi, big)
    raise RuntimeError("balanced_b_matching: cycle cancelling did not terminate; please report this input")


def _slots(most: int, hi: int) -> int:
    """Slots per expert in the tables: room above the largest load ``most`` (up to ``hi``), so
    that a loose capacity (``hi`` up to ``n``) does not make every table ``n`` slots wide."""
    return most if most >= hi else min(hi, most + max(4, most // 4))
