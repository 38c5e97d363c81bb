"""Fuzz tests of routelab.layers: MoE with every router of routelab.routers.ROUTERS (capacity
factors, drop policies, importance weighting, train/eval, empty batches, dtypes, magnitudes),
StackedExperts, MixtureOfAttentiveExperts (every routing, responsibilities, masks, causal gate
context), MultiGateMoE with every gate of routelab.gates, SharedBottom and StackedLinear.

References: the MoE output against a float64 per-expert loop over the returned routes; the MAE
with uniform responsibilities against torch.nn.MultiheadAttention (eq. 5); the multi-gate MoE
against an einsum over all experts.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import routelab.gates as G
import routelab.layers as L
from fuzz_strategies import (
    assert_finite,
    assert_not_mutated,
    call,
    clone_inputs,
    eps,
    f64,
    fresh,
    fuzz,
    guarded,
    mostly,
    same_bits,
    seeds,
)
from routelab.estimators import METHODS
from routelab.routers import ROUTERS
from routelab.routing import expert_capacity
from test_fuzz_rules import COVERED_LAYERS

COVERED = {
    "MixtureOfAttentiveExperts", "MultiGateMoE", "SharedBottom", "StackedLinear", "MoE", "StackedExperts"
} | COVERED_LAYERS


def test_public_api_is_covered() -> None:
    public = {n for n in L.__all__ if callable(getattr(L, n))}
    assert public <= COVERED, f"routelab.layers has callables without a fuzz test: {sorted(public - COVERED)}"


X_DTYPES = mostly((torch.float32,), (torch.float64, torch.float16, torch.bfloat16, torch.int64), weight=6)
NAN = mostly((False,), (True,), weight=9)


def _input(shape, dtype: torch.dtype, scale: float, seed: int, nan: bool) -> torch.Tensor:
    x = torch.randn(shape, generator=fresh(seed), dtype=torch.float64) * scale
    if nan and x.numel():
        x.view(-1)[0] = float("nan")
    return x.round().to(dtype) if dtype == torch.int64 else x.to(dtype)


def _input_validity(x: torch.Tensor, compute: torch.dtype, scale: float) -> bool | None:
    if not x.is_floating_point():
        return False
    if x.numel() and not bool(torch.isfinite(x).all()):
        return False  # NaN, or a magnitude the dtype cannot hold
    if x.dtype != compute or scale > 1e30:
        return None  # another float dtype may be rejected; huge inputs may overflow the logits
    return True


# ----------------------------------------------------------------------------- MoE

BALANCED_METHODS = tuple(m for m in METHODS if m.startswith("gumbel"))


@pytest.mark.parametrize("router", sorted(ROUTERS))
@fuzz(15)
@given(
    E=st.integers(1, 6),
    d_model=st.integers(1, 5),
    k=st.integers(1, 3),
    cf=st.sampled_from((1.0, None, 1.25, 2.0, 0.5, 1e-9)),
    drop_policy=st.sampled_from(("position", "score", "random")),
    iw=st.booleans(),
    lead=st.sampled_from(((6,), (2, 3), (0,), (2, 0), (1,), (8,), ())),
    xdtype=X_DTYPES,
    mdtype=st.sampled_from((torch.float32, torch.float32, torch.float64)),
    xscale=st.sampled_from((1.0, 1e-30, 1e3, 1e10, 1e30, 1e38)),
    nan=NAN,
    training=st.booleans(),
    method=st.sampled_from(METHODS),
    tau=st.sampled_from((1.0, 1e-3, 1e3)),
    seed=seeds,
)
def test_moe(router, E, d_model, k, cf, drop_policy, iw, lead, xdtype, mdtype, xscale, nan, training, method, tau,
             seed) -> None:
    """Output = the per-expert reference over the returned routes; capacity respected; balanced
    routers drop nothing; gates in [0, 1], weights >= 0, aux losses finite; finite output and
    gradients; same seed -> same bits; input not mutated; bad input -> ValueError naming x."""
    takes_k = router in ("topk", "noisy_topk", "batchwise", "sinkhorn")
    kk = min(k, E) if takes_k else None
    rk = {"method": method, "tau": tau} if router == "gumbel_matching" else None

    def build():
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            moe = L.MoE(d_model, 2 * d_model, E, router=router, k=kk, capacity_factor=cf, drop_policy=drop_policy,
                        importance_weighting=iw, generator=fresh(seed), dtype=mdtype, router_kwargs=rk)
            if router == "noisy_topk":  # its weights start at 0; give the router something to rank
                nn.init.normal_(moe.router.proj.weight)
                nn.init.normal_(moe.router.noise.weight)
        moe.train(training)
        return moe

    # base and gumbel_matching assign every token in training, and batchwise gives every expert its
    # quota: a capacity factor below 1 is refused when built
    refused = router in ("base", "gumbel_matching", "batchwise") and cf is not None and cf < 1
    ok, moe = call(build, names=("router", "k", "capacity_factor"), valid=not refused, what=f"MoE(router={router!r})")
    if not ok:
        return
    x = _input((*lead, d_model), xdtype, xscale, seed, nan)
    n = math.prod(lead)
    valid = _input_validity(x, mdtype, xscale)
    slots = moe.router.slots
    cf = cf if training else moe.eval_capacity_factor  # the capacity factor in use (eval: dropless default)
    C = expert_capacity(n, E, slots, cf)
    if valid is not False:
        # base and gumbel_matching (every estimator) need a capacity that holds the batch when
        # they solve (training; eval only with eval_balanced). Batchwise takes any batch size.
        balanced_solve = router in ("base", "gumbel_matching") and (training or moe.router.eval_balanced)
        if balanced_solve and cf is not None and n and C * E < n:
            valid = False
    leaf = x.detach().clone().requires_grad_(x.is_floating_point())
    before = clone_inputs(leaf)
    ok, out = call(moe, leaf, names=("x", "capacity_factor", "batch", "k", "tokens"), valid=valid,
                   what=f"MoE(router={router!r}) forward")
    assert_not_mutated(before, [leaf])
    if not ok:
        return
    y, routes = out
    assert y.shape == x.shape and y.dtype == x.dtype, (
        f"output {tuple(y.shape)} {y.dtype} for input {tuple(x.shape)} {x.dtype}"
    )
    check_moe_routes(moe, routes, n, E, cf, C, router, training, method, xscale)
    # Importance weights reach MAX_WEIGHT (1e8, the biased Gumbel-Matching methods at small tau):
    # weight x expert output then exceeds float16's range (65504), and the output rounds to inf.
    # A documented limit of half-precision outputs with importance_weighting, not checked here.
    beyond_half = (moe.importance_weighting and x.dtype == torch.float16 and routes.weight.numel() > 0
                   and float(routes.weight.max()) > 1e3)
    if xscale <= 1e30 and not beyond_half:
        assert_finite(y, "MoE output")
        check_moe_reference(moe, x, y, routes)
    if xscale <= 1e10 and n and not beyond_half:
        loss = lambda: (  # noqa: E731
            y.float().sum() + sum((v.float().sum() for v in routes.aux.values()), torch.zeros(()))
        ).backward()
        guarded(loss, what="MoE backward")
        assert_finite(leaf.grad, "MoE gradient w.r.t. x")
        for name, p in moe.named_parameters():
            if p.grad is not None:
                assert_finite(p.grad, f"MoE gradient w.r.t. {name}")
    twin = build()
    _, (y2, r2) = call(twin, x.detach().clone(), names=("x",), valid=True, what="MoE forward (same seed)")
    assert same_bits(y.detach(), y2.detach()), "same seed, different output"
    for f in ("expert", "keep", "gate", "weight"):
        assert same_bits(getattr(routes, f).detach(), getattr(r2, f).detach()), f"same seed, different routes.{f}"


def check_moe_routes(moe, routes, n, E, cf, C, router, training, method, xscale) -> None:
    expert, keep = routes.expert, routes.keep
    assert expert.dim() == 2 and expert.shape[0] == n, f"routes.expert has shape {tuple(expert.shape)}"
    assert keep.dtype == torch.bool and keep.shape == expert.shape
    assert bool(((expert >= 0) & (expert < E)).all()), "expert out of range"
    counts = torch.bincount(expert[keep], minlength=E)
    assert torch.equal(routes.stats["tokens_per_expert"].long(), counts), "stats tokens_per_expert != kept per expert"
    cap = int(routes.stats["capacity"])
    assert int(counts.max()) <= cap, f"capacity {cap} exceeded: {counts.tolist()}"
    if cf is not None:
        assert cap == C, f"stats capacity {cap} != expert_capacity = {C}"
    balanced = router == "base" or (router == "gumbel_matching" and (not training or method in BALANCED_METHODS))
    if balanced and n and (cf is None or C * E >= n):
        assert bool(keep.all()), f"a balanced router ({router}) dropped tokens: {(~keep).nonzero()[:4].tolist()}"
    for f in ("gate", "weight"):
        assert_finite(getattr(routes, f), f"routes.{f}")
    # A log-probability below the dtype's range rounds to -inf; that takes router logits some
    # 1e38 apart, i.e. inputs near the float32 maximum. Anywhere else log_prob must be finite.
    lp = routes.log_prob.detach()
    if xscale >= 1e30:
        assert not bool(torch.isnan(lp).any() or torch.isposinf(lp).any()), "routes.log_prob has NaN or +inf"
    else:
        assert_finite(lp, "routes.log_prob")
    g = f64(routes.gate)
    assert bool(((g >= 0) & (g <= 1 + 1e-5)).all()), f"gate outside [0, 1]: {g[(g < 0) | (g > 1 + 1e-5)][:4].tolist()}"
    assert bool((f64(routes.weight) >= 0).all()), "negative importance weight"
    assert bool((f64(routes.log_prob) <= 1e-5).all()), "log_prob > 0"
    for name, v in routes.aux.items():
        assert_finite(v, f"aux[{name!r}]")
    for name, v in routes.stats.items():
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            assert_finite(v, f"stats[{name!r}]")


def check_moe_reference(moe, x, y, routes) -> None:
    """y_t = sum_s keep * c * FFN_e(x_t) in float64, with a rounding bound from |x| |W1| |W2|."""
    ex = moe.experts
    n = routes.expert.shape[0]
    if n == 0:
        return
    flat = f64(x).reshape(n, -1)
    c = f64(routes.gate * routes.weight if moe.importance_weighting else routes.gate)
    w1, w2 = f64(ex.w1), f64(ex.w2)
    b1 = f64(ex.b1) if ex.b1 is not None else torch.zeros(w1.shape[0], 1, w1.shape[2], dtype=torch.float64)
    b2 = f64(ex.b2) if ex.b2 is not None else torch.zeros(w2.shape[0], 1, w2.shape[2], dtype=torch.float64)
    ref = torch.zeros_like(flat)
    bound = torch.zeros_like(flat)
    for t in range(n):
        for s in range(routes.expert.shape[1]):
            if not bool(routes.keep[t, s]):
                continue
            e = int(routes.expert[t, s])
            h = flat[t] @ w1[e] + b1[e, 0]
            ref[t] += c[t, s] * (F.gelu(h) @ w2[e] + b2[e, 0])
            hb = flat[t].abs() @ w1[e].abs() + b1[e, 0].abs()
            bound[t] += c[t, s].abs() * (hb @ w2[e].abs() + b2[e, 0].abs())
    d = flat.shape[-1]
    e_eff = max(eps(x.dtype), eps(ex.w1.dtype))
    tol = 16 * (d + ex.d_hidden + routes.expert.shape[1]) * e_eff * bound + 1e-30
    # The output is rounded to the input's dtype: half a unit in its last place, and values below
    # its smallest subnormal number flush to 0.
    out = torch.finfo(y.dtype)
    tol = tol + out.eps * ref.abs() + out.smallest_normal * out.eps
    err = (f64(y).reshape(n, -1) - ref).abs()
    bad = err > tol
    assert not bool(bad.any()), (
        f"MoE output != per-expert reference at tokens {bad.any(-1).nonzero()[:4].flatten().tolist()}: "
        f"max error {float(err.max()):.3g}, tolerance {float(tol[bad].min()):.3g}"
    )


@fuzz(25)
@given(
    E=st.integers(1, 5),
    d=st.integers(1, 5),
    cap=st.integers(0, 4),
    bias=st.booleans(),
    activation=st.sampled_from(("gelu", "relu", "silu", "tanh")),
    dtype=st.sampled_from((torch.float32, torch.float64)),
    scale=st.sampled_from((1.0, 1e-30, 1e10)),
    seed=seeds,
)
def test_stacked_experts(E, d, cap, bias, activation, dtype, scale, seed) -> None:
    """forward([E, C, d]) == expert(e, buffer[e]) for every e; bad buffer shapes -> ValueError."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        ex = L.StackedExperts(d, 2 * d, E, activation=activation, bias=bias, dtype=dtype)
    buf = (torch.randn(E, cap, d, generator=fresh(seed), dtype=torch.float64) * scale).to(dtype)
    ok, out = call(ex, buf, names=("buffers",), valid=True, what="StackedExperts")
    assert tuple(out.shape) == (E, cap, d) and out.dtype == dtype
    assert_finite(out, "StackedExperts output")
    for e in range(E):
        with torch.no_grad():
            ref = ex.expert(e, buf[e])
        tol = 1e-5 if dtype == torch.float32 else 1e-12
        assert torch.allclose(
            out[e].detach(), ref, rtol=tol, atol=tol * float(ref.abs().max()) if ref.numel() else 0.0
        ), f"StackedExperts forward != expert({e}, .)"
    call(ex, torch.randn(E + 1, cap, d, dtype=dtype), names=("buffers",), valid=False, what="StackedExperts(bad E)")
    call(ex, torch.randn(E, cap, d + 1, dtype=dtype), names=("buffers",), valid=False, what="StackedExperts(bad d)")


# ----------------------------------------------------------------------------- mixture of attentive experts

RESP = mostly(("none", "none", "uniform", "onehot", "random"), ("bad_sum", "bad_shape", "negative"), weight=3)


@pytest.mark.parametrize("routing", ("gate", "sample", "top1", "uniform", "uniform_sample"))
@fuzz(15)
@given(
    h=st.integers(2, 4),
    hd=st.integers(1, 3),
    t=st.integers(1, 3),
    batch_first=st.booleans(),
    gate_context=st.sampled_from((None, None, 1, 3)),
    resp=RESP,
    N=st.integers(1, 3),
    Lq=st.integers(1, 4),
    S=st.integers(1, 4),
    self_attn=st.booleans(),
    padding=st.booleans(),
    unbatched=st.sampled_from((False, False, True)),
    xdtype=X_DTYPES,
    xscale=st.sampled_from((1.0, 1e-30, 1e3, 1e10, 1e30)),
    nan=NAN,
    training=st.booleans(),
    seed=seeds,
)
def test_mixture_of_attentive_experts(h, hd, t, batch_first, gate_context, routing, resp, N, Lq, S, self_attn, padding,
                                      unbatched, xdtype, xscale, nan, training, seed) -> None:
    """Output has the query's shape and dtype and is finite; responsibilities are distributions;
    uniform responsibilities reproduce nn.MultiheadAttention (eq. 5); gradients finite; sampled
    routings reproducible with a seeded generator; bad input -> ValueError."""
    t = min(t, h - 1)
    d = h * hd
    if self_attn:
        S = Lq
    if unbatched:
        N = 1
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        mha = nn.MultiheadAttention(d, h, batch_first=batch_first)
        nn.init.normal_(mha.out_proj.bias)
        ok, mae = call(L.MixtureOfAttentiveExperts.from_multihead_attention, mha, t, gate_context=gate_context,
                       names=("drop_heads", "mha"), valid=True, what="MixtureOfAttentiveExperts")
        nn.init.normal_(mae.gate.out.weight)  # a non-uniform gate
    mae.routing = routing
    mae.generator = fresh(seed)
    mae.train(training)
    mha.train(training)

    def shaped(length):
        if unbatched:
            return (length, d)
        return (N, length, d) if batch_first else (length, N, d)

    q = _input(shaped(Lq), xdtype, xscale, seed, nan)
    if self_attn:
        kv = q
    else:
        kv = _input(shaped(S), xdtype, xscale, seed + 1, False)
    kpm = None
    if padding:
        kpm = torch.rand(N, S, generator=fresh(seed)) < 0.4
        kpm[:, 0] = False  # at least one key per query (MHA itself returns NaN otherwise)
        if unbatched:
            kpm = kpm[0]
    E = mae.num_experts
    per_pos = gate_context is not None
    rshape = ((Lq, E) if per_pos else (E,)) if unbatched else ((N, Lq, E) if per_pos else (N, E))
    r = None
    rvalid = True
    if resp != "none":
        g = fresh(seed + 2)
        if resp == "uniform":
            r = torch.full(rshape, 1.0 / E)
        elif resp == "onehot":
            r = F.one_hot(torch.randint(0, E, rshape[:-1], generator=g), E).float()
        elif resp == "random":
            r = torch.softmax(torch.randn(rshape, generator=g), -1)
        elif resp == "bad_sum":
            r = torch.full(rshape, 2.0 / E)
            rvalid = False
        elif resp == "negative":
            r = torch.full(rshape, 1.0 / E)
            r[..., 0] = -0.5
            r[..., -1] += 0.5 if E > 1 else 1.5
            rvalid = False
        else:
            r = torch.full((*rshape[:-1], E + 1), 1.0 / (E + 1))
            rvalid = False
    valid = _input_validity(q, torch.float32, xscale)
    if valid is not False and not self_attn:
        v2 = _input_validity(kv, torch.float32, xscale)
        valid = False if v2 is False else (None if v2 is None else valid)
    if not rvalid:
        valid = False
    q_leaf = q.detach().clone().requires_grad_(q.is_floating_point())
    kv_leaf = q_leaf if self_attn else kv.detach().clone()
    before = clone_inputs(q_leaf, kv_leaf, r, kpm)
    ok, out = call(mae, q_leaf, kv_leaf, kv_leaf, key_padding_mask=kpm, responsibilities=r,
                   names=("query", "key", "value", "responsibilities", "key_padding_mask", "x"), valid=valid,
                   what=f"MixtureOfAttentiveExperts(routing={routing!r}) forward")
    assert_not_mutated(before, [q_leaf, kv_leaf, r, kpm])
    if not ok:
        return
    y, used = out
    assert y.shape == q.shape and y.dtype == q.dtype, (
        f"output {tuple(y.shape)} {y.dtype} for query {tuple(q.shape)} {q.dtype}"
    )
    assert tuple(used.shape) == rshape, f"responsibilities have shape {tuple(used.shape)}, expected {rshape}"
    assert_finite(used, "responsibilities")
    u = f64(used)
    rtol = 4 * (E + 1) * max(eps(used.dtype), eps(torch.float32))
    assert bool((u >= 0).all()) and float((u.sum(-1) - 1).abs().max()) <= rtol, "responsibilities are not distributions"
    if xscale <= 1e10:
        assert_finite(y, "MAE output")
    uniform = resp == "uniform" or (resp == "none" and routing == "uniform")
    if uniform and q.dtype == torch.float32 and xscale <= 1e3:
        with torch.no_grad():
            ref = mha(q, kv, kv, key_padding_mask=kpm, need_weights=False)[0]
        scale_ref = float(f64(ref).abs().max()) if ref.numel() else 0.0
        assert torch.allclose(f64(y), f64(ref), rtol=1e-4, atol=1e-5 * max(1.0, scale_ref)), (
            "uniform responsibilities do not reproduce nn.MultiheadAttention (eq. 5)"
        )
    if xscale <= 1e3 and q.is_floating_point():
        guarded(lambda: (y.float().sum() + used.float().sum()).backward(), what="MAE backward")
        if q_leaf.grad is not None:
            assert_finite(q_leaf.grad, "MAE gradient w.r.t. query")
        for name, p in mae.named_parameters():
            if p.grad is not None:
                assert_finite(p.grad, f"MAE gradient w.r.t. {name}")
    if resp == "none" and routing in ("sample", "uniform_sample"):
        mae.generator = fresh(seed)
        q2 = q.detach().clone()
        kv2 = q2 if self_attn else kv.detach().clone()
        _, (y2, used2) = call(mae, q2, kv2, kv2, key_padding_mask=kpm, names=("query",), valid=True,
                              what="MAE forward (same seed)")
        assert same_bits(used.detach(), used2.detach()), "same generator seed, different sampled experts"


# ----------------------------------------------------------------------------- multi-gate MoE

GATE_KINDS = ("dselect", "dselect_pe", "softmax", "softmax_pe", "topk", "topk_pe", "gumbel", "selector")


def _gate(kind: str, n: int, in_dim: int, seed: int):
    g = fresh(seed)
    k = min(2, n)
    if kind == "dselect":
        return G.DSelectK(n, k, generator=g, entropy_reg=0.1)
    if kind == "dselect_pe":
        return G.DSelectK(n, k, per_example=True, input_dim=in_dim, generator=g, entropy_reg=0.1)
    if kind == "softmax":
        return G.SoftmaxGate(n, generator=g)
    if kind == "softmax_pe":
        return G.SoftmaxGate(n, per_example=True, input_dim=in_dim, generator=g)
    if kind == "topk":
        return G.TopKGate(n, k, generator=g)
    if kind == "topk_pe":
        return G.TopKGate(n, k, per_example=True, input_dim=in_dim, generator=g)
    if kind == "gumbel":
        return G.GumbelSoftmaxGate(n, seed=seed, sparsity_reg=0.01, generator=g)
    return G.SoftmaxSelectorGate(n, k, entropy_reg=0.01, generator=g)


@fuzz(50)
@given(
    n=st.integers(1, 6),
    in_dim=st.integers(1, 4),
    out_dim=st.integers(1, 3),
    batch=st.integers(1, 4),
    gates=st.lists(st.sampled_from(GATE_KINDS), min_size=1, max_size=3),
    stacked=st.booleans(),
    towers=st.booleans(),
    xdtype=X_DTYPES,
    xscale=st.sampled_from((1.0, 1e-30, 1e3, 1e10)),
    nan=NAN,
    training=st.booleans(),
    seed=seeds,
)
def test_multigate_moe(n, in_dim, out_dim, batch, gates, stacked, towers, xdtype, xscale, nan, training, seed) -> None:
    """Task outputs = tower(sum_i w_i E_i(x)) with the gates' weights (einsum over all experts),
    finite, with finite regularization and gradients; SharedBottom = towers(bottom(x));
    StackedLinear = per-expert x W + b; bad shapes -> ValueError."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if stacked:
            experts = L.StackedLinear(n, in_dim, out_dim, activation=torch.relu, generator=fresh(seed))
        else:
            experts = [nn.Sequential(nn.Linear(in_dim, out_dim), nn.ReLU()) for _ in range(n)]
        tw = [nn.Linear(out_dim, 1) for _ in gates] if towers else None
        with warnings.catch_warnings():  # DSelectK(1, ., per_example=True) warns; test_fuzz_gates reports it
            warnings.simplefilter("ignore")
            gs = [_gate(kind, n, in_dim, seed + i) for i, kind in enumerate(gates)]
        ok, model = call(L.MultiGateMoE, experts, gs, tw, names=("experts", "gates", "towers"), valid=True,
                         what="MultiGateMoE")
    model.train(training)
    if not stacked:  # the experts are the user's own modules: feed them what they take
        xdtype, nan = torch.float32, False
    x = _input((batch, in_dim), xdtype, xscale, seed, nan)
    valid = _input_validity(x, torch.float32, xscale)
    if nan and valid is False and x.is_floating_point():
        valid = None  # NaN input: a ValueError, or NaN out (no gate or expert of the model needs to look)
    leaf = x.detach().clone().requires_grad_(x.is_floating_point())
    before = clone_inputs(leaf)
    ok, outs = call(model, leaf, names=("x",), valid=valid, what="MultiGateMoE forward")
    assert_not_mutated(before, [leaf])
    if ok and not nan:
        assert isinstance(outs, list) and len(outs) == len(gates)
        with torch.no_grad():
            xe = leaf.detach().to(torch.float32)
            if stacked:
                E_all = experts(xe)
            else:
                E_all = torch.stack([e(xe) for e in experts], dim=1)
        for ti, (o, w) in enumerate(zip(outs, model.last_weights)):
            assert_finite(o, f"task {ti} output")
            assert tuple(w.shape) == (batch, n), f"gate {ti} weights {tuple(w.shape)}"
            with torch.no_grad():
                mix = torch.einsum("bn,bnd->bd", w.to(E_all.dtype), E_all)
                ref = model.towers[ti](mix)
            assert tuple(o.shape) == tuple(ref.shape), f"task {ti} output shape {tuple(o.shape)} != {tuple(ref.shape)}"
            sc = max(1.0, float(ref.abs().max()))
            # The output is rounded to the input's dtype (bfloat16: up to ~4e-3 relative).
            r = max(1e-3, 2 * eps(o.dtype))
            assert torch.allclose(f64(o), f64(ref), rtol=r, atol=max(1e-4, 2 * eps(o.dtype)) * sc), (
                f"task {ti} output != tower(sum_i w_i E_i)"
            )
        reg = guarded(model.regularization, what="regularization")
        assert_finite(reg, "MultiGateMoE.regularization()")
        if xscale <= 1e3:
            guarded(lambda: (sum(o.float().sum() for o in outs) + reg.float()).backward(), what="MultiGateMoE backward")
            for name, p in model.named_parameters():
                if p.grad is not None:
                    assert_finite(p.grad, f"MultiGateMoE gradient w.r.t. {name}")
        guarded(model.on_step, 1, 10, what="on_step")
        guarded(model.track, 1, what="track")
        rep = guarded(model.report, what="report")
        assert isinstance(rep, list) and len(rep) == len(gates)
    # shared bottom and stacked linear
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        bottom = nn.Linear(in_dim, out_dim)
        sb = L.SharedBottom(bottom, [nn.Linear(out_dim, 1) for _ in gates])
        sl = L.StackedLinear(n, in_dim, out_dim, init_std=0.5, generator=fresh(seed))
    if valid:
        ok, souts = call(sb, x, names=("x",), valid=True, what="SharedBottom")
        with torch.no_grad():
            for o, tower in zip(souts, sb.towers):
                assert torch.allclose(o, tower(bottom(x))), "SharedBottom != towers(bottom(x))"
        ok, y2 = call(sl, x, names=("x",), valid=True, what="StackedLinear([batch, in])")
        ref2 = torch.einsum("bi,nio->bno", f64(x), f64(sl.weight)) + f64(sl.bias)
        assert torch.allclose(f64(y2), ref2, rtol=1e-4, atol=1e-5 * max(1.0, float(ref2.abs().max()))), (
            "StackedLinear (2-D)"
        )
        x3 = x.unsqueeze(1).expand(batch, n, in_dim)
        ok, y3 = call(sl, x3, names=("x",), valid=True, what="StackedLinear([batch, n, in])")
        assert torch.allclose(
            y3.detach(), y2.detach(), rtol=1e-5, atol=1e-6 * max(1.0, float(y2.detach().abs().max()))
        ), "StackedLinear (3-D) != (2-D)"
        call(sl, x[:, :0] if in_dim else x, names=("x",), valid=False, what="StackedLinear(bad width)")
        call(sl, x.unsqueeze(0).unsqueeze(0), names=("x",), valid=False, what="StackedLinear(4-D)")


BAD_CALLS = [
    ("MoE", lambda: L.MoE(4, 8, 2, router="topk", k=3), ("k", "num_experts")),
    ("MoE", lambda: L.MoE(4, 8, 2, router="nope"), ("router",)),
    ("MoE", lambda: L.MoE(4, 8, 2, capacity_factor=0.0), ("capacity_factor",)),
    ("MoE", lambda: L.MoE(4, 8, 2, drop_policy="lifo"), ("drop_policy",)),
    ("MoE", lambda: L.MoE(4, 8, 2, generator=0), ("generator",)),
    ("MoE", lambda: L.MoE(4, 8, 2)(torch.randn(3, 5)), ("x",)),
    ("MoE", lambda: L.MoE(4, 8, 2)(torch.ones(3, 4, dtype=torch.long)), ("x",)),
    ("MoE", lambda: L.MoE(4, 8, 2)([[0.0] * 4]), ("x",)),
    ("MoE", lambda: L.MoE(4, 8, 2, router="base", capacity_factor=0.5)(torch.randn(8, 4)), ("capacity_factor",)),
    ("StackedExperts", lambda: L.StackedExperts(4, 8, 2, activation="swish"), ("activation",)),
    ("StackedExperts", lambda: L.StackedExperts(4, 0, 2), ("d_hidden",)),
    ("MixtureOfAttentiveExperts", lambda: L.MixtureOfAttentiveExperts(6, 4), ("embed_dim", "num_heads")),
    ("MixtureOfAttentiveExperts", lambda: L.MixtureOfAttentiveExperts(8, 4, drop_heads=4), ("drop_heads",)),
    ("MixtureOfAttentiveExperts", lambda: L.MixtureOfAttentiveExperts(8, 4, dropout=1.0), ("dropout",)),
    (
        "MixtureOfAttentiveExperts",
        lambda: L.MixtureOfAttentiveExperts(8, 4)(torch.randn(3, 2, 8), torch.randn(3, 2, 6), torch.randn(3, 2, 6)),
        ("key", "value", "embed_dim"),
    ),
    (
        "MixtureOfAttentiveExperts",
        lambda: L.MixtureOfAttentiveExperts(8, 4)(
            torch.full((3, 2, 8), float("nan")), torch.randn(3, 2, 8), torch.randn(3, 2, 8)
        ),
        ("query",),
    ),
    ("MultiGateMoE", lambda: L.MultiGateMoE([nn.Linear(2, 2)], [G.SoftmaxGate(2)]), ("gate", "gates", "num_experts")),
    ("MultiGateMoE", lambda: L.MultiGateMoE([], [G.SoftmaxGate(1)]), ("experts",)),
    ("MultiGateMoE", lambda: L.MultiGateMoE([nn.Linear(2, 2)], [G.SoftmaxGate(1)], [nn.Identity()] * 2), ("towers",)),
    ("SharedBottom", lambda: L.SharedBottom(nn.Identity(), []), ("towers",)),
    ("StackedLinear", lambda: L.StackedLinear(2, 3, 4, dropout=1.5), ("dropout",)),
    ("StackedLinear", lambda: L.StackedLinear(0, 3, 4), ("num_experts",)),
]


@pytest.mark.parametrize("what, thunk, names", BAD_CALLS, ids=[f"{i}-{c[0]}" for i, c in enumerate(BAD_CALLS)])
def test_bad_arguments_raise_named_value_or_type_errors(what: str, thunk, names) -> None:
    call(thunk, names=names, valid=False, what=what)
