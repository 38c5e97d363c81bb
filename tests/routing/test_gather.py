"""routelab.routing._gather: the adjoint-gather backward passes of dispatch and combine.

The layer takes them on GPUs and the plain autograd formulation on the CPU, so the CPU suite
checks the adjoint path here directly, on CPU tensors: values and first derivatives equal the
plain path's (whose gradients test_routing_dispatch.py checks against explicit loops),
finite differences in float64 (first and second order), never reading a row of no pair (NaN
there, as grouped matmuls leave them, changes nothing), and a fixed summation order.
"""

from __future__ import annotations

import pytest
import torch
from test_routing_dispatch import random_layout

from routelab.routing import DispatchPlan, GroupedPlan, apply_capacity
from routelab.routing._gather import combine_rows, dispatch_rows


def _buffers_plan(seed: int, n: int = 7, s: int = 2, E: int = 3, C: int = 3) -> DispatchPlan:
    expert, keep, position = random_layout(seed, n, s, E, C, 0.75)
    return DispatchPlan.build(expert, keep, position, E, C)


def _grouped_plan(seed: int, n: int = 9, s: int = 2, E: int = 4, capacity: int = 3) -> GroupedPlan:
    g = torch.Generator().manual_seed(seed)
    expert = torch.stack([torch.randperm(E, generator=g)[:s] for _ in range(n)])
    decision = apply_capacity(expert, torch.ones(n, s, dtype=torch.bool), capacity, E)
    return GroupedPlan.build(expert, decision.keep, decision.position, decision.kept, E)


def _inputs(plan, d: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    n, s = plan.row_of_slot.shape
    R = plan.token_of_row.shape[0]
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    rows = torch.randn(R, d, generator=g, dtype=torch.float64)
    dropped = plan.row_of_slot == R
    weight = torch.randn(n, s, generator=g, dtype=torch.float64).masked_fill(dropped, 0.0)
    return x, rows, weight


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("layout", ["buffers", "grouped"])
def test_adjoint_gathers_equal_the_plain_ones_values_and_gradients(layout: str, seed: int) -> None:
    plan = _buffers_plan(seed) if layout == "buffers" else _grouped_plan(seed)
    x, rows, weight = _inputs(plan, 5, seed)
    maps = (plan.token_of_row, plan.row_of_slot)
    results = []
    for adjoint in (True, False):
        xs, rs, ws = (t.clone().requires_grad_(True) for t in (x, rows, weight))
        out_rows = dispatch_rows(xs, *maps, adjoint=adjoint)
        y = combine_rows(rs, ws, plan.row_of_slot, plan.token_of_row, adjoint=adjoint)
        g = torch.Generator().manual_seed(seed + 9)
        loss = (out_rows * torch.randn(out_rows.shape, generator=g, dtype=torch.float64)).sum() + \
            (y * torch.randn(y.shape, generator=g, dtype=torch.float64)).sum()
        loss.backward()
        results.append((out_rows.detach(), y.detach(), xs.grad, rs.grad, ws.grad))
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("seed", range(3))
def test_adjoint_gathers_pass_gradcheck_and_gradgradcheck(seed: int) -> None:
    plan = _buffers_plan(seed, n=5, C=2)
    x, rows, weight = _inputs(plan, 3, seed)
    maps = (plan.token_of_row, plan.row_of_slot)
    dropped = plan.row_of_slot == plan.token_of_row.shape[0]

    def dispatch(x_):
        return dispatch_rows(x_, *maps, adjoint=True)

    def combine(rows_, weight_):
        # The function's contract: zero weight on dropped pairs (the plans mask it before calling).
        return combine_rows(rows_, weight_.masked_fill(dropped, 0.0), plan.row_of_slot, plan.token_of_row,
                            adjoint=True)

    x.requires_grad_(True)
    rows.requires_grad_(True)
    weight.requires_grad_(True)
    assert torch.autograd.gradcheck(dispatch, (x,))
    assert torch.autograd.gradgradcheck(dispatch, (x,))
    assert torch.autograd.gradcheck(combine, (rows, weight))
    assert torch.autograd.gradgradcheck(combine, (rows, weight))


def test_rows_of_no_pair_are_never_read() -> None:
    """The grouped layout's rows past its last offset hold whatever grouped matmuls leave there:
    NaN in them reaches neither the output nor any gradient, on either path."""
    plan = _grouped_plan(3, capacity=2)
    total = int(plan.offsets[-1])
    assert total < plan.num_rows, "the layout should have rows of no pair"
    _, rows, weight = _inputs(plan, 4, 3)
    rows[total:] = float("nan")
    for adjoint in (True, False):
        rs, ws = rows.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        y = combine_rows(rs, ws, plan.row_of_slot, plan.token_of_row, adjoint=adjoint)
        y.sum().backward()
        assert torch.isfinite(y).all() and torch.isfinite(ws.grad).all()
        assert torch.isfinite(rs.grad[:total]).all() and bool((rs.grad[total:].nan_to_num(1.0) == 0).all())


def test_the_adjoint_backward_sums_the_slots_in_a_fixed_order() -> None:
    """Two calls, same inputs: bitwise the same gradients (no atomic adds whose order varies)."""
    plan = _buffers_plan(5, n=64, s=3, E=4, C=48)
    x, rows, weight = _inputs(plan, 16, 5)
    grads = []
    for _ in range(2):
        xs, rs, ws = (t.clone().float().requires_grad_(True) for t in (x, rows, weight))
        dispatch_rows(xs, plan.token_of_row, plan.row_of_slot, adjoint=True).square().sum().backward()
        combine_rows(rs, ws, plan.row_of_slot, plan.token_of_row, adjoint=True).square().sum().backward()
        grads.append((xs.grad, rs.grad, ws.grad))
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_full_precision_rounds_each_product_then_each_sum_in_slot_order(dtype: torch.dtype) -> None:
    """In float32 and float64 the adjoint combine is ``w_0 r_0 + w_1 r_1 + ...`` with every
    product and every partial sum rounded, slot by slot: what the plain path and the compiled
    layer compute (no fused multiply-add, which would round a product and its sum together)."""
    g = torch.Generator().manual_seed(3)
    n, s, d = 64, 3, 256
    row_of_slot = torch.arange(n * s).view(n, s)
    token_of_row = torch.arange(n * s) // s
    rows = torch.randn(n * s, d, generator=g, dtype=dtype)
    weight = torch.randn(n, s, generator=g, dtype=dtype)
    picked = rows[row_of_slot]
    expected = picked[:, 0] * weight[:, 0:1]
    for j in range(1, s):
        expected = expected + picked[:, j] * weight[:, j:j + 1]
    assert torch.equal(combine_rows(rows, weight, row_of_slot, token_of_row, adjoint=True), expected)


@pytest.mark.parametrize("adjoint", [True, False])
def test_a_plan_of_no_slots_combines_to_zeros(adjoint: bool) -> None:
    n, d = 3, 4
    rows = torch.randn(2, d, requires_grad=True)
    weight = torch.zeros(n, 0, requires_grad=True)
    y = combine_rows(rows, weight, torch.zeros(n, 0, dtype=torch.long), torch.full((2,), n), adjoint=adjoint)
    assert torch.equal(y, torch.zeros(n, d))
    y.sum().backward()
    assert torch.equal(rows.grad, torch.zeros(2, d)) and weight.grad.shape == (n, 0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_sums_products_in_float32_on_both_paths(dtype: torch.dtype) -> None:
    """Combine sums the slots' products in float32 and rounds once; its weight gradient sums the
    products rows * grad_y in float32 too. Small values (rows ~1e-3, grad_y ~1e-4) are where
    products rounded to float16 first underflowed: the adjoint path's weight gradient was 29x
    further from the float64 result than the plain path's. Both paths now match to the bit."""
    g = torch.Generator().manual_seed(0)
    n, s, d = 64, 3, 256
    row_of_slot = torch.arange(n * s).view(n, s)
    token_of_row = torch.arange(n * s) // s
    rows = (torch.randn(n * s, d, generator=g) * 1e-3).to(dtype)
    weight = torch.rand(n, s, generator=g).to(dtype)
    grad_y = (torch.randn(n, d, generator=g) * 1e-4).to(dtype)
    ref_y = (rows.double()[row_of_slot] * weight.double().unsqueeze(-1)).sum(1)
    ref_gw = (rows.double()[row_of_slot] * grad_y.double().unsqueeze(1)).sum(-1)
    results = []
    for adjoint in (True, False):
        rs, ws = rows.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        y = combine_rows(rs, ws, row_of_slot, token_of_row, adjoint=adjoint)
        (gw,) = torch.autograd.grad(y, ws, grad_y)
        results.append((y.detach(), gw))
        # One rounding of the result: half an ulp relative, or half the subnormal spacing (the
        # float16 weight gradients here, ~1e-6, are below float16's smallest normal number).
        info = torch.finfo(dtype)
        for got, ref in ((y, ref_y), (gw, ref_gw)):
            assert (got.double() - ref).abs().max() <= 2 * info.eps * ref.abs().max() + info.tiny * info.eps
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("layout", ["buffers", "grouped"])
def test_torch_func_grad_works_through_the_adjoint_gathers(layout: str) -> None:
    """torch.func.grad through both autograd functions (setup_context form) gives the plain path's gradients."""
    plan = _buffers_plan(1) if layout == "buffers" else _grouped_plan(1)
    x, rows, weight = _inputs(plan, 5, 1)

    def loss(x, rows, weight, adjoint):
        out_rows = dispatch_rows(x, plan.token_of_row, plan.row_of_slot, adjoint=adjoint)
        y = combine_rows(rows, weight, plan.row_of_slot, plan.token_of_row, adjoint=adjoint)
        return out_rows.square().sum() + (y * y.detach().flip(0)).sum()

    got = torch.func.grad(loss, argnums=(0, 1, 2))(x, rows, weight, True)
    want = torch.func.grad(loss, argnums=(0, 1, 2))(x, rows, weight, False)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def _half_case(dtype: torch.dtype, device: str = "cpu"):
    g = torch.Generator().manual_seed(1)
    n, s, d = 64, 2, 512
    row_of_slot = torch.arange(n * s).view(n, s)
    row_of_slot[::7, 1] = n * s  # some dropped pairs: their weight and gradient are 0
    token_of_row = torch.arange(n * s) // s
    token_of_row[(row_of_slot[::7, 0] + 1)] = n  # (their rows belong to no pair)
    rows = (torch.randn(n * s, d, generator=g) * 1e-3).to(dtype)
    weight = torch.rand(n, s, generator=g).masked_fill(row_of_slot == n * s, 0.0).to(dtype)
    grad_y = (torch.randn(n, d, generator=g) * 1e-4).to(dtype)
    picked = torch.cat([rows.double(), rows.new_zeros(1, d).double()])[row_of_slot]
    ref_gw = (picked * grad_y.double().unsqueeze(1)).sum(-1)
    maps = (row_of_slot.to(device), token_of_row.to(device))
    return rows.to(device), weight.to(device), grad_y.to(device), maps, ref_gw


def _check_weight_gradient(rows, weight, grad_y, maps, ref_gw) -> None:
    rs, ws = rows.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    y = combine_rows(rs, ws, *maps, adjoint=True)
    (gw,) = torch.autograd.grad(y, ws, grad_y)
    info = torch.finfo(rows.dtype)
    err = (gw.double().cpu() - ref_gw).abs().max()
    assert err <= 2 * info.eps * ref_gw.abs().max() + info.tiny * info.eps, float(err)
    assert bool((gw.cpu()[ref_gw == 0] == 0).all())  # dropped pairs: exactly 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_float32_out_row_dots_give_the_weight_gradient_within_one_rounding(dtype: torch.dtype) -> None:
    """On CUDA the weight gradient's per-row dots are one batched matmul with a float32 result
    (routelab._float32_out.row_dots_f32); taken here on the CPU (through float32 copies), the
    gradient is within one rounding of the float64 one, as the addcmul path's, also at magnitudes
    where products rounded to half precision would underflow."""
    from routelab import _float32_out
    calls = []
    original = _float32_out.row_dots_f32

    def spy(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        calls.append(a.shape)
        return original(a, b)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_float32_out, "half_kernels", lambda *ts: ts[0].dtype in _float32_out.HALF)
        mp.setattr(_float32_out, "row_dots_f32", spy)
        _check_weight_gradient(*_half_case(dtype))
        assert len(calls) == 1  # the dots went through it
        # A double backward differentiates the addcmul path instead (row_dots_f32 has no graph).
        rows, weight, grad_y, maps, _ = _half_case(dtype)
        rs, ws = rows.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        (gw,) = torch.autograd.grad(combine_rows(rs, ws, *maps, adjoint=True), ws, grad_y, create_graph=True)
        assert len(calls) == 1 and gw.requires_grad


@pytest.mark.requires_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_combine_weight_gradient_within_one_rounding(dtype: torch.dtype) -> None:
    from routelab import _float32_out
    rows, weight, grad_y, maps, ref_gw = _half_case(dtype, "cuda")
    assert _float32_out.half_kernels(rows, rows)  # the batched-matmul dots are taken
    _check_weight_gradient(rows, weight, grad_y, maps, ref_gw)
