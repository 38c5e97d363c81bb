"""The expert graph of an assignment (Kool et al. 2021, App. D.2).

Nodes are the ``k`` experts. The *move* arc ``a -> b`` costs ``min_{i: z_i = a} s[i, a] - s[i, b]``,
the cheapest way to move one token from ``a`` to ``b``. The *release* arc ``a -> b`` (an expert ``a``
with a free slot, a non-empty ``b``) stands for ending a chain of moves in ``a``'s free slot and
starting one at ``b``: it costs 0, and ``-M`` (:func:`release_weight`) when ``b`` holds more than ``c``
tokens, so that shedding overflow comes first. An arc costs the cheaper of the two. (This is the
classic graph with a sink node ``T``, ``a -> T -> b``, with ``T`` contracted.) The assignment is
feasible and optimal iff the graph has no negative cycle.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._workspace import SCORES_A, scratch

__all__ = ["expert_graph", "move_arcs", "move_costs", "release_arcs", "release_unit_costs", "release_weight"]


def move_costs(
    S: Tensor,
    holder: Tensor,
    inst: Tensor | None = None,
    experts: Tensor | None = None,
    out: Tensor | None = None,
) -> Tensor:
    """Cost ``s[i, a] - s[i, b]`` of moving the token in slot ``(a, t)`` to expert ``b``.

    Args:
        S: ``[B, n, k]`` scores.
        holder: ``[B, k, c]`` token ids per slot (``n`` for an empty slot).
        inst, experts: optional ``[r]`` (instance, expert) pairs to compute only those rows.
        out: optional buffer with as many elements as the result.

    Returns:
        ``[B, k, c, k]`` (or ``[r, c, k]`` for selected rows); empty slots cost ``+inf``.
    """
    B, n, k = S.shape
    c = holder.shape[-1]
    if inst is None:
        inst = torch.arange(B, device=S.device).repeat_interleave(k)
        experts = torch.arange(k, device=S.device).repeat(B)
        shape = (B, k, c, k)
    else:
        shape = (inst.numel(), c, k)
    tokens = holder[inst, experts]  # [r, c]
    flat = (inst.unsqueeze(-1) * n + tokens.clamp(max=n - 1)).view(-1)
    if out is not None:
        out = out.view(flat.numel(), k)
    rows = torch.index_select(S.reshape(B * n, k), 0, flat, out=out).view(-1, c, k)  # [r, c, k]
    own = rows.gather(-1, experts.view(-1, 1, 1).expand(-1, c, 1))  # [r, c, 1]: s[i, a]
    # An empty slot moves nothing: +inf (set, not added: the stand-in row may hold -inf).
    own.masked_fill_((tokens >= n).unsqueeze(-1), float("inf"))
    return torch.sub(own, rows, out=rows).view(shape)


def move_arcs(S: Tensor, z: Tensor) -> Tensor:
    """``[B, k, k]`` float64 move arcs of an assignment without slot tables.

    ``a -> b`` costs ``min_{i: z_i = a} s[i, a] - s[i, b]`` (one segmented minimum over all
    tokens); ``+inf`` when ``a`` holds no token and on the diagonal. The same numbers as the
    per-slot table of :func:`expert_graph` reduces to.

    Args:
        S: ``[B, n, k]`` finite scores.
        z: ``[B, n]`` expert of every token.
    """
    B, n, k = S.shape
    moves = torch.sub(S.gather(-1, z.unsqueeze(-1)), S, out=scratch(SCORES_A, S.shape, S.dtype, S.device))
    arcs = torch.full((B, k, k), float("inf"), dtype=S.dtype, device=S.device)
    arcs.scatter_reduce_(1, z.unsqueeze(-1).expand(B, n, k), moves, "amin")
    arcs = arcs.to(torch.float64)
    arcs.diagonal(dim1=-2, dim2=-1).fill_(float("inf"))
    return arcs


def release_arcs(counts: Tensor, c: int, big: Tensor, lower: int = 0) -> Tensor:
    """``[B, k, k]`` costs of the release arcs (the sink node contracted away).

    ``a -> b`` exists when ``a`` has a free slot (fewer than ``c`` tokens) and ``b`` holds more
    than ``lower`` tokens: ``a`` absorbs one token, ``b`` sends one without receiving. It costs 0,
    minus ``big`` when ``b`` is over capacity and minus ``big`` when ``a`` is under ``lower``
    (the convex penalty of an out-of-bounds load, so that repairing it comes first); ``+inf``
    otherwise and on the diagonal. ``lower = 0`` is the capacity-only graph of App. D.2.
    """
    B, k = counts.shape
    room = (counts < c).unsqueeze(-1)
    zero = torch.zeros((), dtype=big.dtype, device=big.device)
    cost = torch.where(counts > c, -big.view(B, 1), zero)
    cost = torch.where(counts > lower, cost, torch.full((), float("inf"), dtype=big.dtype, device=big.device))
    arcs = torch.where(room, cost.unsqueeze(-2), torch.full((), float("inf"), dtype=big.dtype, device=big.device))
    if lower > 0:
        arcs = arcs - torch.where(counts < lower, big.view(B, 1), zero).unsqueeze(-1)
    arcs.diagonal(dim1=-2, dim2=-1).fill_(float("inf"))
    return arcs


def release_unit_costs(counts: Tensor, inst: Tensor, a: Tensor, b: Tensor, c: int, big: Tensor, units: int,
                       lower: int = 0, room: int | None = None) -> Tensor:
    """``[r, units]`` float64: the cost of the ``t``-th unit through each release arc ``a -> b``.

    After ``t`` units ``a`` holds ``t`` more tokens and ``b`` ``t`` fewer; the ``t``-th unit is
    priced as :func:`release_arcs` prices the arc at those loads (``0``, ``-big`` for ``b`` above
    ``c``, ``-big`` for ``a`` below ``lower``), and is ``+inf`` once ``a`` reaches ``c`` (or
    ``room``, the slots of a table) or ``b`` reaches ``lower``. The costs rise with ``t``.

    Args:
        counts: ``[B, E]`` loads now.
        inst, a, b: ``[r]`` long, the instance and the arc of every release arc.
        c, lower: the quotas; ``room``: optional extra bound on ``a``'s load.
        big: ``[B]`` release reward (:func:`release_weight`).
        units: the number of units to price.
    """
    t = torch.arange(units, device=counts.device)
    load_a = counts[inst, a].unsqueeze(-1) + t  # [r, units] before the t-th unit
    load_b = counts[inst, b].unsqueeze(-1) - t
    reward = big.to(torch.float64)[inst].unsqueeze(-1)
    cost = -reward * (load_b > c) - reward * (load_a < lower)
    full = c if room is None else min(c, room)
    return cost.masked_fill((load_a >= full) | (load_b <= lower), float("inf"))


def release_weight(S: Tensor) -> Tensor:
    """``[B]`` a release reward larger than any chain of moves can cost (float64).

    A chain of at most ``k`` moves costs less than ``k * spread``; the floor keeps the reward
    positive (and above the rounding tolerance) when all scores are equal.
    """
    k = S.shape[-1]
    hi, lo = S.amax(dim=(-2, -1)).to(torch.float64), S.amin(dim=(-2, -1)).to(torch.float64)
    floor = torch.maximum(hi.abs(), lo.abs()) * 1e-3 + torch.finfo(torch.float64).tiny
    return 4.0 * (k + 1) * (hi - lo) + floor


def expert_graph(
    S: Tensor, holder: Tensor, counts: Tensor, c: int, big: Tensor | None = None, out: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Arc costs of the expert graph for the assignment described by ``holder``.

    Args:
        S: ``[B, n, k]`` scores (``-inf`` makes moves onto that expert impossible).
        holder: ``[B, k, C]`` token ids per expert slot (``n`` for an empty slot).
        counts: ``[B, k]`` tokens per expert.
        c: capacity.
        big: ``[B]`` release reward for over-full experts (default from :func:`release_weight`).
        out: optional ``[B, k, C, k]`` buffer for ``move``.

    Returns:
        ``(arc, move_arc, move)`` in float64 except ``move``: ``arc`` ``[B, k, k]`` the graph (the
        cheaper of the move and the release arc), ``move_arc`` ``[B, k, k]`` the move arcs alone
        (``+inf`` on the diagonal) and ``move`` ``[B, k, C, k]`` the per-slot move costs.
    """
    B, n, k = S.shape
    move = move_costs(S, holder, out=out)
    move_arc = move.amin(dim=2).to(torch.float64)
    move_arc.diagonal(dim1=-2, dim2=-1).fill_(float("inf"))
    if big is None:
        big = release_weight(S.masked_fill(torch.isinf(S), 0.0))
    return torch.minimum(move_arc, release_arcs(counts, c, big)), move_arc, move
