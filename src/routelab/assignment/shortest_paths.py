"""Shortest paths and negative cycles on small dense graphs, batched.

The graphs here are the *expert graphs* of the balanced assignment solver (:mod:`._graph`):
``m = k`` nodes, one per expert (the sink node of the classic construction is contracted into
the release arcs), a dense ``[..., m, m]`` matrix of arc costs with ``+inf`` for missing arcs.
All functions are batched over leading dimensions and run on any device.
"""

from __future__ import annotations

import torch
from torch import Tensor


def floyd_warshall(cost: Tensor) -> Tensor:
    """All-pairs shortest path distances of a graph without negative cycles.

    Args:
        cost: ``[..., m, m]`` arc costs, ``+inf`` where there is no arc. The diagonal is
            treated as 0 (the empty path).

    Returns:
        ``[..., m, m]`` distances ``d[a, b]`` of the cheapest path from ``a`` to ``b``
        (``+inf`` if ``b`` is unreachable from ``a``).

    ``m`` sequential steps of ``O(m^2)`` vectorised work each (``O(m^3)`` in total), in place in
    one result and one scratch tensor: a fresh ``m x m`` pair per step made ``m = 2048`` take 81 s
    instead of 9 (a review measurement, this project's CPU). In place is exact: step ``via`` leaves
    row and column ``via`` unchanged (``d[via, via] = 0``). Not differentiable.
    """
    m = cost.shape[-1]
    d = cost.detach().clone()
    d.diagonal(dim1=-2, dim2=-1).clamp_(max=0.0)
    through = torch.empty_like(d)
    for via in range(m):
        torch.add(d[..., :, via : via + 1], d[..., via : via + 1, :], out=through)
        torch.minimum(d, through, out=d)
    return d


def relax(dist: Tensor, cost: Tensor) -> tuple[Tensor, Tensor]:
    """One Bellman-Ford round for all nodes at once.

    Args:
        dist: ``[..., m]`` current distance labels.
        cost: ``[..., m, m]`` arc costs.

    Returns:
        ``(cand, arg)``, both ``[..., m]``: the best label ``min_a dist[a] + cost[a, b]`` reachable
        through one more arc, and the predecessor ``a`` achieving it.
    """
    cand, arg = (dist.unsqueeze(-1) + cost).min(dim=-2)
    return cand, arg


def functional_graph_cycles(succ: Tensor) -> Tensor:
    """Nodes that lie on a cycle of a functional graph.

    Args:
        succ: ``[..., m]`` long, ``succ[v]`` is the unique successor of ``v`` (use ``v`` itself
            for "no successor": a self-loop, which callers should ignore).

    Returns:
        ``[..., m]`` bool, True for nodes on a cycle (self-loops included).

    After ``m`` steps every walk has entered its terminal cycle, and walking ``m`` steps is a
    bijection on each cycle, so the nodes reached after ``m`` steps are exactly the cycle nodes.
    Pointer doubling makes this ``ceil(log2 m)`` gathers.
    """
    m = succ.shape[-1]
    jump = succ
    steps = 1
    while steps < m:
        jump = jump.gather(-1, jump)
        steps *= 2
    on_cycle = torch.zeros(succ.shape, dtype=torch.bool, device=succ.device)
    on_cycle.scatter_(-1, jump, True)
    return on_cycle
