"""Exact oracles shared by the assignment tests and the fuzz suite (importable from every test
directory: pytest puts ``tests/``, the directory of the root ``conftest.py``, on ``sys.path``)."""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp
from scipy.optimize import linprog


def b_matching_lp(S: np.ndarray, k: int, lo: int, hi: int) -> np.ndarray | None:
    """A maximiser ``x [n, E]`` (0/1) of ``sum S x`` with ``k`` experts per token and every expert's
    load in ``[lo, hi]``, or ``None`` when no such matching avoids the ``-inf`` pairs.

    scipy's HiGHS on the ``n * E`` LP: its constraint matrix is totally unimodular, so the vertex
    it returns is integral (checked). Solved on ``(S - rowmax) / spread`` (every feasible point
    changes by the same constant times a positive factor: the same maximisers) with tolerances of
    ``1e-10``, so that near-ties far below the spread (``1e-5`` apart at a spread of ``100``) still
    end on an optimal vertex; HiGHS's default ``1e-7`` does not resolve them.
    """
    n, E = S.shape
    N = n * E
    fin = np.isfinite(S)
    rowmax = np.where(fin, S, -np.inf).max(1, keepdims=True)
    rows = np.isfinite(rowmax[:, 0])
    width = (rowmax[:, 0] - np.where(fin, S, np.inf).min(1))[rows]
    spread = float(width.max()) if width.size else 0.0
    norm = np.where(fin, S - np.where(np.isfinite(rowmax), rowmax, 0.0), 0.0) / max(spread, 1e-300)
    pairs = np.arange(N)
    per_token = sp.coo_matrix((np.ones(N), (np.repeat(np.arange(n), E), pairs)), shape=(n, N))
    per_expert = sp.coo_matrix((np.ones(N), (np.tile(np.arange(E), n), pairs)), shape=(E, N))
    res = linprog(
        -norm.ravel(),
        A_ub=sp.vstack([per_expert, -per_expert]),
        b_ub=np.concatenate([np.full(E, hi), np.full(E, -lo)]),
        A_eq=per_token,
        b_eq=np.full(n, k),
        bounds=np.stack([np.zeros(N), fin.ravel().astype(float)], 1),
        method="highs",
        options={"dual_feasibility_tolerance": 1e-10, "primal_feasibility_tolerance": 1e-10},
    )
    if res.status == 2:
        return None
    assert res.status == 0, res.message
    x = np.round(res.x).reshape(n, E)
    assert np.abs(res.x.reshape(n, E) - x).max() < 1e-6, "the LP vertex is not integral"
    assert (x.sum(1) == k).all() and (x.sum(0) >= lo).all() and (x.sum(0) <= hi).all()
    return x
