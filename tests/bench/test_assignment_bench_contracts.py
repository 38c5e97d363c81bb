"""Contracts of ``routelab bench assignment`` (routelab.bench.assignment) that its smoke tests leave open.

Written for the mutation round of the benchmark modules: each test checks a documented number or
decision of the table against an independent truth (a hand computation, a fake clock whose times
are known, scipy's HiGHS on the assignment LP from ``tests/oracles.py``), on tiny sizes and
without asserting anything about real time.
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from test_bench import table_rows

from oracles import b_matching_lp
from routelab.assignment import balanced_assignment as real_balanced_assignment
from routelab.assignment import sinkhorn as real_sinkhorn
from routelab.bench import assignment as bench


def _fake_clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Replace the module's clock by one that only moves when a test advances it (``clock[0] += s``)."""
    clock = [0.0]
    monkeypatch.setattr(bench, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    return clock


def _scipy_optimum(s: torch.Tensor) -> float:
    """The optimal objective of the balanced assignment of ``s [n, k]`` (capacity ``n / k``): scipy's
    HiGHS on the LP of the 1-matching with loads at most ``n / k`` (:func:`oracles.b_matching_lp`)."""
    n, k = s.shape
    s64 = s.double().numpy()
    return float((s64 * b_matching_lp(s64, 1, 0, n // k)).sum())


def _swap_two_tokens(z: torch.Tensor) -> torch.Tensor:
    """``z`` with token 0 and the first token on another expert swapped: loads unchanged, objective changed."""
    z = z.clone()
    j = int((z != z[0]).nonzero()[0])
    z[0], z[j] = z[j].clone(), z[0].clone()
    return z


# ------------------------------------------------------------------ timing: the median, in milliseconds


def test_the_reported_time_is_the_median_of_the_timed_calls_in_ms(monkeypatch: pytest.MonkeyPatch) -> None:
    """Timed call i takes (by the fake clock) 1, 2, 10, 3, 4 ms: the median is 3 ms (not the minimum
    1 ms nor the mean 4 ms), reported in ms (not s, not us)."""
    clock = _fake_clock(monkeypatch)
    durations_s = [0.001, 0.002, 0.010, 0.003, 0.004]

    def fn(i: int) -> int:
        clock[0] += durations_s[i]
        return i

    timings, results = bench._time_paired({"fn": fn}, repeats=5, budget_s=100.0, device="cpu")
    assert timings["fn"].runs == 5 and results["fn"] == [0, 1, 2, 3, 4]
    assert timings["fn"].median_ms == pytest.approx(3.0)


# ------------------------------------------------------------------ checks of routelab's answer


def test_feasible_means_experts_in_range_and_no_expert_over_its_capacity() -> None:
    assert bench._is_feasible(np.array([0, 1, 1, 0]), 2, 2)  # exactly at capacity: feasible
    assert not bench._is_feasible(np.array([0, 0, 0, 1]), 2, 2)  # expert 0 holds 3 > 2
    assert not bench._is_feasible(np.array([0, 1, 2, 0]), 2, 2)  # expert 2 does not exist for k = 2
    assert not bench._is_feasible(np.array([0, 1, -1, 0]), 2, 2)


def test_same_optimum_is_judged_to_the_documented_relative_tolerance() -> None:
    """The note says "equals scipy's to relative 1e-06": ten times that apart is not the same optimum."""
    assert bench.OPTIMUM_RTOL == 1e-6
    assert bench._same_value(100.0, 100.0 * (1 + 1e-7))
    assert not bench._same_value(100.0, 100.0 * (1 + 1e-5))
    assert not bench._same_value(-100.0, -100.0 * (1 + 1e-5))


def test_a_suboptimal_routelab_answer_is_not_the_same_optimum(monkeypatch: pytest.MonkeyPatch) -> None:
    """routelab's answer with two tokens swapped (feasible, a lower objective by scipy's own
    computation) must print "no" and the two objectives, on a single instance."""
    s = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
    swapped = _swap_two_tokens(real_balanced_assignment(s))
    ours = float(s.double()[torch.arange(32), swapped].sum())
    assert ours < _scipy_optimum(s) * (1 - 1e-5)  # the independent truth: clearly suboptimal
    monkeypatch.setattr(bench, "balanced_assignment", lambda scores, *a, **kw: _swap_two_tokens(
        real_balanced_assignment(scores, *a, **kw)))
    row = bench._measure(32, 4, repeats=1, budget_s=10.0, device="cpu", seed=0, scipy_measured={},
                         scipy_limit_s=60.0)
    assert row.same_optimum is False
    assert row.objectives == (pytest.approx(ours), pytest.approx(_scipy_optimum(s)))


# ------------------------------------------------------------------ when scipy is skipped


def test_scipy_estimate_scales_the_largest_smaller_n_cubed() -> None:
    """``_scipy_estimate_s``: the largest measured n0 < n at the same k (else at any k, the slowest
    there), times (n / n0)^3; None when nothing smaller was measured."""
    measured = {(16, 4): 0.001, (16, 2): 0.003, (32, 4): 0.002, (32, 2): 0.005}
    assert bench._scipy_estimate_s(64, 4, measured) == pytest.approx(0.002 * 8)  # n0 = 32, same k
    assert bench._scipy_estimate_s(128, 2, measured) == pytest.approx(0.005 * 64)
    assert bench._scipy_estimate_s(64, 8, measured) == pytest.approx(0.005 * 8)  # no k = 8: the slowest at n0 = 32
    assert bench._scipy_estimate_s(16, 8, measured) is None  # nothing smaller than n = 16
    assert bench._scipy_estimate_s(32, 8, {(32, 4): 1.0}) is None  # the same n is not smaller


def test_scipy_never_runs_from_scipy_never_n_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """``never run for n >= SCIPY_NEVER_N``: at n equal to it, scipy is skipped whatever the estimate."""
    monkeypatch.setattr(bench, "SCIPY_NEVER_N", 32)
    row = bench._measure(32, 4, repeats=1, budget_s=10.0, device="cpu", seed=0, scipy_measured={},
                         scipy_limit_s=1e9)
    assert row.scipy is None and row.same_optimum is None
    assert row.scipy_skip == "n >= 32"
    assert "skipped (n >= 32)" in bench._render_row(row)


def test_a_size_whose_k_does_not_divide_n_is_refused() -> None:
    with pytest.raises(ValueError, match="k must divide n"):
        bench._benchmark([(10, 4)], 1, budget_s=1.0)


# ------------------------------------------------------------------ sinkhorn's column


def test_a_sinkhorn_error_other_than_non_convergence_is_raised_not_tabled(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(log_p: torch.Tensor, **kwargs) -> torch.Tensor:
        raise ValueError("sinkhorn: log_p must be finite")

    monkeypatch.setattr(bench, "sinkhorn", broken)
    with pytest.raises(ValueError, match="finite"):
        bench._sinkhorn_or_error(torch.zeros(8, 2))


def test_only_a_sinkhorn_that_did_not_converge_is_marked_not_converged(monkeypatch: pytest.MonkeyPatch) -> None:
    """At n = 16, k = 4 the sinkhorn of the benchmark converges on every instance (checked here by
    calling it directly): no "(not converged)" in the row. With one sweep allowed it cannot, and
    the column error of its message is what the row keeps."""
    log_p = [torch.log_softmax(torch.randn(16, 4, generator=torch.Generator().manual_seed(i)), -1) for i in range(2)]
    for x in log_p:  # the independent truth: the real call converges (it raises when it does not)
        real_sinkhorn(x, tol=bench.SINKHORN_TOL, max_iter=bench.SINKHORN_MAX_ITER)
    row = bench._measure(16, 4, repeats=2, budget_s=10.0, device="cpu", seed=0, scipy_measured={},
                         scipy_limit_s=60.0)
    assert row.sinkhorn_error is None
    assert "not converged" not in bench._render_row(row)

    monkeypatch.setattr(bench, "SINKHORN_MAX_ITER", 1)
    message = ""
    try:
        real_sinkhorn(log_p[0], tol=bench.SINKHORN_TOL, max_iter=1)
    except ValueError as exc:
        message = str(exc)
    assert "did not converge" in message
    error = bench._sinkhorn_or_error(log_p[0])
    assert isinstance(error, str) and f"off by up to {error}" in message


# ------------------------------------------------------------------ rendering


def _row(**kw) -> bench.Row:
    base = dict(n=16, k=4, routelab=bench.Timing(2.0, 3), gumbel=bench.Timing(1.0, 3), sinkhorn=bench.Timing(3.0, 3),
                requested=3)
    return bench.Row(**{**base, **kw})


def test_speed_up_is_scipy_ms_over_routelab_ms() -> None:
    """The note: "speed-up = scipy ms / routelab ms": scipy 10 ms, routelab 2 ms -> 5.0x."""
    header, [cells] = table_rows("\n".join([*bench.TABLE_HEADER,
                                            bench._render_row(_row(scipy=bench.Timing(10.0, 3), same_optimum=True))]))
    col = dict(zip(header, cells))
    assert col["speed-up"] == "5.0x" and col["scipy ms"] == "10.0" and col["routelab ms"] == "2.00"


def test_growth_sentence_from_times_that_grow_as_n_squared() -> None:
    """Times 1, 16, 256 ms at n = 256, 1024, 4096: 16.0x per 4x n and a fitted exponent of 2.00; a 2x
    step (n = 256 -> 512, 1 -> 4 ms) is scaled to a 4x step: also 16.0x, and said so."""
    rows = [_row(n=n, k=4, routelab=bench.Timing(t, 3)) for n, t in ((256, 1.0), (1024, 16.0), (4096, 256.0))]
    text = bench._growth_sentence(rows)
    assert "k=4: 16.0x, 16.0x (fitted time ~ n^2.00)" in text
    assert "scaled to 4x" not in text
    two = bench._growth_sentence([_row(n=256, k=2, routelab=bench.Timing(1.0, 3)),
                                  _row(n=512, k=2, routelab=bench.Timing(4.0, 3))])
    assert "k=2: 16.0x (fitted time ~ n^2.00)" in two and "scaled to 4x" in two


def test_fewer_timed_calls_are_noted_only_where_fewer_were_made() -> None:
    full = _row(scipy=bench.Timing(5.0, 3))
    short = _row(n=32, routelab=bench.Timing(2.0, 1), scipy=bench.Timing(5.0, 1))
    assert not any("Fewer timed calls" in line for line in bench._notes([full], device="cpu"))
    [line] = [line for line in bench._notes([full, short], device="cpu") if "Fewer timed calls" in line]
    assert "routelab at n=32, k=4: 1" in line and "scipy at n=32, k=4: 1" in line and "n=16" not in line


# ------------------------------------------------------------------ batched section


def test_a_per_instance_routelab_answer_that_differs_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop row calls ``balanced_assignment`` on one [n, k] instance at a time; if those answers
    are worse than the batched call's (scipy confirms they are not optimal), the table must say
    DIFFERS and the notes an exactness bug, not "same"."""
    def per_instance_faulty(scores: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        z = real_balanced_assignment(scores, *args, **kwargs)
        return _swap_two_tokens(z) if scores.dim() == 2 else z

    x = torch.randn(2, 32, 4, generator=torch.Generator().manual_seed(0))
    faulty = float(x[0].double()[torch.arange(32), per_instance_faulty(x[0])].sum())
    assert faulty < _scipy_optimum(x[0]) * (1 - 1e-5)
    monkeypatch.setattr(bench, "balanced_assignment", per_instance_faulty)
    size = bench._measure_batched(2, 32, 4, repeats=1, budget_s=10.0, device="cpu", seed=0)
    assert size.same_optimum is False
    rows = {cells[0]: cells for cells in table_rows("\n".join(bench._render_batched(size)))[1]}
    [loop] = [cells for name, cells in rows.items() if "one call per instance" in name and "routelab" in name]
    assert loop[6] == "DIFFERS"
    assert any("DIFFER" in line for line in bench._batched_notes([size], device="cpu"))


def test_auction_gap_mean_and_max_against_scipy(monkeypatch: pytest.MonkeyPatch) -> None:
    """An auction that answers round robin (token t to expert t mod k: feasible, suboptimal): its
    gaps (opt - auction) / |opt| per instance, with opt from scipy, give the row's mean and max."""
    b, n, k, seed = 3, 32, 4, 5
    monkeypatch.setattr(bench, "fairseq_auction", lambda s: torch.arange(s.shape[0]) % s.shape[1])
    size = bench._measure_batched(b, n, k, repeats=2, budget_s=100.0, device="cpu", seed=seed)
    runs = size.methods["batched"].timing.runs
    assert runs == 2 and size.instances == b * runs
    gaps = []
    for r in range(runs):
        batch = torch.randn(b, n, k, generator=torch.Generator().manual_seed(seed + r))
        for j in range(b):
            opt = _scipy_optimum(batch[j])
            rr = float(batch[j].double()[torch.arange(n), torch.arange(n) % k].sum())
            gaps.append((opt - rr) / abs(opt))
    assert size.auction_gap_mean == pytest.approx(float(np.mean(gaps)), rel=1e-6)
    assert size.auction_gap_max == pytest.approx(max(gaps), rel=1e-6)
    assert size.auction_gap_max > size.auction_gap_mean > 0
    assert size.auction_infeasible == 0 and size.auction_above == 0


def test_feasibility_is_judged_on_every_timed_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """An auction over capacity on the second batch only: its feasible cell must say NO."""
    b, n, k = 2, 32, 4
    second = torch.randn(b, n, k, generator=torch.Generator().manual_seed(1))
    assert not bench._batch_feasible(second.argmax(-1), b, n, k)  # argmax overfills an expert here

    def auction(scores: torch.Tensor) -> torch.Tensor:
        if any(torch.equal(scores, second[j]) for j in range(b)):
            return scores.argmax(-1)
        return torch.arange(scores.shape[0]) % scores.shape[1]

    monkeypatch.setattr(bench, "fairseq_auction", auction)
    size = bench._measure_batched(b, n, k, repeats=2, budget_s=100.0, device="cpu", seed=0)
    assert size.methods["batched"].timing.runs == 2
    assert size.methods["auction"].feasible is False
    assert size.auction_infeasible > 0
    assert size.methods["batched"].feasible is True and size.methods["loop"].feasible is True



def test_fewer_timed_batches_are_noted_only_where_fewer_were_made() -> None:
    """The batched notes' "N timed batch(es) instead of R" appears for a size whose methods timed fewer
    batches than requested, and for no other size (review s43, leftovers: A31)."""
    def size(n: int, runs: int) -> bench.BatchedSize:
        methods = {key: bench.BatchedMethod(name=key, timing=bench.Timing(1.0, runs), feasible=True)
                   for key in ("batched", "device", "loop", "auction")}
        return bench.BatchedSize(b=2, n=n, k=4, methods=methods, instances=2 * runs, requested=3)

    assert not any("instead of" in line for line in bench._batched_notes([size(32, 3)], device="cpu"))
    [line] = [line for line in bench._batched_notes([size(32, 3), size(64, 1)], device="cpu") if "instead of" in line]
    assert "n=64" in line and "1 timed batch(es) instead of 3" in line


# ------------------------------------------------------------------ threads


def test_run_benchmark_sets_its_threads_and_restores_torchs_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """``threads``: torch's intra-op threads while measuring, restored afterwards. With torch at 2
    threads (the one-thread test environment would hide a missing restore), a run with threads=1
    reports 1 in its header and leaves torch at 2 (review s43, leftovers: A26)."""
    monkeypatch.setattr(bench, "QUICK_NS", (16,))
    monkeypatch.setattr(bench, "KS", (4,))
    monkeypatch.setattr(bench, "QUICK_REPEATS", {16: 1})
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        text = bench.run_benchmark(quick=True, threads=1)
        assert "torch threads: 1" in text
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
