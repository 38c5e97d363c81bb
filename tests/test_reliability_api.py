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
from routelab.estimators import MAX_WEIGHT, METHODS, EMABaseline, reinforce_objective, sample_routes, switch_balance_loss
from routelab.gates import DSelectK, GumbelSoftmaxGate, SoftmaxGate, smooth_step, threshold_mask
from routelab.gates.dselect import UNUSED_FLOOR
from routelab.layers import MixtureOfAttentiveExperts, MoE, StackedLinear
from routelab.layers.bcd import BCDTrainer
from routelab.layers.mae import set_routing
from routelab.routers import make_router
from routelab.routing import apply_capacity, check_capacity, check_capacity_factor, expert_capacity

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
    assert (r.expert[..., 0] == 3).all()
    assert torch.isfinite(r.gate).all() and torch.isfinite(r.weight).all()
    torch.testing.assert_close(r.gate[..., 0], torch.ones(200))


# ------------------------------------------------------------------ D7: weights overflow
def test_d7_repro_weights_are_finite_clamped_and_counted():
    lg = torch.randn(16, 16, generator=gen(1066463187))
    r = sample_routes(lg, "gumbel_matching", tau=1e-3, generator=gen(903))
    assert torch.isfinite(r.weight).all()
    log_p, log_q = exact_log_p_q(lg, 1e-3)
    log_w = chosen(log_p, r.expert) - chosen(log_q, r.expert)  # the exact p / q, in log space
    over = log_w > math.log(MAX_WEIGHT)
    assert over.any(), "the repro must exercise the clamp"
    assert int(r.stats["weights_clamped"]) == int(over.sum())
    assert (r.weight[over] == MAX_WEIGHT).all()
    torch.testing.assert_close(r.weight[~over].double(), log_w[~over].exp(), rtol=1e-5, atol=0)


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
        log_w = chosen(log_p, r.expert) - chosen(log_q, r.expert)
        fine = log_w < math.log(MAX_WEIGHT) - 1
        torch.testing.assert_close(r.weight[fine].double(), log_w[fine].exp(), rtol=1e-4, atol=0)
        assert (r.weight[log_w > math.log(MAX_WEIGHT)] == MAX_WEIGHT).all()


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
    assert (r.expert < 2).all()
    torch.testing.assert_close(r.weight, torch.full((4,), p / q), rtol=1e-6, atol=0)
    torch.testing.assert_close(r.gate, torch.full((4,), p), rtol=1e-6, atol=0)


@pytest.mark.parametrize("k", [2, 4, 12])
@pytest.mark.parametrize("offset", [0.0, 1e4, 1e6])
@pytest.mark.parametrize("tau", [1.0, 1e-3, 1e-7])
def test_d8_gate_log_prob_and_weight_exact_under_offset_and_small_tau(k, offset, tau):
    g = gen(11)
    lg = torch.randn(6, 10, k, generator=g) * 2 + offset
    r = sample_routes(lg, "sample", tau=tau, generator=g)
    log_p, log_q = exact_log_p_q(lg, tau)
    torch.testing.assert_close(r.log_prob.double(), chosen(torch.log_softmax(lg.double(), -1), r.expert),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(r.gate.double(), chosen(log_p, r.expert).exp(), rtol=1e-5, atol=1e-7)
    want = (chosen(log_p, r.expert) - chosen(log_q, r.expert)).exp()
    torch.testing.assert_close(r.weight.double(), want, rtol=1e-4, atol=1e-7)


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
    for name in ("expert", "gate", "keep", "weight", "log_prob"):
        assert getattr(r, name).shape == (0, 12), name
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
    torch.testing.assert_close(t.grad.double(), torch.tensor([w[1] for w in want], dtype=torch.float64),
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
    torch.testing.assert_close(reinforce_objective(r, loss, torch.rand(6)), (r.weight * loss).mean(-1))
    with pytest.raises(TypeError, match="routes"):
        reinforce_objective("routes", loss)
    with pytest.raises(ValueError, match="decay"):
        EMABaseline("0.9")
    with pytest.raises(ValueError, match="expert"):
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
        want = (chosen(log_p, r.expert) - chosen(log_q, r.expert)).exp()
        torch.testing.assert_close(r.weight.double(), want, rtol=1e-5, atol=1e-7)
