"""Tests for routelab.assignment.sinkhorn (Kool et al. 2021, Sec. 2.3).

``sinkhorn(log_p)`` returns ``log q`` where ``q`` has rows summing to 1, columns summing to
``col_sum`` (default n/k), and ``q = diag(r) p diag(s)`` for positive ``r``, ``s`` (the matrix scaling
of ``p``; -inf entries stay -inf). The checks below test these defining properties directly and
compare with an independent numpy reference implementation.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from routelab.assignment import sinkhorn

NEG_INF = float("-inf")
DTYPES = [torch.float32, torch.float64]
# (tol passed to sinkhorn, tolerance of the checks)
TOL = {torch.float64: (1e-10, 1e-8), torch.float32: (1e-4, 1e-4)}

HYPOTHESIS = settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


def reference_sinkhorn(p: np.ndarray, col: np.ndarray, iters: int = 100_000, tol: float = 1e-14) -> np.ndarray:
    """Plain (probability-space, float64) alternate column / row normalisation of one matrix."""
    q = p.astype(np.float64).copy()
    for _ in range(iters):
        cs = q.sum(0)
        q = q * np.where(cs > 0, col / np.where(cs > 0, cs, 1.0), 0.0)
        q = q / q.sum(1, keepdims=True)
        if np.abs(q.sum(0) - col).max() < tol:
            return q
    raise AssertionError("reference Sinkhorn did not converge")


def check_marginals(q_log: torch.Tensor, col_sum, atol: float) -> None:
    q = q_log.double().exp()
    n, k = q.shape[-2:]
    target = torch.as_tensor(n / k if col_sum is None else col_sum, dtype=torch.float64).expand(*q.shape[:-2], k)
    assert torch.allclose(q.sum(-1), torch.ones(q.shape[:-1], dtype=torch.float64), atol=atol, rtol=0)
    assert torch.allclose(q.sum(-2), target, atol=atol * max(1.0, n / k), rtol=0)


def check_scaling_form(q_log: torch.Tensor, log_p: torch.Tensor, atol: float) -> None:
    """``log q - log p = -f_i - g_j`` on the finite entries (q is a diagonal rescaling of p)."""
    finite = torch.isfinite(log_p)
    assert torch.equal(torch.isfinite(q_log), finite), "the -inf pattern changed"
    assert torch.isneginf(q_log[~finite]).all()
    D = (q_log.double() - log_p.double()).masked_fill(~finite, float("nan"))
    # f_i + g_j with a fixed gauge: compare with any row/column through a finite reference entry
    n, k = D.shape[-2:]
    Dn = D.reshape(-1, n, k).numpy()
    for d in Dn:
        # least-squares fit of d[i, j] = a_i + b_j over the finite entries; residual must vanish
        ii, jj = np.nonzero(np.isfinite(d))
        A = np.zeros((ii.size, n + k))
        A[np.arange(ii.size), ii] = 1.0
        A[np.arange(ii.size), n + jj] = 1.0
        coef, *_ = np.linalg.lstsq(A, d[ii, jj], rcond=None)
        assert np.abs(A @ coef - d[ii, jj]).max() <= atol


# ----------------------------------------------------------------------------- marginals


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("n", "k"), [(8, 2), (12, 4), (15, 5), (6, 6), (5, 1), (30, 3)])
def test_default_marginals_and_scaling_form(n: int, k: int, dtype: torch.dtype) -> None:
    tol, atol = TOL[dtype]
    log_p = torch.randn(n, k, generator=torch.Generator().manual_seed(100 * n + k), dtype=dtype) * 2
    q = sinkhorn(log_p, tol=tol)
    assert q.shape == log_p.shape and q.dtype == dtype
    check_marginals(q, None, atol)
    check_scaling_form(q, log_p, 1e-3 if dtype == torch.float32 else 1e-8)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_custom_column_sums_number_and_tensor(dtype: torch.dtype) -> None:
    tol, atol = TOL[dtype]
    gen = torch.Generator().manual_seed(1)
    log_p = torch.randn(8, 4, generator=gen, dtype=dtype)
    col = torch.tensor([1.0, 2.0, 3.0, 2.0], dtype=dtype)
    q = sinkhorn(log_p, col_sum=col, tol=tol)
    check_marginals(q, col, atol)
    check_scaling_form(q, log_p, 1e-3 if dtype == torch.float32 else 1e-8)
    # a plain number equal to n / k is the default
    q2 = sinkhorn(log_p, col_sum=2.0, tol=tol)
    check_marginals(q2, 2.0, atol)
    assert torch.allclose(q2, sinkhorn(log_p, tol=tol), atol=atol)
    # a zero target column gets no mass at all
    q3 = sinkhorn(log_p, col_sum=torch.tensor([4.0, 0.0, 2.0, 2.0], dtype=dtype), tol=tol)
    assert (q3[:, 1].exp() == 0).all()
    check_marginals(q3, torch.tensor([4.0, 0.0, 2.0, 2.0]), atol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_batched_with_per_instance_column_sums(dtype: torch.dtype) -> None:
    tol, atol = TOL[dtype]
    gen = torch.Generator().manual_seed(2)
    log_p = torch.randn(2, 3, 6, 3, generator=gen, dtype=dtype)
    col = torch.tensor([[1.0, 2.0, 3.0], [2.0, 2.0, 2.0], [4.0, 1.0, 1.0]], dtype=dtype)  # [3, k] broadcast
    q = sinkhorn(log_p, col_sum=col, tol=tol)
    assert q.shape == log_p.shape
    check_marginals(q, col.expand(2, 3, 3), atol)
    for a in range(2):
        for b in range(3):
            single = sinkhorn(log_p[a, b], col_sum=col[b], tol=tol)
            assert torch.allclose(q[a, b], single, atol=10 * atol, rtol=0)
            check_scaling_form(single, log_p[a, b], 1e-3 if dtype == torch.float32 else 1e-8)


def test_column_error_within_tol_at_loose_tolerance() -> None:
    log_p = torch.randn(12, 3, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 3
    for tol in (1e-1, 1e-3):
        q = sinkhorn(log_p, tol=tol).exp()
        assert (q.sum(-2) - 4).abs().max() <= tol
        assert torch.allclose(q.sum(-1), torch.ones(12, dtype=torch.float64), atol=1e-12)


def test_float32_default_tolerance_converges_for_moderate_n() -> None:
    log_p = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    q = sinkhorn(log_p)
    check_marginals(q, None, 1e-4)


# ----------------------------------------------------------------------------- -inf entries


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_minus_inf_entries_stay_minus_inf(dtype: torch.dtype) -> None:
    tol, atol = TOL[dtype]
    gen = torch.Generator().manual_seed(4)
    n, k = 12, 3
    log_p = torch.randn(5, n, k, generator=gen, dtype=dtype)
    mask = torch.rand(5, n, k, generator=gen) < 0.4
    mask[..., torch.arange(n), torch.arange(n) % k] = False  # a balanced support survives
    log_p = log_p.masked_fill(mask, NEG_INF)
    q = sinkhorn(log_p, tol=tol)
    assert torch.isneginf(q[mask]).all()
    assert (q.exp()[mask] == 0).all()
    assert torch.isfinite(q[~mask]).all()
    check_marginals(q, None, atol)
    check_scaling_form(q, log_p, 1e-3 if dtype == torch.float32 else 1e-8)


def test_all_minus_inf_column_with_zero_target_is_fine() -> None:
    log_p = torch.randn(6, 3, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    log_p[:, 2] = NEG_INF
    q = sinkhorn(log_p, col_sum=torch.tensor([2.0, 4.0, 0.0], dtype=torch.float64), tol=1e-10)
    assert torch.isneginf(q[:, 2]).all()
    check_marginals(q, torch.tensor([2.0, 4.0, 0.0]), 1e-8)


# ----------------------------------------------------------------------------- invariances and reference


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_invariant_to_row_and_column_scaling_of_p(dtype: torch.dtype) -> None:
    tol, atol = TOL[dtype]
    gen = torch.Generator().manual_seed(6)
    log_p = torch.randn(4, 10, 5, generator=gen, dtype=dtype)
    log_p[0, 0, 1] = NEG_INF
    log_r = torch.randn(4, 10, 1, generator=gen, dtype=dtype) * 3  # p_ij * r_i
    log_c = torch.randn(4, 1, 5, generator=gen, dtype=dtype) * 3  # p_ij * c_j
    q = sinkhorn(log_p, tol=tol)
    q2 = sinkhorn(log_p + log_r + log_c, tol=tol)
    fin = torch.isfinite(q)
    assert torch.equal(fin, torch.isfinite(q2))
    assert torch.allclose(q.exp(), q2.exp(), atol=10 * atol, rtol=0)


def test_square_doubly_stochastic_matches_reference() -> None:
    gen = torch.Generator().manual_seed(7)
    for n in (2, 3, 5, 8):
        log_p = torch.randn(n, n, generator=gen, dtype=torch.float64) * 2
        if n >= 3:  # (for n = 2 a zero makes the pattern lack total support: no exact scaling exists)
            log_p[0, n - 1] = NEG_INF
        q = sinkhorn(log_p, tol=1e-12).exp().numpy()
        ref = reference_sinkhorn(np.exp(log_p.numpy()), np.ones(n))
        np.testing.assert_allclose(q, ref, atol=1e-9, rtol=0)
        np.testing.assert_allclose(q.sum(0), 1.0, atol=1e-10)
        np.testing.assert_allclose(q.sum(1), 1.0, atol=1e-10)


def test_rectangular_matches_reference_with_custom_columns() -> None:
    gen = torch.Generator().manual_seed(8)
    log_p = torch.randn(9, 3, generator=gen, dtype=torch.float64) * 2
    col = np.array([2.0, 3.0, 4.0])
    q = sinkhorn(log_p, col_sum=torch.tensor(col), tol=1e-12).exp().numpy()
    np.testing.assert_allclose(q, reference_sinkhorn(np.exp(log_p.numpy()), col), atol=1e-9, rtol=0)


def test_already_balanced_input_is_returned_normalised() -> None:
    """A uniform p is already balanced: q = 1/k everywhere, whatever the per-row scale."""
    log_p = torch.arange(6, dtype=torch.float64).view(6, 1).expand(6, 3)
    q = sinkhorn(log_p)
    assert torch.allclose(q, torch.full((6, 3), -np.log(3.0), dtype=torch.float64), atol=1e-12)


@HYPOTHESIS
@given(
    n=st.integers(1, 10),
    k=st.integers(1, 5),
    dtype=st.sampled_from(DTYPES),
    scale=st.sampled_from([0.1, 1.0, 3.0]),
    custom=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_property_marginals_and_scaling_form(n: int, k: int, dtype, scale: float, custom: bool, seed: int) -> None:
    tol, atol = TOL[dtype]
    gen = torch.Generator().manual_seed(seed)
    log_p = torch.randn(n, k, generator=gen, dtype=torch.float64).mul(scale).to(dtype)
    if custom:
        w = torch.rand(k, generator=gen, dtype=torch.float64) + 0.1
        col = (w / w.sum() * n).to(dtype)
    else:
        col = None
    q = sinkhorn(log_p, col_sum=col, tol=tol, max_iter=20_000)
    check_marginals(q, None if col is None else col.double(), atol)
    check_scaling_form(q, log_p, 1e-3 if dtype == torch.float32 else 1e-7)
    if dtype == torch.float64:
        ref = reference_sinkhorn(np.exp(log_p.numpy()), np.full(k, n / k) if col is None else col.numpy())
        np.testing.assert_allclose(q.exp().numpy(), ref, atol=1e-7, rtol=0)


# ----------------------------------------------------------------------------- errors


def _randn(n: int, k: int) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(9), dtype=torch.float64)


@pytest.mark.parametrize(
    ("log_p", "kwargs", "match"),
    [
        pytest.param(_randn(4, 2), {"col_sum": torch.tensor([5.0, -1.0])}, "non-negative", id="negative-col-sum"),
        pytest.param(_randn(4, 2), {"col_sum": torch.tensor([1.0, 2.0])}, "add up to n=4", id="col-sum-not-n"),
        pytest.param(_randn(4, 2), {"col_sum": 3.0}, "add up to n=4", id="scalar-col-sum-not-n-over-k"),
        pytest.param(
            _randn(4, 2), {"col_sum": torch.tensor([1.0, 1.0, 2.0])}, "last dimension k=2", id="col-sum-shape"
        ),
        pytest.param(_randn(4, 2), {"col_sum": torch.tensor([float("nan"), 2.0])}, "NaN", id="nan-col-sum"),
        pytest.param(
            _randn(4, 2).index_put((torch.tensor([1]),), torch.tensor(NEG_INF, dtype=torch.float64)),
            {},
            "row that is all -inf",
            id="all-minus-inf-row",
        ),
        pytest.param(
            _randn(4, 2).index_put(
                (torch.arange(4), torch.zeros(4, dtype=torch.long)), torch.tensor(NEG_INF, dtype=torch.float64)
            ),
            {},
            "column 0 is all -inf but its col_sum is positive.*give it col_sum 0",
            id="all-minus-inf-column",
        ),
        pytest.param(
            _randn(4, 2).index_put((torch.tensor([0]),), torch.tensor(float("nan"), dtype=torch.float64)),
            {},
            "NaN",
            id="nan-input",
        ),
        pytest.param(
            _randn(4, 2).index_put((torch.tensor([0]),), torch.tensor(float("inf"), dtype=torch.float64)),
            {},
            r"\+inf",
            id="plus-inf-input",
        ),
        pytest.param(torch.zeros(4, dtype=torch.float64), {}, "at least 2 dimensions", id="1-d"),
        pytest.param(torch.zeros(4, 2, dtype=torch.long), {}, "floating", id="integer-dtype"),
        pytest.param(_randn(4, 2), {"max_iter": 0}, "max_iter", id="max-iter-zero"),
        pytest.param(_randn(4, 2), {"tol": 0.0}, "tol must be positive", id="tol-zero"),
        pytest.param(_randn(4, 2), {"tol": -1e-3}, "tol must be positive", id="tol-negative"),
        pytest.param(_randn(4, 2), {"tol": "1e-3"}, "tol must be a number > 0", id="tol-string"),
        pytest.param(_randn(4, 2), {"tol": torch.tensor([1e-3, 1e-3])}, "tol must be a number > 0", id="tol-vector"),
    ],
)
def test_invalid_input_raises(log_p: torch.Tensor, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        sinkhorn(log_p, **kwargs)


def test_non_convergence_raises() -> None:
    """A very skewed matrix is far from balanced after a single sweep."""
    log_p = torch.tensor([[10.0, 0.0], [10.0, 0.0], [9.0, 0.0], [0.0, 0.0]], dtype=torch.float64)
    with pytest.raises(ValueError, match="did not converge"):
        sinkhorn(log_p, max_iter=1)
    q = sinkhorn(log_p, tol=1e-9, max_iter=100_000)  # and it does converge given enough sweeps
    check_marginals(q, None, 1e-8)


def test_infeasible_support_raises_did_not_converge() -> None:
    """Three tokens can only go to expert 0 but its column must sum to 2 (Hall's condition fails)."""
    log_p = torch.tensor([[0.0, NEG_INF]] * 3 + [[0.0, 0.0]], dtype=torch.float64)
    with pytest.raises(ValueError, match="did not converge"):
        sinkhorn(log_p, max_iter=200)


def test_does_not_modify_input_and_is_deterministic() -> None:
    log_p = torch.randn(3, 6, 2, generator=torch.Generator().manual_seed(10), dtype=torch.float64)
    log_p[0, 0, 0] = NEG_INF
    before = log_p.clone()
    q1, q2 = sinkhorn(log_p), sinkhorn(log_p)
    assert torch.equal(q1, q2)
    assert torch.equal(log_p, before)


def test_infeasible_marginals_with_forbidden_pairs_are_a_value_error_on_every_path():
    """Audit finding: the compiled kernel divided by a row sum that had scaled to 0 (ZeroDivisionError)
    where the PyTorch path raises the documented ValueError."""
    from routelab.assignment import sinkhorn

    inf = float("inf")
    log_p = torch.tensor([[-0.12, -inf, -0.30], [-inf, -inf, 0.06], [-inf, -inf, 0.09], [-inf, -inf, 0.14],
                          [0.10, 0.08, -0.03]])
    col_sum = torch.tensor([1.15513229, 3.18093375, 0.66393396])  # tokens 1-3 only fit expert 2 (0.66 < 3)
    for dtype in (torch.float32, torch.float64):
        with pytest.raises(ValueError, match="did not converge"):
            sinkhorn(log_p.to(dtype), col_sum=col_sum.to(dtype))


def test_col_sum_of_another_batch_shape_is_a_clear_error() -> None:
    log_p = torch.randn(3, 8, 4)
    with pytest.raises(ValueError, match=r"col_sum's batch dimensions \(2,\) do not broadcast to the batch \(3,\)"):
        sinkhorn(log_p, col_sum=torch.full((2, 4), 2.0))
    with pytest.raises(ValueError, match="do not broadcast to the batch"):  # more batch dimensions than log_p
        sinkhorn(log_p, col_sum=torch.full((5, 3, 4), 2.0))
    per_batch = sinkhorn(log_p, col_sum=torch.full((3, 4), 2.0))  # [*batch, k] and [k] both fit
    torch.testing.assert_close(per_batch, sinkhorn(log_p, col_sum=torch.full((4,), 2.0)))


def test_no_convergence_says_why_by_the_inputs_pattern() -> None:
    """A sharp but all-finite log_p (feasible marginals, slow sweeps) is not blamed on an -inf
    pattern; one with -inf entries is told that pattern may make the marginals infeasible."""
    sharp = torch.randn(16, 4, generator=torch.Generator().manual_seed(1)) * 30
    with pytest.raises(ValueError, match="finite, so the marginals are feasible") as raised:
        sinkhorn(sharp, max_iter=3)
    assert "-inf pattern" not in str(raised.value)
    holes = sharp.clone()
    holes[0, 1:] = float("-inf")
    with pytest.raises(ValueError, match="-inf pattern"):
        sinkhorn(holes, max_iter=3)


def _two_column_reference(log_p: np.ndarray, target_1: float) -> np.ndarray:
    """``log q`` of two columns by bisection on the dual ``beta`` (float64, numpy; 400 halvings)."""
    d = log_p[:, 1] - log_p[:, 0]
    lo, hi = -d.max() - 50.0, -d.min() + 50.0
    for _ in range(400):
        mid = 0.5 * (lo + hi)
        if (1.0 / (1.0 + np.exp(-(d + mid)))).sum() < target_1:
            lo = mid
        else:
            hi = mid
    z = d + 0.5 * (lo + hi)
    return np.stack([-np.logaddexp(0.0, z), -np.logaddexp(0.0, -z)], axis=-1)


@pytest.mark.parametrize("seed", range(30))
def test_two_column_gradient_is_the_fixed_points_at_the_default_tol(seed: int) -> None:
    """Sharp two-column input (the closed form): the gradient at the default ``tol`` is the fixed
    point's, by central differences of an independent bisection (it was the stopped search's, off by
    up to 73 % on these seeds)."""
    gen = torch.Generator().manual_seed(seed)
    log_p = torch.randn(16, 2, dtype=torch.float64, generator=gen) * 40
    g = torch.randn(16, 2, dtype=torch.float64, generator=gen)
    v = torch.randn(16, 2, dtype=torch.float64, generator=gen)
    x = log_p.clone().requires_grad_()
    q = sinkhorn(x)
    np.testing.assert_allclose(q.detach().numpy(), _two_column_reference(log_p.numpy(), 8.0), atol=1e-6)
    directional = (torch.autograd.grad(q, x, g)[0] * v).sum().item()
    h = 1e-5

    def f(y: torch.Tensor) -> float:
        return float((_two_column_reference(y.numpy(), 8.0) * g.numpy()).sum())

    finite_difference = (f(log_p + h * v) - f(log_p - h * v)) / (2 * h)
    assert directional == pytest.approx(finite_difference, rel=1e-3, abs=1e-6)


def test_two_columns_balance_a_float32_matrix_that_one_expert_wins_by_1000_nats() -> None:
    """The two-column dual is searched in float64: in float32 a shift of 1000 nats left the column
    sums 1e-3 off (a 'did not converge' error); the answer is the float64 one's, rounded."""
    gen = torch.Generator().manual_seed(0)
    log_p = torch.log_softmax(torch.randn(256, 2, generator=gen) + torch.tensor([0.0, 1000.0]), -1)
    q = sinkhorn(log_p)
    assert q.dtype == torch.float32
    exact = torch.from_numpy(_two_column_reference(log_p.double().numpy(), 128.0))
    torch.testing.assert_close(q.double().exp(), exact.exp(), atol=1e-5, rtol=0)


@pytest.mark.parametrize("k", [2, 3])
def test_targets_within_the_slack_are_scaled_to_add_up_to_n(k: int) -> None:
    """Targets that add up to ``n`` within ``1e-6 n`` (n/k rounded in float32, used with float64
    ``log_p``) are met as scaled to ``n``, on the closed form and on the sweeps alike (the sweeps
    used to run to max_iter, the closed form to leave one column off by the whole slack)."""
    n = 1000
    log_p = torch.randn(n, k, dtype=torch.float64, generator=torch.Generator().manual_seed(k))
    col_sum = torch.full((k,), n / k, dtype=torch.float32).double()
    col_sum[0] += 0.9e-3 - float(col_sum.sum() - n)  # adds up to n + 9e-4, inside the slack of 1e-3
    q = sinkhorn(log_p, col_sum=col_sum, tol=1e-8)
    scaled = col_sum * n / col_sum.sum()
    assert (q.exp().sum(-2) - scaled).abs().max().item() <= 1e-8
    torch.testing.assert_close(q.exp().sum(-1), torch.ones(n, dtype=torch.float64))


def test_tol_may_be_a_zero_dimensional_tensor() -> None:
    log_p = torch.randn(8, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(sinkhorn(log_p, tol=torch.tensor(1e-9)), sinkhorn(log_p, tol=1e-9), rtol=0, atol=0)


def test_vmap_is_refused_with_the_batch_dimension_as_the_fix():
    """torch.func.vmap cannot run the host-side stopping rule: the error says so and names the fix (it was
    torch's "Cannot access data pointer of Tensor that doesn't have storage"); the batch dimension gives
    what vmap would have, and torch.func.grad works."""
    x = torch.randn(3, 8, 4, dtype=torch.float64)
    with pytest.raises(NotImplementedError, match="leading batch dimension"):
        torch.func.vmap(sinkhorn)(x)
    batched = sinkhorn(x, tol=1e-10)
    for i in range(3):
        torch.testing.assert_close(batched[i], sinkhorn(x[i], tol=1e-10), atol=1e-8, rtol=0)
    g = torch.func.grad(lambda s: sinkhorn(s)[:, 0].exp().sum())(x[0])
    assert g.shape == (8, 4) and torch.isfinite(g).all()
