"""Fuzz tests of routelab.assignment: balanced_assignment, base_assignment, gumbel_matching (and
GumbelMatching), sinkhorn, sample_gumbel, clear_scratch.

Oracles are independent of routelab: scipy's Hungarian solver on the column-expanded matrix
(optimality and feasibility), brute-force conditionals (n * k scipy solves, Kool et al. eq. 6-9),
scipy's linprog for the feasibility of Sinkhorn marginals. See fuzz_strategies for the shared
machinery (hang guard, error contract, tolerances relative to the score spread).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from scipy.optimize import linprog

import routelab.assignment as A
from fuzz_strategies import (
    FLOAT_DTYPES,
    HALF_DTYPES,
    ScoreCase,
    assert_finite,
    assert_not_mutated,
    assignment_tolerance,
    call,
    capacity_choices,
    capacity_for,
    check_assignment,
    clone_inputs,
    conditional_values,
    eps,
    f64,
    feasible,
    fresh,
    fuzz,
    log_softmax_np,
    logsumexp_rows,
    mostly,
    np64,
    picks,
    resolve,
    same_bits,
    score_cases,
    seeds,
    spread,
    taus,
)
from oracles import b_matching_lp
from test_fuzz_helpers import COVERED_ASSIGNMENT

COVERED = {"GumbelMatching", "balanced_assignment", "balanced_b_matching", "base_assignment", "clear_scratch",
           "compiled_phases", "gumbel_matching", "sample_gumbel", "sinkhorn"} | COVERED_ASSIGNMENT


def test_public_api_is_covered() -> None:
    """A new public function needs a fuzz test here."""
    public = {n for n in A.__all__ if callable(getattr(A, n))}
    assert public <= COVERED, f"routelab.assignment has callables without a fuzz test: {sorted(public - COVERED)}"


@fuzz(40)
@given(case=score_cases(), phase=st.sampled_from(("normalise", "auction", "cycles")))
def test_compiled_phases(case: ScoreCase, phase: str) -> None:
    """Any input: a bool, never an exception, the input untouched; True only for finite float32/64
    CPU scores of a batch (the compiled path in use), and then the full solve is optimal."""
    x = case.x
    if x.ndim < 2 or x.shape[-1] == 0 or x.shape[-2] == 0 or x.shape[-2] % x.shape[-1]:
        return
    flat = x.reshape(-1, x.shape[-2], x.shape[-1])
    before = flat.clone()
    ok = A.compiled_phases(flat, phase)
    assert isinstance(ok, bool)
    assert same_bits(flat, before)
    finite = bool(torch.isfinite(flat).all()) if flat.numel() else True
    if ok:
        assert flat.dtype in (torch.float32, torch.float64) and finite
    if ok and phase == "cycles":
        z = A.balanced_assignment(flat).numpy()
        for b, S in enumerate(np64(flat)):
            check_assignment(S, z[b], flat.shape[-2] // flat.shape[-1], flat.dtype, "compiled_phases")


def _instances(x: torch.Tensor) -> np.ndarray:
    S = np64(x)
    return S.reshape(-1, *S.shape[-2:])


def assignment_validity(case: ScoreCase, c: int | None) -> bool | None:
    """True: must succeed; False: must raise ValueError; None: may reject (half precision)."""
    if case.has_nan_or_posinf() or c is None:
        return False
    if not all(feasible(S, c) for S in _instances(case.x)):
        return False
    return None if case.dtype in HALF_DTYPES else True


def _overflows(x: torch.Tensor, tau: float) -> bool:
    """Whether ``logits / tau`` (plus Gumbel noise) leaves the range of the dtype."""
    if tau == 0.0 or x.numel() == 0:
        return False
    fin = f64(x)[torch.isfinite(x)]
    return bool(fin.numel()) and float(fin.abs().max()) / tau > torch.finfo(x.dtype).max / 4


# ----------------------------------------------------------------------------- balanced / base


@pytest.mark.parametrize("fn", ("balanced", "base"))
@fuzz(60)
@given(case=score_cases(), cap_choice=capacity_choices, pick=picks)
def test_balanced_and_base_assignment(case: ScoreCase, cap_choice: str, pick: int, fn: str) -> None:
    """Capacity respected, no forbidden pair, optimal (scipy) within n(k+1)*8*eps*spread, infeasible
    -inf patterns and bad capacities raise ValueError, empty batches give empty results, input not
    mutated, same output after clear_scratch (no state leaks between calls)."""
    x = case.x
    n, k = case.n, case.k
    capacity = capacity_for(n, k, cap_choice, pick)
    c = resolve(n, k, capacity)
    valid = assignment_validity(case, c)
    func = A.balanced_assignment if fn == "balanced" else A.base_assignment
    name = "scores" if fn == "balanced" else "logits"
    before = clone_inputs(x)
    ok, z = call(func, x, capacity, names=(name, "capacity"), valid=valid, what=f"{fn}_assignment")
    assert_not_mutated(before, [x])
    if not ok:
        return
    assert z.dtype == torch.long and z.shape == x.shape[:-1], f"expert has {z.dtype} {tuple(z.shape)}"
    for i, (S, zi) in enumerate(zip(_instances(x), z.reshape(-1, n).numpy())):
        check_assignment(S, zi, c, x.dtype, f"{fn}_assignment instance {i}")
    call(A.clear_scratch, names=(), valid=True)
    _, z2 = call(func, x, capacity, names=(name, "capacity"), valid=True, what=f"{fn}_assignment (again)")
    assert same_bits(z, z2), "same input, different assignment (after clear_scratch)"


@fuzz(40)
@given(case=score_cases(max_n=9, max_k=6), slot_pick=picks, bad_k=mostly((False,), (True,), weight=8),
       cap_choice=capacity_choices, pick=picks)
def test_balanced_b_matching(case: ScoreCase, slot_pick: int, bad_k: bool, cap_choice: str, pick: int) -> None:
    """k distinct experts per token, loads within the floor/ceil quotas (or the capacity), no
    forbidden pair, optimal against scipy's LP (HiGHS) within k n (E+1) 8 eps spread; bad k,
    capacities, NaN/+inf and infeasible -inf patterns raise ValueError; input not mutated; the
    same bits twice (after clear_scratch)."""
    x = case.x
    n, E = case.n, case.k
    slots = (E + 1 if slot_pick % 2 else 0) if bad_k else 1 + slot_pick % E
    pairs = slots * n
    capacity = capacity_for(pairs, E, cap_choice, pick)
    c = resolve(pairs, E, capacity) if capacity is not None else -(-pairs // E)
    lo, hi = (pairs // E, -(-pairs // E)) if capacity is None else (0, None if c is None else min(c, n))
    valid: bool | None = not case.has_nan_or_posinf() and 1 <= slots <= E and c is not None
    if valid:
        valid = all(b_matching_lp(S, slots, lo, hi) is not None for S in _instances(x))
    if valid and case.dtype in HALF_DTYPES:
        valid = None
    before = clone_inputs(x)
    ok, z = call(A.balanced_b_matching, x, slots, capacity, names=("scores", "k", "capacity"), valid=valid,
                 what="balanced_b_matching")
    assert_not_mutated(before, [x])
    if not ok:
        return
    assert z.dtype == torch.long and z.shape == (*x.shape[:-1], slots), f"experts {z.dtype} {tuple(z.shape)}"
    for i, (S, zi) in enumerate(zip(_instances(x), z.reshape(-1, n, slots).numpy())):
        what = f"balanced_b_matching instance {i}"
        assert all(len(set(row)) == slots for row in zi.tolist()), f"{what}: repeated expert {zi.tolist()}"
        loads = np.bincount(zi.ravel(), minlength=E)
        assert loads.min() >= lo and loads.max() <= hi, f"{what}: loads {loads.tolist()} outside [{lo}, {hi}]"
        used = np.take_along_axis(S, zi, axis=-1)
        assert not np.isneginf(used).any(), f"{what}: a forbidden (-inf) pair was used"
        ref = b_matching_lp(S, slots, lo, hi)
        assert ref is not None, f"{what}: returned a b-matching although the LP finds none feasible"
        fin = np.isfinite(S)
        rowmax = np.where(fin, S, -np.inf).max(1, keepdims=True)
        shifted = S - rowmax  # both objectives on the same row-shifted scores (rounding relative to the spread)
        gap = math.fsum(list(np.take_along_axis(shifted, zi, axis=-1).ravel()) + list(-shifted[ref > 0]))
        tol = slots * n * (E + 1) * 8 * eps(x.dtype) * spread(S)
        assert gap >= -tol, f"{what}: not optimal: objective {gap:.6g} below the LP optimum (tolerance {tol:.3g})"
    call(A.clear_scratch, names=(), valid=True)
    _, z2 = call(A.balanced_b_matching, x, slots, capacity, names=("scores", "k", "capacity"), valid=True,
                 what="balanced_b_matching (again)")
    assert same_bits(z, z2), "same input, different b-matching"


# ----------------------------------------------------------------------------- gumbel_matching


def _gumbel_call(x: torch.Tensor, tau: float, capacity, gumbels, seed: int, valid):
    return call(A.gumbel_matching, x, tau=tau, capacity=capacity, gumbels=gumbels, generator=fresh(seed),
                names=("logits", "capacity", "tau", "gumbels"), valid=valid, what="gumbel_matching")


@pytest.mark.parametrize("tau", (1.0, 0.0, 1e-3, 1e3, 1e-30))
@fuzz(40)
@given(case=score_cases(), cap_choice=capacity_choices, pick=picks, seed=seeds, own_noise=st.booleans())
def test_gumbel_matching(case: ScoreCase, cap_choice: str, pick: int, tau: float, seed: int, own_noise: bool) -> None:
    """The sample is optimal for its returned scores (= logits / tau + gumbels), respects the
    capacity and the forbidden pairs; conditionals are normalised distributions, -inf exactly on
    forbidden pairs, positive on the sampled expert; same seed -> same bits; input not mutated."""
    x = case.x
    n, k = case.n, case.k
    capacity = capacity_for(n, k, cap_choice, pick)
    c = resolve(n, k, capacity)
    valid = assignment_validity(case, c)
    if valid and _overflows(x, tau):
        valid = None  # logits / tau leaves the dtype's range: a ValueError is acceptable
    gumbels = A.sample_gumbel(x.shape, dtype=x.dtype, generator=fresh(seed ^ 1)) if own_noise else None
    before = clone_inputs(x, gumbels)
    ok, gm = _gumbel_call(x, tau, capacity, gumbels, seed, valid)
    assert_not_mutated(before, [x, gumbels])
    if not ok:
        return
    check_gumbel_result(x, gm, c, tau, gumbels, overflow=_overflows(x, tau))
    _, gm2 = _gumbel_call(x, tau, capacity, gumbels, seed, True)
    for f in ("expert", "conditional_log_probs", "scores", "gumbels", "shortest_paths"):
        assert same_bits(getattr(gm, f), getattr(gm2, f)), f"same seed, different {f}"


def check_gumbel_result(x: torch.Tensor, gm: A.GumbelMatching, c: int, tau: float, gumbels, *, overflow: bool) -> None:
    n, k = x.shape[-2], x.shape[-1]
    batch = tuple(x.shape[:-2])
    assert isinstance(gm, A.GumbelMatching)
    assert gm.expert.dtype == torch.long and tuple(gm.expert.shape) == (*batch, n), f"expert {tuple(gm.expert.shape)}"
    for f in ("conditional_log_probs", "scores", "gumbels"):
        assert tuple(getattr(gm, f).shape) == tuple(x.shape), f"{f} has shape {tuple(getattr(gm, f).shape)}"
    assert tuple(gm.shortest_paths.shape) == (*batch, k, k), f"shortest_paths {tuple(gm.shortest_paths.shape)}"
    assert gm.capacity == c, f"capacity field {gm.capacity}, expected {c}"
    assert gm.tau == float(tau), f"tau field {gm.tau}, expected {tau}"
    forbidden = torch.isneginf(x)
    # noise: zero at tau == 0, the given noise when passed, finite
    if tau == 0.0:
        assert not bool(gm.gumbels.any()), "tau == 0 must use no noise (gumbels all zero)"
    else:
        assert_finite(gm.gumbels, "gumbels")
        if gumbels is not None:
            assert torch.equal(f64(gm.gumbels), f64(gumbels)), "the gumbels passed in were not the noise used"
    # scores: the perturbed scores, -inf exactly at the forbidden pairs (in units of 2 ** log2_scale,
    # shifted per token, where the literal sum overflows)
    assert tuple(gm.log2_scale.shape) == batch, f"log2_scale has shape {tuple(gm.log2_scale.shape)}"
    if not overflow:
        assert not bool(gm.log2_scale.any()), "scores are rescaled although logits / tau + gumbels is finite"
    S = gm.scores.detach()
    assert not bool(torch.isnan(S).any()), "scores contain NaN"
    assert not bool(torch.isposinf(S).any()), "scores contain +inf"
    wrong = torch.isneginf(S) & ~forbidden
    assert not bool(wrong.any()), (
        f"scores are -inf at {int(wrong.sum())} pair(s) whose logit is finite (e.g. {wrong.nonzero()[:3].tolist()}): "
        f"a pair the caller allowed became forbidden (logits / tau overflowed?)"
    )
    assert bool(torch.isneginf(S[forbidden]).all()), "scores are finite at a forbidden (-inf) pair"
    if not overflow:
        if tau > 0:
            ref = f64(x) / tau + f64(gm.gumbels)
            fin = ~forbidden
            err = (f64(S) - ref).abs()[fin]
            bound = (4 * eps(S.dtype) * (ref.abs() + f64(gm.gumbels).abs() + 1e-300))[fin]
            assert bool((err <= bound).all()), (
                f"scores != logits / tau + gumbels (max error {float((err - bound).max()):.3g} over bound)"
            )
    # the sample: optimal for the perturbed scores a / tau + g (tau == 0: for the logits themselves).
    # The solver forms them in float64, shifted per token ((a - max_j a) / tau + g: the same
    # assignment), and so does this oracle. The returned float32 scores round them at the scale of
    # |a| / tau, which can exceed a row's spread (a row of logits near 7e5 with tau = 1e-3 rounds at
    # 64 where its entries differ by 1e3): an oracle on those would judge a different problem.
    # Where a / tau + g overflows, the returned scores are already shifted per token.
    if overflow:
        Sn = np64(S).reshape(-1, n, k)
    else:
        a = f64(x)
        top = a.amax(-1, keepdim=True)
        a = a - torch.where(torch.isfinite(top), top, torch.zeros_like(top))
        Sn = np64(a if tau == 0 else a / tau + f64(gm.gumbels)).reshape(-1, n, k)
    for i, (Si, zi) in enumerate(zip(Sn, gm.expert.reshape(-1, n).numpy())):
        check_assignment(Si, zi, c, S.dtype, f"gumbel_matching instance {i}")
    # conditionals
    lq = gm.conditional_log_probs.detach()
    assert_finite(lq, "conditional_log_probs", allow_neg_inf=torch.ones_like(lq, dtype=torch.bool))
    assert bool(torch.isneginf(lq[forbidden]).all()), "conditional_log_probs not -inf at a forbidden pair"
    if lq.numel():
        lse = logsumexp_rows(lq)
        tol = 4 * (k + 1) * eps(lq.dtype)
        worst = float((lse.abs()).max())
        assert worst <= tol, f"conditionals not normalised: max |logsumexp| = {worst:.3g} > {tol:.3g}"
        at = gm.log_prob_of_sample()
        assert same_bits(at, lq.gather(-1, gm.expert.unsqueeze(-1)).squeeze(-1)), "log_prob_of_sample != gather"
        bad = ~torch.isfinite(at)
        assert not bool(bad.any()), (
            f"sampled expert has conditional probability 0 (log q = {at[bad][:4].tolist()}) at tokens "
            f"{bad.nonzero()[:4].tolist()}"
        )


@fuzz(60)
@given(
    case=score_cases(max_n=6, max_k=5, dtypes=(torch.float32, torch.float64), batch_shapes=((),), invalid=False,
                     masks=("none", "sparse", "last_row", "column", "block")),
    cap_choice=st.sampled_from(("none", "min", "mid", "n", "over")),
    pick=picks,
    tau=taus,
    seed=seeds,
)
def test_gumbel_conditionals_match_brute_force(
    case: ScoreCase, cap_choice: str, pick: int, tau: float, seed: int
) -> None:
    """conditional_log_probs == log_softmax_j(a_ij / tau + OPT_-i(j)) with OPT_-i(j) the best value of the
    other tokens when token i takes a slot of expert j (n * k scipy solves on the returned scores).
    tau == 0: positive mass only on the near-maximisers. Tolerances: rounding of the returned
    scores (eps * max|s|) plus n(k+1)*8*eps*spread, turned into a probability bound."""
    x = case.x
    n, k = case.n, case.k
    capacity = capacity_for(n, k, cap_choice, pick)
    c = resolve(n, k, capacity)
    if c is None or not feasible(np64(x), c):
        return
    if bool(torch.isnan(x).any() or torch.isposinf(x).any()):
        return  # invalid input: the error contract is tested by test_gumbel_matching
    valid = None if _overflows(x, tau) else True
    ok, gm = _gumbel_call(x, tau, capacity, None, seed, valid)
    if not ok:
        return
    S = np64(gm.scores)
    allowed = ~np.isneginf(np64(x))
    assert np.isfinite(S[allowed]).all(), (
        f"scores are not finite at allowed pairs (logits / tau overflowed?): {S.tolist()}"
    )
    # Where logits / tau + gumbels overflows, scores come in units of 2 ** log2_scale (shifted per
    # token): the noise is brought to the same units, and the values back to nats for the softmax.
    scale = int(gm.log2_scale)
    G = np.ldexp(np64(gm.gumbels), -scale)
    v = conditional_values(S, G, c)
    lq = np64(gm.conditional_log_probs)
    fin = S[np.isfinite(S)]
    delta = 2 * eps(x.dtype) * (float(np.abs(fin).max()) if fin.size else 0.0) + assignment_tolerance(S, x.dtype)
    if scale:
        top = v.max(-1, keepdims=True)
        v = np.ldexp(v - np.where(np.isfinite(top), top, 0.0), scale)
        delta = float(np.ldexp(delta, scale))
    if tau == 0.0:
        top = v.max(-1, keepdims=True)
        hits = v >= top - delta - 1e-300
        support = np.isfinite(lq)
        outside = support & ~hits
        assert not outside.any(), (
            f"tau=0: mass on experts that are not maximisers of a + OPT_-i: tokens/experts "
            f"{np.argwhere(outside)[:4].tolist()}, values {v.tolist()}, log q {lq.tolist()}"
        )
        return
    ref = log_softmax_np(v)
    p, p_ref = np.exp(lq), np.exp(ref)
    ptol = min(1.0, 4 * delta) + 8 * (k + 1) * eps(x.dtype)
    err = np.abs(p - p_ref)
    assert (err <= ptol).all(), (
        f"conditionals differ from brute force by {err.max():.3g} > {ptol:.3g} at "
        f"{np.unravel_index(err.argmax(), err.shape)}: q={p.round(6).tolist()} ref={p_ref.round(6).tolist()}"
    )
    # A log-probability below the dtype's range rounds to -inf: only that may differ from the oracle.
    beyond = ref < -float(torch.finfo(x.dtype).max)
    assert ((np.isneginf(lq) == np.isneginf(ref)) | (np.isneginf(lq) & beyond)).all(), (
        f"zero conditionals differ from brute force: log q {lq.tolist()} ref {ref.tolist()}"
    )


# ----------------------------------------------------------------------------- sinkhorn

COL_SUMS = ("none", "number", "tensor", "batched", "zeros")
BAD_ARGS = ("col_neg", "col_wrong_sum", "col_wrong_len", "col_nan", "tol_zero", "tol_negative", "tol_nan",
            "max_iter_zero", "max_iter_float")


def _col_sum(choice: str, n: int, k: int, batch: tuple[int, ...], dtype: torch.dtype, seed: int):
    g = fresh(seed)
    if choice == "none":
        return None
    if choice == "number":
        return n / k
    if choice in ("tensor", "batched", "zeros"):
        shape = (*batch, k) if choice == "batched" else (k,)
        w = torch.rand(shape, generator=g, dtype=torch.float64) + 0.05
        if choice == "zeros" and k > 1:
            w[..., 0] = 0.0
        return (w / w.sum(-1, keepdim=True) * n).to(torch.float64)
    if choice == "col_neg":
        t = torch.full((k,), n / k, dtype=torch.float64)
        t[0] = -1.0
        return t
    if choice == "col_wrong_sum":
        return torch.full((k,), n / k + 1.0, dtype=torch.float64)
    if choice == "col_wrong_len":
        return torch.full((k + 1,), n / (k + 1), dtype=torch.float64)
    return torch.full((k,), float("nan"), dtype=torch.float64)


def transport_feasible(allowed: np.ndarray, target: np.ndarray) -> bool:
    """Is there p >= 0 with support in ``allowed``, rows summing to 1 and columns to ``target``?"""
    n, k = allowed.shape
    idx = np.argwhere(allowed)
    if len(idx) == 0:
        return False
    A = np.zeros((n + k, len(idx)))
    A[idx[:, 0], np.arange(len(idx))] = 1.0
    A[n + idx[:, 1], np.arange(len(idx))] = 1.0
    b = np.concatenate([np.ones(n), target])
    res = linprog(np.zeros(len(idx)), A_eq=A, b_eq=b, bounds=(0, None), method="highs")
    return res.status == 0


@fuzz(100)
@given(
    case=score_cases(masks=("none", "none", "sparse", "column", "block", "row", "dense", "last_row")),
    col=st.sampled_from(COL_SUMS),
    tol=st.sampled_from((1e-6, 1e-3, 1e-12)),
    max_iter=st.sampled_from((1000, 1000, 50, 1)),
    bad=mostly(("none",), BAD_ARGS, weight=3 * len(BAD_ARGS)),
    seed=seeds,
    grad=st.booleans(),
)
def test_sinkhorn(case: ScoreCase, col: str, tol: float, max_iter, bad: str, seed: int, grad: bool) -> None:
    """Rows of exp(out) sum to 1, columns to the targets within the documented tolerance; -inf stays
    -inf; infeasible marginals (scipy linprog) and bad arguments raise ValueError; gradients finite."""
    x = case.x
    n, k, batch = case.n, case.k, case.batch
    if bad.startswith("col_"):
        col = bad
    tol = {"tol_zero": 0.0, "tol_negative": -1.0, "tol_nan": float("nan")}.get(bad, tol)
    max_iter = {"max_iter_zero": 0, "max_iter_float": 2.5}.get(bad, max_iter)
    target_arg = _col_sum(col, n, k, batch, x.dtype, seed)
    args_ok = bad == "none"
    if target_arg is None:
        target = np.full((k,), n / k)
    elif isinstance(target_arg, float):
        target = np.full((k,), target_arg)
    else:
        target = target_arg.numpy()
    valid: bool | None
    if case.has_nan_or_posinf() or not args_ok:
        valid = False
    else:
        S = _instances(x)
        T = np.broadcast_to(target, (*batch, k)).reshape(-1, k) if batch else target.reshape(1, k)
        T = np.broadcast_to(T, (S.shape[0], k))
        feas = [transport_feasible(np.isfinite(s), t) for s, t in zip(S, T)]
        if not all(feas):
            valid = False
        elif (case.dtype in (torch.float32, torch.float64) and not bool(torch.isneginf(x).any())
              and spread(np64(x)) <= 10.0 and max_iter == 1000):
            valid = True  # positive matrix, moderate ratios: must converge in the default budget
        else:
            valid = None  # feasible but possibly slow: may raise the documented non-convergence error
    inp = x.detach().clone().requires_grad_(grad and x.dtype in (torch.float32, torch.float64))
    before = clone_inputs(inp, target_arg)
    ok, out = call(A.sinkhorn, inp, col_sum=target_arg, tol=tol, max_iter=max_iter,
                   names=("log_p", "col_sum", "tol", "max_iter"), valid=valid, what="sinkhorn")
    assert_not_mutated(before, [inp, target_arg])
    if not ok:
        return
    assert out.shape == x.shape and out.dtype == x.dtype, f"output {tuple(out.shape)} {out.dtype}"
    o = f64(out)
    assert not bool(torch.isnan(o).any()) and not bool(torch.isposinf(o).any()), "output has NaN/+inf"
    assert bool(torch.isneginf(o[torch.isneginf(x)]).all()), "a -inf entry of log_p is not -inf in the output"
    if out.numel() == 0:
        return
    d = eps(x.dtype)
    rows = torch.logsumexp(o, -1)
    row_tol = 4 * (k + 1) * d
    assert float(rows.abs().max()) <= row_tol, f"rows do not sum to 1: max |log row sum| {float(rows.abs().max()):.3g}"
    t = torch.as_tensor(target, dtype=torch.float64)
    floor = 4 * d * n**0.5 * max(1.0, float(t.max()))
    col_tol = max(tol, floor) + 4 * n * d * max(1.0, float(t.max()))
    cols = o.exp().sum(-2)
    err = float((cols - t).abs().max())
    assert err <= col_tol, f"column sums off by {err:.3g} > {col_tol:.3g} (targets {t.tolist()})"
    if inp.requires_grad:
        w = torch.rand(x.shape, generator=fresh(seed), dtype=x.dtype)
        _, _ = call(lambda: (out.exp() * w).sum().backward(), names=(), valid=True, what="sinkhorn backward")
        assert inp.grad is not None
        assert_finite(inp.grad, "gradient of sinkhorn w.r.t. log_p")


# ----------------------------------------------------------------------------- sample_gumbel


@fuzz(30)
@given(
    shape=st.lists(st.integers(0, 5), min_size=0, max_size=4).map(tuple) | st.sampled_from([(4000,), (0,), (2, 0, 3)]),
    dtype=st.sampled_from(FLOAT_DTYPES),
    seed=seeds,
)
def test_sample_gumbel(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> None:
    """Shape and dtype as asked, finite, same seed -> same bits, mean near the Euler constant."""
    ok, g = call(A.sample_gumbel, shape, dtype=dtype, generator=fresh(seed), names=("shape", "dtype", "generator"),
                 valid=True, what="sample_gumbel")
    assert tuple(g.shape) == shape and g.dtype == dtype, f"got {tuple(g.shape)} {g.dtype}"
    assert_finite(g, "sample_gumbel output")
    _, g2 = call(A.sample_gumbel, shape, dtype=dtype, generator=fresh(seed), names=("shape",), valid=True)
    assert same_bits(g, g2), "same seed, different noise"
    if g.numel() >= 4000:
        m = float(f64(g).mean())
        assert abs(m - 0.5772156649) < 0.15, f"mean {m:.4f} is not that of a standard Gumbel (0.5772)"


# ----------------------------------------------------------------------------- the error contract

X = torch.randn(4, 2, generator=fresh(0))

BAD_CALLS = [
    ("balanced_assignment", lambda: A.balanced_assignment([[1.0, 2.0]]), ("scores",)),
    ("balanced_assignment", lambda: A.balanced_assignment(torch.randn(4)), ("scores",)),
    ("balanced_assignment", lambda: A.balanced_assignment(torch.ones(4, 2, dtype=torch.long)), ("scores",)),
    ("balanced_assignment", lambda: A.balanced_assignment(torch.ones(0, 2)), ("scores",)),
    ("balanced_assignment", lambda: A.balanced_assignment(torch.ones(4, 0)), ("scores",)),
    ("balanced_assignment", lambda: A.balanced_assignment(torch.complex(X, X)), ("scores",)),
    ("base_assignment", lambda: A.base_assignment(X, capacity=float("inf")), ("capacity",)),
    ("base_assignment", lambda: A.base_assignment(X, capacity="2"), ("capacity",)),
    ("gumbel_matching", lambda: A.gumbel_matching(X, tau=-1.0), ("tau",)),
    ("gumbel_matching", lambda: A.gumbel_matching(X, tau=float("nan")), ("tau",)),
    ("gumbel_matching", lambda: A.gumbel_matching(X, tau=float("inf")), ("tau",)),
    ("gumbel_matching", lambda: A.gumbel_matching(X, tau="hot"), ("tau",)),
    ("gumbel_matching", lambda: A.gumbel_matching(X, tau=None), ("tau",)),
    ("gumbel_matching", lambda: A.gumbel_matching(X, generator=3), ("generator",)),
    ("gumbel_matching", lambda: A.gumbel_matching(X, generator="seed"), ("generator",)),
    ("gumbel_matching", lambda: A.gumbel_matching(X, gumbels=torch.zeros(4, 3)), ("gumbels",)),
    ("gumbel_matching", lambda: A.gumbel_matching(X, gumbels=torch.full((4, 2), float("nan"))), ("gumbels",)),
    ("gumbel_matching", lambda: A.gumbel_matching(X, gumbels=[[0.0] * 2] * 4), ("gumbels",)),
    ("gumbel_matching", lambda: A.gumbel_matching(X, capacity=1), ("capacity",)),
    ("sinkhorn", lambda: A.sinkhorn(X, col_sum="2"), ("col_sum",)),
    ("sinkhorn", lambda: A.sinkhorn(X, tol=None), ("tol",)),
    ("sinkhorn", lambda: A.sinkhorn(X, max_iter=True), ("max_iter",)),
    ("sinkhorn", lambda: A.sinkhorn(torch.full((4, 2), float("-inf"))), ("log_p",)),
    ("sinkhorn", lambda: A.sinkhorn(X.numpy()), ("log_p",)),
    ("sample_gumbel", lambda: A.sample_gumbel((2, -1)), ("shape",)),
    ("sample_gumbel", lambda: A.sample_gumbel((2, 3), dtype=torch.long), ("dtype",)),
    ("sample_gumbel", lambda: A.sample_gumbel((2, 3), generator=7), ("generator",)),
    ("sample_gumbel", lambda: A.sample_gumbel("2x3"), ("shape",)),
]


@pytest.mark.parametrize("what, thunk, names", BAD_CALLS, ids=[f"{i}-{c[0]}" for i, c in enumerate(BAD_CALLS)])
def test_bad_arguments_raise_named_value_or_type_errors(what: str, thunk, names) -> None:
    call(thunk, names=names, valid=False, what=what)
