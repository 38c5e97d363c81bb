"""Fuzz tests of routelab.estimators: sample_routes (every method, with and without Sinkhorn),
switch_balance_loss, EMABaseline, reinforce_objective, gating_objective.

References are recomputed independently in float64 from the logits: ``gate = softmax(logits)[z]``,
``log_prob = log_softmax(logits)[z]``, ``weight = p / q * correction`` with the proposal
``q = softmax(logits / tau)`` for the methods whose weight is documented that way; every weight
is at least ``p`` (``q <= 1``, corrections >= 1). Tolerances are relative to the log-probabilities
(not to the magnitude of the logits), so a common offset or a small tau must not cost accuracy.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import routelab.estimators as E
from fuzz_strategies import (
    HALF_DTYPES,
    ScoreCase,
    assert_finite,
    assert_not_mutated,
    call,
    capacity_choices,
    capacity_for,
    clone_inputs,
    eps,
    f64,
    feasible,
    fresh,
    fuzz,
    guarded,
    mostly,
    np64,
    picks,
    resolve,
    same_bits,
    score_cases,
    seeds,
)
from routelab.estimators.sampling import BALANCED_TAU_FLOOR
from routes_view import per_token
from test_fuzz_rules import COVERED_ESTIMATOR_RULES

COVERED = {"EMABaseline", "gating_objective", "reinforce_objective", "sample_routes", "switch_balance_loss"}
COVERED |= COVERED_ESTIMATOR_RULES
NAMES = ("logits", "method", "tau", "capacity", "sinkhorn", "generator")
#: gumbel_matching_iw's documented warning (sample_routes' docstring): -inf logits and the capacity
#: leave router mass on pairs no balanced sample can use (stats["unreachable_mass"] > 0).
UNREACHABLE_WARNING = r"^gumbel_matching_iw: the -inf logits and the capacity force tokens off experts"


def test_public_api_is_covered() -> None:
    public = {n for n in E.__all__ if callable(getattr(E, n))}
    assert public <= COVERED, f"routelab.estimators has callables without a fuzz test: {sorted(public - COVERED)}"


TAUS = ("1", "0.3", "1e-3", "1e3", "1e-7", "1e-30", "tensor")
BAD_TAUS = ("0", "-1", "nan", "inf", "bad_shape")


def _tau(choice: str, batch: tuple[int, ...], seed: int):
    if choice == "tensor":
        return torch.rand(batch, generator=fresh(seed), dtype=torch.float64) * 2 + 0.05
    if choice == "bad_shape":
        return torch.ones((*batch, 2))
    return float(choice)


def _tau_valid(tau, batch: tuple[int, ...]) -> bool:
    if isinstance(tau, torch.Tensor):
        shape_ok = tau.ndim == 0 or tuple(tau.shape) == batch
        return shape_ok and bool(torch.isfinite(tau).all()) and bool((tau > 0).all())
    return math.isfinite(tau) and tau > 0


def _tau64(tau, batch: tuple[int, ...]) -> torch.Tensor:
    """``[..., 1, 1]`` float64 temperatures."""
    t = torch.as_tensor(tau, dtype=torch.float64)
    return t.reshape(*batch, 1, 1) if t.ndim else t.reshape(1, 1)




def _log_softmax64(x: torch.Tensor) -> torch.Tensor:
    top = x.amax(-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    sh = x - top
    return sh - torch.log(torch.exp(sh).sum(-1, keepdim=True))


@pytest.mark.parametrize("method", E.METHODS)
@fuzz(25)
@given(
    case=score_cases(masks=("none", "none", "sparse", "column", "last_row", "block", "row", "single")),
    tau_choice=mostly(TAUS, BAD_TAUS, weight=2),
    cap_choice=capacity_choices,
    pick=picks,
    sinkhorn=st.booleans(),
    seed=seeds,
)
def test_sample_routes(case: ScoreCase, method: str, tau_choice: str, cap_choice: str, pick: int, sinkhorn: bool,
                       seed: int) -> None:
    """Capacity, forbidden pairs, gate/log_prob/weight against float64 references, finite outputs and
    gradients, stats consistent, same seed -> same bits, input not mutated, bad input -> ValueError."""
    x = case.x
    n, k, batch = case.n, case.k, case.batch
    tau = _tau(tau_choice, batch, seed)
    capacity = capacity_for(n, k, cap_choice, pick)
    capped = method != "sample"
    if capped:
        c = resolve(n, k, capacity)
    else:
        c = n if capacity is None else resolve(n, k, capacity)
    S = np64(x).reshape(-1, n, k)
    valid: bool | None = True
    dead_row = bool((~torch.isfinite(x)).all(-1).any()) if x.numel() else False
    if case.has_nan_or_posinf() or c is None or not _tau_valid(tau, batch) or dead_row:
        valid = False
    elif method.startswith("gumbel") and not all(feasible(s, c) for s in S):
        valid = False
    elif case.dtype in HALF_DTYPES:
        valid = None
    elif sinkhorn and x.numel() and bool(torch.isneginf(x).all(-2).any()):
        valid = None  # an all -inf column cannot be balanced: the Sinkhorn step may refuse
    grad = x.dtype in (torch.float32, torch.float64) and valid is not False
    logits = x.detach().clone().requires_grad_(grad)
    before = clone_inputs(logits, tau)
    ok, r = call(E.sample_routes, logits, method, tau=tau, capacity=capacity, sinkhorn=sinkhorn, generator=fresh(seed),
                 names=NAMES, valid=valid, what=f"sample_routes({method!r}, sinkhorn={sinkhorn})",
                 documented_warning=UNREACHABLE_WARNING)
    assert_not_mutated(before, [logits, tau])
    if not ok:
        return
    check_routes(x, r, method, tau, c, sinkhorn)
    if grad and x.numel():
        loss = lambda: (r.gate.sum() + r.log_prob.sum() + r.aux["balance"].sum()).backward()  # noqa: E731
        guarded(loss, what="backward of gate + log_prob + balance")
        assert logits.grad is not None, "no gradient reaches the logits"
        assert_finite(logits.grad, "gradient w.r.t. logits")
    _, r2 = call(E.sample_routes, logits, method, tau=tau, capacity=capacity, sinkhorn=sinkhorn, generator=fresh(seed),
                 names=NAMES, valid=True, what="sample_routes (same seed)",
                 documented_warning=UNREACHABLE_WARNING)
    for f in ("expert", "keep", "weight", "gate", "log_prob"):
        assert same_bits(getattr(r, f), getattr(r2, f)), f"same seed, different {f}"


def check_routes(x: torch.Tensor, r, method: str, tau, c: int, sinkhorn: bool) -> None:
    n, k = x.shape[-2], x.shape[-1]
    batch = tuple(x.shape[:-2])
    assert r.num_slots == 1, "sample_routes must return one slot per token"
    for f in ("expert", "keep", "gate", "weight", "log_prob"):
        assert tuple(getattr(r, f).shape) == (*batch, n, 1), f"{f} has shape {tuple(getattr(r, f).shape)}"
    t = per_token(r)
    z, keep = t.expert, t.keep
    assert z.dtype == torch.long and keep.dtype == torch.bool
    if x.numel() == 0:
        return
    assert bool(((z >= 0) & (z < k)).all()), "expert out of range"
    forbidden = torch.isneginf(x).gather(-1, z.unsqueeze(-1)).squeeze(-1)
    assert not bool(forbidden.any()), f"tokens routed to a forbidden (-inf) expert: {forbidden.nonzero()[:4].tolist()}"
    counts = torch.zeros((*batch, k), dtype=torch.long).scatter_add_(-1, z, keep.long())
    if method != "sample":
        assert int(counts.max()) <= c, f"capacity {c} exceeded: kept tokens per expert {counts.reshape(-1, k).tolist()}"
    if method == "sample" or method.startswith("gumbel"):
        assert bool(keep.all()), f"{method} must keep every token"
    assert torch.equal(r.stats["tokens_per_expert"].long(), counts), (
        "stats['tokens_per_expert'] != kept tokens per expert"
    )
    dropped = (~keep).to(torch.float64).mean(-1)
    assert torch.allclose(f64(r.stats["dropped_fraction"]), dropped, atol=1e-6), "stats['dropped_fraction'] is wrong"
    for f in ("gate", "log_prob", "weight"):
        assert_finite(getattr(r, f), f)
    assert_finite(r.aux["balance"], "aux['balance']")
    # references in float64
    x64 = f64(x)
    lp_all = _log_softmax64(x64)
    lp = lp_all.gather(-1, z.unsqueeze(-1)).squeeze(-1)
    d = eps(x.dtype)
    tol_lp = 8 * (k + 1) * d * (1.0 + lp.abs() + math.log(k))
    err = (f64(t.log_prob) - lp).abs()
    assert bool((err <= tol_lp).all()), (
        f"log_prob != log softmax(logits)[expert]: worst error {float((err - tol_lp).max()):.3g} over the tolerance "
        f"(log_prob {f64(t.log_prob).flatten()[:4].tolist()}, reference {lp.flatten()[:4].tolist()})"
    )
    p = lp.exp()
    tiny = 1e3 * torch.finfo(r.gate.dtype).tiny
    gerr = (f64(t.gate) - p).abs()
    assert bool((gerr <= p * torch.expm1(tol_lp.clamp(max=50.0)) + tiny).all()), (
        f"gate != softmax(logits)[expert]: gate {f64(t.gate).flatten()[:4].tolist()}, "
        f"reference {p.flatten()[:4].tolist()}"
    )
    w = f64(t.weight)
    assert bool((w >= 0).all()), "negative importance weight"
    assert bool((w[~keep] == 0).all()), "a skipped token has a nonzero weight"
    max_w = float(getattr(E, "MAX_WEIGHT", 1e30))
    assert float(w.max()) <= max_w * (1 + 1e-6), f"weight {float(w.max()):.3g} above MAX_WEIGHT"
    # every weight is p / q * correction with q <= 1 and correction >= 1
    low = keep & (w < p * torch.exp(-tol_lp - 1e-6) - tiny)
    assert not bool(low.any()), (
        f"weight below p (q <= 1, corrections >= 1): weight {w[low][:4].tolist()} p {p[low][:4].tolist()}"
    )
    if sinkhorn or method in ("gumbel_matching_iw", "gumbel_matching_sh"):
        return  # q is a (partly converged) Sinkhorn marginal or a conditional: checked elsewhere
    T = _tau64(tau, batch)
    if method == "gumbel_matching":
        # sample_routes' documented floor: a balanced sample's temperature is at least
        # BALANCED_TAU_FLOOR times the largest row spread of finite logits of its instance
        # (make fuzz, seed 31337: logits of 1e10 with tau = 0.3 drew q at a temperature of 27).
        fin = torch.isfinite(x64)
        hi = torch.where(fin, x64, -math.inf).amax(-1) * BALANCED_TAU_FLOOR
        lo = torch.where(fin, x64, math.inf).amin(-1) * BALANCED_TAU_FLOOR
        floor = (hi - lo).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0).amax(-1)
        T = torch.maximum(T, floor.reshape(*batch, 1, 1) if batch else floor.reshape(1, 1))
    top = x64.amax(-1, keepdim=True)
    lq_all = _log_softmax64((x64 - top) / T)
    lq = lq_all.gather(-1, z.unsqueeze(-1)).squeeze(-1)
    log_w = lp - lq
    if method in ("sample_skip", "sample_skip_iw"):
        if method == "sample_skip_iw":
            load = torch.zeros((*batch, k), dtype=torch.float64).scatter_add_(
                -1, z, torch.ones_like(z, dtype=torch.float64)
            )
            nz = load.gather(-1, z)
            corr = nz / nz.clamp(max=c)
        else:
            corr = (n / keep.sum(-1, keepdim=True).clamp(min=1).to(torch.float64)).expand(z.shape)
        log_w = log_w + torch.log(corr)
    tol_lq = 8 * (k + 1) * d * (1.0 + lq.abs() + math.log(k))
    ref = torch.where(keep, log_w.exp(), torch.zeros_like(log_w))
    wtol = ref * torch.expm1((tol_lp + tol_lq + 1e-9).clamp(max=50.0)) + 1e3 * torch.finfo(r.weight.dtype).tiny
    check = keep & (log_w < math.log(max_w))
    bad = check & ((w - ref).abs() > wtol)
    assert not bool(bad.any()), (
        f"{method}: weight != p / q * correction (q = softmax(logits / tau)): weight {w[bad][:4].tolist()}, "
        f"reference {ref[bad][:4].tolist()} at {bad.nonzero()[:4].tolist()}"
    )
    clamped = keep & (log_w >= math.log(max_w) + 1e-6)
    assert bool((w[clamped] >= max_w * (1 - 1e-6)).all()), "a weight above MAX_WEIGHT was not clamped to it"


# ----------------------------------------------------------------------------- the training signals


@fuzz(40)
@given(
    case=score_cases(max_n=10, max_k=6, dtypes=(torch.float32, torch.float64), masks=("none", "sparse"), invalid=False,
                     scales=(1.0, 1e-3, 1e3, 1e-30, 1e10), batch_shapes=((), (2,), (0,), (1, 2))),
    method=st.sampled_from(E.METHODS),
    baseline_kind=st.sampled_from(("number", "per_run", "per_token", "per_run_keepdim", "bad")),
    use_weights=st.booleans(),
    decay=st.sampled_from((0.99, 0.0, 0.5, 1.0, -0.1, float("nan"))),
    seed=seeds,
)
def test_objectives_and_balance_loss(case: ScoreCase, method: str, baseline_kind: str, use_weights: bool, decay: float,
                                     seed: int) -> None:
    """reinforce_objective's value is the weighted mean loss and its gradient finite; gating_objective
    = mean(keep * weight * loss) (or keep * loss); switch_balance_loss = k * sum f * P; EMABaseline
    starts at the first value and averages; bad shapes/decays raise ValueError naming them."""
    x = case.x
    n, k, batch = case.n, case.k, case.batch
    cap = -(-n // k)
    if bool((~torch.isfinite(x)).all(-1).any()) if x.numel() else False:
        return
    if method.startswith("gumbel") and not all(feasible(s, cap) for s in np64(x).reshape(-1, n, k)):
        return
    logits = x.detach().clone().requires_grad_(True)
    ok, r = call(E.sample_routes, logits, method, capacity=cap, generator=fresh(seed), names=NAMES, valid=True,
                 documented_warning=UNREACHABLE_WARNING)
    g = fresh(seed + 1)
    loss = torch.rand((*batch, n), generator=g, dtype=x.dtype).requires_grad_(True)
    if baseline_kind == "number":
        b = 0.25
    elif baseline_kind == "per_run":
        b = torch.rand(batch, generator=g, dtype=x.dtype)
    elif baseline_kind == "per_token":
        b = torch.rand((*batch, n), generator=g, dtype=x.dtype)
    elif baseline_kind == "per_run_keepdim":
        b = torch.rand((*batch, 1), generator=g, dtype=x.dtype)
    else:
        b = torch.rand((*batch, n + 1, 2), generator=g, dtype=x.dtype)
    valid_b = baseline_kind != "bad"
    ok, val = call(E.reinforce_objective, r, loss, b, names=("baseline", "loss", "routes"), valid=valid_b,
                   what="reinforce_objective")
    t = per_token(r)
    w = f64(t.weight) * t.keep.to(torch.float64)
    if ok:
        assert tuple(val.shape) == batch, f"reinforce_objective has shape {tuple(val.shape)}, expected {batch}"
        ref = (w * f64(loss)).mean(-1)
        assert torch.allclose(f64(val), ref, rtol=1e-5, atol=1e-6 * float(w.abs().max() if w.numel() else 1) + 1e-30), (
            "reinforce_objective's value is not the weighted mean loss"
        )
        if val.numel():
            guarded(lambda: val.sum().backward(), what="reinforce backward")
            assert_finite(loss.grad, "reinforce gradient w.r.t. loss")
            if logits.grad is not None:
                assert_finite(logits.grad, "reinforce gradient w.r.t. logits")
    ok, gv = call(E.gating_objective, r, loss.detach(), use_weights=use_weights, names=("loss", "routes"), valid=True)
    coef = w if use_weights else t.keep.to(torch.float64)
    assert torch.allclose(
        f64(gv), (coef * f64(loss)).mean(-1), rtol=1e-5, atol=1e-30 + 1e-6 * float(coef.max() if coef.numel() else 1)
    ), "gating_objective != mean(keep * weight * loss)"
    call(E.gating_objective, r, loss.detach()[..., :-1] if n > 1 else loss.detach().unsqueeze(-1).expand(*batch, 1, 2),
         names=("loss",), valid=False, what="gating_objective(wrong loss shape)")
    # switch balance loss
    probs = torch.softmax(x.detach(), -1).requires_grad_(True)
    ok, bal = call(E.switch_balance_loss, probs, names=("probs",), valid=True)
    top = probs.detach().argmax(-1)  # f_j: share of tokens whose router argmax is j
    f = torch.zeros((*batch, k), dtype=torch.float64).scatter_add_(-1, top, torch.ones(top.shape, dtype=torch.float64))
    f = f / max(n, 1)
    ref = k * (f * f64(probs).mean(-2)).sum(-1)
    assert torch.allclose(f64(bal), ref, rtol=1e-5, atol=1e-6), "switch_balance_loss != k * sum_j f_j P_j"
    if bal.numel():
        guarded(lambda: bal.sum().backward(), what="balance backward")
        assert_finite(probs.grad, "switch_balance_loss gradient")
    # EMA baseline
    ok, ema = call(E.EMABaseline, decay, names=("decay",), valid=0.0 <= decay < 1.0, what="EMABaseline")
    if ok:
        v1, v2 = torch.tensor(2.0), torch.tensor(4.0)
        assert float(ema(v1)) == 0.0, "the first baseline must not depend on the first value (0: none seen yet)"
        assert float(ema(v2)) == 2.0, "the baseline used now is the average before seeing the value"
        assert math.isclose(float(ema(v1)), decay * 2.0 + (1 - decay) * 4.0, rel_tol=1e-6), "EMA update is wrong"


X = torch.randn(6, 3, generator=fresh(0))

BAD_CALLS = [
    ("sample_routes", lambda: E.sample_routes(X, "sampled"), ("method",)),
    ("sample_routes", lambda: E.sample_routes(X, "sample", generator=0), ("generator",)),
    ("sample_routes", lambda: E.sample_routes(X, "sample", tau=torch.ones(3)), ("tau",)),
    ("sample_routes", lambda: E.sample_routes(X, "sample", tau="warm"), ("tau",)),
    ("sample_routes", lambda: E.sample_routes(X.tolist(), "sample"), ("logits",)),
    ("sample_routes", lambda: E.sample_routes(X.long(), "sample"), ("logits",)),
    ("sample_routes", lambda: E.sample_routes(X, "sample_skip", capacity=1), ("capacity",)),
    ("sample_routes", lambda: E.sample_routes(X[:5], "gumbel_matching"), ("capacity",)),
    ("reinforce_objective", lambda: E.reinforce_objective(E.sample_routes(X, "sample"), torch.ones(5)), ("loss",)),
    ("gating_objective", lambda: E.gating_objective("routes", torch.ones(6)), ("routes",)),
    ("EMABaseline", lambda: E.EMABaseline(1.0), ("decay",)),
    ("EMABaseline", lambda: E.EMABaseline("0.9"), ("decay",)),
    ("switch_balance_loss", lambda: E.switch_balance_loss(torch.ones(6, 3) / 3, torch.full((6,), 3)), ("expert",)),
    ("switch_balance_loss", lambda: E.switch_balance_loss(torch.ones(6, 3).long()), ("probs",)),
]


@pytest.mark.parametrize("what, thunk, names", BAD_CALLS, ids=[f"{i}-{c[0]}" for i, c in enumerate(BAD_CALLS)])
def test_bad_arguments_raise_named_value_or_type_errors(what: str, thunk, names) -> None:
    call(thunk, names=names, valid=False, what=what)
