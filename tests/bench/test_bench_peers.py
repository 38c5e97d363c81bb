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


def test_fairseq_auction_with_one_expert_sends_every_token_to_it() -> None:
    """k = 1 (capacity n) meets the documented precondition (k divides n); a review found it
    crashed in ``topk(c + 1)``. The only assignment is every token to expert 0."""
    for n in (1, 4, 9):
        z = peers.fairseq_auction(torch.randn(n, 1, generator=torch.Generator().manual_seed(n)))
        assert z.dtype == torch.long and z.tolist() == [0] * n
    auction = next(p for p in peers.peers()[0] if p.name == "fairseq auction")
    res = peers._measure_size(4, 1, 1, [auction], {})  # the peer table's entry point
    assert res.cells["fairseq auction"].feasible and res.cells["fairseq auction"].gap == 0


# ---------------------------------------------------------------- Sinkhorn against POT at equal accuracy


def _plain_sweeps(p: np.ndarray, tol: float, max_iter: int = 10_000) -> int:
    """Independent truth: the plain Sinkhorn sweeps (columns to n/k, then rows to 1, in float64)
    after which the largest column error of ``p [n, k]`` (rows normalised) is within ``tol``."""
    n, k = p.shape
    q = p / p.sum(1, keepdims=True)
    for sweep in range(max_iter + 1):
        if np.abs(q.sum(0) - n / k).max() <= tol:
            return sweep
        q = q * (n / k / q.sum(0))
        q = q / q.sum(1, keepdims=True)
    raise AssertionError("no convergence")


def _plain_plan(p: np.ndarray, sweeps: int) -> np.ndarray:
    n, k = p.shape
    q = p / p.sum(1, keepdims=True)
    for _ in range(sweeps):
        q = q * (n / k / q.sum(0))
        q = q / q.sum(1, keepdims=True)
    return q


def test_routelab_sweeps_counts_the_plain_sinkhorn_sweeps() -> None:
    for seed, (n, k) in enumerate([(32, 4), (64, 8), (48, 3)]):
        log_p = torch.log_softmax(torch.randn(n, k, generator=torch.Generator().manual_seed(seed),
                                              dtype=torch.float64), -1)
        truth = _plain_sweeps(log_p.exp().numpy(), 1e-6)
        assert truth >= 2 and peers._routelab_sweeps(log_p, 1e-6) == truth


class _FakePOT:
    """Stands in for ``ot``: records every ``ot.sinkhorn`` call (with the sweeps routelab needs on
    that instance, by :func:`_plain_sweeps`) and returns the plain Sinkhorn plan."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def sinkhorn(self, a, b, M, reg, method, stopThr, numItermax):  # noqa: N803 (POT's names)
        n, k = M.shape
        p = np.exp(-M.astype(np.float64))
        tol = peers.sinkhorn_tolerance(torch.float32 if M.dtype == np.float32 else torch.float64, n, k)
        self.calls.append({"method": method, "stopThr": stopThr, "numItermax": numItermax,
                           "dtype": M.dtype, "needed": _plain_sweeps(p, tol)})
        sweeps = numItermax if stopThr == 0 else _plain_sweeps(p, stopThr)
        return _plain_plan(p, sweeps).astype(M.dtype)


def test_pot_is_timed_for_exactly_the_sweeps_routelab_needed(tiny: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A review found POT timed with its own stopping rule, tested every 10 sweeps: >= 11 sweeps
    against routelab's 2-7, so the ratio compared unequal work. Both POT methods that count for the
    target now run exactly routelab's sweeps on every instance (stopThr 0), the same iterate."""
    fake = _FakePOT()
    real = peers._module
    monkeypatch.setattr(peers, "_module", lambda name: fake if name == "ot" else real(name))
    text = peers.run_sinkhorn_peers(quick=True)
    for dtype in (np.float32, np.float64):
        for method in ("sinkhorn", "sinkhorn_log"):
            same = [c for c in fake.calls if c["method"] == method and c["dtype"] == dtype and c["stopThr"] == 0]
            assert len(same) == 3 + 1  # 3 instances (quick) and the warm-up
            assert all(c["numItermax"] == c["needed"] for c in same), same
    own_rule = [c for c in fake.calls if c["stopThr"] != 0]
    assert own_rule and all(c["method"] == "sinkhorn" for c in own_rule)  # information only
    assert "at equal accuracy" in text and "Equal accuracy, checked" in text


def test_pot_at_routelabs_sweeps_reaches_routelabs_column_error() -> None:
    """With the real POT: on every instance its same-sweeps runs end with routelab's column error."""
    ot = pytest.importorskip("ot")
    cell = peers._sinkhorn_cell(ot, torch.float64, 1.0, 64, 4, 3)
    for seed, sweeps in enumerate(cell.sweeps):
        log_p = torch.log_softmax(torch.randn(64, 4, generator=torch.Generator().manual_seed(seed),
                                              dtype=torch.float64), -1)
        assert sweeps == _plain_sweeps(log_p.exp().numpy(), peers.SINKHORN_TOL)
    for name in peers.POT_SAME_SWEEPS:
        assert cell.err[name] <= peers.SINKHORN_TOL
        assert cell.err_ratio[name] == pytest.approx(1.0, rel=1e-6)
    # POT's own stopping rule (tested after sweeps 1, 11, 21, ...) runs at least as long: as accurate or more
    assert cell.err[peers.POT_OWN_RULE] <= cell.err["routelab"] * (1 + 1e-9)
