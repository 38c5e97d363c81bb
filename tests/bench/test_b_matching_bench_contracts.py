"""Contracts of ``routelab bench b-matching`` (routelab.bench.b_matching) that its smoke tests leave open.

Written for the mutation round of the benchmark modules: the instances and capacities the module
documents, each peer's correctness check counting on its own, the milp size limit, the medians and
ratios of the table (from a fake clock and fake peer times, so that nothing depends on real time),
the threads and the command line's defaults.
"""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch

from oracles import b_matching_lp
from routelab.assignment.b_matching import b_matching_quotas
from routelab.bench import b_matching as module

TINY = ((30, 4, 2), (30, 4, 2, 1.1))


def _cells(text: str, n: int) -> list[list[str]]:
    """The cells of the table rows of size ``n`` in the report ``text``."""
    return [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()
            if line.startswith(f"| {n} |")]


COLUMNS = ("n", "E", "k", "capacity", "routelab ms", "OR-Tools ms", "linprog ms", "milp ms", "OR-Tools / routelab",
           "linprog / routelab", "milp / routelab", "same optimum")


def _row(text: str, n: int) -> dict[str, str]:
    [cells] = _cells(text, n)
    return dict(zip(COLUMNS, cells, strict=True))


# ------------------------------------------------------------------ the instances


def test_a_capacity_row_has_capacity_ceil_f_k_n_over_e() -> None:
    """ceil(1.1 * 2 * 30 / 4) = ceil(16.5) = 17 (the module's own example, 1.2, is an integer: 18)."""
    assert module._capacity(30, 4, 2, 1.1) == 17
    assert module._capacity(30, 4, 2, None) is None
    assert module._instance((30, 4, 2, 1.1), 0)[2] == 17


def test_capacity_rows_add_the_popular_expert_bias_and_balanced_rows_do_not() -> None:
    """Documented: scores ``torch.randn(n, E)`` from the seed; capacity rows add ``linspace(2, 0, E)``."""
    plain = torch.randn(30, 4, generator=torch.Generator().manual_seed(3))
    balanced, k, capacity = module._instance((30, 4, 2), 3)
    assert torch.equal(balanced, plain) and (k, capacity) == (2, None)
    biased, _, _ = module._instance((30, 4, 2, 1.1), 3)
    assert torch.allclose(biased - plain, torch.tensor([2.0, 4 / 3, 2 / 3, 0.0]).expand(30, 4))


# ------------------------------------------------------------------ the peers against an independent oracle


@pytest.mark.parametrize("size", [(40, 6, 2), (30, 4, 3, 1.2)], ids=["balanced-fractional-quota", "capacity"])
def test_scipy_peers_reach_the_oracles_optimum(size) -> None:
    """linprog and milp against the LP oracle of ``tests/oracles.py`` with the quotas of
    :func:`b_matching_quotas` (E does not divide k n at 40, 6, 2: the lower quota floor(k n / E) binds)."""
    scores, k, capacity = module._instance(size, 0)
    s64 = scores.double().numpy()
    lo, hi = b_matching_quotas(s64.shape[0], s64.shape[1], k, capacity)
    best = float((s64 * b_matching_lp(s64, k, lo, hi)).sum())
    for method in ("linprog", "milp"):
        value, _ = module.scipy_b_matching(s64, k, method, capacity)
        assert value == pytest.approx(best, rel=1e-9, abs=1e-9), method


# ------------------------------------------------------------------ "same optimum": every peer's check counts


def _offset_peer(monkeypatch: pytest.MonkeyPatch, peer: str, rel: float) -> None:
    """Make ``peer`` report an objective ``rel`` (relative) above its true optimum."""
    real_scipy, real_ortools = module.scipy_b_matching, module.ortools_b_matching

    def scipy_peer(scores, k, method, capacity=None):
        value, seconds = real_scipy(scores, k, method, capacity)
        return (value + rel * abs(value) if method == peer else value), seconds

    def ortools_peer(scores, k, capacity=None):
        value, seconds = real_ortools(scores, k, capacity)
        return (value + rel * abs(value) if peer == "OR-Tools" else value), seconds

    monkeypatch.setattr(module, "scipy_b_matching", scipy_peer)
    monkeypatch.setattr(module, "ortools_b_matching", ortools_peer)


@pytest.mark.parametrize("peer", ["OR-Tools", "linprog", "milp"])
def test_one_peer_that_disagrees_makes_the_row_say_no(monkeypatch: pytest.MonkeyPatch, peer: str) -> None:
    """A peer optimum 1e-3 (relative) above routelab's, far beyond the check's ``1e-6 x spread x k n``
    (and OR-Tools' rounding): the row must say NO, whichever peer it is; unchanged peers: yes."""
    if peer == "OR-Tools":
        pytest.importorskip("ortools")
    assert _row(module.run_b_matching_benchmark(TINY[:1], seeds=1), 30)["same optimum"] == "yes"
    _offset_peer(monkeypatch, peer, 1e-3)
    assert _row(module.run_b_matching_benchmark(TINY[:1], seeds=1), 30)["same optimum"] == "NO"


def test_a_disagreement_on_any_seed_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    """OR-Tools off one seed only (the last of three): still NO."""
    pytest.importorskip("ortools")
    real = module.ortools_b_matching
    calls: list[int] = []

    def late(scores, k, capacity=None):
        calls.append(1)
        value, seconds = real(scores, k, capacity)
        return (value + 1e-3 * abs(value) if len(calls) == 3 else value), seconds

    monkeypatch.setattr(module, "ortools_b_matching", late)
    assert _row(module.run_b_matching_benchmark(TINY[:1], seeds=3), 30)["same optimum"] == "NO"
    assert len(calls) == 3


# ------------------------------------------------------------------ milp's size limit


def test_milp_is_skipped_above_max_pairs_of_n_times_e(monkeypatch: pytest.MonkeyPatch) -> None:
    """``milp only up to MILP_MAX_PAIRS variables n E``: with the limit at 100, n E = 120 skips it
    and n E = 80 runs it."""
    monkeypatch.setattr(module, "MILP_MAX_PAIRS", 100)
    text = module.run_b_matching_benchmark(((30, 4, 2), (20, 4, 2)), seeds=1)
    big, small = _row(text, 30), _row(text, 20)
    assert big["milp ms"] == "skipped" and big["milp / routelab"] == "—"
    assert small["milp ms"] != "skipped" and small["milp / routelab"].endswith("x")
    assert big["linprog ms"] != "skipped"


# ------------------------------------------------------------------ medians and ratios


def test_times_are_medians_in_ms_and_ratios_are_peer_over_routelab(monkeypatch: pytest.MonkeyPatch) -> None:
    """routelab's three solves take 1, 2 and 9 ms by a fake clock (median 2 ms, mean 4 ms); linprog
    reports 3, 6 and 30 ms (median 6), milp 1, 1 and 1 ms, OR-Tools 4, 4 and 40 ms: the row shows the
    medians in ms and each peer's median over routelab's: 3.0x, 0.5x and 2.0x."""
    clock = [0.0]
    monkeypatch.setattr(module, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    real = module.balanced_b_matching
    solves: list[int] = []
    routelab_s = [0.5, 0.001, 0.002, 0.009]  # the untimed warm-up on seed 0, then seeds 0, 1, 2

    def timed(scores, k, capacity=None):
        clock[0] += routelab_s[len(solves)]
        solves.append(1)
        return real(scores, k, capacity)

    peer_s = {"linprog": [0.003, 0.006, 0.030], "milp": [0.001, 0.001, 0.001], "OR-Tools": [0.004, 0.004, 0.040]}
    used = {name: 0 for name in peer_s}

    def fake_time(name: str, value: float) -> tuple[float, float]:
        seconds = peer_s[name][used[name]]
        used[name] += 1
        return value, seconds

    real_scipy, real_ortools = module.scipy_b_matching, module.ortools_b_matching
    monkeypatch.setattr(module, "balanced_b_matching", timed)
    monkeypatch.setattr(module, "scipy_b_matching",
                        lambda s, k, method, capacity=None: fake_time(method, real_scipy(s, k, method, capacity)[0]))
    monkeypatch.setattr(module, "ortools_b_matching",
                        lambda s, k, capacity=None: fake_time("OR-Tools", real_ortools(s, k, capacity)[0]))
    row = _row(module.run_b_matching_benchmark(TINY[:1], seeds=3), 30)
    assert len(solves) == 4
    assert row["routelab ms"] == "2.0" and row["linprog ms"] == "6.0" and row["milp ms"] == "1.0"
    assert row["linprog / routelab"] == "3.0x" and row["milp / routelab"] == "0.5x"
    if module._ortools_flow() is not None:
        assert row["OR-Tools ms"] == "4.0" and row["OR-Tools / routelab"] == "2.0x"
    assert row["same optimum"] == "yes"


# ------------------------------------------------------------------ threads and the command line


def test_threads_are_set_for_the_run_and_restored() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        text = module.run_b_matching_benchmark(((12, 3, 1),), seeds=1, threads=1)
        assert "torch threads: 1;" in text
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [0, -1, True, 2.5])
def test_a_bad_thread_count_is_a_value_error_naming_threads(threads: Any) -> None:
    """As the assignment benchmark's: a ValueError naming ``threads``, not torch's RuntimeError, and
    torch's own setting untouched (review s43)."""
    before = torch.get_num_threads()
    with pytest.raises(ValueError, match="threads"):
        module.run_b_matching_benchmark(((12, 3, 1),), seeds=1, threads=threads)
    assert torch.get_num_threads() == before


def test_main_defaults_and_option_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    """``python -m routelab.bench.b_matching``: full sizes, 5 seeds and 1 thread by default, the three
    quick sizes with --quick; --seeds and --threads below 1 are usage errors (status 2)."""
    calls: list[dict] = []
    monkeypatch.setattr(module, "run_b_matching_benchmark",
                        lambda sizes, seeds, out=None, threads=None: calls.append(
                            dict(sizes=sizes, seeds=seeds, threads=threads)) or "")
    assert module.main([]) == 0
    assert calls[-1] == dict(sizes=module.FULL_SIZES, seeds=5, threads=1)
    assert module.main(["--quick", "--seeds", "2", "--threads", "3"]) == 0
    assert calls[-1] == dict(sizes=module.QUICK_SIZES, seeds=2, threads=3)
    assert len(module.QUICK_SIZES) == 3
    for bad in (["--seeds", "0"], ["--threads", "0"], ["--threads", "-1"]):
        with pytest.raises(SystemExit) as exit_info:
            module.main(bad)
        assert exit_info.value.code == 2, bad
    assert len(calls) == 2

