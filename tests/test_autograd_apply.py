"""routelab._autograd.apply: the layer's autograd Functions without torch's per-call signature binding.

Checked against ``Function.apply`` itself (the independent truth): the same outputs and gradients,
eager, under ``torch.func`` transforms (vmap, grad, jvp) and under ``torch.compile``; and on the
eager path no ``inspect.signature`` call (what made each call about 40 us slower).
"""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import Tensor

from routelab import _autograd


class _Scaled(torch.autograd.Function):
    """``x * w`` with a separate setup_context (the torch.func form), forward-mode rule included."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, w: Tensor, scale: float = 1.0) -> Tensor:  # type: ignore[override]
        return x * w * scale

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        x, w, scale = inputs
        ctx.save_for_backward(x, w)
        ctx.scale = scale

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        x, w = ctx.saved_tensors
        return grad * w * ctx.scale, grad * x * ctx.scale, None


class _ScaledWithJvp(_Scaled):
    """The same with a forward-mode rule (Dynamo cannot trace a custom jvp: not compiled here)."""

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.x, ctx.w, ctx.scale = inputs

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        return grad * ctx.w * ctx.scale, grad * ctx.x * ctx.scale, None

    @staticmethod
    def jvp(ctx, tx, tw, _):  # type: ignore[override]
        return (tx * ctx.w + ctx.x * tw) * ctx.scale


def _both(x: Tensor, w: Tensor, function: type[torch.autograd.Function] = _Scaled) -> tuple[Tensor, Tensor]:
    return _autograd.apply(function, x, w, 2.0), function.apply(x, w, 2.0)


def test_eager_values_and_gradients_equal_function_apply_without_signature_binding(monkeypatch) -> None:
    x = torch.randn(5, 3, requires_grad=True)
    w = torch.randn(5, 3, requires_grad=True)
    expected = _Scaled.apply(x, w, 2.0)
    expected_grads = torch.autograd.grad(expected.square().sum(), (x, w))

    def no_binding(*args, **kwargs):
        raise AssertionError("inspect.signature was called")

    monkeypatch.setattr(inspect, "signature", no_binding)
    got = _autograd.apply(_Scaled, x, w, 2.0)
    grads = torch.autograd.grad(got.square().sum(), (x, w))
    assert torch.equal(got, expected)
    for a, b in zip(grads, expected_grads):
        assert torch.equal(a, b)
    with pytest.raises(AssertionError, match="inspect.signature"):  # the plain apply binds
        _Scaled.apply(x, w, 2.0)


def test_forward_mode_ad_equals_function_apply() -> None:
    import torch.autograd.forward_ad as fwAD

    x, w, tx, tw = (torch.randn(4) for _ in range(4))
    tangents = []
    for fn in (lambda a, b: _autograd.apply(_ScaledWithJvp, a, b, 2.0), lambda a, b: _ScaledWithJvp.apply(a, b, 2.0)):
        with fwAD.dual_level():
            out = fn(fwAD.make_dual(x, tx), fwAD.make_dual(w, tw))
            tangents.append(fwAD.unpack_dual(out).tangent)
    assert torch.equal(tangents[0], tangents[1])
    assert torch.allclose(tangents[0], (tx * w + x * tw) * 2.0)


def test_torch_func_transforms_equal_function_apply() -> None:
    x = torch.randn(6, 3)
    w = torch.randn(6, 3)
    got, want = (torch.func.grad(lambda a, b, i=i: _both(a, b)[i].sum())(x, w) for i in (0, 1))
    assert torch.equal(got, want)
    got, want = (torch.func.vmap(lambda a, b, i=i: _both(a, b)[i])(x, w) for i in (0, 1))
    assert torch.equal(got, want)
    tangent = (torch.ones(6, 3), torch.zeros(6, 3))
    (_, got), (_, want) = (torch.func.jvp(lambda a, b, i=i: _both(a, b, _ScaledWithJvp)[i], (x, w), tangent)
                           for i in (0, 1))
    assert torch.equal(got, want)


def test_compiled_fullgraph_equals_eager() -> None:
    x = torch.randn(5, 3, requires_grad=True)
    w = torch.randn(5, 3, requires_grad=True)

    def f(a, b):
        return _autograd.apply(_Scaled, a, b, 2.0).square().sum()

    expected = f(x, w)
    expected_grads = torch.autograd.grad(expected, (x, w))
    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(x, w)
    grads = torch.autograd.grad(got, (x, w))
    assert torch.allclose(got, expected)
    for a, b in zip(grads, expected_grads):
        assert torch.allclose(a, b)
