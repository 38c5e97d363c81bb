"""The b-matching solver's tables: who holds what, and the move costs (speed machinery).

The state of a b-matching of ``n`` tokens with ``k`` slots each over ``E`` experts is kept in
three tables that every cancelling round updates in place (no Python loop over tokens):

* ``holder`` ``[B, E, C]``: the tokens of every expert, one per slot, ``n`` in an empty slot;
* ``open`` ``[B, n + 1, E]``: ``s[i, j]`` where token ``i`` does *not* hold ``j`` and ``-inf``
  where it does (row ``n``, the stand-in for empty slots, is all ``-inf``): the scores a token
  can still move to;
* ``counts`` ``[B, E]``: the load of every expert.

The move cost of the token in slot ``(a, t)`` to expert ``b`` is ``s[i, a] - open[i, b]``:
finite exactly when ``i`` holds ``a`` and not ``b`` (:func:`move_table`), so the expert graph's
move arc ``a -> b`` is a minimum over the ``C`` slots of ``a``: ``E C E = O(k n E)`` work for the
whole graph, the size of the scores times ``k``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._cycles import cycle_units
from ._graph import release_unit_costs

__all__ = ["BTables", "move_table", "push_along_cycles", "tables_from_held"]


class BTables:
    """The mutable state of one batch of b-matchings (see the module docstring).

    Attributes:
        scores: ``[B, n + 1, E]`` finite scores, row ``n`` at ``+inf`` (an empty slot's own score).
        open: ``[B, n + 1, E]`` scores still open to each token (``-inf`` where it holds the expert).
        holder: ``[B, E, C]`` long token per expert slot, ``n`` when empty.
        counts: ``[B, E]`` long load of every expert.
    """

    def __init__(self, scores: Tensor, open_: Tensor, holder: Tensor, counts: Tensor) -> None:
        self.scores, self.open, self.holder, self.counts = scores, open_, holder, counts

    @property
    def held(self) -> Tensor:
        """``[B, n, E]`` bool: which experts every token holds."""
        return torch.isneginf(self.open[:, :-1])


def tables_from_held(S: Tensor, held: Tensor, slots: int) -> BTables:
    """The tables of the b-matching ``held`` (any loads up to ``slots`` per expert).

    Args:
        S: ``[B, n, E]`` finite scores.
        held: ``[B, n, E]`` bool, the pairs of the matching.
        slots: ``C``, at least the largest load.
    """
    B, n, E = S.shape
    dev = S.device
    scores = torch.cat([S, torch.full((B, 1, E), float("inf"), dtype=S.dtype, device=dev)], dim=1)
    open_ = torch.cat([S.masked_fill(held, float("-inf")),
                       torch.full((B, 1, E), float("-inf"), dtype=S.dtype, device=dev)], dim=1)
    counts = held.sum(1)
    b, e, i = held.transpose(1, 2).nonzero(as_tuple=True)  # sorted by (instance, expert, token)
    start = (torch.cumsum(counts.view(-1), 0) - counts.view(-1))[b * E + e]
    rank = torch.arange(b.numel(), device=dev) - start
    holder = torch.full((B * E * slots,), n, dtype=torch.long, device=dev)
    holder[(b * E + e) * slots + rank] = i
    return BTables(scores, open_, holder.view(B, E, slots), counts)


def move_table(t: BTables) -> tuple[Tensor, Tensor]:
    """Per-slot move costs and the move arcs of the expert graph.

    Returns:
        ``(move, move_arc)``: ``move`` ``[B, E, C, E]`` the cost ``s[i, a] - s[i, b]`` of moving
        the token ``i`` in slot ``(a, t)`` to ``b`` (``+inf`` if ``i`` holds ``b``, the diagonal
        included, or the slot is empty); ``move_arc`` ``[B, E, E]`` float64, its minimum over
        the slots (``+inf``: no token of ``a`` can move to ``b``).
    """
    B, n1, E = t.open.shape
    C = t.holder.shape[-1]
    base = (torch.arange(B, device=t.holder.device) * n1).view(B, 1, 1)
    flat = (t.holder + base).view(-1)
    rows = t.open.view(-1, E).index_select(0, flat).view(B, E, C, E)
    expert = torch.arange(E, device=flat.device).view(1, E, 1)
    own = t.scores.view(-1).index_select(0, ((t.holder + base) * E + expert).view(-1)).view(B, E, C, 1)  # s[i, a]
    move = torch.sub(own, rows, out=rows)
    return move, move.amin(dim=2).to(torch.float64)


def push_along_cycles(t: BTables, move: Tensor, inst: Tensor, u: Tensor, v: Tensor, cycle: Tensor,
                      release: Tensor, tol: Tensor, lo: int, hi: int, big: Tensor) -> None:
    """Cancel node-disjoint negative cycles as many times as each stays negative (in place;
    :func:`._cycles.cycle_units` picks the tokens).

    Every unit moves one token along each move arc; a release arc ``a -> b`` moves none: each
    unit ends a chain in ``a`` (its token takes a free slot of ``a``) and starts one at ``b``
    (whose leaving token's slot stays free), so ``a``'s load rises and ``b``'s falls by the
    cycle's units, within the quotas and the free slots of the tables. A token moving along two
    arcs ``a -> b`` and ``c -> d`` of one round has ``a != c``, ``b != d`` and, as it holds
    ``a`` and not ``d``, ``a != d``: it ends with ``k`` distinct experts again.

    Args:
        t: the tables (updated).
        move: ``[B, E, C, E]`` the move costs of :func:`move_table` for the current tables.
        inst, u, v: ``[r]`` long, the arcs of the cycles (every node of a cycle once as ``u``).
        cycle: ``[r]`` long, the cycle of every arc (:func:`._cycles.cycle_ids`).
        release: ``[r]`` bool, the release arcs.
        tol: ``[B, 1]`` the threshold below which a unit's cost counts as negative.
        lo, hi: the quotas; big: ``[B]`` the release reward (:func:`._graph.release_weight`).
    """
    B, E, C = t.holder.shape
    n = t.open.shape[1] - 1
    costs = release_unit_costs(t.counts, inst[release], u[release], v[release], hi, big, C, lower=lo, room=C)
    arc, slot_a, slot_b, rank = cycle_units(move, inst, u, v, cycle, tol, release, costs)
    i, a, b = inst[arc], u[arc], v[arc]
    absorbed = (slot_b < 0).nonzero(as_tuple=True)[0]  # b's out-arc is a release arc: a free slot of b
    if absorbed.numel():
        ia, ba = i[absorbed], b[absorbed]
        free_first = torch.argsort((t.holder[ia, ba] != n).to(torch.uint8), dim=-1, stable=True)  # [m, C]
        slot_b[absorbed] = free_first.gather(-1, rank[absorbed].unsqueeze(-1)).squeeze(-1)
    token = t.holder[i, a, slot_a]
    t.holder[i, a, slot_a] = n
    t.holder[i, b, slot_b] = token
    t.open[i, token, a] = t.scores[i, token, a]
    t.open[i, token, b] = float("-inf")
    t.counts.index_put_((i, a), torch.full_like(a, -1), accumulate=True)
    t.counts.index_put_((i, b), torch.ones_like(b), accumulate=True)
