"""Cycle cancelling on the expert graph until no negative cycle is left (Kool et al. 2021, App. D.2).

Bellman-Ford from a virtual source; a cycle in its predecessor graph is a negative cycle.
Node-disjoint negative cycles are collected for a few more sweeps and all cancelled at once (one
token moves along each move arc; a cycle of move arcs alone as many times as it stays negative,
:func:`cycle_units`); the touched experts' rows of the graph are refreshed incrementally. When
Bellman-Ford converges, there is no negative cycle: the assignment is optimal (the certificate, up
to the rounding guard of :func:`cycle_tolerance`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._graph import expert_graph, move_arcs, move_costs, release_arcs, release_weight
from ._groups import slot_table
from ._tuning import TUNING
from ._workspace import SCORES_A, scratch
from .shortest_paths import functional_graph_cycles, relax

__all__ = ["cancel_negative_cycles", "cycle_ids", "cycle_tolerance", "cycle_units", "find_negative_cycles",
           "phase_tolerance", "unit_counts", "unit_moves"]


def cycle_tolerance(scale: Tensor, k: int) -> Tensor:
    """``[B, 1]`` threshold below which a cycle's cost counts as negative (rounding guard).

    A cycle has at most ``k + 1`` arcs, each a difference of two scores of size at most
    ``scale``; costs below a few rounding errors of that size are treated as zero.
    """
    return (4 * (k + 1) * torch.finfo(scale.dtype).eps * scale).unsqueeze(-1)


def phase_tolerance(exact: Tensor, coarse: Tensor | None, in_use: Tensor | None, dist: Tensor,
                    limit: Tensor) -> tuple[Tensor, Tensor]:
    """The cycle tolerance of each instance in this round, and its Bellman-Ford labels.

    Forbidden pairs carry a finite penalty of about ``n`` times the scores' spread
    (:func:`.balanced._working_scores`). While an instance still uses one, its arcs and labels
    are of that size, and their rounding exceeds the finite scores' tolerance: cycles of true cost
    0 (one token off a forbidden pair, another onto one) looked negative, and the cancelling never
    ended (a review found 49 of 3000 feasible instances with tied rows). Those rounds take the
    tolerance of the penalty's magnitude (``coarse``), which still sees every cycle that leaves a
    forbidden pair (it gains about the penalty); once none is used, the finite one (``exact``),
    with labels beyond the finite problem's size reset to 0 (they would carry the penalty's
    rounding on; any labels start a valid search).

    Args:
        exact, coarse: ``[B, 1]`` tolerances of the finite scores and of the penalty (None: no
            forbidden pair anywhere).
        in_use: ``[B]`` bool, the instances that use a forbidden pair now (None with ``coarse``).
        dist: ``[B, m]`` the labels.
        limit: ``[B, 1]`` the largest label of the finite problem (its arcs times the nodes).
    """
    if coarse is None or in_use is None:
        return exact, dist
    use = in_use.unsqueeze(-1)
    dist = torch.where(use | (dist.abs() <= limit), dist, torch.zeros_like(dist))
    return torch.where(use, coarse, exact), dist


def find_negative_cycles(
    arc: Tensor, tol: Tensor, running: Tensor, dist: Tensor, extra_sweeps: int = 6
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Bellman-Ford from a virtual source, collecting node-disjoint negative cycles.

    The virtual source reaches every node ``v`` with an arc of cost ``dist[v]``: any initial
    labels give a valid search, and labels close to the optimal potentials (the previous round's,
    or the negated expert prices) make it converge in a few sweeps. A cycle in the predecessor
    graph is a negative cycle; once one is found its nodes are blocked and the search goes on for
    up to ``extra_sweeps`` sweeps to collect more cycles among the remaining nodes, so that one
    round of the caller cancels several.

    Args:
        arc: ``[B, m, m]`` arc costs.
        tol: ``[B, 1]`` improvement threshold (rounding guard).
        running: ``[B]`` bool, instances to examine.
        dist: ``[B, m]`` initial labels.
        extra_sweeps: sweeps to continue after the first cycle of an instance is found.

    Returns:
        ``(optimal, cycle_nodes, pred, dist)``: ``optimal`` ``[B]`` bool (Bellman-Ford converged
        without finding a cycle: no negative cycle exists); ``cycle_nodes`` ``[B, m]`` bool, the
        nodes on the negative cycles found (node-disjoint, each cycle formed by ``pred``);
        ``pred`` ``[B, m]`` the predecessor of every node; ``dist`` the final labels.
    """
    B, m, _ = arc.shape
    dev = arc.device
    # Nodes whose label never improved point to an extra node m (a self-loop there), so that
    # every cycle of the predecessor graph among the real nodes is a negative cycle.
    pred = torch.full((B, m + 1), m, dtype=torch.long, device=dev)
    found = torch.zeros(B, dtype=torch.bool, device=dev)
    cycle_nodes = torch.zeros((B, m), dtype=torch.bool, device=dev)
    free = torch.ones((B, m), dtype=torch.bool, device=dev)  # ~cycle_nodes: nodes not yet on a cycle
    run = running.clone()
    gate = run.unsqueeze(-1).expand(B, m).clone()  # labels that may still change
    # The improvement a label needs, +inf where it may not change (gated by the tolerance, so a
    # sweep costs 4 operators: at about 20 us a launch on a GPU, sweeps set this search's time).
    need = torch.where(gate, tol, torch.inf)
    work = arc
    # The first sweep at which instances with a cycle stop looking for more: ``extra_sweeps``
    # after the batch's first cycle. A check reads the host once (whether any cycle is new, and
    # whether any instance still runs, together); everything else stays on the device, and the
    # book-keeping that only a new cycle changes runs only then (the GPU's time here is set by
    # the number of launches, about 20 a check, not by their size).
    stop_collecting: int | None = None
    for sweep in range(1, 2 * m + 4 + extra_sweeps):
        cand, arg = relax(dist, work)
        better = cand < dist - need  # (False where need is +inf: dist is finite)
        dist = torch.where(better, cand, dist)
        torch.where(better, arg, pred[:, :m], out=pred[:, :m])
        if sweep % TUNING.check_every:
            continue  # book-keeping every few sweeps: a converged instance just idles meanwhile
        run &= better.any(-1)  # an instance whose labels stopped moving has converged
        gate = run.unsqueeze(-1) & free
        on_cycle = functional_graph_cycles(pred)[:, :m] & gate
        new = on_cycle.any(-1)
        if stop_collecting is not None and sweep >= stop_collecting:
            run &= ~(found | new)
        any_new, any_running = torch.stack([new.any(), run.any()]).tolist()  # one synchronisation
        if any_new:
            found |= new
            cycle_nodes |= on_cycle
            free = ~cycle_nodes
            gate = run.unsqueeze(-1) & free
            # Blocking the cycles' nodes is a no-op for instances without one.
            work = arc.masked_fill(cycle_nodes.unsqueeze(-1) | cycle_nodes.unsqueeze(-2), float("inf"))
            if stop_collecting is None:
                stop_collecting = sweep + extra_sweeps
        elif stop_collecting is not None and sweep >= stop_collecting:
            gate = run.unsqueeze(-1) & free
        if not any_running:
            # Converged: the instances that ran and stopped without a cycle (run is all False).
            return running & ~found, cycle_nodes, pred[:, :m], dist
        need = torch.where(gate, tol, torch.inf)
    if bool((run & ~found).any()):
        raise RuntimeError(
            "balanced_assignment: Bellman-Ford found neither convergence nor a cycle; please report this input"
        )
    return running & ~run & ~found, cycle_nodes, pred[:, :m], dist


def cancel_negative_cycles(
    S: Tensor,
    z: Tensor,
    c: int,
    prices: Tensor | None = None,
    scale: Tensor | None = None,
    max_rounds: int | None = None,
    forbidden: Tensor | None = None,
) -> tuple[Tensor, Tensor, int]:
    """Cycle cancelling until no negative cycle is left (App. D.2).

    The expert graph is kept up to date incrementally: a cancelled cycle changes the token sets of
    the experts on it only, so only their rows of the move-cost table are recomputed.

    Args:
        S: ``[B, n, k]`` finite scores.
        z: ``[B, n]`` any assignment, possibly over capacity (a modified copy is returned).
        c: capacity.
        prices: optional ``[B, k]`` approximate expert prices; their negation starts the
            Bellman-Ford labels near the optimal potentials.
        scale: optional ``[B]`` magnitude of the finite scores (default: of ``S``), which sets
            the rounding tolerance.
        max_rounds: most cancelling rounds (default: a bound no correct run reaches).
        forbidden: optional ``[B, n, k]`` bool, the pairs whose score in ``S`` is a forbidden
            pair's penalty: while an instance uses one, :func:`phase_tolerance` judges its cycles.

    Returns:
        ``(z, arc_cost, rounds)`` with the optimal assignment, the float64 expert graph at the
        optimum ``[B, k, k]`` and the number of rounds.
    """
    B, n, k = S.shape
    dev = S.device
    z = z.clone()
    if scale is None:
        scale = torch.maximum(S.amax(dim=(-2, -1)).abs(), S.amin(dim=(-2, -1)).abs())
    exact = cycle_tolerance(scale, k).to(torch.float64)  # rounding errors of the scores' dtype
    coarse = cycle_tolerance(S.abs().amax(dim=(-2, -1)), k).to(torch.float64) if forbidden is not None else None
    limit = (2 * (k + 1) * scale).to(torch.float64).unsqueeze(-1)  # a finite label: k + 1 arcs of size 2 scale
    big = release_weight(S)
    counts = torch.zeros((B, k), dtype=torch.long, device=dev).scatter_add_(-1, z, torch.ones_like(z))
    # The graph straight from the assignment; the slot tables that cancelling needs are built
    # only if the first search finds a negative cycle (a good start often has none).
    move_arc = move_arcs(S, z)
    arc = torch.minimum(move_arc, release_arcs(counts, c, big))
    holder = move = None
    running = torch.ones(B, dtype=torch.bool, device=dev)
    dist = torch.zeros((B, k), dtype=torch.float64, device=dev)
    if prices is not None:
        dist -= prices.to(torch.float64)
    rounds = 0
    if max_rounds is None:
        max_rounds = 10 * n * k + 100  # each round strictly improves; this only guards against bugs
    while True:
        in_use = None if forbidden is None else forbidden.gather(-1, z.unsqueeze(-1)).flatten(1).any(-1)
        tol, dist = phase_tolerance(exact, coarse, in_use, dist, limit)
        optimal, cycle_nodes, pred, dist = find_negative_cycles(arc, tol, running, dist)
        running &= ~optimal
        done, overfull = torch.stack([~running.any(), (counts > c).any()]).tolist()  # one synchronisation
        if done:
            if overfull:
                raise RuntimeError("balanced_assignment: over-full expert left without a negative cycle")
            return z, arc, rounds
        rounds += 1
        if rounds > max_rounds:
            raise RuntimeError("balanced_assignment: cycle cancelling did not terminate; please report this input")
        if move is None:  # the first cycles: build the per-slot tables (same arcs as _move_arcs)
            slots = max(c, int(counts.max()))  # over-full experts need room for their extra tokens
            holder, counts = slot_table(z, k, slots)
            work = scratch(SCORES_A, (B, k, slots, k), S.dtype, dev)  # the start's input is spent
            _, move_arc, move = expert_graph(S, holder, counts, c, big, out=work)
        # Every cycle node v whose in-arc u -> v is a move arc receives the cheapest token of
        # u (cycle nodes have one out-arc each, so no token moves twice); release arcs move
        # nothing: their tail absorbs a token, their head sends one without receiving.
        inst, v = cycle_nodes.nonzero(as_tuple=True)
        u = pred[inst, v]
        is_move = move_arc[inst, u, v] <= arc[inst, u, v]
        touched = torch.cat([inst * k + u, inst * k + v])
        # Cycles of move arcs alone: as many units as stay negative (cycle_units); a cycle through
        # a release arc (a load changes): one unit, its move arcs' cheapest tokens.
        cycle = cycle_ids(pred, inst, v, k)
        releases = torch.zeros((B, k), dtype=torch.long, device=dev)
        releases.index_put_((inst, cycle), (~is_move).long(), accumulate=True)
        pure = releases[inst, cycle] == 0
        count, order = unit_counts(move, inst, u, v, cycle, tol, active=pure)
        count = torch.where(is_move & ~pure, 1, count)
        unit, slot_a, slot_b, _ = unit_moves(count, order, inst, u, v, move.shape, int(count.sum()))
        ui, ua, ub = inst[unit], u[unit], v[unit]
        # A token takes the slot that ub's own outgoing token of its rank leaves, or a free slot
        # of ub when ub absorbs it (its out-arc is a release arc, which exists only while ub has a
        # free slot; such a cycle moves one unit, so ub receives one token).
        first_free = (holder[ui, ub] == n).long().argmax(dim=-1)
        slot_b = torch.where(slot_b < 0, first_free, slot_b)
        moved = holder[ui, ua, slot_a]
        holder[ui, ua, slot_a] = n
        holder[ui, ub, slot_b] = moved
        z[ui, moved] = ub
        counts.index_put_((ui, ua), torch.full_like(ua, -1), accumulate=True)  # a cycle of moves: net 0
        counts.index_put_((ui, ub), torch.ones_like(ub), accumulate=True)
        # Refresh the move rows of the experts whose tokens changed, and the release arcs.
        key = torch.unique(touched)
        ci, ce = key // k, key % k
        rows = move_costs(S, holder, ci, ce)
        move[ci, ce] = rows
        row_arc = rows.amin(dim=1).to(torch.float64)
        row_arc[torch.arange(ce.numel(), device=dev), ce] = float("inf")
        move_arc[ci, ce] = row_arc
        arc = torch.minimum(move_arc, release_arcs(counts, c, big))


def cycle_ids(pred: Tensor, inst: Tensor, v: Tensor, m: int) -> Tensor:
    """``[r]`` the smallest node of the cycle through every node ``v`` of instance ``inst``, by
    pointer doubling on the predecessors ``pred [B, >= m]`` of the ``m`` nodes (``log2 m`` gathers)."""
    B = pred.shape[0]
    succ = pred[:, :m].clamp(max=m - 1)  # (the nodes off every cycle point anywhere: unused)
    low = torch.minimum(torch.arange(m, device=pred.device).expand(B, m), succ)
    for _ in range(max(1, (m - 1).bit_length())):
        low = torch.minimum(low, low.gather(1, succ))
        succ = succ.gather(1, succ)
    return low[inst, v]


def cycle_units(move: Tensor, inst: Tensor, u: Tensor, v: Tensor, cycle: Tensor, tol: Tensor,
                release: Tensor | None = None, release_costs: Tensor | None = None
                ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The token moves that cancel node-disjoint negative cycles as often as each stays negative.

    One unit along a cycle moves the cheapest token of every move arc; the ``t``-th unit moves
    every move arc's ``t``-th cheapest. Each unit is an independent improvement (a token's gain
    depends on its own scores only, the tokens of one arc are distinct, and no token of ``u``
    can have received ``v`` in the round: ``v``'s one in-arc is ``u -> v``), so every unit whose
    cost, the sum over the cycle of its arcs' ``t``-th costs, is below ``-tol`` is taken at once:
    one round does what took one round per unit (a structured score matrix, rank one say, needed
    rounds in proportion to ``n``: 4080 rounds, 24.6 s at 16384 x 64, k = 2, a review
    measurement). A *release* arc ``a -> b`` moves no token: its ``t``-th unit is ``a``'s
    ``t``-th extra token and ``b``'s ``t``-th fewer, at the cost ``release_costs[., t]`` that
    the loads then give (``+inf`` once ``a`` is full or ``b`` at its lower bound). Without
    release arcs the loads do not change: every node sends and receives as many tokens.

    Args:
        move: ``[B, E, C, E]`` per-slot move costs (``+inf`` for an empty slot or a held target).
        inst, u, v: ``[r]`` long, the arcs ``u -> v`` of the cycles, each node once as ``u``.
        cycle: ``[r]`` long, the cycle of every arc (:func:`cycle_ids`).
        tol: ``[B, 1]`` the threshold below which a unit's cost counts as negative.
        release: optional ``[r]`` bool, the release arcs (default: none).
        release_costs: ``[n_release, C]`` float64, the unit costs of the release arcs, in their
            order in ``inst`` (:func:`._graph.release_unit_costs`); with ``release``.

    Returns:
        ``(arc, slot_u, slot_v, rank)``, ``[units]`` long, one entry per token move: the move
        arc (an index into ``inst``), the slot of ``u`` it leaves, the slot of ``v`` it takes (the
        one ``v``'s own token of the same rank leaves; ``-1`` where ``v``'s out-arc is a release
        arc: the caller gives it a free slot of ``v``) and the unit's rank ``t`` on its arc.
    """
    count, order = unit_counts(move, inst, u, v, cycle, tol, release, release_costs)
    return unit_moves(count, order, inst, u, v, move.shape, int(count.sum()))


def unit_counts(move: Tensor, inst: Tensor, u: Tensor, v: Tensor, cycle: Tensor, tol: Tensor,
                release: Tensor | None = None, release_costs: Tensor | None = None, active: Tensor | None = None
                ) -> tuple[Tensor, Tensor]:
    """The first half of :func:`cycle_units`, without a host synchronisation: how many units every
    arc moves, and the order of its tokens.

    Args:
        move, inst, u, v, cycle, tol, release, release_costs: as in :func:`cycle_units`.
        active: optional ``[r]`` bool, the arcs whose cycles are pushed here (the others move
            nothing: count 0); default all.

    Returns:
        ``(count, order)``: ``[r]`` long, the token moves of every arc (0 on a release arc or an
        inactive one), and ``[r, C]`` long, every arc's slots of ``u``, cheapest move first.
    """
    B, E, C, _ = move.shape
    costs, order = move[inst, u, :, v].to(torch.float64).sort(dim=-1)  # [r, C]: cheapest tokens first
    if release is not None and release_costs is not None:
        costs[release] = release_costs
    total = torch.zeros((B, E, C), dtype=torch.float64, device=move.device)
    total.index_put_((inst, cycle), costs, accumulate=True)  # [B, E, C]: the t-th unit of each cycle
    units = (total < -tol.unsqueeze(-1)).long().cumprod(-1).sum(-1)  # [B, E]
    count = units[inst, cycle].clamp(min=1)  # [r] (the first unit is negative: the cycle was)
    if release is not None:
        count = count.masked_fill(release, 0)  # a release arc moves no token
    if active is not None:
        count = count.masked_fill(~active, 0)
    return count, order


def unit_moves(count: Tensor, order: Tensor, inst: Tensor, u: Tensor, v: Tensor, shape: torch.Size,
               n_units: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The second half of :func:`cycle_units`: its token moves from :func:`unit_counts`' result,
    ``n_units = count.sum()`` read by the caller (so that one synchronisation can read it with
    other sizes). ``shape``: the move table's ``[B, E, C, E]``."""
    B, E, C, _ = shape
    dev = count.device
    arc = torch.repeat_interleave(torch.arange(inst.numel(), device=dev), count, output_size=n_units)
    rank = torch.arange(arc.numel(), device=dev) - (torch.cumsum(count, 0) - count)[arc]
    slot_u = order[arc, rank]
    vacated = torch.full((B, E, C), -1, dtype=torch.long, device=dev)
    vacated[inst[arc], u[arc], rank] = slot_u
    return arc, slot_u, vacated[inst[arc], v[arc], rank], rank
