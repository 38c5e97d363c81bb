"""Fuzz tests of routelab.routing: expert_capacity, check_capacity_factor, check_capacity (when
public), apply_capacity (every drop policy) with CapacityDecision, and DispatchPlan and GroupedPlan
(build, dispatch, combine) against loop references.
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import routelab.routing as R
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
    same_bits,
    seeds,
)
from test_fuzz_helpers import COVERED_ROUTING
from test_fuzz_masks import COVERED_MASKS
from test_fuzz_record import COVERED_ROUTING_RECORD
from test_fuzz_rules import COVERED_ROUTING_RULES

COVERED = {"CapacityDecision", "DispatchPlan", "GroupedPlan", "apply_capacity", "check_capacity",
           "check_capacity_factor", "expert_capacity"} | COVERED_ROUTING | COVERED_ROUTING_RULES \
    | COVERED_ROUTING_RECORD | COVERED_MASKS


def test_public_api_is_covered() -> None:
    public = {n for n in R.__all__ if callable(getattr(R, n))}
    assert public <= COVERED, f"routelab.routing has callables without a fuzz test: {sorted(public - COVERED)}"


FACTORS = (None, 1.0, 1.25, 2.0, 0.5, 1e-9, 1e9, 1e308, 3, 0.0, -1.0, float("nan"), float("inf"), True, "1.0")


def _factor_valid(cf) -> bool:
    if cf is None:
        return True
    return not isinstance(cf, (bool, str)) and math.isfinite(cf) and cf > 0


@fuzz(100)
@given(
    num_tokens=st.integers(-2, 64) | st.sampled_from((10**6, 0)),
    num_experts=st.integers(-1, 16),
    slots=st.sampled_from((1, 2, 3, 0.5, 8, 0, -1)),
    cf=st.sampled_from(FACTORS),
)
def test_expert_capacity(num_tokens, num_experts, slots, cf) -> None:
    """0 <= C <= n, C = n when dropless, C >= 1 with tokens, C = ceil(cf * n * slots / E) (clamped),
    so capacity_factor >= 1 always fits every pair; bad arguments -> ValueError naming them."""
    valid = _factor_valid(cf) and num_tokens >= 0 and num_experts >= 1 and slots > 0
    ok, c = call(R.check_capacity_factor, cf, names=("capacity_factor",), valid=_factor_valid(cf))
    ok, C = call(R.expert_capacity, num_tokens, num_experts, slots, cf,
                 names=("capacity_factor", "num_tokens", "num_experts", "slots"), valid=valid, what="expert_capacity")
    if not ok:
        return
    n = num_tokens
    assert isinstance(C, int) and not isinstance(C, bool), f"capacity {C!r} is not an int"
    assert 0 <= C <= n, f"capacity {C} outside [0, {n}]"
    if cf is None:
        assert C == n, "dropless capacity must be the number of tokens"
        return
    if n:
        assert C >= 1, "a batch with tokens needs capacity >= 1"
    exact = Fraction(cf) * n * Fraction(slots) / num_experts
    want = min(max(math.ceil(exact), 1 if n else 0), n)
    assert want - 1 <= C <= want, f"capacity {C}, expected ceil({float(exact)}) = {want} (clamped to [1, {n}])"
    if cf >= 1 and slots <= num_experts:
        assert C == n or C * num_experts >= n * slots, (
            f"capacity_factor {cf} >= 1 but capacity {C} x {num_experts} experts cannot hold {n} x {slots} pairs"
        )


@fuzz(100)
@given(
    n=st.integers(0, 12),
    s=st.integers(1, 4),
    E=st.integers(1, 6),
    capacity=st.integers(0, 14) | st.sampled_from((-1, 2.5, float("inf"), None, True)),
    policy=st.sampled_from(("position", "score", "random", "fifo")),
    cand_p=st.sampled_from((1.0, 0.7, 0.0)),
    score_kind=st.sampled_from(("normal", "ties", "none", "nan")),
    bad=st.sampled_from(("none",) * 6 + ("expert_high", "expert_neg", "shape", "float_expert")),
    seed=seeds,
)
def test_apply_capacity(n, s, E, capacity, policy, cand_p, score_kind, bad, seed) -> None:
    """keep = candidates that fit: per expert min(load, C) kept, positions distinct in [0, C),
    skip_weight = n_z / min(n_z, C) on kept pairs and 0 elsewhere; 'position' keeps the earliest
    (slot-major), 'score' the largest scores, 'random' is reproducible with a seed; bad input ->
    ValueError naming the argument."""
    g = fresh(seed)
    expert = torch.randint(0, E, (n, s), generator=g)
    candidate = torch.rand(n, s, generator=g) < cand_p
    if score_kind == "ties":
        score = torch.randint(0, 2, (n, s), generator=g).float()
    elif score_kind == "nan":
        score = torch.randn(n, s, generator=g)
        if score.numel():
            score[0, 0] = float("nan")
    else:
        score = torch.randn(n, s, generator=g)
    if bad == "expert_high" and expert.numel():
        expert[0, 0] = E
    elif bad == "expert_neg" and expert.numel():
        expert[0, 0] = -1
    elif bad == "shape":
        candidate = candidate[:, :-1] if s > 1 else candidate.unsqueeze(-1).expand(n, 1, 2)
    elif bad == "float_expert":
        expert = expert.float()
    cap_ok = isinstance(capacity, int) and not isinstance(capacity, bool) and capacity >= 0
    bad_effective = bad != "none" and (expert.numel() > 0 or bad in ("shape", "float_expert"))
    needs_score = policy == "score"
    score_arg = None if score_kind == "none" else score
    valid = (cap_ok and policy != "fifo" and not bad_effective
             and not (needs_score and (score_arg is None or (score_kind == "nan" and score.numel()))))
    before = clone_inputs(expert, candidate, score_arg)
    args = (expert, candidate, capacity, E)
    ok, d = call(R.apply_capacity, *args, names=("capacity", "policy", "score", "expert", "candidate", "num_experts"),
                 valid=valid, what="apply_capacity", policy=policy, score=score_arg, generator=fresh(seed + 1))
    assert_not_mutated(before, [expert, candidate, score_arg])
    if not ok:
        return
    assert isinstance(d, R.CapacityDecision)
    C = capacity
    for f in ("keep", "position", "skip_weight"):
        assert tuple(getattr(d, f).shape) == (n, s), f"{f} has shape {tuple(getattr(d, f).shape)}"
    keep = d.keep
    assert keep.dtype == torch.bool
    assert not bool((keep & ~candidate).any()), "a non-candidate pair was kept"
    load = torch.bincount(expert[candidate], minlength=E)[:E]
    kept = torch.bincount(expert[keep], minlength=E)[:E]
    assert torch.equal(d.load.long(), load), f"load {d.load.tolist()} != candidates per expert {load.tolist()}"
    assert torch.equal(kept, torch.clamp(load, max=C)), f"kept {kept.tolist()} != min(load, C={C}) {load.tolist()}"
    assert torch.equal(d.kept.long(), kept), "decision.kept != pairs kept per expert"
    pos = d.position[keep]
    assert bool(((pos >= 0) & (pos < max(C, 1))).all()), f"kept positions outside [0, {C})"
    rows = expert[keep] * max(C, 1) + pos
    assert rows.unique().numel() == rows.numel(), "two kept pairs share an (expert, position) slot"
    sw = f64(d.skip_weight)
    ref = torch.where(
        keep,
        load.to(torch.float64)[expert.clamp(0, E - 1)] / kept.clamp(min=1).to(torch.float64)[expert.clamp(0, E - 1)],
        0.0,
    )
    assert torch.allclose(sw, ref, rtol=1e-6), "skip_weight != n_z / min(n_z, C) on kept pairs (0 elsewhere)"
    # policy semantics
    flat_e = expert.t().reshape(-1)
    flat_c = candidate.t().reshape(-1)
    flat_k = keep.t().reshape(-1)
    if policy == "position":
        for e in range(E):
            idx = ((flat_e == e) & flat_c).nonzero().flatten()
            want = torch.zeros_like(flat_k)
            want[idx[:C]] = True
            assert torch.equal(flat_k & (flat_e == e), want), f"'position' did not keep expert {e}'s first {C} pairs"
    elif policy == "score":
        fs = score.t().reshape(-1)
        for e in range(E):
            mine = (flat_e == e) & flat_c
            if bool((mine & ~flat_k).any()) and bool((mine & flat_k).any()):
                assert float(fs[mine & flat_k].min()) >= float(fs[mine & ~flat_k].max()), (
                    f"'score' dropped a higher-scoring pair of expert {e}"
                )
    else:
        _, d2 = call(R.apply_capacity, *args, names=("capacity",), valid=True, what="apply_capacity (same seed)",
                     policy=policy, score=score_arg, generator=fresh(seed + 1))
        assert same_bits(d.keep, d2.keep) and same_bits(d.position, d2.position), "same seed, different random drops"


def assert_combine_is_the_loop(y, w, keep, out_of_pair, read, dtype, d_model) -> None:
    """``y [n, d_model]`` equals the loop ``y_t = sum_s w[t, s] * out_of_pair(t, s)`` over the kept pairs,
    within rounding of ``dtype`` relative to the largest output the plan may read (``read``)."""
    n, s = keep.shape
    assert tuple(y.shape) == (n, d_model), f"combine output {tuple(y.shape)}"
    yref = torch.zeros(y.shape, dtype=torch.float64)
    for t in range(n):
        for j in range(s):
            if keep[t, j]:
                yref[t] += f64(w[t, j]) * f64(out_of_pair(t, j))
    tol = 8 * s * eps(dtype) * (yref.abs() + f64(read).abs().max() if read.numel() else yref.abs()) + 1e-300
    assert bool(((f64(y) - yref).abs() <= tol).all()), "combine != sum_s weight * out[row] over kept pairs"


#: The sizes, dtypes and magnitudes both dispatch plans are fuzzed over.
PLAN_CASES = {
    "n": st.integers(0, 10),
    "s": st.integers(1, 3),
    "E": st.integers(1, 5),
    "d_model": st.integers(1, 4),
    "capacity": st.integers(0, 8),
    "dtype": st.sampled_from(FLOAT_DTYPES),
    "scale": st.sampled_from((1.0, 1e-30, 1e30)),
    "seed": seeds,
}


@fuzz(80)
@given(**PLAN_CASES)
def test_dispatch_plan(n, s, E, d_model, capacity, dtype, scale, seed) -> None:
    """dispatch puts token t in row expert * C + position of every kept pair (zero rows elsewhere);
    combine returns sum_s weight * out[row] over kept pairs; both differentiable with finite grads."""
    g = fresh(seed)
    scale = min(scale, torch.finfo(dtype).max / 1e3)
    expert = torch.randint(0, E, (n, s), generator=g)
    candidate = torch.ones(n, s, dtype=torch.bool)
    dec = R.apply_capacity(expert, candidate, capacity, E)
    ok, plan = call(R.DispatchPlan.build, expert, dec.keep, dec.position, E, capacity,
                    names=("expert", "keep", "position", "capacity"), valid=True, what="DispatchPlan.build")
    x = (torch.randn(n, d_model, generator=g, dtype=torch.float64) * scale).to(dtype).requires_grad_(True)
    before = clone_inputs(x)
    ok, buf = call(plan.dispatch, x, names=("x",), valid=True, what="DispatchPlan.dispatch")
    assert_not_mutated(before, [x])
    assert tuple(buf.shape) == (E, capacity, d_model) and buf.dtype == dtype, f"buffer {tuple(buf.shape)} {buf.dtype}"
    ref = torch.zeros(E, capacity, d_model, dtype=dtype)
    for t in range(n):
        for j in range(s):
            if dec.keep[t, j]:
                ref[expert[t, j], dec.position[t, j]] = x[t].detach()
    assert same_bits(buf.detach(), ref), "dispatch buffer != loop reference"
    out = (torch.randn(E, capacity, d_model, generator=g, dtype=torch.float64) * scale).to(dtype).requires_grad_(True)
    w = torch.rand(n, s, generator=g, dtype=torch.float64).to(dtype).requires_grad_(True)
    ok, y = call(plan.combine, out, w, names=("expert_out", "weight"), valid=True, what="DispatchPlan.combine")
    assert_combine_is_the_loop(y, w, dec.keep, lambda t, j: out[expert[t, j], dec.position[t, j]], out, dtype,
                               d_model)
    if n and capacity and scale <= 1:
        guarded(lambda: (buf.sum() + y.sum()).backward(), what="dispatch/combine backward")
        for name, leaf in (("x", x), ("expert_out", out), ("weight", w)):
            if leaf.grad is not None:
                assert_finite(leaf.grad, f"gradient w.r.t. {name}")


@fuzz(80)
@given(**PLAN_CASES, policy=st.sampled_from(("position", "score", "random")))
def test_grouped_plan(n, s, E, d_model, capacity, policy, dtype, scale, seed) -> None:
    """Expert e's rows (offsets[e-1]:offsets[e]) hold its kept tokens in position order, the rest
    are zero rows; combine returns sum_s weight * out[row] over kept pairs whatever the rows of no
    expert hold (NaN here); both differentiable with finite grads."""
    g = fresh(seed)
    scale = min(scale, torch.finfo(dtype).max / 1e3)
    expert = torch.randint(0, E, (n, s), generator=g)
    candidate = torch.rand(n, s, generator=g) < 0.8
    dec = R.apply_capacity(expert, candidate, capacity, E, policy=policy, score=torch.rand(n, s, generator=g),
                           generator=fresh(seed + 1))
    ok, plan = call(R.GroupedPlan.build, expert, dec.keep, dec.position, dec.kept, E,
                    names=("expert", "keep", "position", "kept"), valid=True, what="GroupedPlan.build")
    x = (torch.randn(n, d_model, generator=g, dtype=torch.float64) * scale).to(dtype).requires_grad_(True)
    before = clone_inputs(x)
    ok, rows = call(plan.dispatch, x, names=("x",), valid=True, what="GroupedPlan.dispatch")
    assert_not_mutated(before, [x])
    assert tuple(rows.shape) == (n * s, d_model) and rows.dtype == dtype, f"rows {tuple(rows.shape)} {rows.dtype}"
    ends = plan.offsets.tolist()
    ref = torch.zeros(n * s, d_model, dtype=dtype)
    for e in range(E):
        start = ends[e - 1] if e else 0
        mine = sorted((int(dec.position[t, j]), t) for t in range(n) for j in range(s)
                      if dec.keep[t, j] and expert[t, j] == e)
        assert ends[e] - start == len(mine), f"expert {e} owns {ends[e] - start} rows for {len(mine)} kept pairs"
        for i, (_, t) in enumerate(mine):
            ref[start + i] = x[t].detach()
    assert same_bits(rows.detach(), ref), "grouped rows != loop reference"
    out = (torch.randn(n * s, d_model, generator=g, dtype=torch.float64) * scale).to(dtype)
    out[ends[-1]:] = float("nan")  # rows of no expert: never read
    out.requires_grad_(True)
    w = torch.rand(n, s, generator=g, dtype=torch.float64).to(dtype).requires_grad_(True)
    ok, y = call(plan.combine, out, w, names=("expert_out", "weight"), valid=True, what="GroupedPlan.combine")
    assert_combine_is_the_loop(y, w, dec.keep, lambda t, j: out[plan.row_of_slot[t, j]], out[:ends[-1]],
                               dtype, d_model)
    if n and scale <= 1:
        guarded(lambda: (rows.sum() + y.sum()).backward(), what="grouped dispatch/combine backward")
        for name, leaf in (("x", x), ("expert_out", out), ("weight", w)):
            if leaf.grad is not None:
                assert_finite(leaf.grad, f"gradient w.r.t. {name}")


E3 = torch.tensor([[0], [1], [2]])
K3 = torch.ones(3, 1, dtype=torch.bool)

BAD_CALLS = [
    ("apply_capacity", lambda: R.apply_capacity(E3, K3, 1, 3, policy="lifo"), ("policy",)),
    ("apply_capacity", lambda: R.apply_capacity(E3, K3, 1, 3, policy="score"), ("score",)),
    ("apply_capacity", lambda: R.apply_capacity(E3, K3, -1, 3), ("capacity",)),
    ("apply_capacity", lambda: R.apply_capacity(E3, K3, 1, 2), ("expert", "num_experts")),
    ("apply_capacity", lambda: R.apply_capacity(E3, K3, 1, 3, policy="random", generator=1), ("generator",)),
    ("apply_capacity", lambda: R.apply_capacity(E3.squeeze(-1), K3, 1, 3), ("expert",)),
    ("apply_capacity", lambda: R.apply_capacity(E3, K3.long(), 1, 3), ("candidate",)),
    ("expert_capacity", lambda: R.expert_capacity(4, 0, 1, 1.0), ("num_experts",)),
    ("expert_capacity", lambda: R.expert_capacity(-4, 2, 1, 1.0), ("num_tokens",)),
    ("check_capacity_factor", lambda: R.check_capacity_factor("2"), ("capacity_factor",)),
    ("DispatchPlan.build", lambda: R.DispatchPlan.build(E3, K3, torch.tensor([[5], [0], [0]]), 3, 2), ("position",)),
    (
        "DispatchPlan.dispatch",
        lambda: R.DispatchPlan.build(E3, K3, torch.zeros(3, 1, dtype=torch.long), 3, 1).dispatch(torch.ones(4, 2)),
        ("x",),
    ),
    ("GroupedPlan.build", lambda: R.GroupedPlan.build(E3, K3, torch.zeros(3, 1, dtype=torch.long),
                                                      torch.ones(2, dtype=torch.long), 3), ("kept",)),
    (
        "GroupedPlan.combine",
        lambda: R.GroupedPlan.build(E3, K3, torch.zeros(3, 1, dtype=torch.long), torch.ones(3, dtype=torch.long),
                                    3).combine(torch.ones(2, 2), torch.ones(3, 1)),
        ("expert_out",),
    ),
]


@pytest.mark.parametrize("what, thunk, names", BAD_CALLS, ids=[f"{i}-{c[0]}" for i, c in enumerate(BAD_CALLS)])
def test_bad_arguments_raise_named_value_or_type_errors(what: str, thunk, names) -> None:
    call(thunk, names=names, valid=False, what=what)
