"""Contracts of routelab._float32_out and routelab._autograd that the
other tests leave open (found by mutation testing).

The CUDA branches of ``_float32_out`` are checked on this CPU through ``FakeTensorMode``: fake CUDA
tensors carry device, dtype and shape (no values), enough for ``half_kernels``' decision and for the
dtype and shape of the ``out_dtype`` matmuls' results. The CPU stand-ins are checked against float64
products (the products of two half-precision numbers are exact in float32). ``_autograd.apply`` is
checked against ``Function.apply`` itself. (routelab.routing.dropless needs nothing here: every
behaviour-changing mutant of it tried was caught by tests/routing/test_dropless.py's oracle test.)
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensorMode

from routelab import _autograd, _float32_out
from test_autograd_apply import _Scaled

HALF = (torch.bfloat16, torch.float16)


def _fake_cuda(*shape: int, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    return torch.empty(*shape, dtype=dtype, device="cuda")


# --- _float32_out.half_kernels ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", HALF)
def test_half_kernels_never_take_cpu_tensors(dtype: torch.dtype) -> None:
    """The out_dtype matmuls have CUDA kernels only: CPU tensors (either operand) never take them,
    while the same shapes and dtype as (fake) CUDA tensors do."""
    a, b = torch.randn(4, 3).to(dtype), torch.randn(3, 5).to(dtype)
    assert not _float32_out.half_kernels(a, b)
    assert not _float32_out.half_kernels(a)
    with FakeTensorMode():
        ca, cb = _fake_cuda(4, 3, dtype=dtype), _fake_cuda(3, 5, dtype=dtype)
        assert _float32_out.half_kernels(ca, cb)
        assert not _float32_out.half_kernels(ca, torch.empty(3, 5, dtype=dtype))  # one on the CPU


def test_half_kernels_need_one_half_precision_dtype() -> None:
    """Both bfloat16 and float16 take the kernels, but only with every operand of the first's dtype
    (a bfloat16 x float16 matmul has no such kernel); float32 never takes them."""
    with FakeTensorMode():
        for dtype in HALF:
            assert _float32_out.half_kernels(_fake_cuda(4, 3, dtype=dtype), _fake_cuda(3, 5, dtype=dtype)), dtype
        assert not _float32_out.half_kernels(_fake_cuda(4, 3), _fake_cuda(3, 5, dtype=torch.float16))
        assert not _float32_out.half_kernels(_fake_cuda(4, 3, dtype=torch.float16), _fake_cuda(3, 5))
        assert not _float32_out.half_kernels(_fake_cuda(4, 3), _fake_cuda(3, 5), _fake_cuda(3, dtype=torch.float32))
        f32 = torch.float32
        assert not _float32_out.half_kernels(_fake_cuda(4, 3, dtype=f32), _fake_cuda(3, 5, dtype=f32))


def test_half_kernels_are_off_while_torch_compile_traces(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under torch.compile (``torch.compiler.is_compiling()``) the float32 paths are taken, even for
    CUDA half-precision operands that take the kernels eagerly."""
    with FakeTensorMode():
        a, b = _fake_cuda(4, 3), _fake_cuda(3, 5)
        assert _float32_out.half_kernels(a, b)
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        assert not _float32_out.half_kernels(a, b)


def test_half_kernels_are_off_for_vmap_batched_tensors() -> None:
    """vmap's batching rules do not cover out_dtype: tensors batched by torch.func.vmap never take
    the kernels (the same tensors unbatched do)."""
    seen: list[bool] = []
    with FakeTensorMode():
        a, b = _fake_cuda(2, 4, 3), _fake_cuda(2, 3, 5)
        assert _float32_out.half_kernels(a, b)
        torch.func.vmap(lambda x, y: seen.append(_float32_out.half_kernels(x, y)) or x.sum())(a, b)
    assert seen == [False]


# --- _float32_out.mm_f32 / row_dots_f32 -----------------------------------------------------------


def test_mm_f32_on_cuda_gives_a_float32_result_of_the_matmul_shape() -> None:
    """The CUDA branch writes float32 (not the operands' half precision), [m, n], on the device."""
    with FakeTensorMode():
        for dtype in HALF:
            out = _float32_out.mm_f32(_fake_cuda(4, 3, dtype=dtype), _fake_cuda(3, 5, dtype=dtype))
            assert out.dtype == torch.float32 and out.shape == (4, 5) and out.is_cuda, dtype


def test_row_dots_f32_on_cuda_gives_one_float32_dot_per_row() -> None:
    """The CUDA branch's batched 1 x d x 1 matmul gives [R] float32: one dot per row (not [R, d, d]
    outer products)."""
    with FakeTensorMode():
        for dtype in HALF:
            for rows, d in ((5, 3), (1, 7), (6, 1)):
                out = _float32_out.row_dots_f32(_fake_cuda(rows, d, dtype=dtype), _fake_cuda(rows, d, dtype=dtype))
                assert out.dtype == torch.float32 and out.shape == (rows,) and out.is_cuda, (dtype, rows, d)


@pytest.mark.parametrize("dtype", HALF)
def test_cpu_stand_ins_keep_the_exact_products(dtype: torch.dtype) -> None:
    """On the CPU, mm_f32 and row_dots_f32 compute exact half x half products summed in float32:
    with one term per sum the float64 products exactly (not rounded to half precision), and with
    many terms within float32 summation error of them."""
    gen = torch.Generator().manual_seed(0)
    a = (1 + torch.randint(1, 100, (6, 1), generator=gen) / 128).to(dtype)
    b = (1 + torch.randint(1, 100, (1, 5), generator=gen) / 128).to(dtype)
    out = _float32_out.mm_f32(a, b)
    assert out.dtype == torch.float32
    assert torch.equal(out.double(), a.double() @ b.double())
    c = (1 + torch.randint(1, 100, (6, 1), generator=gen) / 128).to(dtype)
    dots = _float32_out.row_dots_f32(a, c)
    assert dots.dtype == torch.float32 and dots.shape == (6,)
    assert torch.equal(dots.double(), (a.double() * c.double()).sum(-1))
    x, w = torch.randn(8, 64, generator=gen).to(dtype), torch.randn(64, 3, generator=gen).to(dtype)
    torch.testing.assert_close(_float32_out.mm_f32(x, w).double(), x.double() @ w.double(), rtol=1e-5, atol=1e-5)
    y = torch.randn(8, 64, generator=gen).to(dtype)
    torch.testing.assert_close(_float32_out.row_dots_f32(x, y).double(), (x.double() * y.double()).sum(-1),
                               rtol=1e-5, atol=1e-5)


# --- _autograd.apply ----------------------------------------------------------------------------


def test_apply_unwraps_tensors_escaped_from_a_finished_transform() -> None:
    """A tensor that escaped torch.func.grad (a dead wrapper) is unwrapped first, as Function.apply
    does: the same values, and no graph on a result whose inputs need no gradient."""
    leaked: list[Tensor] = []
    torch.func.grad(lambda r: leaked.append(r) or r.sum())(torch.randn(4))
    dead = leaked[0]
    assert torch._C._functorch.is_functorch_wrapped_tensor(dead) and not torch._C._are_functorch_transforms_active()
    w = torch.randn(4)
    want = _Scaled.apply(dead, w, 2.0)
    got = _autograd.apply(_Scaled, dead, w, 2.0)
    assert torch.equal(got, want)
    assert got.requires_grad == want.requires_grad is False
    assert got.grad_fn is None


def _count_function_apply(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that grows by one at every ``_Scaled.apply`` (Function.apply) call."""
    calls: list[int] = []
    real = _Scaled.apply.__func__

    def counting(cls, *args):
        calls.append(1)
        return real(cls, *args)

    monkeypatch.setattr(_Scaled, "apply", classmethod(counting))
    return calls


def test_apply_under_functorch_transforms_is_function_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under a torch.func transform apply goes through Function.apply (the custom-function path the
    transforms need): it is called, and gives its gradients."""
    calls = _count_function_apply(monkeypatch)
    x, w = torch.randn(5), torch.randn(5)
    grad = torch.func.grad(lambda a: _autograd.apply(_Scaled, a, w, 3.0).sum())(x)
    assert calls and torch.equal(grad, w * 3.0)
    calls.clear()
    out = _autograd.apply(_Scaled, x, w, 3.0)  # eager: straight to the C++ apply
    assert not calls and torch.equal(out, x * w * 3.0)


def test_apply_while_compiling_is_function_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    """While torch.compile traces, apply calls Function.apply as it is (what Dynamo knows how to
    trace)."""
    calls = _count_function_apply(monkeypatch)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    x, w = torch.randn(5), torch.randn(5)
    out = _autograd.apply(_Scaled, x, w, 3.0)
    assert calls and torch.equal(out, x * w * 3.0)

