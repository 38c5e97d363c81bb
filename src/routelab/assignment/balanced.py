"""Exact n x k balanced assignment (Kool et al. 2021, eq. 4 and App. D.2).

Problem: given scores ``s[i, j]`` for ``n`` tokens and ``k`` experts and a capacity ``c``,

    maximise  sum_i s[i, z_i]   subject to   #{i : z_i = j} <= c  for every expert j.

Algorithm (App. D.2, generalised to slack capacity and to an infeasible start):

1. **Start.** Approximate expert prices ``u`` from a few Newton steps on the entropy-smoothed dual
   (:mod:`._prices`); every token starts at its best expert under those prices,
   ``argmax_j s[i, j] - u_j``. This start may put more than ``c`` tokens on some experts.
2. **Expert graph** on the ``k`` experts. The *move* arc ``a -> b`` costs
   ``min_{i: z_i = a} s[i, a] - s[i, b]``, the cheapest way to move one token from ``a`` to ``b``.
   The *release* arc ``a -> b`` (an expert ``a`` with a free slot, a non-empty ``b``) stands for
   ending a chain of moves in ``a``'s free slot and starting one at ``b``: it costs 0, and
   ``-M`` (a large constant) when ``b`` holds more than ``c`` tokens, so that shedding overflow
   comes first. The arc cost is the cheaper of the two. (This is the classic graph with a sink
   node ``T`` — ``a -> T -> b`` — with ``T`` contracted, so that cycles through the sink need not
   share a node and several can be cancelled at once.) The assignment is feasible and optimal iff
   the graph has no negative cycle (min-cost-flow optimality).
3. **Cycle cancelling.** Bellman-Ford from a virtual source; a cycle in its predecessor graph is a
   negative cycle. Node-disjoint negative cycles are collected for a few more sweeps and all
   cancelled at once (one token moves along each move arc). Repeat until Bellman-Ford converges.
4. The converged graph's all-pairs shortest paths ``d*`` (Floyd-Warshall) are what
   :func:`routelab.assignment.gumbel_matching` needs for its conditionals (App. D.3-D.4).

Forbidden pairs (``-inf`` scores) are replaced by a large finite penalty: if the optimum still
uses one, no feasible assignment exists and a ``ValueError`` is raised.
Everything is batched over the leading dimensions; the only Python loops are over rounds of the
algorithm (never over tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ._checks import check_score_matrix, resolve_capacity
from ._normalise import compute_dtype, normalise_scores
from ._groups import rank_within_groups, slot_table
from ._ops import top_two
from ._prices import approximate_prices
from ._workspace import NORMALISED, SCORES_A, SCORES_B, scratch
from .shortest_paths import floyd_warshall, functional_graph_cycles, relax

__all__ = ["balanced_assignment", "solve_balanced", "BalancedSolution", "expert_graph"]

# Bellman-Ford sweeps between two looks for predecessor cycles (a look costs about two sweeps;
# tuned on random instances, n = 1024 to 16384, k = 64).
CHECK_EVERY = 3


@dataclass
class BalancedSolution:
    """Internal result of :func:`solve_balanced` (flattened batch).

    Attributes:
        expert: ``[B, n]`` optimal expert per token.
        arc_cost: ``[B, k, k]`` float64 expert-graph arc costs at the optimum (move and release
            arcs), in units of the normalised scores: multiply by ``2 ** log2_scale`` for the
            units of the input scores.
        log2_scale: ``[B]`` long, the exponent the solver took out of the scores
            (:func:`routelab.assignment._normalise.normalise_scores`).
        capacity: the capacity ``c``.
        rounds: number of cycle-cancelling rounds that were run.
    """

    expert: Tensor
    arc_cost: Tensor
    log2_scale: Tensor
    capacity: int
    rounds: int


def balanced_assignment(scores: Tensor, capacity: int | None = None) -> Tensor:
    """The exact maximiser of ``sum_i scores[i, z_i]`` with at most ``capacity`` tokens per expert.

    Exact means: no other feasible assignment beats it by more than the rounding of the scores'
    dtype relative to their spread (``n (k + 1) 4 eps max_i (max_j s_ij - min_j s_ij)``), at any
    magnitude and under any common or per-token offset: the solver works on row-shifted scores
    scaled by a power of two (:mod:`routelab.assignment._normalise`), which has the same
    maximisers. float16 and bfloat16 scores are solved in float32 (converted exactly).

    Args:
        scores: ``[..., n, k]`` floating scores of ``n`` tokens for ``k`` experts, batched over the
            leading dimensions (which may be empty). ``-inf`` marks a forbidden (token, expert)
            pair.
        capacity: tokens each expert may take; default ``n / k`` (then ``k`` must divide ``n``).

    Returns:
        ``[..., n]`` long tensor, the expert of every token.

    Raises:
        ValueError: NaN or +inf scores, fewer than two dimensions, ``capacity * k < n``,
            ``n`` not divisible by ``k`` without an explicit capacity, or a pattern of ``-inf``
            entries that leaves no feasible assignment.
    """
    sol = solve_balanced(scores, capacity)
    return sol.expert.view(scores.shape[:-1])


def solve_balanced(scores: Tensor, capacity: int | None = None, *, name: str = "scores") -> BalancedSolution:
    """Validate, normalise, solve and certify; returns the flattened :class:`BalancedSolution`."""
    check_score_matrix(scores, name)
    n, k = scores.shape[-2], scores.shape[-1]
    c = min(resolve_capacity(n, k, capacity), n)
    flat = scores.detach().reshape(-1, n, k)
    B, dev = flat.shape[0], scores.device
    if B == 0:
        return BalancedSolution(
            expert=torch.zeros((0, n), dtype=torch.long, device=dev),
            arc_cost=torch.zeros((0, k, k), dtype=torch.float64, device=dev),
            log2_scale=torch.zeros(0, dtype=torch.long, device=dev),
            capacity=c,
            rounds=0,
        )
    work = compute_dtype(scores.dtype)
    normalised, log2_scale = normalise_scores(flat.to(work), out=scratch(NORMALISED, flat.shape, work, dev))
    S, forbidden, scale = _working_scores(normalised)
    if k <= 2:
        z, rounds = _two_experts(S, c), 0
        if k == 1:
            arc_cost = torch.zeros((B, 1, 1), dtype=torch.float64, device=dev)
        else:
            arc_cost = _two_expert_graph(S, z, c, _release_weight(S))
    else:
        # Inference mode skips autograd's bookkeeping on every one of the solver's many small
        # operations (~10% of the time); the results are cloned outside it into normal tensors,
        # which autograd may save (e.g. as gather indices).
        with torch.inference_mode():
            prices = approximate_prices(S, c)
            reduced = torch.sub(S, prices.unsqueeze(1), out=scratch(SCORES_A, S.shape, S.dtype, S.device))
            z = _initial_assignment(reduced, c)
            z, arc_cost, rounds = _cancel_negative_cycles(S, z, c, prices, scale=scale)
        z, arc_cost = z.clone(), arc_cost.clone()
    if forbidden is not None and bool(forbidden.gather(-1, z.unsqueeze(-1)).any()):
        bad = forbidden.gather(-1, z.unsqueeze(-1)).squeeze(-1).any(-1).nonzero().flatten()
        raise ValueError(
            f"{name}: the -inf (forbidden) entries leave no feasible assignment with capacity {c} "
            f"(batch instance(s) {bad.tolist()[:5]}): some set of tokens is allowed on too few experts. "
            f"Allow more (token, expert) pairs or raise the capacity"
        )
    if forbidden is not None and k > 1:
        # The graph for the conditionals must not move a token onto a forbidden expert: rebuild
        # it from the scores with their -inf entries, where such a move costs +inf instead of
        # the penalty.
        if k == 2:
            arc_cost = _two_expert_graph(normalised, z, c, _release_weight(S))
        else:
            holder, counts = slot_table(z, k, c)
            arc_cost, _, _ = expert_graph(normalised, holder, counts, c)
    return BalancedSolution(expert=z, arc_cost=arc_cost, log2_scale=log2_scale, capacity=c, rounds=rounds)


def _working_scores(S: Tensor) -> tuple[Tensor, Tensor | None, Tensor]:
    """Replace -inf by a finite penalty large enough that any feasible assignment beats one using it.

    Returns:
        ``(working, forbidden, scale)``: the finite ``[B, n, k]`` scores, the ``[B, n, k]`` mask
        of forbidden pairs (``None`` when there is none) and the ``[B]`` largest finite score
        magnitude (the size of the rounding errors).
    """
    hi_all = S.amax(dim=(-2, -1))
    lo_all = S.amin(dim=(-2, -1))
    if not bool(torch.isneginf(lo_all).any()):
        return S, None, torch.maximum(hi_all.abs(), lo_all.abs())
    forbidden = torch.isneginf(S)
    finite = S.masked_fill(forbidden, 0.0)
    lo = S.masked_fill(forbidden, float("inf")).amin(dim=(-2, -1), keepdim=True)
    hi = S.masked_fill(forbidden, float("-inf")).amax(dim=(-2, -1), keepdim=True)
    lo = torch.where(torch.isinf(lo), torch.zeros_like(lo), lo)  # an all-forbidden instance
    hi = torch.where(torch.isinf(hi), torch.zeros_like(hi), hi)
    n = S.shape[-2]
    penalty = lo - (hi - lo + 1.0) * (n + 1)
    scale = torch.maximum(hi.abs(), lo.abs()).view(-1)
    return torch.where(forbidden, penalty.expand_as(S), finite), forbidden, scale


def _tolerance(scale: Tensor, k: int) -> Tensor:
    """``[B, 1]`` threshold below which a cycle's cost counts as negative (rounding guard).

    A cycle has at most ``k + 1`` arcs, each a difference of two scores of size at most
    ``scale``; costs below a few rounding errors of that size are treated as zero.
    """
    return (4 * (k + 1) * torch.finfo(scale.dtype).eps * scale).unsqueeze(-1)


def _two_experts(S: Tensor, c: int) -> Tensor:
    """Exact solution for ``k <= 2`` by selection (no graph needed).

    With two experts, putting ``m`` tokens on expert 0 is best done with the ``m`` largest
    differences ``d_i = s[i, 0] - s[i, 1]``, and the capacities allow ``n - c <= m <= c``: take
    every positive difference, clamped to that range. (``k = 1``: everything on expert 0.)

    Args:
        S: ``[B, n, k]`` finite scores, ``k <= 2``.
        c: capacity.

    Returns:
        ``[B, n]`` long expert per token.
    """
    B, n, k = S.shape
    if k == 1:
        return torch.zeros((B, n), dtype=torch.long, device=S.device)
    d = S[..., 0] - S[..., 1]
    positive = d > 0
    m = positive.sum(-1).clamp(min=n - c, max=c)  # tokens on expert 0
    on_zero = positive.clone()
    for bound in sorted({n - c, c}):
        rows = ((m == bound) & (positive.sum(-1) != bound)).nonzero().flatten()
        if rows.numel() == 0:
            continue
        dr = d[rows]
        # The bound-th largest value; ties at it are taken in token order up to the bound.
        t = torch.kthvalue(dr, n - bound + 1, dim=-1, keepdim=True).values
        above = dr > t
        tie = dr == t
        room = bound - above.sum(-1, keepdim=True)
        on_zero[rows] = above | (tie & (torch.cumsum(tie, -1) <= room))
    return (~on_zero).long()


def _two_expert_graph(S: Tensor, z: Tensor, c: int, big: Tensor) -> Tensor:
    """The expert graph ``[B, 2, 2]`` (float64) of a two-expert assignment, without slot tables."""
    d = (S[..., 0] - S[..., 1]).to(torch.float64)
    inf = float("inf")
    move_01 = d.masked_fill(z != 0, inf).amin(-1)  # cheapest move of a token from 0 to 1
    move_10 = (-d).masked_fill(z != 1, inf).amin(-1)
    move = torch.full((z.shape[0], 2, 2), inf, dtype=torch.float64, device=S.device)
    move[:, 0, 1], move[:, 1, 0] = move_01, move_10
    counts = torch.stack([(z == 0).sum(-1), (z == 1).sum(-1)], dim=-1)
    return torch.minimum(move, _release_arcs(counts, c, big))


def _initial_assignment(S: Tensor, c: int) -> Tensor:
    """A feasible assignment by rounds of proposals (greedy, no token is moved once placed).

    Every unplaced token proposes to its best expert with a free slot; each expert accepts the
    proposals with the largest margin (best minus second best score) up to its free capacity.
    Every proposal goes to an expert with a free slot (full experts are at ``-inf`` and the
    scores are finite), and an expert accepts ``min(proposals, free slots) >= 1`` of them; so a
    round either places every pending token or fills at least one expert, and this ends within
    ``k + 1`` rounds (the loop's bound; running past it raises ``RuntimeError``).

    Args:
        S: ``[B, n, k]`` finite scores.
        c: capacity, ``c * k >= n``.

    Returns:
        ``[B, n]`` long expert per token.
    """
    B, n, k = S.shape
    dev = S.device
    z = torch.full((B, n), -1, dtype=torch.long, device=dev)
    free = torch.full((B, k), c, dtype=torch.long, device=dev)
    pb = torch.arange(B, device=dev).repeat_interleave(n)  # pending (batch, token) pairs
    pi = torch.arange(n, device=dev).repeat(B)
    rows = S.reshape(B * n, k)
    first = True
    for _ in range(k + 1):
        if pb.numel() == 0:
            return z
        if first:  # every expert is free and every token pending: all n x k scores
            first = False
            w1, j, w2 = top_two(rows, scratch(SCORES_B, rows.shape, S.dtype, dev))
        else:  # the few tokens left, with the full experts at -inf
            full = torch.zeros((B, k), dtype=S.dtype, device=dev).masked_fill_(free == 0, float("-inf"))
            W = rows.index_select(0, pb * n + pi) + full.index_select(0, pb)
            w1, j, w2 = top_two(W, torch.empty_like(W))
        tied = (w1 == w2).nonzero().view(-1)
        if tied.numel():
            j = j.clone()
            j[tied] = _spread_ties(rows.index_select(0, pb[tied] * n + pi[tied]), w1[tied], pi[tied], free, pb[tied])
        margin = torch.where(torch.isinf(w2), torch.full_like(w1, float("inf")), w1 - w2)
        group = pb * k + j
        # Experts proposed to no more than their free slots accept everything; only the others
        # rank their proposals (few, when the start comes from good prices).
        room = free.view(-1)[group]
        ok = torch.bincount(group, minlength=B * k)[group] <= room
        contested = (~ok).nonzero().view(-1)
        if contested.numel():
            rank = rank_within_groups(group[contested], margin[contested], B * k)
            ok[contested] = rank < room[contested]
        z[pb[ok], pi[ok]] = j[ok]
        free.view(-1).scatter_add_(0, group[ok], torch.full_like(group[ok], -1))
        pb, pi = pb[~ok], pi[~ok]
    if pb.numel() == 0:
        return z
    raise RuntimeError("balanced_assignment: the start placed no token in a round; please report this input")


def _spread_ties(W: Tensor, best: Tensor, token: Tensor, free: Tensor, inst: Tensor) -> Tensor:
    """For tokens with several best experts, pick one of them in turn by token index.

    Taking the first maximiser would send every tied token to the same expert, which fills up
    and sends the rest round by round (``k`` rounds for all-equal scores); token ``i`` with
    ``t`` tied maxima takes the ``(i mod t)``-th of them instead. Any of them is as good for
    the objective; experts without room are not candidates.

    Args:
        W: ``[r, k]`` the tied tokens' scores.
        best: ``[r]`` their maximum.
        token: ``[r]`` their token index.
        free: ``[B, k]`` free slots per expert.
        inst: ``[r]`` their batch instance.

    Returns:
        ``[r]`` long chosen expert.
    """
    top = (W == best.unsqueeze(-1)) & (free.index_select(0, inst) > 0)
    order = top.long().cumsum(-1)  # 1, 2, ... at the maxima
    count = order[:, -1].clamp(min=1)
    want = token % count + 1
    return (order == want.unsqueeze(-1)).long().argmax(dim=-1)


def _move_costs(
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


def _move_arcs(S: Tensor, z: Tensor) -> Tensor:
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


def _release_arcs(counts: Tensor, c: int, big: Tensor) -> Tensor:
    """``[B, k, k]`` costs of the release arcs (the sink node contracted away).

    ``a -> b`` exists when ``a`` has a free slot and ``b`` holds a token: it costs 0, or ``-big``
    when ``b`` is over capacity; ``+inf`` otherwise and on the diagonal.
    """
    B, k = counts.shape
    room = (counts < c).unsqueeze(-1)
    cost = torch.where(counts > c, -big.view(B, 1), torch.zeros((), dtype=big.dtype, device=big.device))
    cost = torch.where(counts > 0, cost, torch.full((), float("inf"), dtype=big.dtype, device=big.device))
    arcs = torch.where(room, cost.unsqueeze(-2), torch.full((), float("inf"), dtype=big.dtype, device=big.device))
    arcs.diagonal(dim1=-2, dim2=-1).fill_(float("inf"))
    return arcs


def _release_weight(S: Tensor) -> Tensor:
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
        big: ``[B]`` release reward for over-full experts (default from :func:`_release_weight`).
        out: optional ``[B, k, C, k]`` buffer for ``move``.

    Returns:
        ``(arc, move_arc, move)`` in float64 except ``move``: ``arc`` ``[B, k, k]`` the graph (the
        cheaper of the move and the release arc), ``move_arc`` ``[B, k, k]`` the move arcs alone
        (``+inf`` on the diagonal) and ``move`` ``[B, k, C, k]`` the per-slot move costs.
    """
    B, n, k = S.shape
    move = _move_costs(S, holder, out=out)
    move_arc = move.amin(dim=2).to(torch.float64)
    move_arc.diagonal(dim1=-2, dim2=-1).fill_(float("inf"))
    if big is None:
        big = _release_weight(S.masked_fill(torch.isinf(S), 0.0))
    return torch.minimum(move_arc, _release_arcs(counts, c, big)), move_arc, move


def _find_negative_cycles(
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
    optimal = torch.zeros(B, dtype=torch.bool, device=dev)
    found = torch.zeros(B, dtype=torch.bool, device=dev)
    cycle_nodes = torch.zeros((B, m), dtype=torch.bool, device=dev)
    run = running.clone()
    gate = run.unsqueeze(-1).expand(B, m).clone()  # labels that may still change
    work = arc
    stop_collecting = None  # sweep after which instances with a cycle stop looking for more
    for sweep in range(1, 2 * m + 4 + extra_sweeps):
        cand, arg = relax(dist, work)
        better = (cand < dist - tol) & gate
        dist = torch.where(better, cand, dist)
        pred[:, :m] = torch.where(better, arg, pred[:, :m])
        if sweep % CHECK_EVERY:
            continue  # book-keeping every few sweeps: a converged instance just idles meanwhile
        moved = better.any(-1)
        optimal |= run & ~moved & ~found
        run &= moved
        on_cycle = functional_graph_cycles(pred)[:, :m] & gate & run.unsqueeze(-1)
        new = on_cycle.any(-1)
        if bool(new.any()):
            found |= new
            cycle_nodes |= on_cycle
            work = arc.masked_fill(cycle_nodes.unsqueeze(-1) | cycle_nodes.unsqueeze(-2), float("inf"))
            if stop_collecting is None:
                stop_collecting = sweep + extra_sweeps
        if stop_collecting is not None and sweep >= stop_collecting:
            run &= ~found
        gate = run.unsqueeze(-1) & ~cycle_nodes
        if not bool(run.any()):
            return optimal, cycle_nodes, pred[:, :m], dist
    if bool((run & ~found).any()):
        raise RuntimeError(
            "balanced_assignment: Bellman-Ford found neither convergence nor a cycle; please report this input"
        )
    return optimal, cycle_nodes, pred[:, :m], dist


def _cancel_negative_cycles(
    S: Tensor,
    z: Tensor,
    c: int,
    prices: Tensor | None = None,
    scale: Tensor | None = None,
    max_rounds: int | None = None,
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

    Returns:
        ``(z, arc_cost, rounds)`` with the optimal assignment, the float64 expert graph at the
        optimum ``[B, k, k]`` and the number of rounds.
    """
    B, n, k = S.shape
    dev = S.device
    z = z.clone()
    if scale is None:
        scale = torch.maximum(S.amax(dim=(-2, -1)).abs(), S.amin(dim=(-2, -1)).abs())
    tol = _tolerance(scale, k).to(torch.float64)  # rounding errors of the scores' dtype
    big = _release_weight(S)
    counts = torch.zeros((B, k), dtype=torch.long, device=dev).scatter_add_(-1, z, torch.ones_like(z))
    # The graph straight from the assignment; the slot tables that cancelling needs are built
    # only if the first search finds a negative cycle (a good start often has none).
    move_arc = _move_arcs(S, z)
    arc = torch.minimum(move_arc, _release_arcs(counts, c, big))
    holder = move = None
    running = torch.ones(B, dtype=torch.bool, device=dev)
    dist = torch.zeros((B, k), dtype=torch.float64, device=dev)
    if prices is not None:
        dist -= prices.to(torch.float64)
    rounds = 0
    if max_rounds is None:
        max_rounds = 10 * n * k + 100  # each round strictly improves; this only guards against bugs
    while True:
        optimal, cycle_nodes, pred, dist = _find_negative_cycles(arc, tol, running, dist)
        running &= ~optimal
        if not bool(running.any()):
            if bool((counts > c).any()):
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
        inst, u, v = inst[is_move], u[is_move], v[is_move]
        slot_u = move[inst, u, :, v].argmin(dim=-1)
        token = holder[inst, u, slot_u]
        # The token takes the slot that v's own outgoing token leaves, or a free slot of v when v
        # absorbs it (its out-arc is a release arc, which exists only while v has a free slot).
        vacated = torch.full((B, k), -1, dtype=torch.long, device=dev)
        vacated[inst, u] = slot_u
        slot_v = vacated[inst, v]
        first_free = (holder[inst, v] == n).long().argmax(dim=-1)
        slot_v = torch.where(slot_v < 0, first_free, slot_v)
        holder[inst, u, slot_u] = n
        holder[inst, v, slot_v] = token
        z[inst, token] = v
        counts.index_put_((inst, u), torch.full_like(u, -1), accumulate=True)
        counts.index_put_((inst, v), torch.ones_like(v), accumulate=True)
        # Refresh the move rows of the experts whose tokens changed, and the release arcs.
        key = torch.unique(torch.cat([inst * k + u, inst * k + v]))
        ci, ce = key // k, key % k
        rows = _move_costs(S, holder, ci, ce)
        move[ci, ce] = rows
        row_arc = rows.amin(dim=1).to(torch.float64)
        row_arc[torch.arange(ce.numel(), device=dev), ce] = float("inf")
        move_arc[ci, ce] = row_arc
        arc = torch.minimum(move_arc, _release_arcs(counts, c, big))


def conditional_shortest_paths(arc_cost: Tensor) -> Tensor:
    """All-pairs shortest paths ``d*`` ``[B, k, k]`` of an optimal expert graph (App. D.3)."""
    return floyd_warshall(arc_cost)
