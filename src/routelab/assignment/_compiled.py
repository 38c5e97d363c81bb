"""The balanced-assignment solver as one compiled (numba) kernel on CPU: the speed machinery.

The pure-PyTorch solver of :mod:`.balanced` (prices, start, cycle cancelling) runs several hundred
small tensor operations per call; on CPU each costs microseconds of dispatch, which is most of the
time below ``n = 4096``. This module runs the same outline as straight loops, compiled by numba:

1. **Start (prices and a feasible assignment at once):** the auction algorithm for a
   transportation problem (Bertsekas): expert ``j`` has ``c`` copies, each with a price; an
   unplaced token bids for the cheapest copy of its best expert (value ``s[i, j] - price``),
   raising that copy's price by its lead over the second-best expert plus ``eps`` and evicting
   the copy's holder. ``eps`` shrinks phase by phase (``eps``-scaling); tokens that violate
   ``eps``-complementary slackness at the new ``eps`` bid again. The end is a feasible
   assignment in which every token is within ``eps`` of its best expert.
2. **Exact:** cycle cancelling on the expert graph (:mod:`._graph`, :mod:`._cycles`): Bellman-Ford
   from the auction's prices finds a negative cycle (a cycle of the predecessor graph), its tokens
   move, the touched experts' rows of the graph are refreshed; until Bellman-Ford converges,
   which certifies optimality with the same rounding guard (:func:`._cycles.cycle_tolerance`)
   as the PyTorch path.

The PyTorch path stays the reference (and the path on CUDA, for autograd-free tensors of other
devices, and whenever numba is missing or :data:`ENABLED` is ``False``); the tests check that both
reach the same optimum. Nothing here changes *what* the solver returns.
"""

from __future__ import annotations

import os

import numpy as np
import torch
from torch import Tensor

try:  # numba is a dependency; without it (an unusual install) the PyTorch path is used
    import numba
except ImportError:  # pragma: no cover - exercised only without numba
    numba = None

LAST_INFO = None
__all__ = ["ENABLED", "available", "solve_compiled"]

#: The switch of the compiled path (``False``: every call takes the PyTorch path). The environment
#: variable ``ROUTELAB_PURE_TORCH=1`` turns it off at import.
ENABLED = os.environ.get("ROUTELAB_PURE_TORCH", "") not in ("1", "true", "yes")

#: The auction's ``eps``, in units of the normalised scores (whose largest spread is in ``(1/2, 1]``).
#: Measured (float32 ``randn``, one thread): one phase at ``1e-3`` takes ~1.2 bids per token and
#: leaves 0-25 cycles to cancel up to ``n = 16384, k = 64``; ``eps``-scaling from ``0.05`` down
#: (phases ``/5``) took 50-100x more bids (copies of one expert outbid each other ``eps`` at a
#: time), and ``1e-2`` leaves 2-5x more cycles.
EPS = 1e-3

#: Error codes of the kernel.
_OK, _NO_CYCLE, _NO_END = 0, 1, 2


def available(S: Tensor) -> bool:
    """Whether the compiled path solves ``S`` (``[B, n, k]``): CPU, float32/float64, numba present."""
    return ENABLED and numba is not None and S.device.type == "cpu" and S.dtype in (torch.float32, torch.float64)


def solve_compiled(S: Tensor, c: int, tol: Tensor, big: Tensor) -> tuple[Tensor, Tensor, int]:
    """Exact assignment of the finite normalised scores ``S`` by the compiled kernel.

    Args:
        S: ``[B, n, k]`` finite float32/float64 scores on CPU.
        c: capacity (``c * k >= n``).
        tol: ``[B]`` float64 rounding guard of a cycle's cost (:func:`._cycles.cycle_tolerance`).
        big: ``[B]`` float64 release reward (:func:`._graph.release_weight`).

    Returns:
        ``(z, arc_cost, rounds)``: ``[B, n]`` long experts, the ``[B, k, k]`` float64 expert graph
        at the optimum and the largest number of cancelled cycles of an instance.
    """
    B, n, k = S.shape
    s = S.detach().contiguous().numpy()
    z = np.empty((B, n), dtype=np.int64)
    arc = np.empty((B, k, k), dtype=np.float64)
    info = np.zeros(4, dtype=np.int64)
    _kernels()[0](s, c, tol.numpy(), big.numpy(), EPS, z, arc, info)
    if info[0] == _NO_CYCLE:
        raise RuntimeError("balanced_assignment: Bellman-Ford found neither convergence nor a cycle; please report")
    if info[0] == _NO_END:
        raise RuntimeError("balanced_assignment: cycle cancelling did not terminate; please report this input")
    global LAST_INFO
    LAST_INFO = info.copy()
    return torch.from_numpy(z), torch.from_numpy(arc), int(info[1])


_COMPILED: list = []


def _kernels() -> list:
    """The compiled kernels (compiled on first use, cached on disk by numba)."""
    if not _COMPILED:
        _COMPILED.append(numba.njit(cache=True, nogil=True)(_solve_batch_py))
    return _COMPILED


# --------------------------------------------------------------------------------------------
# The kernel (plain Python, compiled by numba; also runnable as Python for debugging).
# --------------------------------------------------------------------------------------------


def _solve_batch_py(S, c, tol, big, eps, z_out, arc_out, info):  # noqa: C901
    B, n, k = S.shape
    inf = np.inf
    price = np.empty((k, c), dtype=np.float64)  # copy prices, a min-heap per expert
    holder = np.empty((k, c), dtype=np.int64)  # token per copy, -1 if free
    slot_of = np.empty(n, dtype=np.int64)  # heap position (j * c + slot) of every token, -1 if unplaced
    bid_of = np.empty(n, dtype=np.float64)  # the price each placed token pays
    stack = np.empty(n, dtype=np.int64)
    count = np.empty(k, dtype=np.int64)
    move = np.empty((k, k), dtype=np.float64)
    who = np.empty((k, k), dtype=np.int64)
    arc = np.empty((k, k), dtype=np.float64)
    dist = np.empty(k, dtype=np.float64)
    pred = np.empty(k, dtype=np.int64)
    mark = np.empty(k, dtype=np.int64)
    cyc = np.empty(k + 1, dtype=np.int64)
    mv_tok = np.empty(k, dtype=np.int64)
    mv_to = np.empty(k, dtype=np.int64)
    touched = np.zeros(k, dtype=np.bool_)
    max_rounds = 0
    for b in range(B):
        s = S[b]
        z = z_out[b]
        if k == 1:
            for i in range(n):
                z[i] = 0
            arc_out[b, 0, 0] = inf
            continue
        # ---- 1. auction with eps-scaling ------------------------------------------------------
        for j in range(k):
            for t in range(c):
                price[j, t] = 0.0
                holder[j, t] = -1
        for i in range(n):
            slot_of[i] = -1
        top = 0
        for i in range(n):
            stack[top] = n - 1 - i
            top += 1
        while True:  # one phase (a loop, so that phases of eps-scaling could be added)
            while top > 0:
                top -= 1
                i = stack[top]
                info[2] += 1
                best = -inf
                second = -inf
                jb = 0
                for j in range(k):
                    v = s[i, j] - price[j, 0]
                    if v > best:
                        second = best
                        best = v
                        jb = j
                    elif v > second:
                        second = v
                new_price = price[jb, 0] + (best - second) + eps
                old = holder[jb, 0]
                if old >= 0:
                    slot_of[old] = -1
                    stack[top] = old
                    top += 1
                # replace the heap top by (new_price, i) and sift it down
                pos = 0
                while True:
                    child = 2 * pos + 1
                    if child >= c:
                        break
                    if child + 1 < c and price[jb, child + 1] < price[jb, child]:
                        child += 1
                    if price[jb, child] >= new_price:
                        break
                    price[jb, pos] = price[jb, child]
                    h = holder[jb, child]
                    holder[jb, pos] = h
                    if h >= 0:
                        slot_of[h] = jb * c + pos
                    pos = child
                price[jb, pos] = new_price
                holder[jb, pos] = i
                slot_of[i] = jb * c + pos
                bid_of[i] = new_price
            break
        for j in range(k):
            count[j] = 0
        for i in range(n):
            j0 = slot_of[i] // c
            z[i] = j0
            count[j0] += 1
        # ---- 2. cycle cancelling on the expert graph --------------------------------------------
        for a in range(k):
            for j in range(k):
                move[a, j] = inf
                who[a, j] = -1
        for i in range(n):
            a = z[i]
            sa = s[i, a]
            for j in range(k):
                d = sa - s[i, j]
                if d < move[a, j]:
                    move[a, j] = d
                    who[a, j] = i
        for a in range(k):
            move[a, a] = inf
            dist[a] = price[a, 0]
        rounds = 0
        tol_b = tol[b]
        big_b = big[b]
        while True:
            # the graph: the cheaper of the move and the release arc
            for a in range(k):
                for j in range(k):
                    r = inf
                    if a != j and count[a] < c and count[j] > 0:
                        r = -big_b if count[j] > c else 0.0
                    arc[a, j] = move[a, j] if move[a, j] <= r else r
            # Bellman-Ford from a virtual source with labels dist; a cycle of the predecessor
            # graph is a negative cycle
            for a in range(k):
                pred[a] = -1
            found = -1
            converged = False
            for _sweep in range(2 * k + 8):
                changed = False
                for a in range(k):
                    da = dist[a]
                    for j in range(k):
                        cand = da + arc[a, j]
                        if cand < dist[j] - tol_b:
                            dist[j] = cand
                            pred[j] = a
                            changed = True
                if not changed:
                    converged = True
                    break
                # look for a cycle in the predecessor graph
                for a in range(k):
                    mark[a] = -1
                for a0 in range(k):
                    if mark[a0] != -1:
                        continue
                    a = a0
                    while a >= 0 and mark[a] == -1:
                        mark[a] = a0
                        a = pred[a]
                    if a >= 0 and mark[a] == a0:
                        found = a
                        break
                if found >= 0:
                    break
            if converged:
                break
            if found < 0:
                info[0] = _NO_CYCLE
                return
            rounds += 1
            info[3] += 1
            if rounds > 10 * n * k + 100:
                info[0] = _NO_END
                return
            # the cycle's nodes, following pred backwards from `found`
            m = 0
            a = found
            while True:
                cyc[m] = a
                m += 1
                a = pred[a]
                if a == found:
                    break
            # every node v whose in-arc u -> v is a move arc receives u's cheapest token
            nm = 0
            for t in range(m):
                v = cyc[t]
                u = pred[v]
                touched[u] = True
                touched[v] = True
                if move[u, v] <= arc[u, v]:
                    mv_tok[nm] = who[u, v]
                    mv_to[nm] = v
                    nm += 1
            for t in range(nm):
                i = mv_tok[t]
                count[z[i]] -= 1
                z[i] = mv_to[t]
                count[mv_to[t]] += 1
            # refresh the touched experts' rows
            for a in range(k):
                if not touched[a]:
                    continue
                for j in range(k):
                    move[a, j] = inf
                    who[a, j] = -1
            for i in range(n):
                a = z[i]
                if not touched[a]:
                    continue
                sa = s[i, a]
                for j in range(k):
                    d = sa - s[i, j]
                    if d < move[a, j]:
                        move[a, j] = d
                        who[a, j] = i
            for a in range(k):
                if touched[a]:
                    move[a, a] = inf
                    touched[a] = False
        for a in range(k):
            for j in range(k):
                arc_out[b, a, j] = arc[a, j]
        if rounds > max_rounds:
            max_rounds = rounds
    info[0] = _OK
    info[1] = max_rounds
