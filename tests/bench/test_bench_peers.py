"""Smoke tests of routelab.bench.peers on tiny sizes: the peer table, its verdicts, the batched
row, the phase breakdown, a missing peer, the sinkhorn table; and the fairseq auction peer."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from scipy.optimize import linear_sum_assignment

from routelab.bench import peers


@pytest.fixture
def tiny(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(peers, "QUICK_NS", (32,))
    monkeypatch.setattr(peers, "KS", (4,))
    monkeypatch.setattr(peers, "QUICK_REPEATS", {32: 2})
    monkeypatch.setattr(peers, "BATCH", (3, 32, 4))
    monkeypatch.setattr(peers, "PHASE_SIZE", (32, 4))
    monkeypatch.setattr(peers, "QUICK_SINKHORN_SIZES", ((32, 4),))
    monkeypatch.setattr(peers, "SINKHORN_TEMPERATURES", (1.0,))


def _optimum(s: torch.Tensor) -> float:
    n, k = s.shape
    rows, cols = linear_sum_assignment(np.repeat(s.double().numpy(), n // k, axis=1), maximize=True)
    return float(s.double().numpy()[rows, cols // (n // k)].sum())


def test_fairseq_auction_is_feasible_and_near_optimal() -> None:
    for seed in range(5):
        s = torch.randn(64, 8, generator=torch.Generator().manual_seed(seed))
        z = peers.fairseq_auction(s).numpy()
        assert np.bincount(z, minlength=8).max() <= 8 and len(z) == 64
        got = float(s.double().numpy()[np.arange(64), z].sum())
        best = _optimum(s)
        assert got <= best + 1e-9 and (best - got) / abs(best) < 0.05


def test_assignment_peer_table(tiny: None) -> None:
    out = io.StringIO()
    text = peers.run_assignment_peers(quick=True, out=out)
    assert out.getvalue() == text
    rows = [line for line in text.splitlines() if line.startswith("| 32 | 4 |")]
    assert len(rows) == 1
    assert "exact on every instance (" in text and "): met" in text
    assert "faster than the fairseq auction at every size" in text
    assert "Batched per-sequence routing" in text
    assert "Memory bound" in text or "not in use" in text
    for name, _ in [("scipy LSA", 0)]:
        assert name in text
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert all("INFEASIBLE" not in c for c in cells)


def test_an_answer_over_capacity_does_not_raise_the_best_objective() -> None:
    """A peer that sends every token to its own best expert (ignoring capacity) scores above the
    optimum; the gaps are measured against the best feasible answer, so routelab's stays 0 and
    the greedy peer is reported infeasible."""
    greedy = peers.Peer("greedy", exact=False, prepare=lambda x: x, solve=lambda x: x.argmax(-1).numpy())
    res = peers._measure_size(32, 4, 2, [greedy], {})
    assert res.cells["routelab"].feasible and res.cells["routelab"].gap <= 1e-12
    assert not res.cells["greedy"].feasible


def test_missing_peer_is_reported(tiny: None, monkeypatch: pytest.MonkeyPatch) -> None:
    real = peers._module
    monkeypatch.setattr(peers, "_module", lambda name: None if name in ("ot", "ortools.graph.python.min_cost_flow")
                        else real(name))
    text = peers.run_assignment_peers(quick=True)
    assert "Missing peers (not installed): POT ot.emd" in text and "OR-Tools" in text
    assert "| 32 | 4 |" in text  # routelab, scipy and the auction still run


def test_sinkhorn_peer_table(tiny: None) -> None:
    text = peers.run_sinkhorn_peers(quick=True)
    rows = [line for line in text.splitlines() if line.startswith("| float")]
    assert len(rows) == 2  # float32 and float64 at T = 1
    assert "Target (at least as fast as POT" in text or "POT is missing" in text


def test_sinkhorn_tolerance_is_floored_for_float32() -> None:
    assert peers.sinkhorn_tolerance(torch.float64, 1024, 16) == peers.SINKHORN_TOL
    assert peers.sinkhorn_tolerance(torch.float32, 4096, 64) > 1e-3
