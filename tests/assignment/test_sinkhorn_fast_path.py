"""The small-CPU fast path of ``sinkhorn`` (speed machinery only) returns the general path's
result bit for bit, and the general path's errors where it hands back."""

from __future__ import annotations

import importlib

import pytest
import torch

from routelab.assignment import _compiled
from routelab.assignment import sinkhorn as sinkhorn_fn

# the module (``routelab.assignment.sinkhorn`` the attribute is the function)
sk = importlib.import_module("routelab.assignment.sinkhorn")

pytestmark = pytest.mark.skipif(not _compiled.available(torch.zeros(1, 1)), reason="compiled path off (numba)")


def _general(log_p: torch.Tensor, monkeypatch: pytest.MonkeyPatch, **kw) -> torch.Tensor:
    with monkeypatch.context() as m:
        m.setattr(sk, "FAST_PATH_NUMEL", 0)  # every call takes the general path
        return sinkhorn_fn(log_p, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(256, 16), (3, 64, 8), (100, 5), (2, 1, 40, 3)])
@pytest.mark.parametrize("scale", [1.0, 6.0])
@pytest.mark.parametrize("neg_inf", [False, True])
def test_fast_path_matches_general_path(dtype, shape, scale, neg_inf, monkeypatch):
    g = torch.Generator().manual_seed(hash((shape, scale, neg_inf)) % 2**31)
    log_p = torch.log_softmax(scale * torch.randn(shape, generator=g, dtype=torch.float64), -1).to(dtype)
    if neg_inf:  # forbidden pairs, one per row at most (every row and column keeps finite entries)
        rows = torch.arange(shape[-2])
        log_p[..., rows[::3], rows[::3] % shape[-1]] = float("-inf")
    for kw in ({"tol": 1e-6}, {"tol": 1e-4, "max_iter": 20}):
        try:
            want = _general(log_p, monkeypatch, **kw)
        except ValueError as e:  # no convergence: the fast path hands back, the same error
            with pytest.raises(ValueError, match="did not converge") as got:
                sinkhorn_fn(log_p, **kw)
            assert str(got.value) == str(e)
            continue
        first = sk._small_cpu_first_round(log_p, kw["tol"], kw.get("max_iter", 1000))
        assert (first is None) == neg_inf  # -inf entries: the general path's checks
        got = sinkhorn_fn(log_p, **kw)
        assert got.dtype == dtype and got.shape == log_p.shape
        assert torch.equal(got, want)
        # and the marginals themselves: rows sum to 1, columns to n / k
        q = got.double().exp()
        torch.testing.assert_close(q.sum(-1), torch.ones(shape[:-1], dtype=torch.float64), atol=1e-5, rtol=0)
        n, k = shape[-2:]
        assert (q.sum(-2) - n / k).abs().max() <= max(kw["tol"], 4 * torch.finfo(dtype).eps * n**0.5 * n / k) * 1.01


def test_general_path_goes_on_from_the_fast_first_round(monkeypatch):
    # sharp p (float64: its scaling domain reaches 600 nats): the first round of sweeps does not
    # converge, and Newton's method finishes from its iterate
    g = torch.Generator().manual_seed(5)
    dtype = torch.float64
    log_p = torch.log_softmax(30.0 * torch.randn(512, 16, generator=g, dtype=dtype), -1)
    first = sk._small_cpu_first_round(log_p, 1e-6, 1000)
    assert first is not None and not first[2]
    got = sinkhorn_fn(log_p, tol=1e-6)
    assert torch.equal(got, _general(log_p, monkeypatch, tol=1e-6))
    q = got.double().exp()
    assert (q.sum(-2) - 32.0).abs().max() <= max(1e-6, 4 * torch.finfo(dtype).eps * 512**0.5 * 32) * 1.01
    torch.testing.assert_close(q.sum(-1), torch.ones(512, dtype=torch.float64), atol=1e-5, rtol=0)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_fast_path_hands_back_invalid_values(bad):
    log_p = torch.zeros(8, 4)
    log_p[3, 1] = bad
    assert sk._small_cpu_first_round(log_p, 1e-6, 1000) is None
    with pytest.raises(ValueError, match="log_p"):
        sinkhorn_fn(log_p)


def test_fast_path_skips_autograd_and_col_sum():
    log_p = torch.log_softmax(torch.randn(32, 4, dtype=torch.float64), -1).requires_grad_()
    assert sk._small_cpu_first_round(log_p, 1e-6, 1000) is None
    out = sinkhorn_fn(log_p, col_sum=torch.full((4,), 8.0, dtype=torch.float64))
    out.exp().sum().backward()
    assert log_p.grad is not None
