"""routelab.routing._gather_triton: the fused Triton gathers of dispatch and combine.

The kernels are checked against the PyTorch formulation of ``routelab.routing._gather`` (itself
checked against explicit loops and finite differences in test_gather.py): the same values,
sentinels reading nothing, rows of no pair never read, and the layer's outputs and gradients the
same with the kernels as without. Where a GPU is, on CUDA tensors (compiled kernels); elsewhere
on CPU tensors in Triton's interpreter (``TRITON_INTERPRET=1``, set by conftest.py; Triton is a
test dependency). The interpreter rounds float32 to bfloat16 toward zero (the GPU to nearest
even), so its bfloat16 results are compared within one bfloat16 ulp, the GPU's bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from test_gather import _buffers_plan, _grouped_plan

from routelab.layers import MoE
from routelab.routing import _gather, _gather_triton
from routelab.routing._gather import combine_rows, dispatch_rows
from triton_devices import KERNEL_DEVICES, kernel_device

pytest.importorskip("triton")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]




@pytest.fixture
def dev(monkeypatch: pytest.MonkeyPatch) -> str:
    """The device the kernels run on here: CUDA, else the CPU in Triton's interpreter."""
    return kernel_device(monkeypatch)


def _assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit for bit, except bfloat16 in the interpreter (truncating float32): within one ulp."""
    got = got.cpu()
    assert got.shape == want.shape and got.dtype == want.dtype
    if got.dtype == torch.bfloat16 and KERNEL_DEVICES[-1] == "cpu":
        ulp = torch.finfo(torch.bfloat16).eps * want.float().abs().clamp_min(torch.finfo(torch.bfloat16).tiny)
        assert bool(((got.float() - want.float()).abs() <= ulp).all())
    else:
        assert torch.equal(got, want)


def _padded(t: torch.Tensor) -> torch.Tensor:
    return torch.cat([t, t.new_zeros(1, t.shape[1])])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [1, 37, 1030])
def test_gather_rows_reads_the_indexed_rows_and_zeros_for_the_sentinel(dev, dtype, d) -> None:
    g = torch.Generator().manual_seed(d)
    src = torch.randn(6, d, generator=g).to(dtype)
    index = torch.tensor([5, 6, 0, 6, 2, 2])
    assert torch.equal(_gather_triton.gather_rows(src.to(dev), index.to(dev)).cpu(), _padded(src)[index])
    assert _gather_triton.gather_rows(src.to(dev), index[:0].to(dev)).shape == (0, d)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("s", "d"), [(0, 8), (1, 37), (2, 1030), (3, 5)])
def test_slot_sum_is_the_float32_sum_of_products_in_slot_order(dev, dtype, s, d) -> None:
    g = torch.Generator().manual_seed(10 * s + d)
    m, n = 7, 9
    src = torch.randn(m, d, generator=g).to(dtype)
    src[3] = float("nan")  # a row that no slot names: never read
    index = torch.randint(0, m + 1, (n, s), generator=g)
    index[index == 3] = m
    index[::4] = m  # whole tokens dropped
    weight = torch.randn(n, s, generator=g).to(dtype).masked_fill(index == m, 0.0)
    picked = _padded(src)[index].float()  # [n, s, d]
    for w in (weight, None):
        want = torch.zeros(n, d)
        for j in range(s):
            want = want + (picked[:, j] * w[:, j:j + 1].float() if w is not None else picked[:, j])
        got = _gather_triton.slot_sum(src.to(dev), index.to(dev), None if w is None else w.to(dev))
        _assert_same(got, want.to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [3, 1030])
def test_combine_backward_scales_the_token_gradients_and_dots_the_rows(dev, dtype, d) -> None:
    g = torch.Generator().manual_seed(d)
    n, R = 5, 8
    rows = torch.randn(R, d, generator=g).to(dtype)
    token_of_row = torch.tensor([0, 4, 5, 1, 5, 2, 3, 0])
    rows[token_of_row == n] = float("nan")  # rows of no pair: never read
    grad_y = torch.randn(n, d, generator=g).to(dtype)
    weight_of_row = torch.randn(R, generator=g).to(dtype)
    gathered = _padded(grad_y)[token_of_row].float()
    want_rows = (gathered * weight_of_row.float()[:, None]).to(dtype)
    finite_rows = rows.double().nan_to_num(0.0)
    want_dots = (finite_rows * gathered.double()).sum(-1)
    bound = d * torch.finfo(torch.float32).eps * (finite_rows.abs() * gathered.double().abs()).sum(-1)
    for need_rows, need_dots in ((True, True), (True, False), (False, True), (False, False)):
        got_rows, dots = _gather_triton.combine_backward(
            rows.to(dev), grad_y.to(dev), token_of_row.to(dev), weight_of_row.to(dev) if need_rows else None,
            need_dots)
        assert (got_rows is not None) == need_rows and (dots is not None) == need_dots
        if need_rows:
            _assert_same(got_rows, want_rows)
        if need_dots:
            dots = dots.cpu()
            assert dots.dtype == torch.float32
            assert bool(((dots.double() - want_dots).abs() <= bound).all())
            assert bool((dots[token_of_row == n] == 0).all())


def test_the_kernels_take_strided_and_expanded_inputs(dev) -> None:
    """A gradient of ``y.sum()`` is an expanded tensor (stride 0): the wrappers make it contiguous."""
    rows = torch.randn(4, 6, device=dev)
    grad_y = torch.ones(1, 1, device=dev).expand(3, 6)
    token_of_row = torch.tensor([0, 1, 2, 3], device=dev)
    got_rows, dots = _gather_triton.combine_backward(rows, grad_y, token_of_row, torch.ones(4, device=dev), True)
    assert torch.equal(got_rows, _padded(grad_y.contiguous())[token_of_row])
    torch.testing.assert_close(dots, torch.cat([rows[:3].sum(-1), torch.zeros(1, device=dev)]))
    src = torch.randn(6, 4, device=dev).t()  # [4, 6], not contiguous
    index = torch.tensor([3, 4, 0], device=dev)
    assert torch.equal(_gather_triton.gather_rows(src, index), _padded(src)[index])


def test_the_gate_takes_cuda_tensors_of_one_dtype_outside_compile_and_vmap() -> None:
    assert not _gather_triton.usable(torch.randn(3, 4))  # the CPU is not a kernel device outside the tests
    assert not _gather_triton.usable(torch.randn(3, 4, device="meta"))
    if torch.cuda.is_available():
        x = torch.randn(3, 4, device="cuda")
        assert _gather_triton.usable(x) and _gather_triton.usable(x.half())
        assert not _gather_triton.usable(x.double()) and not _gather_triton.usable(x, x.half())
        assert torch.func.vmap(lambda t: torch.tensor(_gather_triton.usable(t)))(x).sum() == 0


def test_the_gate_refuses_fake_tensors_and_dispatch_modes(monkeypatch) -> None:
    """Tracing (fake tensors, an operator-counting mode) sees PyTorch operators, never a kernel."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counting(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(_gather_triton, "DEVICE_TYPES", ("cuda", "cpu"))
    x = torch.randn(3, 4)
    assert _gather_triton.usable(x) == (_gather_triton.triton is not None)
    with Counting():
        assert not _gather_triton.usable(x)
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(x)
        assert not _gather_triton.usable(fake)
    assert not _gather_triton.usable(torch.nn.Parameter(x))


def _on(dev: str, *ts: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(dev) for t in ts]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["buffers", "grouped"])
def test_adjoint_gathers_with_kernels_equal_them_without(dev, monkeypatch, layout, dtype) -> None:
    """dispatch_rows and combine_rows (adjoint path), values and all gradients, kernels on and off;
    a row of no pair holding NaN changes nothing."""
    plan = _buffers_plan(2, n=11, s=2, E=4, C=4) if layout == "buffers" else _grouped_plan(2, n=11)
    g = torch.Generator().manual_seed(7)
    n, s = plan.row_of_slot.shape
    R = plan.token_of_row.shape[0]
    x = torch.randn(n, 9, generator=g).to(dtype)
    rows = torch.randn(R, 9, generator=g).to(dtype)
    rows[plan.token_of_row == n] = float("nan")
    weight = torch.rand(n, s, generator=g).to(dtype).masked_fill(plan.row_of_slot == R, 0.0)
    gy = torch.randn(n, 9, generator=g).to(dtype)
    grows = torch.randn(R, 9, generator=g).to(dtype)
    token_of_row, row_of_slot = _on(dev, plan.token_of_row, plan.row_of_slot)
    calls = _spy(monkeypatch, ("gather_rows", "slot_sum", "combine_backward"))
    results = []
    for on in (True, False):
        monkeypatch.setattr(_gather_triton, "DEVICE_TYPES", KERNEL_DEVICES if on else ())
        xs, rs, ws = (t.to(dev).requires_grad_(True) for t in (x, rows, weight))
        out = dispatch_rows(xs, token_of_row, row_of_slot, adjoint=True)
        y = combine_rows(rs, ws, row_of_slot, token_of_row, adjoint=True)
        torch.autograd.backward([out, y], _on(dev, grows, gy))
        results.append([t.detach().cpu() for t in (out, y, xs.grad, rs.grad, ws.grad)])
        assert calls == (["gather_rows", "slot_sum", "combine_backward", "slot_sum"] if on else [])
        calls.clear()
    paired = plan.token_of_row < n  # rows of a pair: the only rows whose values anything reads
    for i, (got, want) in enumerate(zip(*results, strict=True)):
        if i == 4:  # the weight gradient: the dots summed in another order
            torch.testing.assert_close(got, want, rtol=1e-2 if dtype == torch.bfloat16 else 1e-6, atol=1e-6)
        else:
            _assert_same(got.nan_to_num(123.0), want.nan_to_num(123.0))
    out, y, x_grad, rows_grad, w_grad = results[0]
    for t in (y, x_grad, w_grad, rows_grad[paired], out):
        assert torch.isfinite(t).all()
    assert bool((rows_grad[~paired] == 0).all())


def test_the_gate_checks_the_maps_too(dev, monkeypatch) -> None:
    """int32 maps, or maps batched by vmap, take the PyTorch operators (which accept them)."""
    plan = _buffers_plan(3, n=6, C=3)
    R = plan.token_of_row.shape[0]
    x = torch.randn(6, 4, device=dev)
    rows = torch.randn(R, 4, device=dev)
    weight = torch.rand(6, 2, device=dev).masked_fill(plan.row_of_slot.to(dev) == R, 0.0)
    token_of_row, row_of_slot = _on(dev, plan.token_of_row, plan.row_of_slot)
    assert _gather_triton.usable(x, indices=(token_of_row,))
    assert not _gather_triton.usable(x, indices=(token_of_row.int(),))
    assert not _gather_triton.usable(x, indices=(token_of_row.to("meta"),))
    want = dispatch_rows(x, token_of_row, row_of_slot, adjoint=True)
    got = dispatch_rows(x, token_of_row.int(), row_of_slot.int(), adjoint=True)
    assert torch.equal(got, want)
    batched = torch.func.vmap(lambda t: dispatch_rows(x, t, row_of_slot, adjoint=True))(
        torch.stack([token_of_row, token_of_row]))
    assert torch.equal(batched, torch.stack([want, want]))
    y = combine_rows(rows, weight, row_of_slot, token_of_row, adjoint=True)
    batched = torch.func.vmap(lambda m: combine_rows(rows, weight, m, token_of_row, adjoint=True))(
        torch.stack([row_of_slot, row_of_slot]))
    torch.testing.assert_close(batched, torch.stack([y, y]))


def _spy(monkeypatch: pytest.MonkeyPatch, names: tuple[str, ...]) -> list[str]:
    calls: list[str] = []
    for name in names:
        original = getattr(_gather_triton, name)

        def spy(*args, _original=original, _name=name, **kwargs):
            calls.append(_name)
            return _original(*args, **kwargs)
        monkeypatch.setattr(_gather_triton, name, spy)
    return calls


def test_a_double_backward_takes_the_differentiable_path(dev, monkeypatch) -> None:
    """The kernels build no graph: with create_graph the PyTorch operators run (and the second
    derivatives exist); without it the kernels do."""
    calls = _spy(monkeypatch, ("slot_sum", "combine_backward"))
    plan = _buffers_plan(4, n=6, C=3)
    R = plan.token_of_row.shape[0]
    token_of_row, row_of_slot = _on(dev, plan.token_of_row, plan.row_of_slot)
    rows = torch.randn(R, 5, device=dev, requires_grad=True)
    weight = torch.rand(6, 2).masked_fill(plan.row_of_slot == R, 0.0).to(dev).requires_grad_(True)
    y = combine_rows(rows, weight, row_of_slot, token_of_row, adjoint=True)
    assert calls == ["slot_sum"]
    (gw,) = torch.autograd.grad(y.square().sum(), weight, create_graph=True)
    assert calls == ["slot_sum"] and gw.requires_grad
    # gw = 2 <y, rows>: its backward runs y's first-order backward again, with no graph: the kernel.
    gw.sum().backward()
    assert rows.grad is not None and torch.isfinite(rows.grad).all()
    assert calls == ["slot_sum", "combine_backward"]


@pytest.mark.parametrize("k", [1, 2])
def test_the_layer_with_kernels_computes_what_it_computes_without(dev, monkeypatch, k) -> None:
    """The MoE layer with the adjoint gathers (the GPU's path), kernels on and off: the same
    output and gradients (the weight gradient's dots summed in another order: close); the
    kernels are what ran."""
    monkeypatch.setattr(_gather, "_adjoint_by_default", lambda t: True)
    calls = _spy(monkeypatch, ("gather_rows", "slot_sum", "combine_backward"))
    results = []
    for on in (True, False):
        monkeypatch.setattr(_gather_triton, "DEVICE_TYPES", KERNEL_DEVICES if on else ())
        torch.manual_seed(0)
        moe = MoE(16, 8, 4, router="topk", k=k, capacity_factor=1.0).to(dev)
        x = torch.randn(40, 16, device=dev, requires_grad=True)
        y, _ = moe(x)
        y.square().sum().backward()
        results.append([y.detach(), x.grad] + [p.grad for p in moe.parameters()])
        if on:
            assert sorted(set(calls)) == ["combine_backward", "gather_rows", "slot_sum"]
            calls.clear()
    assert calls == []
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# --- on CUDA: the compiled kernels -------------------------------------------------------------

def _cuda_case(dtype: torch.dtype, n: int = 4096, d: int = 1024, s: int = 2):
    g = torch.Generator().manual_seed(0)
    R = n * s
    row_of_slot = torch.randperm(R, generator=g).view(n, s)
    row_of_slot[::9, -1] = R
    token_of_row = torch.full((R,), n)
    kept = row_of_slot < R
    token_of_row[row_of_slot[kept]] = torch.arange(n).unsqueeze(1).expand(n, s)[kept]
    rows = torch.randn(R, d, generator=g).to(dtype)
    weight = torch.rand(n, s, generator=g).to(dtype).masked_fill(~kept, 0.0)
    x = torch.randn(n, d, generator=g).to(dtype)
    return [t.cuda() for t in (x, rows, weight, row_of_slot, token_of_row)]


@pytest.mark.requires_cuda
@pytest.mark.parametrize("s", [1, 2, 3])
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_kernels_equal_the_pytorch_path_bit_for_bit(monkeypatch, dtype, s) -> None:
    """Values and the row gradients bit for bit (float32 without fused multiply-adds); the weight
    gradient within the float32 sums' rounding. From 3 slots on, PyTorch's ``sum`` over the slots
    (dispatch's backward) may add in another order: within one rounding there."""
    x, rows, weight, row_of_slot, token_of_row = _cuda_case(dtype, s=s)
    gy = torch.randn_like(x)
    grows = torch.randn_like(rows)
    results = []
    for on in (True, False):
        monkeypatch.setattr(_gather_triton, "DEVICE_TYPES", ("cuda",) if on else ())
        assert _gather_triton.usable(x) == on
        xs, rs, ws = (t.clone().requires_grad_(True) for t in (x, rows, weight))
        out = dispatch_rows(xs, token_of_row, row_of_slot, adjoint=True)
        y = combine_rows(rs, ws, row_of_slot, token_of_row, adjoint=True)
        torch.autograd.backward([out, y], [grows, gy])
        results.append((out, y, xs.grad, rs.grad, ws.grad))
    for i, (got, want) in enumerate(zip(*results, strict=True)):
        if i == 4:
            torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-3)
        elif i == 2 and s >= 3:
            eps = torch.finfo(dtype).eps
            assert bool(((got.float() - want.float()).abs() <= eps * want.float().abs()).all())
        else:
            assert torch.equal(got, want), i


@pytest.mark.requires_cuda
def test_cuda_kernels_address_past_two_to_the_31_elements() -> None:
    """Offsets are 64-bit: a source of more than 2**31 elements (4.3 GB in bfloat16)."""
    free, _ = torch.cuda.mem_get_info()
    if free < 12 * 2**30:
        pytest.skip("needs 12 GiB of free GPU memory")
    d = 4096
    m = 2**31 // d + 1000
    src = torch.empty(m, d, dtype=torch.bfloat16, device="cuda")
    src[-3:] = torch.arange(3 * d, device="cuda", dtype=torch.bfloat16).view(3, d)
    index = torch.tensor([m - 1, m, m - 3], device="cuda")
    out = _gather_triton.gather_rows(src, index)
    assert torch.equal(out[0], src[-1]) and bool((out[1] == 0).all()) and torch.equal(out[2], src[-3])
    summed = _gather_triton.slot_sum(src, index.view(1, 3))
    assert torch.equal(summed[0], (src[-1].float() + src[-3].float()).to(torch.bfloat16))
    del src


@pytest.mark.requires_cuda
def test_the_layer_takes_the_kernels_on_cuda(monkeypatch) -> None:
    calls = _spy(monkeypatch, ("gather_rows", "slot_sum", "combine_backward"))
    moe = MoE(64, 32, 8, router="topk", k=2).cuda().to(torch.bfloat16)
    x = torch.randn(256, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    moe(x)[0].float().square().sum().backward()
    assert sorted(set(calls)) == ["combine_backward", "gather_rows", "slot_sum"]
    assert torch.isfinite(x.grad).all()
