"""Sinkhorn's error path for ``-inf`` patterns: a maximum flow decides whether the marginals can be met.

Oracle: scipy's HiGHS LP on the transport polytope (rows sum to 1, columns to the targets, zero
where the pattern forbids) is feasible exactly when the flow says so, and the Hall violator it
names is checked directly (its rows may use only its columns, whose targets are too small).
"""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from scipy.optimize import linprog

from routelab.assignment import sinkhorn
from routelab.assignment._feasibility import hall_violator


def _lp_feasible(finite: np.ndarray, target: np.ndarray) -> bool:
    n, k = finite.shape
    rows, cols = np.nonzero(finite)
    m = rows.size
    a_eq = sp.vstack([sp.csr_matrix((np.ones(m), (rows, np.arange(m))), shape=(n, m)),
                      sp.csr_matrix((np.ones(m), (cols, np.arange(m))), shape=(k, m))])
    res = linprog(np.zeros(m), A_eq=a_eq, b_eq=np.concatenate([np.ones(n), target]), bounds=(0, None),
                  method="highs")
    return res.status == 0


@pytest.mark.parametrize("seed", range(40))
def test_the_flow_agrees_with_the_lp_and_names_a_true_violator(seed):
    rng = np.random.default_rng(seed)
    n, k = int(rng.integers(1, 40)), int(rng.integers(2, 9))
    finite = rng.random((n, k)) < rng.uniform(0.1, 0.6)
    finite[np.arange(n), rng.integers(0, k, n)] = True  # every row has an entry (else an earlier error)
    target = rng.dirichlet(np.ones(k)) * n if seed % 2 else np.full(k, n / k)
    found = hall_violator(finite, target)
    assert (found is None) == _lp_feasible(finite, target)
    if found is not None:
        rows, cols, room = found
        assert rows.size > 0 and not finite[np.ix_(rows, np.setdiff1d(np.arange(k), cols))].any()
        assert room == pytest.approx(target[cols].sum()) and room < rows.size


def test_an_infeasible_pattern_is_named_with_its_tokens_and_experts():
    """It ran max_iter sweeps and said the pattern "may" be infeasible; now it says which tokens."""
    log_p = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    log_p[:40, 1:] = float("-inf")  # 40 tokens may only use expert 0, whose target is 8
    with pytest.raises(ValueError, match=r"infeasible .*rows \[0, 1, 2, 3, 4, 5, 6, 7, \.\.\.\] \(40 tokens\) "
                                         r"have finite entries only in columns \[0\], whose col_sum adds up to 8 < 40"):
        sinkhorn(log_p, max_iter=50)
    batch = torch.zeros(3, 64, 8)
    batch[2] = log_p
    with pytest.raises(ValueError, match="batch instance 2: rows"):
        sinkhorn(batch, max_iter=50)


def test_a_feasible_pattern_that_needs_more_sweeps_says_so():
    log_p = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    log_p[:8, 1:] = float("-inf")  # exactly fills expert 0: feasible, but only in the limit of the sweeps
    with pytest.raises(ValueError, match="admits the marginals .* raise max_iter or tol"):
        sinkhorn(log_p, max_iter=3, tol=1e-9)
