"""Sinkhorn's three ways to the same sweeps: the compiled scaling-domain kernel, the PyTorch
scaling domain and the log domain (the stabilised path for low temperatures and autograd).

Each must meet the marginals and the scaling form (tests/assignment/test_sinkhorn.py's checks),
and they must agree with one another to the tolerance; the log domain must take over where the
scaling domain would lose entries (a finite entry far below its row's maximum).
"""

from __future__ import annotations

import pytest
import torch
from test_sinkhorn import check_marginals, check_scaling_form

from routelab.assignment import _compiled, sinkhorn

sinkhorn_module = __import__("routelab.assignment.sinkhorn", fromlist=["SCALING_RANGE"])

PATHS = ["compiled", "pytorch-scaling", "log"]


def _use(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if path == "compiled" and not _compiled.HAVE_NUMBA:
        pytest.skip("numba is not installed")
    monkeypatch.setattr(_compiled, "ENABLED", path == "compiled")
    if path == "log":
        for name in ("SCALING_RANGE", "COMPILED_SCALING_RANGE"):
            monkeypatch.setattr(sinkhorn_module, name, {torch.float32: -1.0, torch.float64: -1.0})


def _instances(dtype: torch.dtype) -> list[tuple[torch.Tensor, object]]:
    gen = torch.Generator().manual_seed(3)
    plain = torch.log_softmax(torch.randn(64, 8, generator=gen, dtype=dtype), -1)
    batched = torch.log_softmax(torch.randn(3, 40, 5, generator=gen, dtype=dtype) * 2, -1)
    holes = torch.randn(48, 6, generator=gen, dtype=dtype)
    holes[torch.rand(48, 6, generator=gen) < 0.3] = float("-inf")
    holes[:, 0] = 0.0  # every row keeps a finite entry
    custom = torch.randn(30, 4, generator=gen, dtype=dtype)
    return [(plain, None), (batched, None), (holes, None), (custom, torch.tensor([3.0, 7.0, 10.0, 10.0], dtype=dtype))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("path", PATHS)
def test_every_path_meets_the_marginals(path: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    _use(path, monkeypatch)
    tol, atol = (1e-10, 1e-8) if dtype == torch.float64 else (1e-4, 1e-4)
    for log_p, col in _instances(dtype):
        q = sinkhorn(log_p, col_sum=col, tol=tol, max_iter=100_000)
        check_marginals(q, col, atol)
        check_scaling_form(q, log_p, 1e-6 if dtype == torch.float64 else 1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_the_paths_agree(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    tol = 1e-10 if dtype == torch.float64 else 1e-4
    results = {}
    for path in PATHS:
        if path == "compiled" and not _compiled.HAVE_NUMBA:
            continue
        with monkeypatch.context() as m:
            _use(path, m)
            results[path] = [sinkhorn(x, col_sum=c, tol=tol, max_iter=100_000) for x, c in _instances(dtype)]
    reference = results.pop("log")
    for path, qs in results.items():
        for q, r in zip(qs, reference):
            assert torch.equal(torch.isneginf(q), torch.isneginf(r)), path
            finite = torch.isfinite(r)
            diff = (q.double().exp() - r.double().exp()).abs()[finite].max()
            assert diff <= (1e-8 if dtype == torch.float64 else 1e-3), (path, float(diff))


def test_low_temperature_takes_the_log_domain_and_stays_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """Entries hundreds of nats apart underflow in the scaling domain; the log domain balances them."""
    calls = []
    original = sinkhorn_module._balance_scaling

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        calls.append(out is None)
        return out

    monkeypatch.setattr(sinkhorn_module, "_balance_scaling", spy)
    gen = torch.Generator().manual_seed(5)
    log_p = torch.randn(32, 4, generator=gen, dtype=torch.float64)
    log_p[::2, 3] = -1000.0  # far below its row's maximum: exp underflows relative to the row
    q = sinkhorn(log_p, tol=1e-9, max_iter=100_000)
    assert calls and all(calls)  # the scaling domain declined (each round of sweeps: sinkhorn measures their rate)
    check_marginals(q, None, 1e-7)
    check_scaling_form(q, log_p, 1e-6)


def test_autograd_uses_the_log_domain() -> None:
    log_p = torch.log_softmax(torch.randn(16, 4, dtype=torch.float64), -1).requires_grad_()
    q = sinkhorn(log_p, tol=1e-10)
    q.exp()[:, 0].sum().backward()
    assert log_p.grad is not None and torch.isfinite(log_p.grad).all()


# ----------------------------------------------------------------------------- convergence reads


def _read_every(every: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sinkhorn_module.CHECK_EVERY, "cpu", every)


@pytest.mark.parametrize("path", ["pytorch-scaling", "log"])
@pytest.mark.parametrize("every", [2, 4, 7])
def test_reading_the_errors_every_few_sweeps_returns_the_same_iterate(path: str, every: int,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU the errors are read every few sweeps (one synchronisation each time); the answer is
    still the first sweep within tol, bit for bit what a read per sweep returns: converged,
    stopped by max_iter, with -inf entries, batched, and with gradients (the log domain)."""
    _use(path, monkeypatch)
    cases = [(log_p, col, tol, max_iter) for log_p, col in _instances(torch.float64)
             for tol, max_iter in ((1e-9, 10_000), (1e-9, 5), (1e-3, 10_000))]
    expected = []
    with monkeypatch.context() as m:
        _read_every(1, m)
        for log_p, col, tol, max_iter in cases:
            expected.append(sinkhorn_module.balance(log_p, _target(log_p, col), tol=tol, max_iter=max_iter))
    _read_every(every, monkeypatch)
    for (log_p, col, tol, max_iter), (want, want_err) in zip(cases, expected, strict=True):
        got, err = sinkhorn_module.balance(log_p, _target(log_p, col), tol=tol, max_iter=max_iter)
        assert torch.equal(got, want) and err == want_err
    log_p = _instances(torch.float64)[0][0].clone().requires_grad_(True)
    out, _ = sinkhorn_module.balance(log_p, _target(log_p, None), tol=1e-9, max_iter=10_000)
    (grad,) = torch.autograd.grad(out.exp()[:, 0].sum(), log_p)
    with monkeypatch.context() as m:
        _read_every(1, m)
        out1, _ = sinkhorn_module.balance(log_p, _target(log_p, None), tol=1e-9, max_iter=10_000)
        (grad1,) = torch.autograd.grad(out1.exp()[:, 0].sum(), log_p)
    assert torch.equal(out, out1) and torch.equal(grad, grad1)


@pytest.mark.parametrize("every", [1, 4])
def test_dead_columns_and_a_scaling_that_leaves_the_range_read_every_few_sweeps_alike(
        every: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Dead columns (target 0, or no finite entry: the scaling path hands over to the log domain)
    and a float32 problem that does not converge within max_iter (entries near the scaling range's
    limit, a tiny target) give the same answer whether the errors are read every sweep or every 4."""
    gen = torch.Generator().manual_seed(5)
    dead = torch.log_softmax(torch.randn(40, 5, generator=gen), -1)
    dead[:, 2] = float("-inf")
    tiny = torch.log_softmax(torch.randn(64, 6, generator=gen) * 6, -1)
    cases = [(dead, torch.tensor([10.0, 10.0, 0.0, 10.0, 10.0])),
             (torch.log_softmax(torch.randn(30, 4, generator=gen), -1), torch.tensor([0.0, 10.0, 10.0, 10.0])),
             (tiny, torch.tensor([1e-30, 12.0, 12.0, 12.0, 12.0, 12.0 - 1e-30]))]
    results = {}
    for reads in (1, every):
        with monkeypatch.context() as m:
            m.setattr(_compiled, "ENABLED", False)
            _read_every(reads, m)
            results[reads] = [sinkhorn_module.balance(p, t, tol=1e-6, max_iter=300) for p, t in cases]
            results[reads] += [sinkhorn_module._balance_scaling(p, t, tol=1e-6, max_iter=300) for p, t in cases]
    for a, b in zip(results[1], results[every], strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.equal(a[0], b[0]) and (a[1] == b[1] or (a[1] != a[1] and b[1] != b[1]))


@pytest.mark.parametrize("every", [1, 3, 4])
def test_the_first_sweep_within_tol_is_the_answer_whatever_the_reading_interval(every: int) -> None:
    """``_FirstConverged`` on a known error sequence: the first sweep within tol, or the first NaN
    where NaN stops (the scaling path), or the last sweep; never a later sweep of the same read."""
    def run(errors: list[float], stop_on_nan: bool, max_iter: int) -> tuple[object, float]:
        stop = sinkhorn_module._FirstConverged(0.5, max_iter, torch.device("meta"), stop_on_nan=stop_on_nan)
        stop.every = every
        for sweep, e in enumerate(errors[:max_iter + 1]):
            found = stop.check(sweep, torch.tensor(e, dtype=torch.float64), sweep)
            if found is not None:
                return found
        raise AssertionError("no answer")

    nan = float("nan")
    assert run([3.0, 2.0, 0.4, 0.1, 0.0, 0.0, 0.0], False, 6) == (2, 0.4)
    assert run([3.0, nan, 0.4, 0.1, 0.0], False, 4) == (2, 0.4)  # the log domain sweeps on past a NaN
    sweep, err = run([3.0, nan, 0.4, 0.1, 0.0], True, 4)  # the scaling path stops at it
    assert sweep == 1 and err != err
    assert run([3.0, 2.0, 1.0, 0.9, 0.8, 0.7], False, 4) == (4, 0.8)  # max_iter mid-read


def test_no_sweep_for_a_negative_budget() -> None:
    log_p = torch.log_softmax(torch.randn(8, 4, generator=torch.Generator().manual_seed(0)), -1)
    out, err = sinkhorn_module.balance(log_p, torch.full((4,), 2.0), tol=1e-9, max_iter=-1)
    assert err == float("inf") and torch.allclose(out.exp().sum(-1), torch.ones(8))


def _target(log_p: torch.Tensor, col) -> torch.Tensor:
    n, k = log_p.shape[-2:]
    return torch.full((k,), n / k, dtype=log_p.dtype) if col is None else col


def test_reading_every_four_sweeps_synchronises_a_quarter_as_often(monkeypatch: pytest.MonkeyPatch) -> None:
    from host_syncs import record_host_syncs

    _use("pytorch-scaling", monkeypatch)
    log_p = torch.log_softmax(torch.randn(256, 16, generator=torch.Generator().manual_seed(0), dtype=torch.float64), -1)
    counts = {}
    for every in (1, 4):
        with monkeypatch.context() as m:
            _read_every(every, m)
            with record_host_syncs() as found:
                # a tolerance no sweep meets: all 201 sweeps run
                sinkhorn_module.balance(log_p, _target(log_p, None), tol=1e-300, max_iter=200)
            counts[every] = sum("sinkhorn.py" in f.where for f in found)
    setup = counts[1] - 201  # the reads before the sweeps
    assert counts[4] - setup == 51, counts  # sweeps 0-3, 4-7, ..., 196-199, then 200
