"""The b-matching benchmark runs on a tiny grid and agrees with scipy (no timing is asserted)."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from routelab.assignment import balanced_b_matching
from routelab.bench.b_matching import run_b_matching_benchmark, scipy_b_matching


def test_scipy_solvers_agree_with_routelab():
    scores = torch.randn(40, 6, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    ours = float(scores.gather(-1, balanced_b_matching(scores, 2)).sum())
    for method in ("linprog", "milp"):
        best, seconds = scipy_b_matching(scores.numpy(), 2, method)
        assert best == pytest.approx(ours, rel=1e-9, abs=1e-9) and seconds >= 0
    with pytest.raises(ValueError, match="method"):
        scipy_b_matching(np.zeros((2, 2)), 1, "simplex")


def test_tiny_benchmark_report():
    out = io.StringIO()
    text = run_b_matching_benchmark(((30, 4, 2), (24, 6, 3)), seeds=2, out=out)
    rows = [line for line in text.splitlines() if line.startswith("| 30 ") or line.startswith("| 24 ")]
    assert len(rows) == 2 and all(row.rstrip().endswith("| yes |") for row in rows)
    for row in rows:  # the peers' median time over routelab's
        r_linprog, r_milp = [c.strip() for c in row.strip("|").split("|")][6:8]
        assert float(r_linprog.removesuffix("x")) > 0 and float(r_milp.removesuffix("x")) > 0
    assert out.getvalue().strip() == text.strip()


def test_speedup_is_the_peers_median_over_routelabs():
    from routelab.bench.b_matching import _speedup

    assert _speedup([3.0, 9.0, 6.0], [1.0, 3.0, 2.0]) == "3.0x"
    assert _speedup([1.0], [4.0]) == "0.2x"  # routelab slower: below 1
    assert _speedup([], [1.0]) == "—"  # the peer was skipped (milp above its size limit)
