"""Regression tests for issue 12 in the estimators, gates, routing, routers and layers.

Each test names the defect it pins (D3, D4, D6, D7, D8, D11, D12, error quality, half precision)
and checks behaviour against an independent truth: the exact ``p / q`` of the router and the
proposal computed by hand in float64, torch's own ``log_softmax``/``softmax``, the paper's
formulas evaluated by explicit loops, or the same call in float32 (the documented dtype policy).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from routelab.assignment import sinkhorn
from routelab.estimators import (
    MAX_WEIGHT,
    METHODS,
    EMABaseline,
    reinforce_objective,
    sample_routes,
    switch_balance_loss,
)
from routelab.gates import DSelectK, GumbelSoftmaxGate, SoftmaxGate, smooth_step, threshold_mask
from routelab.gates.dselect import UNUSED_FLOOR
from routelab.layers import MixtureOfAttentiveExperts, MoE, StackedLinear
from routelab.layers.bcd import BCDTrainer
from routelab.layers.mae import set_routing
from routelab.routers import make_router
from routelab.routing import apply_capacity, check_capacity, check_capacity_factor, expert_capacity
from routes_view import per_token

SAMPLE_METHODS = tuple(m for m in METHODS if m.startswith("sample"))
NEG_INF = float("-inf")


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)




def chosen(t: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
    """``t[..., i, expert_i]``."""
    return t.gather(-1, expert.unsqueeze(-1)).squeeze(-1)


def exact_log_p_q(logits: torch.Tensor, tau: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Router and proposal log-probabilities by hand in float64: log softmax(l), log softmax(l / tau)."""
    lg = logits.detach().double()

    def log_softmax(v: torch.Tensor) -> torch.Tensor:
        m = v.amax(-1, keepdim=True)
        return v - m - (v - m).exp().sum(-1, keepdim=True).log()

    return log_softmax(lg), log_softmax(lg / tau)


# ------------------------------------------------------------------ D6: all -inf rows
@pytest.mark.parametrize("k", [2, 4, 12])
@pytest.mark.parametrize("use_sinkhorn", [False, True])
@pytest.mark.parametrize("method", METHODS)
def test_d6_all_neg_inf_row_raises_naming_logits_and_row(method, use_sinkhorn, k):
    g = gen()
    lg = torch.randn(4, k, generator=g)
    lg[2] = NEG_INF
    with pytest.raises(ValueError, match=r"logits has a row that is all -inf \(row 2\)"):
        sample_routes(lg, method, capacity=4, sinkhorn=use_sinkhorn, generator=g)


def test_d6_batched_row_and_repro():
    g = gen()
    lg = torch.randn(4, 4, generator=g)
    lg[0] = NEG_INF
    with pytest.raises(ValueError, match=r"row 0\)"):
        sample_routes(lg, "sample", generator=g)
    batched = torch.randn(3, 5, 4, generator=g)
    batched[1, 3] = NEG_INF
    with pytest.raises(ValueError, match=r"row 3 of batch entry \(1,\)"):
        sample_routes(batched, "sample_skip_iw", capacity=5, generator=g)
    with pytest.raises(ValueError, match=r"log_p has a row that is all -inf \(row 3 of batch entry \(1,\)\)"):
        sinkhorn(batched)


@pytest.mark.parametrize("method", SAMPLE_METHODS)
def test_d6_partial_neg_inf_rows_never_use_a_forbidden_expert(method):
    g = gen(1)
    lg = torch.randn(200, 6, 4, generator=g)
    lg[..., 0, :3] = NEG_INF  # token 0 may only use expert 3
    r = sample_routes(lg, method, capacity=6, generator=g)
    t = per_token(r)
    assert (t.expert[..., 0] == 3).all()
    assert torch.isfinite(r.gate).all() and torch.isfinite(r.weight).all()
    torch.testing.assert_close(t.gate[..., 0], torch.ones(200))


# ------------------------------------------------------------------ D7: weights overflow
def test_d7_repro_weights_are_finite_clamped_and_counted():
    lg = torch.randn(16, 16, generator=gen(1066463187))
    r = sample_routes(lg, "gumbel_matching", tau=1e-3, generator=gen(903))
    t = per_token(r)
    assert torch.isfinite(r.weight).all()
    log_p, log_q = exact_log_p_q(lg, 1e-3)
    log_w = chosen(log_p, t.expert) - chosen(log_q, t.expert)  # the exact p / q, in log space
    over = log_w > math.log(MAX_WEIGHT)
    assert over.any(), "the repro must exercise the clamp"
    assert int(r.stats["weights_clamped"]) == int(over.sum())
    assert (t.weight[over] == MAX_WEIGHT).all()
    torch.testing.assert_close(t.weight[~over].double(), log_w[~over].exp(), rtol=1e-5, atol=0)


@pytest.mark.parametrize("tau", [1e-3, 1e-12, 1e-30])
@pytest.mark.parametrize("method", METHODS)
def test_d7_no_inf_or_nan_weight_at_any_temperature(method, tau):
    g = gen(7)
    lg = torch.randn(8, 12, 4, generator=g) * 3
    r = sample_routes(lg, method, tau=tau, capacity=4, generator=g)
    for name in ("weight", "gate", "log_prob"):
        assert torch.isfinite(getattr(r, name)).all(), name
    assert (r.weight <= MAX_WEIGHT).all()
    assert r.stats["weights_clamped"].shape == (8,)
    log_p, log_q = exact_log_p_q(lg, tau)
    if method in ("sample", "gumbel_matching"):  # weight = p / q of the proposal itself
        t = per_token(r)
        log_w = chosen(log_p, t.expert) - chosen(log_q, t.expert)
        fine = log_w < math.log(MAX_WEIGHT) - 1
        torch.testing.assert_close(t.weight[fine].double(), log_w[fine].exp(), rtol=1e-4, atol=0)
        assert (t.weight[log_w > math.log(MAX_WEIGHT)] == MAX_WEIGHT).all()


def test_d7_routes_through_the_moe_carry_the_clamp_count():
    torch.manual_seed(0)
    moe = MoE(8, 8, 4, router="gumbel_matching", router_kwargs={"tau": 1e-3, "method": "gumbel_matching"},
              generator=gen(3), importance_weighting=True)
    y, routes = moe(torch.randn(16, 8) * 20)
    assert torch.isfinite(y).all() and torch.isfinite(routes.weight).all()
    assert routes.stats["weights_clamped"].dtype == torch.long


# ------------------------------------------------------------------ D8: precision at large |logits / tau|
def test_d8_repro_weight_is_p_over_q():
    r = sample_routes(torch.tensor([[1.0, 1.0, 0.0, 0.0]] * 4), "sample", tau=1e-7, generator=gen())
    p = math.e / (2 * math.e + 2)  # softmax([1, 1, 0, 0]) of either tied maximum
    q = 0.5  # tau -> 0 splits the proposal between the two maxima
    t = per_token(r)
    assert (r.expert < 2).all()
    torch.testing.assert_close(t.weight, torch.full((4,), p / q), rtol=1e-6, atol=0)
    torch.testing.assert_close(t.gate, torch.full((4,), p), rtol=1e-6, atol=0)


@pytest.mark.parametrize("k", [2, 4, 12])
@pytest.mark.parametrize("offset", [0.0, 1e4, 1e6])
@pytest.mark.parametrize("tau", [1.0, 1e-3, 1e-7])
def test_d8_gate_log_prob_and_weight_exact_under_offset_and_small_tau(k, offset, tau):
    g = gen(11)
    lg = torch.randn(6, 10, k, generator=g) * 2 + offset
    t = per_token(sample_routes(lg, "sample", tau=tau, generator=g))
    log_p, log_q = exact_log_p_q(lg, tau)
    torch.testing.assert_close(t.log_prob.double(), chosen(torch.log_softmax(lg.double(), -1), t.expert),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(t.gate.double(), chosen(log_p, t.expert).exp(), rtol=1e-5, atol=1e-7)
    want = (chosen(log_p, t.expert) - chosen(log_q, t.expert)).exp()
    torch.testing.assert_close(t.weight.double(), want, rtol=1e-4, atol=1e-7)


# ------------------------------------------------------------------ D3: empty leading batch
@pytest.mark.parametrize("k", [2, 3, 12])
def test_d3_sinkhorn_empty_batch(k):
    out = sinkhorn(torch.randn(0, 4, k))
    assert out.shape == (0, 4, k) and out.dtype == torch.float32
    assert sinkhorn(torch.randn(2, 0, 6, k)).shape == (2, 0, 6, k)


@pytest.mark.parametrize("k", [2, 4, 12])
@pytest.mark.parametrize("use_sinkhorn", [False, True])
@pytest.mark.parametrize("method", METHODS)
def test_d3_sample_routes_empty_batch(method, use_sinkhorn, k):
    lg = torch.randn(0, 12, k, requires_grad=True)
    r = sample_routes(lg, method, capacity=12, sinkhorn=use_sinkhorn, generator=gen())
    assert r.num_slots == 1
    for name in ("expert", "gate", "keep", "weight", "log_prob"):
        assert getattr(r, name).shape == (0, 12, 1), name
    assert r.expert.dtype == torch.long and r.keep.dtype == torch.bool
    assert r.aux["balance"].shape == (0,)
    assert r.stats["tokens_per_expert"].shape == (0, k)
    assert r.stats["dropped_fraction"].shape == (0,) and r.stats["weights_clamped"].shape == (0,)
    (r.gate.sum() + r.aux["balance"].sum()).backward()
    assert lg.grad.shape == lg.shape


# ------------------------------------------------------------------ D4: capacity = inf and friends
BAD_CAPACITIES = [float("inf"), float("nan"), -1, True, 2.5, "4"]


@pytest.mark.parametrize("capacity", BAD_CAPACITIES)
def test_d4_bad_capacity_is_a_value_error_everywhere(capacity):
    with pytest.raises(ValueError, match="capacity"):
        check_capacity(capacity)
    expert = torch.tensor([[0], [1], [0]])
    with pytest.raises(ValueError, match="capacity"):
        apply_capacity(expert, torch.ones_like(expert, dtype=torch.bool), capacity, 2)
    for name in ("topk", "base", "gumbel_matching", "sinkhorn"):
        router = make_router(name, 4, 2)
        with pytest.raises(ValueError, match="capacity"):
            router(torch.randn(6, 4), capacity)
    with pytest.raises(ValueError, match="capacity"):
        sample_routes(torch.randn(8, 4), "sample_skip", capacity=capacity, generator=gen())


def test_d4_valid_capacities_still_work():
    assert check_capacity(None) is None and check_capacity(0) == 0 and check_capacity(3.0) == 3
    expert = torch.tensor([[0], [1], [0], [0]])
    d = apply_capacity(expert, torch.ones_like(expert, dtype=torch.bool), 2.0, 2)
    assert d.keep.squeeze(-1).tolist() == [True, True, True, False]  # position policy: first two of expert 0


@pytest.mark.parametrize("factor", [float("inf"), float("nan"), -1.0, 0.0, True])
def test_d4_bad_capacity_factor_is_a_value_error(factor):
    with pytest.raises(ValueError, match="capacity_factor"):
        check_capacity_factor(factor)
    with pytest.raises(ValueError, match="capacity_factor"):
        MoE(8, 8, 4, capacity_factor=factor)


def test_d4_huge_capacity_factor_means_every_token_fits():
    assert expert_capacity(16, 4, 1, 1e308) == 16  # 1e308 * 16 / 4 overflows to inf: no OverflowError
    y, routes = MoE(8, 8, 4, capacity_factor=1e308)(torch.randn(16, 8))
    assert int(routes.stats["capacity"]) == 16 and float(routes.stats["dropped_fraction"]) == 0.0


# ------------------------------------------------------------------ D11: smooth_step gradients
def ref_smooth_step(t: float, gamma: float) -> tuple[float, float]:
    """S(t) and S'(t) of Hazimeh et al. Sec. 3.1.3, in float64."""
    if t <= -gamma / 2:
        return 0.0, 0.0
    if t >= gamma / 2:
        return 1.0, 0.0
    return -2.0 / gamma**3 * t**3 + 3.0 / (2.0 * gamma) * t + 0.5, -6.0 / gamma**3 * t**2 + 3.0 / (2.0 * gamma)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("gamma", [1.0, 0.01, 50.0])
def test_d11_smooth_step_value_and_gradient_exact_and_finite(dtype, gamma):
    big = torch.finfo(dtype).max
    ts = [300.0, -300.0, 3e4, -3e4, big, -big, 2e19 if dtype != torch.float16 else 6e4, 0.0,
          0.1 * gamma, -0.37 * gamma, 0.5 * gamma, -0.5 * gamma, 0.49 * gamma]
    t = torch.tensor(ts, dtype=dtype, requires_grad=True)
    s = smooth_step(t, gamma)
    s.sum().backward()
    assert s.dtype == dtype and t.grad.dtype == dtype
    assert torch.isfinite(s).all() and torch.isfinite(t.grad).all()
    want = [ref_smooth_step(float(v), gamma) for v in t.detach().double()]
    tol = {torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float32: 1e-6, torch.float64: 1e-12}[dtype]
    torch.testing.assert_close(s.detach().double(), torch.tensor([w[0] for w in want], dtype=torch.float64),
                               rtol=tol, atol=tol)
    # The derivative, except where the value rounds to exactly 0 or 1 in this dtype (bfloat16 at
    # 0.49 gamma): binary values have a zero gradient, as documented.
    binary = [v in (0.0, 1.0) for v in s.detach().double().tolist()]
    grad_want = [0.0 if b else w[1] for w, b in zip(want, binary, strict=True)]
    torch.testing.assert_close(t.grad.double(), torch.tensor(grad_want, dtype=torch.float64),
                               rtol=tol, atol=tol * 3 / gamma)
    outside = t.detach().double().abs() >= gamma / 2
    assert (t.grad[outside] == 0).all()  # exactly zero outside the band, as documented
    assert set(s.detach()[outside].tolist()) <= {0.0, 1.0}


def test_d11_repro_and_nan_propagates():
    t = torch.tensor([300.0, -300.0], dtype=torch.float16, requires_grad=True)
    smooth_step(t).sum().backward()
    assert t.grad.tolist() == [0.0, 0.0]
    assert torch.isnan(smooth_step(torch.tensor([float("nan")]))).all()
    with pytest.raises(ValueError, match="gamma"):
        smooth_step(torch.zeros(2), gamma=1e-300)
    with pytest.raises(ValueError, match="floating"):
        smooth_step(torch.zeros(2, dtype=torch.long))


# ------------------------------------------------------------------ D12: DSelect-k unused-code penalty
def paper_unused_penalty(z: list[list[float]], n: int, gamma: float, coef: float) -> float:
    """App. B.2: coef * sum_i 1 / sum_{e < n} r(S(z_i))_e, by explicit loops in float64."""
    m = len(z[0])
    total = 0.0
    for zi in z:
        real = 0.0
        for e in range(n):
            prod = 1.0
            for j in range(m):
                s = ref_smooth_step(zi[j], gamma)[0]
                prod *= s if (e >> j) & 1 else 1.0 - s
            real += prod
        total += 1.0 / real
    return coef * total


def test_d12_repro_is_finite_with_finite_gradient():
    gate = DSelectK(3, 1)
    gate.z.data.fill_(1.0)  # S(z) = 1 on both bits: code 3, which has no expert
    w = gate(4)
    pen = gate.regularization()
    assert float(pen.detach()) == pytest.approx(1.0 / UNUSED_FLOOR)  # the floored 1 / 0, not inf
    (w.sum() + pen).backward()
    assert torch.isfinite(gate.z.grad).all() and torch.isfinite(gate.alpha.grad).all()


@pytest.mark.parametrize("seed", range(8))
def test_d12_per_example_large_inputs_finite(seed):
    g = gen(seed)
    gate = DSelectK(5, 2, per_example=True, input_dim=1, generator=g, entropy_reg=0.1)
    x = 50 * torch.randn(64, 1, generator=g)
    w = gate(x)
    pen = gate.regularization()
    (w.sum() + pen).backward()
    assert torch.isfinite(w).all() and torch.isfinite(pen)
    for p in gate.parameters():
        assert torch.isfinite(p.grad).all()


@pytest.mark.parametrize("n,k", [(3, 1), (5, 2), (7, 3), (13, 4)])
def test_d12_penalty_equals_the_paper_on_ordinary_inputs(n, k):
    g = gen(n * 10 + k)
    gate = DSelectK(n, k, unused_penalty=0.7, generator=g).double()
    with torch.no_grad():
        gate.z.copy_(torch.rand(gate.z.shape, generator=g, dtype=torch.float64) * 0.8 - 0.4)
    gate(3)
    want = paper_unused_penalty(gate.z.detach().tolist(), n, 1.0, 0.7)
    assert float(gate.aux["unused_codes"].detach()) == pytest.approx(want, rel=1e-12)
    # and so is its gradient: the plain formula through autograd, without the floor
    gate.aux["unused_codes"].backward()
    z = gate.z.detach().clone().requires_grad_(True)
    from routelab.gates import selector_outputs

    plain = 0.7 * (1.0 / selector_outputs(z, 1.0)[..., :n].sum(-1)).sum()
    plain.backward()
    torch.testing.assert_close(gate.z.grad, z.grad, rtol=1e-10, atol=0)


def test_d12_penalty_below_the_floor_still_pushes_towards_real_experts():
    gate = DSelectK(3, 1).double()
    with torch.no_grad():
        gate.z.copy_(torch.tensor([[0.4999999, 0.4999]], dtype=torch.float64))  # almost all mass on code 3
    gate(1)
    gate.regularization().backward()
    assert torch.isfinite(gate.z.grad).all()
    assert (gate.z.grad > 0).all(), "decreasing z moves mass back to the real experts"


# ------------------------------------------------------------------ error quality
BAD_GENERATORS = [0, 3, "seed", 1.5]


@pytest.mark.parametrize("bad", BAD_GENERATORS)
def test_wrong_type_generator_is_a_routelab_type_error(bad):
    def raises(fn):
        with pytest.raises(TypeError, match=r"generator must be a torch.Generator or None, got"):
            fn()

    raises(lambda: sample_routes(torch.randn(4, 4), "sample", generator=bad))
    expert = torch.tensor([[0], [1]])
    raises(lambda: apply_capacity(expert, torch.ones_like(expert, dtype=torch.bool), 1, 2, policy="random",
                                  generator=bad))
    raises(lambda: MoE(8, 8, 4, generator=bad))
    raises(lambda: DSelectK(4, 2, generator=bad))
    raises(lambda: SoftmaxGate(4, generator=bad))
    raises(lambda: GumbelSoftmaxGate(4, generator=bad))
    raises(lambda: StackedLinear(2, 3, 4, generator=bad))
    router = make_router("noisy_topk", 8, 4)
    raises(lambda: setattr(router, "generator", bad))
    mae = MixtureOfAttentiveExperts(8, 2)
    raises(lambda: setattr(mae, "generator", bad))
    raises(lambda: set_routing(mae, "sample", bad))
    raises(lambda: BCDTrainer(mae, lambda m, b: torch.zeros(()), generator=bad))


def test_seed_hint_in_generator_message():
    with pytest.raises(TypeError, match=r"torch.Generator\(\).manual_seed"):
        sample_routes(torch.randn(4, 4), "sample", generator=3)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
def test_moe_accepts_other_float_dtypes_and_returns_them(dtype):
    torch.manual_seed(0)
    moe = MoE(8, 16, 4, router="topk", k=2)
    x = torch.randn(3, 5, 8).to(dtype)
    y, routes = moe(x)
    assert y.dtype == dtype and y.shape == x.shape
    # the documented policy: router and experts compute in float32 on x's values
    ref, ref_routes = moe(x.float())
    assert torch.equal(routes.expert, ref_routes.expert)
    assert torch.equal(y, ref.to(dtype))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
def test_mae_accepts_other_float_dtypes_and_returns_them(dtype):
    torch.manual_seed(0)
    mae = MixtureOfAttentiveExperts(8, 2, batch_first=True)
    q = torch.randn(2, 5, 8).to(dtype)
    kv = torch.randn(2, 4, 8).to(dtype)
    out, resp = mae(q, kv, kv)
    assert out.dtype == dtype and resp.dtype == dtype
    ref, ref_resp = mae(q.float(), kv.float(), kv.float())
    assert torch.equal(out, ref.to(dtype)) and torch.equal(resp, ref_resp.to(dtype))
    # self-attention is still detected after the cast (the gate's mean skips padded positions)
    pad = torch.tensor([[False, False, False, True, True], [False] * 5])
    out, _ = mae(q, q, q, key_padding_mask=pad)
    ref, _ = mae(q.float(), q.float(), q.float(), key_padding_mask=pad)
    assert torch.equal(out, ref.to(dtype))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
def test_dselect_accepts_other_float_dtypes_and_returns_them(dtype):
    gate = DSelectK(5, 2, per_example=True, input_dim=3, generator=gen(2))
    x = torch.randn(4, 3).to(dtype)
    w = gate(x)
    assert w.dtype == dtype
    assert torch.equal(w, gate(x.float()).to(dtype))
    static = DSelectK(5, 2, generator=gen(2))
    assert static(x).dtype == dtype and static(4).dtype == torch.float32


def test_integer_inputs_are_value_errors():
    with pytest.raises(ValueError, match="x must be a floating tensor"):
        MoE(8, 8, 4)(torch.zeros(3, 8, dtype=torch.long))
    with pytest.raises(ValueError, match="query must be a floating tensor"):
        q = torch.zeros(2, 3, 8, dtype=torch.long)
        MixtureOfAttentiveExperts(8, 2)(q, q, q)
    with pytest.raises(ValueError, match="x must be a floating tensor"):
        DSelectK(5, 2, per_example=True, input_dim=3)(torch.zeros(4, 3, dtype=torch.long))


def test_nan_inputs_are_value_errors():
    x = torch.randn(4, 3)
    x[1, 2] = float("nan")
    with pytest.raises(ValueError, match="not finite"):
        DSelectK(5, 2, per_example=True, input_dim=3)(x)
    with pytest.raises(ValueError, match="not finite"):
        SoftmaxGate(5, per_example=True, input_dim=3)(x)
    mae = MixtureOfAttentiveExperts(8, 2)
    q = torch.randn(5, 2, 8)
    bad = q.clone()
    bad[3, 1, 0] = float("inf")
    for args in ((bad, bad, bad), (q, bad, bad), (q, q, bad)):
        with pytest.raises(ValueError, match="query/key/value are not finite"):
            mae(*args)
    with pytest.raises(ValueError, match="not finite"):
        MoE(8, 8, 4)(torch.full((3, 8), float("nan")))


def test_estimator_helpers_name_bad_arguments():
    r = sample_routes(torch.randn(6, 3), "sample", generator=gen())
    loss = torch.rand(6)
    with pytest.raises(ValueError, match="baseline"):
        reinforce_objective(r, loss, torch.rand(7, 2))  # would broadcast to [7, 2] silently
    torch.testing.assert_close(reinforce_objective(r, loss, torch.rand(6)), (per_token(r).weight * loss).mean(-1))
    with pytest.raises(TypeError, match="routes"):
        reinforce_objective("routes", loss)
    with pytest.raises(ValueError, match="decay"):
        EMABaseline("0.9")
    with pytest.raises(TypeError, match="expert"):
        switch_balance_loss(torch.ones(6, 3) / 3, torch.full((6,), 3))
    with pytest.raises(TypeError, match="tau"):
        sample_routes(torch.randn(6, 3), "sample", tau="warm")
    with pytest.raises(ValueError, match="col_sum"):
        sinkhorn(torch.randn(6, 3), col_sum="2")


def test_threshold_mask_rejects_nan_thresholds():
    scores = torch.rand(5, 3, generator=gen())
    thresholds = torch.tensor([0.2, 0.5, 0.7])
    assert torch.equal(threshold_mask(scores, thresholds), scores > thresholds.unsqueeze(0))
    with pytest.raises(ValueError, match="thresholds contain NaN"):
        threshold_mask(scores, torch.tensor([0.2, float("nan"), 0.7]))
    with pytest.raises(ValueError, match="scores contain NaN"):
        threshold_mask(torch.full((2, 3), float("nan")), thresholds)


def test_no_internal_warnings_leak():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for k in (2, 3, 12):
            x = torch.randn(8, k, requires_grad=True)
            sinkhorn(x).sum().backward()  # no "converting a tensor with requires_grad=True to a scalar"
            sinkhorn(x, col_sum=torch.full((k,), 8 / k, requires_grad=True))
            for method in METHODS:
                sample_routes(x, method, capacity=8, sinkhorn=True, generator=gen())
                sample_routes(torch.randn(0, 8, k), method, capacity=8, sinkhorn=True)  # no std() of empty
        for router in ("topk", "base", "sinkhorn", "gumbel_matching", "softmax", "noisy_topk"):
            moe = MoE(8, 8, 4, router=router, generator=gen())
            moe(torch.randn(0, 8))
            moe(torch.randn(1, 8))


# ------------------------------------------------------------------ half precision
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("k", [2, 3, 12])
def test_half_precision_sinkhorn_in_float32_returned_in_dtype(dtype, k):
    n = 24
    log_p = torch.randn(3, n, k, generator=gen(k)).to(dtype)
    out = sinkhorn(log_p)
    assert out.dtype == dtype and torch.isfinite(out).all()
    q = out.double().exp()
    eps = torch.finfo(dtype).eps
    floor = 4 * eps * math.sqrt(n) * max(1.0, n / k)  # the documented tolerance floor
    torch.testing.assert_close(q.sum(-1), torch.ones(3, n, dtype=torch.float64), rtol=0, atol=k * eps)
    torch.testing.assert_close(q.sum(-2), torch.full((3, k), n / k, dtype=torch.float64), rtol=0,
                               atol=floor + n * eps)
    # the same balancing as float32 input, up to the output's rounding
    ref = sinkhorn(log_p.float())
    torch.testing.assert_close(out.float(), ref, rtol=2 * eps, atol=floor)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("k", [2, 4, 12])
@pytest.mark.parametrize("method", METHODS)
def test_half_precision_sample_routes_equals_float32(method, k, dtype):
    lg = (torch.randn(3, 12, k, generator=gen(5)) * 2).to(dtype)
    r = sample_routes(lg, method, capacity=12 // k + 1, tau=0.7, generator=gen(6))
    ref = sample_routes(lg.float(), method, capacity=12 // k + 1, tau=0.7, generator=gen(6))
    assert r.gate.dtype == dtype and r.log_prob.dtype == dtype and r.weight.dtype == torch.float32
    assert torch.equal(r.expert, ref.expert) and torch.equal(r.keep, ref.keep)
    assert torch.equal(r.weight, ref.weight)
    assert torch.equal(r.gate, ref.gate.to(dtype)) and torch.equal(r.log_prob, ref.log_prob.to(dtype))
    assert torch.isfinite(r.weight).all() and torch.isfinite(r.gate).all()
    if method == "sample":  # and the weight is p / q of the half-precision logits' values
        log_p, log_q = exact_log_p_q(lg, 0.7)
        t = per_token(r)
        want = (chosen(log_p, t.expert) - chosen(log_q, t.expert)).exp()
        torch.testing.assert_close(t.weight.double(), want, rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------------ fuzz findings: routing, gates, layers
# (tests/fuzz found these; each test pins the behaviour against an independent truth)
from routelab.gates import keep_top_k, selector_outputs  # noqa: E402
from routelab.layers import MultiGateMoE, StackedExperts  # noqa: E402
from routelab.routing import DispatchPlan  # noqa: E402


def _removed_column_problem(lp, col_sum, j):
    """``lp`` and ``col_sum`` without column ``j`` (the problem a zero target should reduce to)."""
    keep = [c for c in range(lp.shape[-1]) if c != j]
    return lp[..., keep], col_sum[..., keep], keep


@pytest.mark.parametrize("n, k", [(4, 2), (5, 3), (6, 10)])
def test_fuzz_sinkhorn_gradient_matches_finite_differences(n, k):
    """Without zero targets the gradient is autograd's through the iteration: it must agree with
    central finite differences of the converged map (gradcheck, float64; k = 2 is the Newton path)."""
    g = gen(n * k)
    lp = torch.randn(2, n, k, generator=g, dtype=torch.float64, requires_grad=True)
    cs = torch.rand(k, generator=g, dtype=torch.float64) + 0.5
    cs = cs / cs.sum() * n
    assert torch.autograd.gradcheck(lambda a: sinkhorn(a, col_sum=cs, tol=1e-13, max_iter=10_000), (lp,),
                                    atol=1e-7, rtol=1e-6)


def test_fuzz_sinkhorn_zero_target_column_repro_has_finite_gradient():
    lp = torch.tensor([[1.541, -.2934, -2.1788], [.5684, -1.0845, -1.3986]], requires_grad=True)
    out = sinkhorn(lp, col_sum=torch.tensor([0., 1.2, .8], dtype=torch.float64))
    assert torch.isneginf(out[:, 0]).all() and torch.isfinite(out[:, 1:]).all()
    out.exp().sum().backward()
    assert torch.isfinite(lp.grad).all() and (lp.grad[:, 0] == 0).all()


@pytest.mark.parametrize("n, k, zero", [(2, 3, 0), (5, 4, 2), (6, 10, 3), (6, 11, 10)])
def test_fuzz_sinkhorn_zero_target_column_equals_the_problem_without_it(n, k, zero):
    """A zero target: that column is -inf with gradient 0, and the rest (values and gradient of any
    loss) equal the balancing of the problem with the column removed (float64, tight tol)."""
    g = gen(100 + k)
    lp = torch.randn(n, k, generator=g, dtype=torch.float64)
    cs = torch.rand(k, generator=g, dtype=torch.float64) + 0.5
    cs[zero] = 0.0
    cs = cs / cs.sum() * n
    w = torch.randn(n, k, generator=g, dtype=torch.float64)  # a loss that is not constant
    leaf = lp.clone().requires_grad_(True)
    out = sinkhorn(leaf, col_sum=cs, tol=1e-13, max_iter=10_000)
    (out.exp() * w).sum().backward()
    sub_lp, sub_cs, keep = _removed_column_problem(lp, cs, zero)
    sub_leaf = sub_lp.clone().requires_grad_(True)
    ref = sinkhorn(sub_leaf, col_sum=sub_cs, tol=1e-13, max_iter=10_000)
    (ref.exp() * w[:, keep]).sum().backward()
    assert torch.isneginf(out[:, zero]).all()
    torch.testing.assert_close(out[:, keep], ref, rtol=1e-9, atol=1e-10)
    assert torch.isfinite(leaf.grad).all() and (leaf.grad[:, zero] == 0).all()
    torch.testing.assert_close(leaf.grad[:, keep], sub_leaf.grad, rtol=1e-6, atol=1e-9)
    # a col_sum that itself requires grad gets a finite gradient too (0 on the zero column)
    cs_leaf = cs.clone().requires_grad_(True)
    (sinkhorn(lp, col_sum=cs_leaf, tol=1e-13, max_iter=10_000).exp() * w).sum().backward()
    assert torch.isfinite(cs_leaf.grad).all() and cs_leaf.grad[zero] == 0


def test_fuzz_sinkhorn_row_only_on_zero_target_columns_is_a_value_error():
    lp = torch.tensor([[0.0, float("-inf"), float("-inf")], [0.0, 1.0, 2.0], [1.0, 0.0, 0.0]])
    with pytest.raises(ValueError, match=r"log_p row 0 has finite entries only in columns whose col_sum is 0"):
        sinkhorn(lp, col_sum=torch.tensor([0.0, 1.5, 1.5]))


@pytest.mark.parametrize("per_example", [False, True])
def test_fuzz_dselect_one_expert_no_warning_and_weight_one(per_example):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gate = DSelectK(1, 1, per_example=per_example, input_dim=1 if per_example else None,
                        entropy_reg=0.1, generator=gen())
        x = torch.randn(3, 1, generator=gen(1), requires_grad=True)
        w = gate(x)
        loss = w.sum() + gate.regularization()
        loss.backward()
    assert w.shape == (3, 1) and torch.equal(w, torch.ones(3, 1))  # m = 0 code bits: all weight on expert 0
    assert torch.isfinite(gate.regularization())
    for p in gate.parameters():
        assert p.grad is None or torch.isfinite(p.grad).all()
    if per_example:
        assert isinstance(gate.W, torch.nn.Linear) and gate.W.weight.shape == (0, 1)
        assert set(gate.state_dict()) == {"G.weight", "G.bias", "W.weight", "W.bias", "_extra_state"}


def _top_k_reference(row: list[float], k: int) -> set[int]:
    """The k largest entries, ties to the lowest index: sort by (-value, index)."""
    return set(sorted(range(len(row)), key=lambda i: (-row[i], i))[:k])


def test_fuzz_keep_top_k_ties_go_to_the_lowest_index():
    out = keep_top_k(torch.ones(4), 1)
    assert torch.equal(out, torch.tensor([1.0, -math.inf, -math.inf, -math.inf]))
    x = torch.randint(0, 3, (64, 9), generator=gen()).float()
    for k in (1, 2, 5, 9):
        out = keep_top_k(x, k)
        for row, kept in zip(x.tolist(), (out == x).tolist()):
            assert {i for i, v in enumerate(kept) if v} == _top_k_reference(row, k)
        assert torch.isneginf(out[out != x]).all()


def test_fuzz_gate_functions_name_bad_arguments():
    with pytest.raises(TypeError, match=r"^z must be a torch.Tensor"):
        selector_outputs([0.0], 1.0)
    with pytest.raises(ValueError, match=r"^z must be a floating tensor"):
        selector_outputs(torch.zeros(2, dtype=torch.long))
    torch.testing.assert_close(selector_outputs(torch.zeros(0)), torch.ones(1))  # m = 0: one code, prob 1
    with pytest.raises(TypeError, match=r"^logits must be a torch.Tensor"):
        keep_top_k([1.0, 2.0], 1)
    with pytest.raises(ValueError, match=r"^logits must be a floating tensor"):
        keep_top_k(torch.tensor([1, 2]), 1)
    with pytest.raises(ValueError, match=r"^k must be a positive integer"):
        keep_top_k(torch.zeros(3), 1.5)
    with pytest.raises(ValueError, match=r"^seed must be an integer"):
        GumbelSoftmaxGate(3, seed="a")
    for bad in (True, 1.5, -1, 2**64):
        with pytest.raises(ValueError, match=r"^seed must be an integer"):
            GumbelSoftmaxGate(3, seed=bad)
    # integer-like seeds (numpy, 0-dim tensors) are the same seed
    import numpy as np

    a, b, c = (GumbelSoftmaxGate(4, seed=s, generator=gen()) for s in (5, np.int64(5), torch.tensor(5)))
    assert a(2).tolist() == b(2).tolist() == c(2).tolist()


def test_fuzz_stacked_experts_validates_buffers_and_follows_the_dtype_policy():
    ex = StackedExperts(1, 2, 1)
    for shape in ((2, 1, 1), (1, 1, 2), (1, 1)):
        with pytest.raises(ValueError, match=r"buffers must have shape \[num_experts=1, capacity, d_model=1\]"):
            ex(torch.randn(shape))
    with pytest.raises(ValueError, match="buffers must be a floating tensor"):
        ex(torch.ones(1, 1, 1, dtype=torch.long))
    torch.manual_seed(0)
    ex = StackedExperts(3, 5, 2)
    buf = torch.randn(2, 4, 3, dtype=torch.float64)
    y = ex(buf)
    assert y.dtype == torch.float64 and torch.equal(y, ex(buf.float()).double())  # float32 compute
    for e in range(2):
        torch.testing.assert_close(y[e].float(), ex.expert(e, buf[e].float()))


def test_fuzz_stacked_linear_and_multigate_follow_the_dtype_policy():
    sl = StackedLinear(1, 2, 1)
    x = torch.randn(1, 2, dtype=torch.float64)
    y = sl(x)
    assert y.dtype == torch.float64 and torch.equal(y, sl(x.float()).double())
    torch.testing.assert_close(y.float(), (x.float() @ sl.weight[0] + sl.bias[0]).unsqueeze(1))
    with pytest.raises(ValueError, match="x must be a floating tensor"):
        sl(torch.ones(1, 2, dtype=torch.long))
    torch.manual_seed(0)
    gates = [DSelectK(3, 2, per_example=True, input_dim=2, generator=gen()), SoftmaxGate(3, generator=gen(1))]
    model = MultiGateMoE(StackedLinear(3, 2, 4, activation=torch.relu, generator=gen(2)), gates,
                         [torch.nn.Linear(4, 1), torch.nn.Linear(4, 1)])
    for dtype in (torch.float64, torch.float16, torch.bfloat16):
        x = torch.randn(5, 2, generator=gen(3)).to(dtype)
        outs, ref = model(x), model(x.float())
        for o, r in zip(outs, ref):
            assert o.dtype == dtype and torch.equal(o, r.to(dtype))
    bad = torch.randn(5, 2)
    bad[0, 0] = float("inf")
    with pytest.raises(ValueError, match="x are not finite"):
        model(bad)


def test_fuzz_multigate_with_no_expert_weighed_returns_zeros():
    """Every gate weight exactly 0 (DSelect-k codes on unused codes): the mixture is 0, no crash."""
    gate = DSelectK(3, 1, generator=gen())
    with torch.no_grad():
        gate.z.fill_(1.0)  # code 3 of 4: no expert (n = 3)
    experts = [torch.nn.Linear(2, 4) for _ in range(3)]
    out = MultiGateMoE(experts, [gate])(torch.randn(5, 2))
    assert torch.equal(out[0], torch.zeros(5, 4))


def test_fuzz_expert_capacity_validates_every_argument():
    for args, name in [((4, 0, 1, 1.0), "num_experts"), ((0, 0, 1, None), "num_experts"),
                       ((-4, 2, 1, 1.0), "num_tokens"), ((4, 2, 0, 1.0), "slots"), ((4, 2, -1, 1.0), "slots"),
                       ((4.0, 2, 1, 1.0), "num_tokens"), ((True, 2, 1, 1.0), "num_tokens"),
                       ((4, 2, float("nan"), None), "slots")]:
        with pytest.raises(ValueError, match=rf"^{name} must be"):
            expert_capacity(*args)
    assert expert_capacity(0, 4, 2, 1.25) == 0 and expert_capacity(0, 4, 2, None) == 0  # an empty batch
    for n, E, s, cf in [(10, 4, 2, 1.0), (7, 3, 1, 1.25), (5, 8, 0.5, 2.0), (1, 64, 1, 1.0)]:
        assert expert_capacity(n, E, s, cf) == min(max(math.ceil(cf * n * s / E), 1), n)


E3 = torch.tensor([[0], [1], [2]])
K3 = torch.ones(3, 1, dtype=torch.bool)


@pytest.mark.parametrize("call, match", [
    (lambda: apply_capacity(E3, K3, 1, 2), r"^expert must hold expert indices in \[0, num_experts=2\)"),
    (lambda: apply_capacity(E3 - 1, K3, 1, 3), r"^expert must hold expert indices in \[0, num_experts=3\)"),
    (lambda: apply_capacity(E3.squeeze(-1), K3, 1, 3), r"^expert must have 2 dimensions"),
    (lambda: apply_capacity(E3.float(), K3, 1, 3), r"^expert must be an integer tensor"),
    (lambda: apply_capacity(E3, K3.long(), 1, 3), r"^candidate must be a BoolTensor"),
    (lambda: apply_capacity(E3, K3[:2], 1, 3), r"^candidate must have the shape of expert"),
    (lambda: apply_capacity(E3[:0], torch.ones(0, 1, 2, dtype=torch.bool), 1, 3),
     r"^candidate must have the shape of expert"),
    (lambda: apply_capacity(E3, K3, 1, 0), r"^num_experts must be a positive integer"),
    (lambda: apply_capacity(E3, K3, 1, 3, policy="score", score=torch.ones(2, 1)), r"^score must be a real tensor"),
    (lambda: apply_capacity(E3, K3, 1, 3, policy="score", score=torch.tensor([[0.0], [float("nan")], [1.0]])),
     r"^score contains NaN"),
])
def test_fuzz_apply_capacity_names_bad_arguments(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_fuzz_apply_capacity_valid_input_unchanged():
    """Int32 experts are read as long; the decision is the documented one (position policy)."""
    expert = torch.tensor([[0, 1], [0, 2], [0, 1], [1, 0]], dtype=torch.int32)
    d = apply_capacity(expert, torch.ones(4, 2, dtype=torch.bool), 2, 3)
    # slot-major: first choices (tokens 0..3) before second choices, so expert 0 keeps tokens 0, 1
    # and expert 1 keeps token 3's first choice and token 0's second (token 2's second is dropped)
    assert d.keep.tolist() == [[True, True], [True, True], [False, False], [True, False]]
    assert d.load.tolist() == [4, 3, 1] and d.kept.tolist() == [2, 2, 1]
    assert d.position.dtype == torch.long


def _compile_fullgraph(fn):
    return torch.compile(fn, backend="eager", fullgraph=True)


def test_fuzz_routing_value_checks_are_skipped_while_compiling():
    """The range checks need a host sync: under torch.compile they are skipped (no graph break:
    fullgraph=True would raise on one), and the compiled result equals the eager one."""
    torch._dynamo.reset()

    def route(expert, candidate, position_x):
        d = apply_capacity(expert, candidate, 1, 3)
        plan = DispatchPlan.build(expert, d.keep, d.position, 3, 1)
        return d.keep, d.position, plan.dispatch(position_x)

    x = torch.arange(6.0).view(3, 2)
    eager = route(E3, K3, x)
    compiled = _compile_fullgraph(route)(E3, K3, x)
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)


def test_fuzz_dispatch_plan_rejects_bad_positions_and_token_counts():
    with pytest.raises(ValueError, match=r"^position\[0, 0\] = 5 is kept but outside the expert's buffer"):
        DispatchPlan.build(E3, K3, torch.tensor([[5], [0], [0]]), 3, 2)
    with pytest.raises(ValueError, match=r"^position\[1, 0\] = -1 is kept"):
        DispatchPlan.build(E3, K3, torch.tensor([[0], [-1], [0]]), 3, 2)
    with pytest.raises(ValueError, match=r"^expert\[2, 0\] = 3 is kept but outside"):
        DispatchPlan.build(E3 + 1, K3, torch.zeros(3, 1, dtype=torch.long), 3, 1)
    with pytest.raises(ValueError, match=r"^position puts kept pair \(0, 0\) in the \(expert, position\) = \(0, 0\) "
                                         r"buffer row with another kept pair"):
        DispatchPlan.build(torch.tensor([[0], [0]]), torch.ones(2, 1, dtype=torch.bool),
                           torch.zeros(2, 1, dtype=torch.long), 3, 1)
    # two slots of one token in one row (a review case: accepted, and the adjoint gathers then
    # counted the token's gradient twice)
    with pytest.raises(ValueError, match=r"another slot of the same one"):
        DispatchPlan.build(torch.tensor([[0, 0], [1, 0]]), torch.ones(2, 2, dtype=torch.bool),
                           torch.tensor([[0, 0], [0, 1]]), 2, 2)
    # a dropped pair's expert/position are not used, so they are not checked
    keep = torch.tensor([[True], [False], [True]])
    plan = DispatchPlan.build(E3, keep, torch.tensor([[0], [99], [0]]), 3, 1)
    assert plan.token_of_row.tolist() == [0, 3, 2] and plan.row_of_slot.tolist() == [[0], [3], [2]]
    plan = DispatchPlan.build(E3, K3, torch.zeros(3, 1, dtype=torch.long), 3, 1)
    with pytest.raises(ValueError, match=r"^x must have shape \[tokens=3, d\] \(the plan was built for 3 tokens\)"):
        plan.dispatch(torch.ones(4, 2))
    with pytest.raises(ValueError, match=r"^expert_out must have shape \[E=3, C=1, d\]"):
        plan.combine(torch.ones(1, 3, 2), torch.ones(3, 1))
    with pytest.raises(ValueError, match=r"^weight must have shape \[tokens, slots\] = \(3, 1\)"):
        plan.combine(torch.ones(3, 1, 2), torch.ones(3))
    x = torch.arange(6.0).view(3, 2)
    torch.testing.assert_close(plan.combine(plan.dispatch(x), torch.full((3, 1), 2.0)), 2 * x)


def test_batchwise_router_with_one_expert_keeps_every_token_in_eval() -> None:
    """One expert: every token has gate probability 1 and must reach it in train and in eval
    (the output then equals the expert applied to every token)."""
    from routelab.layers import MoE

    torch.manual_seed(0)
    layer = MoE(8, 16, 1, router="batchwise")
    x = torch.randn(6, 8)
    for mode in (layer.train, layer.eval):
        mode()
        y, routes = layer(x)
        assert bool(routes.keep.all())
        expected = layer.experts(x.unsqueeze(0)).squeeze(0)
        torch.testing.assert_close(y, expected)


@pytest.mark.parametrize("method", ["sample", "sample_skip_iw", "gumbel_matching_iw"])
def test_gumbel_matching_router_below_capacity_factor_one_names_it(method: str) -> None:
    """Kool et al.'s estimators sample under a capacity that holds the batch: with
    capacity_factor < 1 the Gumbel-Matching router says so, naming the layer's knob (it raised a
    capacity error about an argument the user never passed)."""
    from routelab.layers import MoE

    with pytest.raises(ValueError, match="capacity_factor"):  # when built
        MoE(4, 8, 2, router="gumbel_matching", capacity_factor=0.5, router_kwargs={"method": method})
    layer = MoE(4, 8, 2, router="gumbel_matching", capacity_factor=1.0, router_kwargs={"method": method})
    layer.capacity_factor = 0.5  # set since: the forward says so
    with pytest.raises(ValueError, match="capacity_factor"):
        layer(torch.randn(6, 4))
    layer.capacity_factor = 1.0
    out, routes = layer(torch.randn(6, 4))
    assert bool(routes.keep.all()) or method != "gumbel_matching_iw"


def test_noisy_topk_gates_stay_finite_when_logits_plus_noise_overflow() -> None:
    """Router logits and noise scales near float32's maximum: the noisy sum overflows, the gates
    must still be a distribution over the chosen experts (here one expert: exactly 1)."""
    from routelab.routing.rules import noisy_topk_routes

    logits = torch.full((4, 3), 3e38)
    std = torch.full((4, 3), 3e38)
    g = torch.Generator().manual_seed(0)
    r = noisy_topk_routes(logits, std, 1, training=True, generator=g)
    assert torch.equal(r.gate, torch.ones(4, 1))
    assert not torch.isnan(r.log_prob).any()


def test_moe_that_keeps_no_token_returns_zeros_inside_the_graph() -> None:
    """Every token dropped (untrained batchwise thresholds in eval, probabilities at 1/E): the
    output is 0 and backward gives zero gradients instead of an autograd error."""
    from routelab.layers import MoE

    torch.manual_seed(0)
    layer = MoE(1, 2, 2, router="batchwise").eval()
    x = (torch.randn(6, 1) * 1e-30).requires_grad_(True)
    y, routes = layer(x)
    assert not bool(routes.keep.any())
    assert torch.equal(y, torch.zeros_like(y))
    y.sum().backward()
    assert torch.equal(x.grad, torch.zeros_like(x))
    assert all(p.grad is None or torch.equal(p.grad, torch.zeros_like(p)) for p in layer.experts.parameters())


def test_a_numpy_array_where_a_tensor_goes_is_a_type_error_naming_the_argument() -> None:
    """README's error contract: a wrong type is a TypeError naming the argument and the fix. A review
    found four entry points raising a ValueError (smooth_step, dselect_weights, a per-example gate)
    or an AttributeError naming nothing (MixtureOfAttentiveExperts). They raise an
    ArgumentTypeError, which is also a ValueError (callers catching the old type still do)."""
    import numpy as np

    from routelab.gates import DSelectK, dselect_weights, smooth_step
    from routelab.layers import MixtureOfAttentiveExperts

    array = np.zeros((2, 4), dtype=np.float32)
    cases = {
        "t": lambda: smooth_step(array),
        "alpha and z": lambda: dselect_weights(array, array, 4),
        "x": lambda: DSelectK(4, 2, input_dim=4, per_example=True)(array),
        "query": lambda: MixtureOfAttentiveExperts(16, 4)(np.zeros((3, 2, 16)), torch.zeros(3, 2, 16),
                                                          torch.zeros(3, 2, 16)),
        "value": lambda: MixtureOfAttentiveExperts(16, 4)(torch.zeros(3, 2, 16), torch.zeros(3, 2, 16),
                                                          np.zeros((3, 2, 16))),
    }
    for name, call in cases.items():
        with pytest.raises(TypeError, match=rf"^{name} must be") as raised:
            call()
        assert isinstance(raised.value, ValueError) and "torch.as_tensor" in str(raised.value), name
