"""Whether a ``-inf`` pattern admits the Sinkhorn marginals, decided by a maximum flow (diagnostics).

Sinkhorn balancing of ``p`` with ``-inf`` entries looks for a matrix ``q >= 0`` that is zero where
``p`` is, with row sums 1 and column sums ``c``. Such a ``q`` exists iff the flow network source ->
row ``i`` (capacity 1) -> column ``j`` (where ``p[i, j] > 0``) -> sink (capacity ``c_j``) carries
``n`` units; when it does not, the rows reachable from the source in the residual graph of a
maximum flow form a *Hall violator*: a set ``R`` of rows whose allowed columns ``C`` have targets
adding up to less than ``|R|`` (max-flow min-cut). Only :func:`~routelab.assignment.sinkhorn`'s
error path calls it, after the sweeps failed, to say which case it is.

The capacities are integers (scipy's ``maximum_flow``): everything is scaled by ``S`` and the
targets rounded, so the flow is exact to ``k / (2 S)`` units; a deficit within that is taken as
feasible (the sweeps then need more room, not other marginals).
"""

from __future__ import annotations

import numpy as np

__all__ = ["hall_violator"]

#: Largest capacity scipy's int32 flow can hold with room to spare.
_INT_LIMIT = 2**30


def hall_violator(finite: np.ndarray, target: np.ndarray) -> tuple[np.ndarray, np.ndarray, float] | None:
    """A set of rows whose allowed columns cannot take them, or None when the pattern is feasible.

    Args:
        finite: ``[n, k]`` bool, the allowed (finite) entries.
        target: ``[k]`` non-negative column sums adding up to ``n`` (every row sums to 1).

    Returns:
        ``(rows, cols, room)``: the row indices ``R``, the columns ``C`` they may use, and ``room =
        sum(target[C]) < len(R)``; ``None`` when a feasible matrix exists (to the flow's resolution).
    """
    # (imported here: scipy.sparse.csgraph, which loads scipy.linalg, adds ~0.5 s to `import routelab`)
    import scipy.sparse as sp
    from scipy.sparse.csgraph import breadth_first_order, maximum_flow

    n, k = finite.shape
    if n == 0:
        return None
    scale = max(1, min(2**20, _INT_LIMIT // max(n, 1)))  # every capacity, and the total, below 2^30
    rows, cols = np.nonzero(finite)
    source, sink = 0, n + k + 1
    tails = np.concatenate([np.full(n, source), 1 + rows, 1 + n + np.arange(k)])
    heads = np.concatenate([1 + np.arange(n), 1 + n + cols, np.full(k, sink)])
    caps = np.concatenate([np.full(n, scale), np.full(rows.size, scale),
                           np.rint(np.asarray(target, dtype=np.float64) * scale)]).astype(np.int32)
    graph = sp.csr_matrix((caps, (tails, heads)), shape=(sink + 1, sink + 1))
    result = maximum_flow(graph, source, sink)
    if result.flow_value >= n * scale - k:  # within the targets' rounding: feasible
        return None
    # The residual graph: capacity minus flow (scipy's flow is antisymmetric, so an arc with flow
    # leaves room backwards), arcs with room left.
    residual = (graph.astype(np.int64) - result.flow.astype(np.int64)).tocsr()
    residual.data = (residual.data > 0).astype(np.int8)
    residual.eliminate_zeros()
    reached = breadth_first_order(residual, source, directed=True, return_predecessors=False)
    seen = np.zeros(sink + 1, dtype=bool)
    seen[reached] = True
    bad_rows = np.nonzero(seen[1:n + 1])[0]
    allowed = np.nonzero(finite[bad_rows].any(0))[0]
    return bad_rows, allowed, float(np.asarray(target, dtype=np.float64)[allowed].sum())
