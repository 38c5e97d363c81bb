"""The b-matching benchmark runs on a tiny grid and agrees with its peers (no timing is asserted)."""

from __future__ import annotations

import io
import re

import numpy as np
import pytest
import torch

from routelab.assignment import balanced_b_matching
from routelab.bench.b_matching import ortools_b_matching, run_b_matching_benchmark, scipy_b_matching


@pytest.mark.parametrize("capacity", [None, 17, 40])
def test_peers_agree_with_routelab(capacity):
    # popular experts, so that a capacity binds some of them
    scores = torch.randn(40, 6, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    scores += torch.linspace(2.0, 0.0, 6, dtype=torch.float64)
    ours = float(scores.gather(-1, balanced_b_matching(scores, 2, capacity)).sum())
    for method in ("linprog", "milp"):
        best, seconds = scipy_b_matching(scores.numpy(), 2, method, capacity)
        assert best == pytest.approx(ours, rel=1e-9, abs=1e-9) and seconds >= 0
    pytest.importorskip("ortools")
    theirs, seconds = ortools_b_matching(scores.numpy(), 2, capacity)
    assert theirs == pytest.approx(ours, rel=1e-6) and seconds >= 0
    with pytest.raises(ValueError, match="method"):
        scipy_b_matching(np.zeros((2, 2)), 1, "simplex")


def test_a_size_of_the_wrong_length_or_no_instance_is_refused():
    with pytest.raises(ValueError, match="sizes"):
        run_b_matching_benchmark(((30, 4),), seeds=1)
    for seeds in (0, -1, 1.5):  # a review: --seeds 0 printed "same optimum: yes" for nothing measured
        with pytest.raises(ValueError, match="seeds"):
            run_b_matching_benchmark(((30, 4, 2),), seeds=seeds)


def test_tiny_benchmark_report():
    out = io.StringIO()
    text = run_b_matching_benchmark(((30, 4, 2), (24, 6, 3), (30, 4, 2, 1.2)), seeds=2, out=out)
    rows = [line for line in text.splitlines() if line.startswith("| 30 ") or line.startswith("| 24 ")]
    assert len(rows) == 3 and all(row.rstrip().endswith("| yes |") for row in rows)
    cells = [[c.strip() for c in row.strip("|").split("|")] for row in rows]
    assert [c[3] for c in cells] == ["balanced", "balanced", "18"]  # ceil(1.2 * 2 * 30 / 4)
    has_ortools = _has("ortools")
    for c in cells:  # the peers' median time over routelab's
        ratios = c[8:11] if has_ortools else c[9:11]
        assert all(float(r.removesuffix("x")) > 0 for r in ratios), c
        assert (c[5] == "missing") != has_ortools
    assert out.getvalue().strip() == text.strip()


def test_report_states_the_date_and_versions():
    """A review found the b-matching report gave only the CPU, threads and load: no date, no versions."""
    import scipy

    import routelab

    text = run_b_matching_benchmark(((12, 3, 1),), seeds=1)
    head = text.split("| n | E |")[0]
    assert re.search(r"date: \d{4}-\d{2}-\d{2} \d{2}:\d{2}", head)
    for version in (f"routelab {routelab.__version__}", f"torch {torch.__version__}", f"scipy {scipy.__version__}",
                    f"numpy {np.__version__}"):
        assert version in head
    ortools = _has("ortools")
    assert ("OR-Tools missing" in head) != ortools
    if ortools:
        import ortools as ot_pkg

        assert f"OR-Tools {ot_pkg.__version__}" in head


def test_ortools_is_not_called_network_simplex():
    """OR-Tools documents SimpleMinCostFlow as cost-scaling push-relabel; a review found it called
    network simplex (POT's ot.emd is the network simplex)."""
    import routelab.bench.b_matching as module

    assert "network simplex" not in module.__doc__ and "push-relabel" in module.__doc__


def test_speedup_is_the_peers_median_over_routelabs():
    from routelab.bench.b_matching import _speedup

    assert _speedup([3.0, 9.0, 6.0], [1.0, 3.0, 2.0]) == "3.0x"
    assert _speedup([1.0], [4.0]) == "0.25x"  # routelab slower: below 1, two significant digits
    assert _speedup([1.0], [190.0]) == "0.0053x"
    assert _speedup([0.996], [1.0]) == "0.996x"  # never "1x" for a peer that is faster
    assert _speedup([], [1.0]) == "—"  # the peer was skipped (milp above its size limit)


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None
