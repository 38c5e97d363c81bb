"""Fuzz tests of routelab.gates: smooth_step, selector_outputs, dselect_weights, DSelectK, the
baseline gates (SoftmaxGate, TopKGate, GumbelSoftmaxGate, SoftmaxSelectorGate, ablation_annealing,
ablation_entropy), keep_top_k, batchwise_mask, threshold_mask, batchwise_threshold_loss.

References are float64 recomputations of the documented formulas; every gate's weights must be
finite, non-negative and sum to at most 1, and its penalties and gradients finite.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import routelab.gates as G
from fuzz_strategies import (
    FLOAT_DTYPES,
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
from test_fuzz_rules import COVERED_GATES

COVERED = {"batchwise_mask", "batchwise_threshold_loss", "threshold_mask", "DSelectK", "dselect_weights",
           "selector_outputs", "smooth_step", "MTLGate", "SoftmaxGate", "TopKGate", "GumbelSoftmaxGate",
           "SoftmaxSelectorGate", "ablation_annealing", "ablation_entropy", "keep_top_k"} | COVERED_GATES


def test_public_api_is_covered() -> None:
    public = {n for n in G.__all__ if callable(getattr(G, n))}
    assert public <= COVERED, f"routelab.gates has callables without a fuzz test: {sorted(public - COVERED)}"


GAMMAS = (1.0, 0.5, 1e-3, 1e3, 7.0)
BAD_GAMMAS = (0.0, -1.0, float("nan"), float("inf"), True, "1")
NUMBER_GAMMAS = (np.float32(0.5), torch.tensor(2.0), np.int64(3))  # real numbers that are not Python floats
SCALES = (1.0, 0.3, 1e-3, 1e3, 300.0, 1e10, 2e19, 1e30)


@st.composite
def tensors(draw, *, dtypes=FLOAT_DTYPES, max_dims=3, max_side=5, scales=SCALES, extra=()):
    shape = tuple(draw(st.lists(st.integers(0, max_side), min_size=0, max_size=max_dims), label="shape"))
    dtype = draw(st.sampled_from(dtypes), label="dtype")
    scale = draw(st.sampled_from(scales), label="scale")
    seed = draw(st.integers(0, 2**31 - 1), label="seed")
    x = torch.randn(shape, generator=fresh(seed), dtype=torch.float64) * scale
    for v in extra:  # plant special values
        if x.numel() and draw(st.booleans(), label=f"plant {v}"):
            x.view(-1)[draw(st.integers(0, x.numel() - 1))] = v
    return x.to(dtype)


# ----------------------------------------------------------------------------- smooth step


@fuzz(100)
@given(t=tensors(extra=(0.5, -0.5, 0.0, 500.0, -500.0)), gamma=mostly(GAMMAS + NUMBER_GAMMAS, BAD_GAMMAS))
def test_smooth_step(t: torch.Tensor, gamma) -> None:
    """Values in [0, 1], exactly 0 / 1 outside the band, the cubic inside (float64 reference),
    monotone; gradients finite everywhere and exactly 0 outside the band; gamma may be any real
    number (NumPy scalars, 0-dim tensors); bad gamma -> ValueError."""
    valid_gamma = not isinstance(gamma, (bool, str)) and math.isfinite(gamma) and gamma > 0
    leaf = t.detach().clone().requires_grad_(True)
    before = clone_inputs(leaf)
    ok, s = call(G.smooth_step, leaf, gamma, names=("gamma", "t"), valid=valid_gamma, what="smooth_step")
    assert_not_mutated(before, [leaf])
    if not ok:
        return
    assert s.shape == t.shape and s.dtype == t.dtype, f"smooth_step returned {tuple(s.shape)} {s.dtype}"
    assert_finite(s, "smooth_step output")
    s64, t64 = f64(s), f64(t)
    gamma = float(gamma)
    half = gamma / 2
    assert bool(((s64 >= 0) & (s64 <= 1)).all()), "smooth_step left [0, 1]"
    assert bool((s64[t64 <= -half] == 0).all()), "smooth_step is not exactly 0 below -gamma/2"
    assert bool((s64[t64 >= half] == 1).all()), "smooth_step is not exactly 1 above gamma/2"
    u = t64.clamp(-half, half) / gamma
    ref = torch.where(t64 <= -half, 0.0, torch.where(t64 >= half, 1.0, u * (1.5 - 2 * u * u) + 0.5))
    err = (s64 - ref).abs()
    tol = 32 * eps(t.dtype)
    assert float(err.max()) <= tol if err.numel() else True, (
        f"smooth_step differs from the cubic by {float(err.max()):.3g} > {tol:.3g} "
        f"at t={float(t64.flatten()[err.argmax()])}"
    )
    if t.numel() > 1:
        order = t64.flatten().argsort()
        d = s64.flatten()[order].diff()
        assert float(d.min()) >= -tol, "smooth_step is not monotone"
    if t.numel():
        guarded(lambda: s.sum().backward(), what="smooth_step backward")
        g = leaf.grad
        assert g is not None
        assert_finite(g, "smooth_step gradient")
        outside = (t64 < -half) | (t64 > half)
        assert bool((f64(g)[outside] == 0).all()), "smooth_step gradient is not 0 outside the band"
        dref = torch.where(outside, 0.0, (1.5 - 6 * u * u) / gamma)
        gtol = 64 * eps(t.dtype) * (1.5 / gamma)
        gerr = (f64(g) - dref).abs()
        assert float(gerr.max()) <= gtol, f"smooth_step gradient off by {float(gerr.max()):.3g} > {gtol:.3g}"


# ----------------------------------------------------------------------------- DSelect-k functions


@fuzz(80)
@given(
    num_experts=st.integers(1, 17),
    k=st.integers(1, 4),
    lead=st.sampled_from(((), (3,), (0,), (2, 1))),
    dtype=st.sampled_from(FLOAT_DTYPES),
    zscale=st.sampled_from((1.0, 0.01, 1e3, 1e30, "binary")),
    ascale=st.sampled_from((1.0, 1e3, 1e30, 1e-30)),
    gamma=st.sampled_from(GAMMAS),
    seed=seeds,
)
def test_selector_outputs_and_dselect_weights(num_experts: int, k: int, lead, dtype, zscale, ascale, gamma: float,
                                              seed: int) -> None:
    """selector_outputs: rows are probability vectors over 2^m codes; dselect_weights: non-negative,
    sum <= 1 (== 1 for a power of 2), at most k nonzero once S(z) is binary; gradients finite."""
    k = min(k, num_experts)
    m = (num_experts - 1).bit_length()
    g = fresh(seed)
    if zscale == "binary":
        z = (torch.randint(0, 2, (*lead, k, m), generator=g) * 2 - 1).to(torch.float64) * gamma
    else:
        z = torch.randn((*lead, k, m), generator=g, dtype=torch.float64) * zscale
    big = torch.finfo(dtype).max / 4  # finite in the dtype: the functions take finite logits
    alpha = (torch.randn((*lead, k), generator=g, dtype=torch.float64) * ascale).clamp(-big, big)
    z = z.clamp(-big, big).to(dtype).requires_grad_(True)
    alpha = alpha.to(dtype).requires_grad_(True)
    ok, r = call(G.selector_outputs, z, gamma, names=("z", "gamma"), valid=True)
    assert tuple(r.shape) == (*lead, k, 2**m), f"selector_outputs shape {tuple(r.shape)}"
    assert_finite(r, "selector_outputs")
    r64 = f64(r)
    tol = 16 * (m + 2**m) * eps(dtype)
    assert bool((r64 >= 0).all()), "negative selector output"
    if r.numel():
        assert float((r64.sum(-1) - 1).abs().max()) <= tol, "selector outputs do not sum to 1 (Prop. 2)"
    ok, w = call(G.dselect_weights, alpha, z, num_experts, gamma, names=("alpha", "z", "num_experts", "gamma"),
                 valid=True)
    assert tuple(w.shape) == (*lead, num_experts), f"dselect_weights shape {tuple(w.shape)}"
    assert_finite(w, "dselect_weights")
    w64 = f64(w)
    assert bool((w64 >= 0).all()), "negative expert weight"
    if w.numel():
        total = w64.sum(-1)
        assert float(total.max()) <= 1 + tol, f"weights sum to {float(total.max())} > 1"
        if 2**m == num_experts:
            assert float((total - 1).abs().max()) <= tol, "weights of a power-of-2 gate do not sum to 1"
        if zscale == "binary":
            nz = (w != 0).sum(-1)
            assert int(nz.max()) <= k, f"{int(nz.max())} experts nonzero with binary codes and k={k}"
        guarded(lambda: (w.sum() + r.sum()).backward(), what="dselect backward")
        for name, leaf in (("z", z), ("alpha", alpha)):
            if leaf.numel():
                assert leaf.grad is not None, f"no gradient reaches {name}"
                assert_finite(leaf.grad, f"gradient w.r.t. {name}")


# ----------------------------------------------------------------------------- gate modules

X_DTYPES = mostly((torch.float32,), (torch.float64, torch.float16, torch.bfloat16, torch.int64), weight=6)
NAN = mostly((False,), (True,), weight=9)


def _x(batch: int, dim: int, dtype: torch.dtype, scale: float, seed: int, nan: bool) -> torch.Tensor:
    x = torch.randn(batch, dim, generator=fresh(seed), dtype=torch.float64) * scale
    if nan and x.numel():
        x[0, 0] = float("nan")
    return x.round().to(dtype) if dtype == torch.int64 else x.to(dtype)


def _x_validity(per_example: bool, dtype: torch.dtype, scale: float, nan: bool) -> bool | None:
    if not per_example:
        return True  # a static gate only uses the batch size
    if dtype == torch.int64 or nan:
        return False
    if dtype != torch.float32 or scale >= 1e30:
        return None  # other float dtypes may be rejected; codes may overflow at 1e30+
    return True


def check_gate_output(
    gate, x, w: torch.Tensor, batch: int, n: int, *, sums_to_one: bool, max_nonzero: int | None
) -> None:
    assert tuple(w.shape) == (batch, n), f"{type(gate).__name__} weights have shape {tuple(w.shape)}"
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        assert w.dtype == x.dtype or w.dtype == torch.float32, f"weights dtype {w.dtype} for x {x.dtype}"
    assert_finite(w, f"{type(gate).__name__} weights")
    w64 = f64(w)
    assert bool((w64 >= 0).all()), "negative gate weight"
    tol = 16 * n * max(eps(w.dtype), eps(torch.float32))  # computed in the float32 parameters' precision
    total = w64.sum(-1)
    if batch:
        assert float(total.max()) <= 1 + tol, f"gate weights sum to {float(total.max())} > 1"
    if sums_to_one and batch:
        assert float((total - 1).abs().max()) <= tol, f"gate weights sum to {total.tolist()}, not 1"
    if max_nonzero is not None and batch:
        assert int((w != 0).sum(-1).max()) <= max_nonzero, f"more than {max_nonzero} nonzero weights"
    reg = guarded(gate.regularization, what="regularization")
    assert_finite(reg, f"{type(gate).__name__}.regularization()")
    params = [p for p in gate.parameters() if p.requires_grad]
    if params:
        loss = w.float().sum() + reg.float()
        grads = guarded(torch.autograd.grad, loss, params, allow_unused=True, what="gate backward")
        for _param, gr in zip(params, grads):
            if gr is not None:
                assert_finite(gr, f"{type(gate).__name__} gradient of weights + regularization")
    rep = guarded(gate.report, what="report")
    check_report(gate, rep, w)


def check_report(gate, rep, w: torch.Tensor) -> None:
    """report() after a forward that returned ``w``: its experts counts; after an empty batch a
    static gate reports its parameters' selection (one count in [0, n]) and a per-example gate no
    example (``[]``, mean ``None``)."""
    assert isinstance(rep, dict)
    n = gate.num_experts
    if w.shape[0]:
        counts = (w != 0).sum(-1).float()
        assert rep["experts_selected_mean"] == pytest.approx(float(counts.mean())), rep
        want = counts.tolist() if gate.per_example else float(counts[0])
        assert rep["experts_selected"] == want, rep
    elif gate.per_example:
        assert rep["experts_selected"] == [] and rep["experts_selected_mean"] is None, rep
    else:
        sel = rep["experts_selected"]
        assert isinstance(sel, float) and 0 <= sel <= n and rep["experts_selected_mean"] == sel, rep


@fuzz(80)
@given(
    num_experts=st.integers(1, 9),
    k=st.integers(1, 4),
    per_example=st.booleans(),
    batch=st.integers(0, 5),
    input_dim=st.integers(1, 4),
    gamma=st.sampled_from(GAMMAS),
    entropy_reg=st.sampled_from((0.0, 0.1, 1e3)),
    unused_penalty=st.sampled_from((1.0, 0.0)),
    z_fill=st.sampled_from((None, 1.0, -1.0, 0.0, 1e30, "binary")),
    xdtype=X_DTYPES,
    xscale=st.sampled_from((1.0, 50.0, 1e-30, 1e10, 1e30, 1e38)),
    nan=NAN,
    as_int=st.booleans(),
    seed=seeds,
)
def test_dselectk_module(num_experts, k, per_example, batch, input_dim, gamma, entropy_reg, unused_penalty, z_fill,
                         xdtype, xscale, nan, as_int, seed) -> None:
    """DSelectK (static and per-example): weights finite, >= 0, sum <= 1 (== 1 for a power of 2),
    penalties (entropy, unused codes) and their gradients finite (D12), same generator -> same gate,
    bad x (NaN, integer) -> ValueError naming x; a batch of no examples (report and track work, and
    S(z) of no example is not "binary")."""
    k = min(k, num_experts)
    kw = dict(gamma=gamma, per_example=per_example, input_dim=input_dim if per_example else None,
              entropy_reg=entropy_reg, unused_penalty=unused_penalty)
    ok, gate = call(G.DSelectK, num_experts, k, generator=fresh(seed), names=("num_experts", "k"), valid=True, **kw)
    _, twin = call(G.DSelectK, num_experts, k, generator=fresh(seed), names=("num_experts", "k"), valid=True, **kw)
    assert all(same_bits(a, b) for a, b in zip(gate.state_dict().values(), twin.state_dict().values())), (
        "same generator, different initialisation"
    )
    if z_fill is not None and not per_example:
        with torch.no_grad():
            if z_fill == "binary":
                gate.z.copy_((torch.randint(0, 2, gate.z.shape, generator=fresh(seed)) * 2 - 1) * gamma)
            else:
                gate.z.fill_(z_fill)
    nan = nan and batch > 0  # (no example to plant a NaN in)
    if not per_example and as_int and batch:
        x = batch
        valid = True
    else:
        x = _x(batch, input_dim, xdtype, xscale, seed, nan)
        valid = _x_validity(per_example, xdtype, xscale, nan)
    before = clone_inputs(x)
    ok, w = call(gate, x, names=("x",), valid=valid, what="DSelectK forward")
    assert_not_mutated(before, [x])
    if not ok:
        return
    m = (num_experts - 1).bit_length()
    check_gate_output(gate, x, w, batch, num_experts, sums_to_one=2**m == num_experts, max_nonzero=None)
    if not per_example and gate.is_binary() and batch:
        assert int((w != 0).sum(-1).max()) <= k, "binary codes but more than k experts selected"
    guarded(gate.track, 3, what="track")
    if per_example and not batch:
        assert not gate.is_binary() and gate.binary_step is None, "an empty batch made the codes binary"


GATES = ("softmax", "topk", "gumbel", "selector", "annealing", "entropy")


@pytest.mark.parametrize("kind", GATES)
@fuzz(15)
@given(
    num_experts=st.integers(1, 9),
    k=st.integers(1, 4),
    per_example=st.booleans(),
    batch=st.integers(0, 5),
    input_dim=st.integers(1, 4),
    temperature=st.sampled_from((1.0, 1e-3, 1e3, 1e-30)),
    reg=st.sampled_from((0.0, 0.01, 1e3)),
    training=st.booleans(),
    xdtype=X_DTYPES,
    xscale=st.sampled_from((1.0, 1e-30, 1e10, 1e30, 1e38)),
    nan=NAN,
    seed=seeds,
)
def test_baseline_gates(kind, num_experts, k, per_example, batch, input_dim, temperature, reg, training, xdtype, xscale,
                        nan, seed) -> None:
    """Every baseline gate: weights finite, >= 0, sum <= 1 (softmax/top-k: == 1, top-k: <= k nonzero),
    penalties and gradients finite, on_step/report work, same seed -> same weights."""
    k = min(k, num_experts)
    static = kind in ("gumbel", "selector", "annealing", "entropy")
    pe = per_example and not static

    def build():
        g = fresh(seed)
        if kind == "softmax":
            return G.SoftmaxGate(num_experts, per_example=pe, input_dim=input_dim if pe else None, generator=g)
        if kind == "topk":
            return G.TopKGate(num_experts, k, per_example=pe, input_dim=input_dim if pe else None, generator=g)
        if kind == "gumbel":
            return G.GumbelSoftmaxGate(num_experts, temperature=temperature, sparsity_reg=reg, seed=seed, generator=g)
        if kind == "selector":
            return G.SoftmaxSelectorGate(num_experts, k, temperature=temperature, final_temperature=1e-3,
                                         entropy_reg=reg, generator=g)
        if kind == "annealing":
            return G.ablation_annealing(num_experts, k, temperature=temperature, generator=g)
        return G.ablation_entropy(num_experts, k, entropy_reg=reg, generator=g)

    ok, gate = call(build, names=("num_experts", "k", "temperature"), valid=True, what=f"{kind} gate constructor")
    gate.train(training)
    nan = nan and batch > 0  # (no example to plant a NaN in)
    x = _x(batch, input_dim, xdtype, xscale, seed, nan)
    valid = _x_validity(pe, xdtype, xscale, nan)
    guarded(gate.on_step, 3, 10, what="on_step")
    before = clone_inputs(x)
    ok, w = call(gate, x, names=("x",), valid=valid, what=f"{kind} gate forward")
    assert_not_mutated(before, [x])
    if not ok:
        return
    sums = kind in ("softmax", "topk", "selector", "annealing", "entropy")
    check_gate_output(gate, x, w, batch, num_experts, sums_to_one=sums, max_nonzero=k if kind == "topk" else None)
    twin = build()
    twin.train(training)
    guarded(twin.on_step, 3, 10, what="on_step")
    _, w2 = call(twin, x, names=("x",), valid=True, what=f"{kind} gate forward (same seed)")
    assert same_bits(w, w2), "same seed, different weights"


# ----------------------------------------------------------------------------- top-k and batchwise masks


@fuzz(80)
@given(
    lead=st.sampled_from(((), (2,), (0,), (2, 3))),
    n=st.integers(1, 10),
    k=st.integers(-1, 11),
    dtype=st.sampled_from(FLOAT_DTYPES),
    values=st.sampled_from(("normal", "ties", "constant", "huge")),
    seed=seeds,
)
def test_keep_top_k(lead, n, k, dtype, values, seed) -> None:
    """keep_top_k keeps exactly the k largest entries (ties: lowest index), the rest -inf; bad k -> ValueError."""
    g = fresh(seed)
    if values == "ties":
        x = torch.randint(0, 3, (*lead, n), generator=g).to(dtype)
    elif values == "constant":
        x = torch.ones((*lead, n), dtype=dtype)
    else:
        big = torch.finfo(dtype).max / 10 if values == "huge" else 1.0
        x = (torch.randn((*lead, n), generator=g, dtype=torch.float64).clamp(-5, 5) * big).to(dtype)
    before = clone_inputs(x)
    ok, out = call(G.keep_top_k, x, k, names=("k",), valid=1 <= k <= n, what="keep_top_k")
    assert_not_mutated(before, [x])
    if not ok:
        return
    assert out.shape == x.shape and out.dtype == x.dtype
    kept = out == x
    assert bool((kept.sum(-1) == k).all()), f"keep_top_k kept {kept.sum(-1).flatten().tolist()} entries, not {k}"
    assert bool(torch.isneginf(out[~kept]).all()), "dropped entries are not -inf"
    x64 = f64(x)
    lowest_kept = torch.where(kept, x64, torch.inf).amin(-1)
    highest_dropped = torch.where(kept, -torch.inf, x64).amax(-1)
    assert bool((lowest_kept >= highest_dropped).all()), "keep_top_k dropped a larger entry than one it kept"
    idx = torch.arange(n).expand(x.shape)
    tie = (~kept) & (x64 == lowest_kept.unsqueeze(-1))
    last_kept_at_tie = torch.where(kept & (x64 == lowest_kept.unsqueeze(-1)), idx, -1).amax(-1)
    first_dropped_at_tie = torch.where(tie, idx, n).amin(-1)
    assert bool((first_dropped_at_tie > last_kept_at_tie).all()), (
        f"ties not broken towards the lowest index: kept {kept.int().tolist()} of {x64.tolist()}"
    )


@fuzz(80)
@given(
    batch=st.integers(0, 12),
    n=st.integers(1, 8),
    k=st.integers(0, 9),
    dtype=st.sampled_from(FLOAT_DTYPES),
    values=st.sampled_from(("softmax", "ties", "constant", "huge", "nan")),
    tvalues=st.sampled_from(("normal", "nan", "inf", "wrong_shape")),
    seed=seeds,
)
def test_batchwise_and_threshold_masks(batch, n, k, dtype, values, tvalues, seed) -> None:
    """batchwise_mask: exactly m = k*batch/n per column, the column's top m (stable: earlier example
    first on ties); threshold_mask == scores > T; the threshold loss is >= 0, finite, 0 where the
    masks agree, with a finite gradient; bad k / batch / NaN / shapes -> ValueError."""
    g = fresh(seed)
    if values == "ties":
        s = torch.randint(0, 3, (batch, n), generator=g).to(torch.float64) / 3
    elif values == "constant":
        s = torch.full((batch, n), 1.0 / n, dtype=torch.float64)
    else:
        s = torch.softmax(
            torch.randn(batch, n, generator=g, dtype=torch.float64) * (1e30 if values == "huge" else 1), -1
        )
        if values == "nan" and s.numel():
            s[0, 0] = float("nan")
    s = s.to(dtype)
    has_nan = values == "nan" and s.numel() > 0
    valid = not has_nan and 1 <= k <= n  # any batch: quotas floor / ceil of k*batch/n
    before = clone_inputs(s)
    mask_ok, mask = call(G.batchwise_mask, s, k, names=("k", "scores", "batch"), valid=valid, what="batchwise_mask")
    assert_not_mutated(before, [s])
    if mask_ok:
        m = k * batch // n
        counts = mask.sum(0)
        assert mask.dtype == torch.bool and mask.shape == s.shape
        if (k * batch) % n == 0:
            assert bool((counts == m).all()), f"columns keep {counts.tolist()} examples, not m={m}"
        else:
            assert bool(((counts == m) | (counts == m + 1)).all()), f"columns keep {counts.tolist()}, not {m}/{m + 1}"
        assert int(counts.sum()) == k * batch, "the mask must hold k * batch pairs"
        ref = torch.zeros_like(mask)
        order = torch.argsort(f64(s), dim=0, descending=True, stable=True)
        for i in range(n):  # every column keeps its own stable top counts[i]
            ref[order[: int(counts[i]), i], i] = True
        assert torch.equal(mask, ref), "batchwise_mask is not each column's stable top m"
    t = torch.rand(n, generator=g, dtype=torch.float64).to(dtype) / n
    if tvalues == "nan":
        t[0] = float("nan")
    elif tvalues == "inf":
        t[0] = float("inf")
    elif tvalues == "wrong_shape":
        t = torch.zeros(n + 1, dtype=dtype)
    tvalid = not has_nan and tvalues in ("normal", "inf")
    ok, tm = call(G.threshold_mask, s, t, names=("thresholds", "scores"), valid=tvalid, what="threshold_mask")
    if not ok:
        return
    assert torch.equal(tm, s > t), "threshold_mask != scores > thresholds"
    if not mask_ok:
        return
    tt = t.detach().clone().requires_grad_(True)
    ok, loss = call(G.batchwise_threshold_loss, s, tt, mask, names=("scores", "thresholds", "mask"), valid=True)
    assert loss.dim() == 0
    if tvalues == "inf":  # T = +inf switches expert 0 off: the loss is +inf where the batch picked it, never NaN
        assert not bool(torch.isnan(loss)), "batchwise_threshold_loss is NaN with an infinite threshold"
        assert (float(loss.detach()) == float("inf")) == bool(mask[:, 0].any()), "an infinite threshold's term is wrong"
        guarded(loss.backward, what="threshold loss backward")
        assert_finite(tt.grad, "threshold loss gradient")
        return
    assert_finite(loss, "batchwise_threshold_loss")
    value = float(loss.detach())
    assert value >= 0, f"threshold loss {value} < 0"
    ref = ((tm.to(torch.float64) - mask.to(torch.float64)) * (f64(s) - f64(t))).sum()
    assert abs(value - float(ref)) <= 1e-3 * max(1.0, abs(float(ref))) + 64 * batch * n * eps(dtype), (
        "threshold loss != eq. 20"
    )
    guarded(loss.backward, what="threshold loss backward")
    assert_finite(tt.grad, "threshold loss gradient")
    ok, zero = call(G.batchwise_threshold_loss, s, t, tm, names=("scores",), valid=True)
    assert float(zero.detach()) == 0.0, "the threshold loss is not 0 when the masks agree"


ALL_GATES = ("dselect", "dselect_binary") + GATES


@fuzz(60)
@given(
    kind=st.sampled_from(ALL_GATES),
    num_experts=st.integers(1, 9),
    k=st.integers(1, 4),
    per_example=st.booleans(),
    batches=st.lists(mostly((0,), (1, 2, 3), weight=1), min_size=1, max_size=6),
    training=st.booleans(),
    seed=seeds,
)
def test_empty_batches_between_batches_report_and_track(kind, num_experts, k, per_example, batches, training,
                                                        seed) -> None:
    """A run with batches of no examples among the others: report() and track() never fail; after an
    empty batch a static gate reports what a batch of one example would (its parameters' selection,
    eval-mode weights for the Gumbel gate, and no noise drawn), a per-example gate no example; an
    empty batch neither changes DSelectK.is_binary() nor records binary_step."""
    k = min(k, num_experts)
    dim = 3
    pe = per_example and kind in ("dselect", "dselect_binary", "softmax", "topk")
    g = fresh(seed)
    if kind in ("dselect", "dselect_binary"):
        gate = G.DSelectK(num_experts, k, per_example=pe, input_dim=dim if pe else None, entropy_reg=0.1, generator=g)
        if kind == "dselect_binary":  # codes at +-gamma: S(z) binary for every input
            with torch.no_grad():
                if pe:
                    gate.W.weight.zero_()
                    gate.W.bias.copy_(torch.sign(gate.W.bias) + (gate.W.bias == 0))
                else:
                    gate.z.copy_(torch.sign(gate.z) + (gate.z == 0))
    elif kind == "softmax":
        gate = G.SoftmaxGate(num_experts, per_example=pe, input_dim=dim if pe else None, generator=g)
    elif kind == "topk":
        gate = G.TopKGate(num_experts, k, per_example=pe, input_dim=dim if pe else None, generator=g)
    elif kind == "gumbel":
        gate = G.GumbelSoftmaxGate(num_experts, sparsity_reg=0.1, seed=seed, generator=g)
    elif kind == "selector":
        gate = G.SoftmaxSelectorGate(num_experts, k, entropy_reg=0.1, generator=g)
    elif kind == "annealing":
        gate = G.ablation_annealing(num_experts, k, generator=g)
    else:
        gate = G.ablation_entropy(num_experts, k, generator=g)
    gate.train(training)
    is_dselect = isinstance(gate, G.DSelectK)
    binary_before = gate.is_binary() if is_dselect else None
    for step, batch in enumerate(batches):
        x = torch.randn(batch, dim, generator=fresh(seed + step))
        w = guarded(gate, x, what="forward")
        assert tuple(w.shape) == (batch, num_experts)
        noise = gate.noise.get_state() if isinstance(gate, G.GumbelSoftmaxGate) else None
        rep = guarded(gate.report, what="report")
        check_report(gate, rep, w)
        if noise is not None:
            assert same_bits(gate.noise.get_state(), noise), "report() drew noise"
        if batch == 0 and not pe:  # the report of the parameters: what a batch of one (eval mode) gives
            twin = copy.deepcopy(gate).eval()
            twin(1)
            assert rep == twin.report(), (rep, twin.report())
        if is_dselect:
            binary = gate.is_binary()
            if pe and batch == 0:
                assert binary == binary_before, "an empty batch changed is_binary()"
            recorded = gate.binary_step
            guarded(gate.track, step, what="track")
            if gate.binary_step != recorded:
                assert batch > 0 or not pe, f"track() recorded binary_step {step} after an empty batch"
                assert binary, "track() recorded binary_step for codes that are not binary"
            if kind == "dselect_binary" and (batch or not pe):
                assert gate.binary_step is not None
            binary_before = binary
        else:
            guarded(gate.track, step, what="track")


S = torch.softmax(torch.randn(4, 2, generator=fresh(0)), -1)

BAD_CALLS = [
    ("smooth_step", lambda: G.smooth_step([0.1, 0.2]), ("t",)),
    ("smooth_step", lambda: G.smooth_step(torch.tensor([1, 2])), ("t",)),
    ("selector_outputs", lambda: G.selector_outputs([0.0], 1.0), ("z",)),
    ("dselect_weights", lambda: G.dselect_weights(torch.zeros(3), torch.zeros(3, 1), 2), ("z", "alpha", "k")),
    ("dselect_weights", lambda: G.dselect_weights(torch.zeros(2), torch.zeros(2, 5), 4), ("z",)),
    ("dselect_weights", lambda: G.dselect_weights(torch.zeros(2), torch.zeros(2, 1), 0), ("num_experts",)),
    ("DSelectK", lambda: G.DSelectK(4, 5), ("k",)),
    ("DSelectK", lambda: G.DSelectK(4, 2, per_example=True), ("input_dim",)),
    ("DSelectK", lambda: G.DSelectK(4, 2, generator=0), ("generator",)),
    ("DSelectK", lambda: G.DSelectK(4, 2, per_example=True, input_dim=3)(torch.zeros(2, 4)), ("x",)),
    ("DSelectK", lambda: G.DSelectK(4, 2)(0), ("x", "batch")),
    ("DSelectK", lambda: G.DSelectK(4, 2, entropy_reg=-1.0), ("entropy_reg",)),
    ("TopKGate", lambda: G.TopKGate(3, 0), ("k",)),
    ("SoftmaxGate", lambda: G.SoftmaxGate(0), ("num_experts",)),
    ("GumbelSoftmaxGate", lambda: G.GumbelSoftmaxGate(3, temperature=0.0), ("temperature",)),
    ("GumbelSoftmaxGate", lambda: G.GumbelSoftmaxGate(3, seed="a"), ("seed",)),
    ("SoftmaxSelectorGate", lambda: G.SoftmaxSelectorGate(3, 2, final_temperature=-1.0), ("final_temperature",)),
    ("keep_top_k", lambda: G.keep_top_k(torch.zeros(3), 4), ("k",)),
    ("keep_top_k", lambda: G.keep_top_k([1.0, 2.0], 1), ("logits",)),
    ("keep_top_k", lambda: G.keep_top_k(torch.zeros(3), 1.5), ("k",)),
    ("batchwise_mask", lambda: G.batchwise_mask(S, 1.0), ("k",)),
    ("batchwise_mask", lambda: G.batchwise_mask(S[0], 1), ("scores",)),
    ("threshold_mask", lambda: G.threshold_mask(S, [0.5, 0.5]), ("thresholds",)),
    (
        "batchwise_threshold_loss",
        lambda: G.batchwise_threshold_loss(S, torch.zeros(2), torch.ones(3, 2).bool()),
        ("mask",),
    ),
]


@pytest.mark.parametrize("what, thunk, names", BAD_CALLS, ids=[f"{i}-{c[0]}" for i, c in enumerate(BAD_CALLS)])
def test_bad_arguments_raise_named_value_or_type_errors(what: str, thunk, names) -> None:
    call(thunk, names=names, valid=False, what=what)
