"""Router scores in float32 (routelab.routers._scores): the values and gradients of the plain
float32 linear, half its saved memory for half-precision inputs, and autocast kept out of routing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st

from routelab.layers import MoE
from routelab.routers import make_router
from routelab.routers._scores import float32_linear

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def _reference(x, w, b):
    return F.linear(x.float(), w.float(), None if b is None else b.float())


@settings(max_examples=30, deadline=None)
@given(x_dtype=st.sampled_from(DTYPES), w_dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       bias=st.booleans(), lead=st.sampled_from([(7,), (2, 3), (0,)]), seed=st.integers(0, 2**16))
def test_values_and_gradients_are_those_of_the_float32_linear(x_dtype, w_dtype, bias, lead, seed) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, 12, generator=gen).to(x_dtype)
    w = torch.randn(5, 12, generator=gen).to(w_dtype)
    b = torch.randn(5, generator=gen).to(w_dtype) if bias else None
    g = torch.randn(*lead, 5, generator=gen)
    leaves = [t.clone().requires_grad_(True) for t in (x, w) + ((b,) if bias else ())]
    ref_leaves = [t.clone().requires_grad_(True) for t in (x, w) + ((b,) if bias else ())]
    got = float32_linear(*leaves)
    want = _reference(*ref_leaves, *(() if bias else (None,)))
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    got.backward(g)
    want.backward(g)
    for a, r in zip(leaves, ref_leaves, strict=True):
        assert a.grad.dtype == r.grad.dtype == a.dtype
        torch.testing.assert_close(a.grad, r.grad, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, 1e-6), (torch.bfloat16, 5e-2)])
def test_double_backward_matches_the_float32_linear(dtype: torch.dtype, tol: float) -> None:
    torch.manual_seed(0)
    x = torch.randn(6, 8, dtype=dtype)
    w = torch.randn(3, 8)
    results = []
    for fn in (float32_linear, lambda a, b: _reference(a, b, None)):
        xi, wi = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        out = fn(xi, wi).square().sum()
        (gw,) = torch.autograd.grad(out, wi, create_graph=True)
        (gx,) = torch.autograd.grad(gw.square().sum(), xi)
        results.append(gx)
    # bfloat16: second derivatives summed in another order round differently (up to ~9 of its ulps
    # on one element under torch 2.11), so the tolerance is relative to the largest entry.
    torch.testing.assert_close(results[0], results[1], rtol=tol, atol=tol * float(results[1].abs().max()))


def _saved_bytes(fn) -> int:
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total


def test_a_bfloat16_input_is_saved_in_bfloat16_not_as_a_float32_copy() -> None:
    x = torch.randn(512, 64, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(8, 64, requires_grad=True)
    plain = _saved_bytes(lambda: _reference(x, w, None))
    ours = _saved_bytes(lambda: float32_linear(x, w))
    assert plain == 512 * 64 * 4 + 8 * 64 * 4  # the float32 copy of x, and w
    assert ours == 512 * 64 * 2 + 8 * 64 * 4  # x itself


ROUTERS = [("topk", 2), ("noisy_topk", 2), ("softmax", None), ("switch", None), ("base", 2), ("sinkhorn", 2),
           ("gumbel_matching", None), ("batchwise", 2)]


@pytest.mark.parametrize(("name", "k"), ROUTERS)
def test_autocast_does_not_reach_the_router(name: str, k: int | None) -> None:
    """Inside torch.autocast (the usual mixed-precision training) the router still scores and
    routes in float32: the same routes as without autocast, while the experts run in bfloat16."""
    torch.manual_seed(0)
    moe = MoE(32, 64, 4, router=name, k=k, capacity_factor=1.0)
    with torch.no_grad():
        moe.router.proj.weight.normal_()
        if hasattr(moe.router, "noise"):
            moe.router.noise.weight.normal_()
    x = torch.randn(64, 32)
    torch.manual_seed(1)
    _, plain = moe(x)
    torch.manual_seed(1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = moe.router.logits(x)
        y, routes = moe(x)
    assert logits.dtype == torch.float32 and routes.gate.dtype == torch.float32
    torch.testing.assert_close(logits, moe.router.logits(x), rtol=0, atol=0)
    assert torch.equal(routes.expert, plain.expert) and torch.equal(routes.keep, plain.keep)
    torch.testing.assert_close(routes.gate, plain.gate, rtol=0, atol=0)
    assert y.dtype == torch.float32  # the layer's output in x's dtype; its experts ran under autocast


def test_router_features_of_a_half_precision_input_under_autocast_are_float32() -> None:
    router = make_router("noisy_topk", 16, 4, k=2)
    x = torch.randn(10, 16, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        feats = router.features(x)
    assert feats.dtype == torch.float32
    torch.testing.assert_close(feats, router.features(x), rtol=0, atol=0)


def test_torch_func_transforms_work_through_it() -> None:
    """torch.func.grad and vmap, as through F.linear (an autograd.Function needs setup_context
    and a vmap rule for them)."""
    torch.manual_seed(0)
    x = torch.randn(5, 8, dtype=torch.bfloat16)
    w = torch.randn(3, 8)
    grad_w = torch.func.grad(lambda weight: float32_linear(x, weight).square().sum())(w)
    wr = w.clone().requires_grad_(True)
    _reference(x, wr, None).square().sum().backward()
    torch.testing.assert_close(grad_w, wr.grad)
    per_row = torch.func.vmap(lambda row: float32_linear(row, w))(x)
    torch.testing.assert_close(per_row, _reference(x, w, None))


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float64])
@pytest.mark.parametrize("tangents", ["x", "weight", "bias", "all"])
def test_forward_mode_equals_the_float32_linears(x_dtype, tangents) -> None:
    """torch.func.jvp (and jacfwd) through it, with a tangent on any of its inputs, equal those of
    the float32 F.linear (it had no jvp: forward mode raised NotImplementedError)."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, 8, generator=gen).to(x_dtype)
    w, b = torch.randn(3, 8, generator=gen), torch.randn(3, generator=gen)
    tx = torch.randn(x.shape, generator=gen).to(x_dtype)
    tw, tb = torch.randn(w.shape, generator=gen), torch.randn(b.shape, generator=gen)
    which = {"x": (0,), "weight": (1,), "bias": (2,), "all": (0, 1, 2)}[tangents]
    primals, tans = (x, w, b), (tx, tw, tb)

    def only(f):
        def g(*moving):
            args = list(primals)
            for i, value in zip(which, moving):
                args[i] = value
            return f(*args)
        return g

    chosen, chosen_t = tuple(primals[i] for i in which), tuple(tans[i] for i in which)
    got = torch.func.jvp(only(float32_linear), chosen, chosen_t)
    want = torch.func.jvp(only(_reference), chosen, chosen_t)
    for a, b_ in zip(got, want):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b_, rtol=1e-6, atol=1e-6)
    jac = torch.func.jacfwd(lambda weight: float32_linear(x, weight, b))(w)
    torch.testing.assert_close(jac, torch.func.jacfwd(lambda weight: _reference(x, weight, b))(w))


def test_the_layer_still_runs_on_the_meta_device() -> None:
    """Shape and memory dry runs on meta tensors (autocast knows no meta device type)."""
    moe = MoE(16, 32, 4, router="topk", k=2, device="meta", check_finite=False)  # a check reads values
    y, routes = moe(torch.empty(10, 16, device="meta"))
    assert y.shape == (10, 16) and y.device.type == "meta" and routes.expert.shape == (10, 2)


# --- The half-precision kernels (CUDA; their logic is tested on the CPU by routing through them there) ---

def _truth(x, w, g):
    """The float64 values, ``grad_x`` and ``grad_w`` of ``x @ w.T`` for an output gradient ``g``."""
    x64, w64, g64 = x.double(), w.double(), g.double()
    return x64 @ w64.T, g64 @ w64, g64.T @ x64


def _through_half_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Take the half-precision path on any device (on the CPU its matmuls run through float32 copies,
    so the split of the gradient and the stacked weight are what is tested)."""
    from routelab import _float32_out
    monkeypatch.setattr(_float32_out, "half_kernels",
                        lambda *ts: ts[0].dtype in _float32_out.HALF and all(t.dtype == ts[0].dtype for t in ts))


def _ulps_bf16(err: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """``err`` in units of the last place of bfloat16 at ``ref``'s magnitude (2^-7 relative)."""
    return err / (ref.abs() * 2.0 ** -7).clamp_min(torch.finfo(torch.float32).tiny)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), tokens=st.sampled_from([0, 1, 37, 256]), d_in=st.sampled_from([8, 96]),
       d_out=st.sampled_from([1, 4, 64]), scale=st.sampled_from([1e-30, 1.0, 1e30]), bias=st.booleans(),
       batched=st.booleans())
@example(seed=941, tokens=256, d_in=96, d_out=1, scale=1e-30, bias=False, batched=True)
def test_the_bfloat16_split_gradients_are_the_float32_ones_rounded(seed, tokens, d_in, d_out, scale, bias,
                                                                    batched) -> None:
    """The bfloat16 backward of the half-precision path (the float32 gradient split into two
    bfloat16 parts, tensor-core matmuls) gives the float32 path's gradients: ``grad_x`` within one
    bfloat16 rounding of the float64 truth (as the float32 path, which rounds its float32 result),
    ``grad_w`` as well, for gradients from 1e-30 to 1e30 (the split's range, _split_bfloat16), and
    for a ``[2, tokens, d]`` input that is not contiguous."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        _through_half_kernels(monkeypatch)
        _check_split_gradients(seed, tokens, d_in, d_out, scale, bias, batched)


def _check_split_gradients(seed: int, tokens: int, d_in: int, d_out: int, scale: float, bias: bool,
                           batched: bool = False, device: str = "cpu") -> None:
    gen = torch.Generator().manual_seed(seed)
    lead = (2, tokens) if batched else (tokens,)
    x = torch.randn(*lead, d_in, generator=gen).bfloat16()
    w = torch.randn(d_out, d_in, generator=gen).bfloat16()
    b = torch.randn(d_out, generator=gen).bfloat16() if bias else None
    g = torch.randn(*lead, d_out, generator=gen) * scale
    xs = x.to(device)
    if batched:  # the same values, laid out [tokens, 2, d] in memory
        xs = xs.transpose(0, 1).contiguous().transpose(0, 1)
        assert not xs.is_contiguous() or tokens <= 1
    xs, ws = xs.requires_grad_(True), w.to(device).requires_grad_(True)
    bs = b.to(device).requires_grad_(True) if bias else None
    out = float32_linear(xs, ws, bs)
    out.backward(g.to(device))
    flat_x, flat_g = x.reshape(-1, d_in), g.reshape(-1, d_out)
    value, grad_x, grad_w = _truth(flat_x, w, flat_g)
    if bias:
        value = value + b.double()
        torch.testing.assert_close(bs.grad.cpu(), flat_g.sum(0).to(torch.bfloat16))
    assert out.shape == (*lead, d_out) and xs.grad.shape == x.shape
    torch.testing.assert_close(out.double().cpu().reshape(-1, d_out), value, rtol=1e-6, atol=1e-5)
    assert xs.grad.dtype == ws.grad.dtype == torch.bfloat16
    # Within 1 ulp where a sum does not cancel; a cancelling sum is judged against its terms' size;
    # and a product below float32's smallest normal (2^-126) may be flushed by the matmul, on the
    # float32 path as on the split's parts (found at gradients ~1e-35: seed 941, 256 tokens, d_out 1).
    for got, want, terms, count in ((xs.grad.reshape(-1, d_in), grad_x, flat_g.double().abs() @ w.double().abs(),
                                     d_out),
                                    (ws.grad, grad_w, flat_g.double().abs().T @ flat_x.double().abs(),
                                     flat_x.shape[0])):
        err = (got.double().cpu() - want).abs()
        flushed = 2 * count * 2.0 ** -126  # (two parts per product)
        assert bool((err <= (want.abs() * 2.0 ** -8 + terms * 2.0 ** -14 + flushed)).all()), float(err.max())


def test_the_split_carries_a_non_finite_gradient_as_the_float32_path_does(monkeypatch) -> None:
    x = torch.randn(6, 16).bfloat16()
    w = torch.randn(3, 16).bfloat16()
    g = torch.randn(6, 3)
    g[1, 0], g[2, 2], g[4, 1] = float("inf"), float("nan"), float("-inf")
    grads = []
    for half in (False, True):
        if half:
            _through_half_kernels(monkeypatch)
        xs, ws = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        float32_linear(xs, ws).backward(g)
        grads.append((xs.grad, ws.grad))
    for plain, half in zip(grads[0], grads[1], strict=True):
        for mask in (torch.isnan, torch.isposinf, torch.isneginf):
            assert torch.equal(mask(plain), mask(half)), mask.__name__
        torch.testing.assert_close(half[half.isfinite()], plain[plain.isfinite()], rtol=1e-2, atol=1e-2)


def test_the_split_keeps_a_finite_gradient_beyond_bfloat16s_largest_finite(monkeypatch) -> None:
    """A float32 gradient between bfloat16's largest finite number and float32's would round to inf
    in bfloat16: the split clamps it (hi) and keeps the rest (lo), so grad_x stays finite, as on the
    float32 path (a review finding)."""
    x = torch.ones(2, 16).bfloat16()
    w = torch.full((3, 16), 0.5).bfloat16()
    g = torch.zeros(2, 3)
    g[0, 0] = 3.3999e38
    grads = []
    for half in (False, True):
        if half:
            _through_half_kernels(monkeypatch)
        xs = x.clone().requires_grad_(True)
        float32_linear(xs, w).backward(g)
        grads.append(xs.grad)
    assert bool(grads[0].isfinite().all()) and bool(grads[1].isfinite().all())
    torch.testing.assert_close(grads[1], grads[0], rtol=2.0 ** -7, atol=0)


def test_the_half_kernels_keep_double_backward_and_float16_on_the_float32_path(monkeypatch) -> None:
    """A double backward (create_graph) differentiates the float32 path's backward; a float16 x
    (whose range cannot hold the split parts) takes it too: the same results as without the kernels."""
    torch.manual_seed(0)
    x = torch.randn(6, 8, dtype=torch.bfloat16)
    w = torch.randn(3, 8, dtype=torch.bfloat16)
    results = []
    for half in (False, True):
        if half:
            _through_half_kernels(monkeypatch)
        xi, wi = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        out = float32_linear(xi, wi).square().sum()
        (gw,) = torch.autograd.grad(out, wi, create_graph=True)
        (gx,) = torch.autograd.grad(gw.float().square().sum(), xi)
        h16, w16 = x.half().requires_grad_(True), w.half().requires_grad_(True)
        float32_linear(h16, w16).square().sum().backward()
        results.append((gx, h16.grad, w16.grad))
    for plain, half in zip(*results, strict=True):
        torch.testing.assert_close(half, plain, rtol=0, atol=0)


@pytest.mark.requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_half_inputs_score_on_the_tensor_cores_with_the_float32_values(dtype: torch.dtype) -> None:
    """On CUDA the half-precision path is taken (out_dtype matmuls): the float32 linear's values (the
    same exact products, summed in another order) and, for bfloat16, gradients within one rounding
    (the CPU test's criterion, on a 3-D non-contiguous input with a bias as well)."""
    from routelab import _float32_out
    if dtype == torch.bfloat16:
        for batched, bias in ((False, False), (True, True)):
            _check_split_gradients(0, 1024, 256, 64, 1.0, bias, batched, device="cuda")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 512, generator=gen).to(dtype)
    w = (torch.randn(64, 512, generator=gen) * 0.05).to(dtype)
    g = torch.randn(4096, 64, generator=gen)
    xc, wc = x.cuda().requires_grad_(True), w.cuda().requires_grad_(True)
    assert _float32_out.half_kernels(xc, wc)
    out = float32_linear(xc, wc)
    out.backward(g.cuda())
    value, grad_x, grad_w = _truth(x, w, g)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double().cpu(), value, rtol=1e-5, atol=1e-4)
    for got, want in ((xc.grad, grad_x), (wc.grad, grad_w)):
        assert got.dtype == dtype
        torch.testing.assert_close(got.double().cpu(), want, rtol=2.0 ** -7, atol=1e-3 * float(want.abs().max()))
