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

On CPU (float32/float64, numba installed) the same outline runs as compiled loops
(:mod:`._compiled`, the speed machinery): an auction start (steps 1-2 in one: bids raise expert
prices until every token is within ``eps`` of its best expert), then the cycle cancelling of
step 3 with the same certificate. The PyTorch code below is the reference, and the path on a GPU
for problems above ``SolverTuning.host_max_scores`` scores (or with ``on_host=False``); smaller
GPU problems are copied to the host and solved there (:func:`host_solve_pays`).
Everything is batched over the leading dimensions; the only Python loops are over rounds of the
algorithm (never over tokens).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch
from torch import Tensor

from .._checks import check_plain_tensor, check_score_matrix, resolve_capacity, to_device
from . import _compiled
from ._cycles import cancel_negative_cycles, cycle_tolerance
from ._feasibility import hall_violator
from ._graph import expert_graph, release_weight
from ._groups import slot_table
from ._normalise import compute_dtype, normalise_scores
from ._prices import approximate_prices
from ._start import initial_assignment
from ._tuning import TUNING, SolverTuning
from ._two_experts import closed_form, two_expert_assignment, two_expert_graph
from ._workspace import NORMALISED, SCORES_A, scratch

__all__ = ["balanced_assignment", "solve_balanced", "BalancedSolution"]

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
        log2_bound: ``max |log2_scale|`` when it is known on the host without reading a GPU
            tensor (a solve on the host), else ``None``.
    """

    expert: Tensor
    arc_cost: Tensor
    log2_scale: Tensor
    capacity: int
    rounds: int
    log2_bound: int | None = None


def balanced_assignment(scores: Tensor, capacity: int | None = None, *, k: int = 1,
                        on_host: bool | None = None) -> Tensor:
    """The exact maximiser of ``sum_i scores[i, z_i]`` with at most ``capacity`` tokens per expert.

    Exact means: no other feasible assignment beats it by more than the rounding of the scores'
    dtype relative to their spread (``n (k + 1) 4 eps max_i (max_j s_ij - min_j s_ij)``), at any
    magnitude and under any common or per-token offset: the solver works on row-shifted scores
    scaled by a power of two (:mod:`routelab.assignment._normalise`), which has the same
    maximisers. float16 and bfloat16 scores are solved in float32 (converted exactly).
    Ties: among equally good assignments one is returned deterministically; which one is
    unspecified, and on the PyTorch path (a GPU solve, or ``ROUTELAB_PURE_TORCH=1``) it may depend on
    the other instances of a batch (their shared warm start), never the total score; so on a GPU
    it may depend on ``on_host`` and, by default, on the problem's size.

    Args:
        scores: ``[..., n, k]`` floating scores of ``n`` tokens for ``k`` experts, batched over the
            leading dimensions (which may be empty). ``-inf`` marks a forbidden (token, expert)
            pair.
        capacity: tokens each expert may take; default ``n / k`` (then ``k`` must divide ``n``).
        k: experts per token (keyword). ``k = 1`` (default): this function's assignment. ``k > 1``:
            the exact balanced b-matching of :func:`~routelab.assignment.balanced_b_matching`
            (``k`` distinct experts per token, every expert ``floor`` or ``ceil`` of ``k n / E``
            pairs, or at most ``capacity``; here the experts are ``E``, the last dimension).
        on_host: where scores on a GPU are solved (keyword). ``None`` (default): on the host
            when that is faster, i.e. for ``k = 1`` scores of at most ``host_max_scores``
            entries (2^21, :mod:`._tuning`) with the compiled CPU solver available; ``True``:
            always on the host (copied there, the result copied back to ``scores.device``);
            ``False``: on ``scores.device``. The same optimum either way; a GPU solve makes about
            a hundred host synchronisations, a host solve two. Ignored for CPU scores.

    Returns:
        ``[..., n]`` long tensor, the expert of every token; for ``k > 1``, ``[..., n, k]``, the
        ``k`` distinct experts of every token by descending score.

    Raises:
        ValueError: NaN or +inf scores, fewer than two dimensions, ``capacity * k < n``,
            ``n`` not divisible by ``k`` without an explicit capacity, or a pattern of ``-inf``
            entries that leaves no feasible assignment.
        TypeError: ``on_host`` is not ``None``, ``True`` or ``False``.
    """
    if on_host is not None and not isinstance(on_host, bool):
        raise TypeError(f"on_host must be None (automatic), True or False, got {on_host!r}")
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k != 1:
        from .b_matching import balanced_b_matching  # the sibling module builds on this one

        if on_host and isinstance(scores, Tensor) and scores.device.type != "cpu":
            return to_device(balanced_b_matching(scores.to("cpu"), k, capacity), scores.device)
        return balanced_b_matching(scores, k, capacity)
    sol = solve_balanced(scores, capacity, on_host=on_host)
    return sol.expert.view(scores.shape[:-1])


def solve_balanced(scores: Tensor, capacity: int | None = None, *, name: str = "scores",
                   on_host: bool | None = None, tuning: SolverTuning = TUNING) -> BalancedSolution:
    """Validate, normalise, solve and certify; returns the flattened :class:`BalancedSolution`
    on ``scores.device``.

    ``on_host``: as in :func:`balanced_assignment` (``None``: :func:`host_solve_pays` decides, by
    ``tuning.host_max_scores``).
    """
    check_score_matrix(scores, name, values=False)
    check_plain_tensor(scores, name, "the balanced assignment solver")
    n, k = scores.shape[-2], scores.shape[-1]
    c = min(resolve_capacity(n, k, capacity), n)
    flat = scores.detach().reshape(-1, n, k)
    B, dev = flat.shape[0], scores.device
    if dev.type != "cpu" and (host_solve_pays(flat, tuning) if on_host is None else on_host):
        # The same solve on a host copy (half precision widened exactly, as the solver would).
        sol = solve_balanced(flat.to(device="cpu", dtype=compute_dtype(flat.dtype)), c, name=name)
        bound = int(sol.log2_scale.abs().max()) if sol.log2_scale.numel() else 0  # a host tensor: no sync
        expert, arc_cost, log2_scale = _to_device((sol.expert, sol.arc_cost, sol.log2_scale), dev)
        return BalancedSolution(expert=expert, arc_cost=arc_cost, log2_scale=log2_scale, capacity=c,
                                rounds=sol.rounds, log2_bound=bound)
    if B and not closed_form(k) and _compiled.available(flat):
        # Steps 0-3 below in one compiled call (the speed machinery, :mod:`._compiled`); None for
        # input with -inf, NaN or +inf entries, which the steps below validate and handle.
        fast = _compiled.solve_scores(flat, c)
        if fast is not None:
            z, arc_cost, log2_scale, rounds = fast
            return BalancedSolution(expert=z, arc_cost=arc_cost, log2_scale=log2_scale, capacity=c, rounds=rounds)
    check_score_matrix(scores, name)
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
    if forbidden is not None:
        _check_feasible(forbidden, c, name)
    if closed_form(k):
        z = two_expert_assignment(S, c)
        arc_cost, rounds = _graph_of(S, z, c, release_weight(S)), 0
    elif _compiled.available(S):
        # The same outline (a priced start, then cycle cancelling) as one compiled CPU kernel.
        tol = cycle_tolerance(scale, k).to(torch.float64).view(-1)
        z, arc_cost, rounds = _compiled.solve_normalised(S, c, tol, release_weight(S))
    else:
        # Inference mode skips autograd's bookkeeping on every one of the solver's many small
        # operations (~10% of the time); the results are cloned outside it into normal tensors,
        # which autograd may save (e.g. as gather indices).
        with torch.inference_mode():
            # 1. warm start: approximate expert prices from the smoothed dual
            prices = approximate_prices(S, c)
            # 2. start: greedy proposals under those prices (may leave experts over capacity)
            z = initial_assignment(torch.sub(S, prices.unsqueeze(1), out=scratch(SCORES_A, S.shape, S.dtype, dev)), c)
            # 3. exact: cancel negative cycles of the expert graph until there is none
            z, arc_cost, rounds = cancel_negative_cycles(S, z, c, prices, scale=scale, forbidden=forbidden)
        z, arc_cost = z.clone(), arc_cost.clone()
    if forbidden is not None:
        used = forbidden.gather(-1, z.unsqueeze(-1)).squeeze(-1).any(-1)
        if bool(used.any()):
            stranded = forbidden.all(-1)  # [B, n]: tokens allowed on no expert at all
            if bool(stranded.any()):
                b, i = stranded.nonzero()[0].tolist()
                raise ValueError(f"{name}: no feasible assignment: row {i} of batch instance {b} is -inf everywhere "
                                 "(that token is allowed on no expert). Allow it at least one expert")
            raise ValueError(
                f"{name}: the -inf (forbidden) entries leave no feasible assignment with capacity {c} "
                f"(batch instance(s) {used.nonzero().flatten().tolist()[:5]}): some set of tokens is allowed "
                f"on too few experts. Allow more (token, expert) pairs or raise the capacity"
            )
        # The graph for the conditionals must not move a token onto a forbidden expert: rebuild
        # it from the scores with their -inf entries, where such a move costs +inf instead of
        # the penalty.
        arc_cost = _graph_of(normalised, z, c, release_weight(S))
    return BalancedSolution(expert=z, arc_cost=arc_cost, log2_scale=log2_scale, capacity=c, rounds=rounds)


def _check_feasible(forbidden: Tensor, c: int, name: str) -> None:
    """A ValueError naming the batch instance where the ``-inf`` pattern ``forbidden [B, n, k]`` leaves
    no assignment of every token to an allowed expert with at most ``c`` tokens per expert.

    One max flow per instance with a forbidden pair (:func:`._feasibility.hall_violator`), before the
    solve: with the penalty in place of ``-inf`` an infeasible instance still solves, only to find a
    penalised pair in the optimum, and the compiled auction raises the prices of the allowed experts
    to the penalty's level in steps of its epsilon (minutes at 2048 x 8; a review measured it).
    """
    B, n, k = forbidden.shape
    for b in forbidden.flatten(1).any(-1).nonzero().flatten().tolist():
        allowed = ~forbidden[b]
        stranded = (~allowed.any(-1)).nonzero()
        if stranded.numel():
            raise ValueError(f"{name}: no feasible assignment: row {int(stranded[0])} of batch instance {b} is -inf "
                             "everywhere (that token is allowed on no expert). Allow it at least one expert")
        found = hall_violator(allowed.cpu().numpy(), [float(c)] * k)
        if found is not None:
            rows, experts, room = found
            raise ValueError(
                f"{name}: the -inf (forbidden) entries leave no feasible assignment with capacity {c} "
                f"(batch instance {b}): {len(rows)} tokens are allowed only on {len(experts)} experts, which "
                f"hold {int(room)}. Allow more (token, expert) pairs or raise the capacity")


def _to_device(tensors: tuple[Tensor, ...], device: torch.device) -> tuple[Tensor, ...]:
    """Host tensors of 8-byte dtypes (long, float64) copied to ``device`` in one transfer through
    pinned memory (:func:`~routelab._checks.to_device`: no host sync), bit for bit: the float64
    ones travel as their int64 bit patterns."""
    flat = [t.reshape(-1).view(torch.int64) for t in tensors]
    moved = to_device(torch.cat(flat), device).split([f.numel() for f in flat])
    return tuple(m.view(t.dtype).view(t.shape) for m, t in zip(moved, tensors))


def host_solve_pays(flat: Tensor, tuning: SolverTuning = TUNING) -> bool:
    """Whether the ``[B, n, k]`` scores, on a CUDA device, are solved faster on the host.

    Yes when the compiled CPU solver runs there (:func:`._compiled.host_available`; with ``k <= 2``
    experts the host runs the closed forms instead, as fast), the problem has at most
    ``tuning.host_max_scores`` entries, and ``torch.compile`` is not tracing (the
    copy to the host is a graph break; the traced solver stays on the device). The measurements
    behind the bound are in :class:`._tuning.SolverTuning`.
    """
    return (flat.device.type == "cuda" and flat.numel() <= tuning.host_max_scores
            and not torch.compiler.is_compiling() and _compiled.host_available(flat))


def _graph_of(S: Tensor, z: Tensor, c: int, big: Tensor) -> Tensor:
    """``[B, k, k]`` float64 expert graph of the assignment ``z`` for the scores ``S``."""
    B, _, k = S.shape
    if k == 1:
        return torch.zeros((B, 1, 1), dtype=torch.float64, device=S.device)
    if closed_form(k):
        return two_expert_graph(S, z, c, big)
    holder, counts = slot_table(z, k, c)
    return expert_graph(S, holder, counts, c, big)[0]


def _working_scores(S: Tensor, pairs: int | None = None) -> tuple[Tensor, Tensor | None, Tensor]:
    """Replace -inf by a finite penalty large enough that any feasible assignment beats one using it.

    ``pairs`` is the number of (token, expert) pairs a solution holds (default ``n``; ``k n`` for
    the b-matching of :mod:`.b_matching`): a solution with a forbidden pair is then worse than
    every one without, as ``penalty < lo - (hi - lo + 1) (pairs + 1)``.

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
    n = S.shape[-2] if pairs is None else pairs
    penalty = lo - (hi - lo + 1.0) * (n + 1)
    scale = torch.maximum(hi.abs(), lo.abs()).view(-1)
    return torch.where(forbidden, penalty.expand_as(S), finite), forbidden, scale
