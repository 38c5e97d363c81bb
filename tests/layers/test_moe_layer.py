"""The MoE layer: equality with a per-token reference, capacity, gradients, edge cases."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from routelab.layers import MoE
from routelab.routers import ROUTERS, Router

D, H = 8, 12

# Router name -> k to build it with (None: the router fixes k itself).
ROUTER_K = {
    "softmax": None,
    "topk": 2,
    "switch": None,
    "noisy_topk": 2,
    "batchwise": 2,
    "base": None,
    "sinkhorn": 2,
    "gumbel_matching": None,
}
assert set(ROUTER_K) == set(ROUTERS)


def make(router: str, E: int = 4, *, seed: int = 0, **kw) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(D, H, E, router=router, k=ROUTER_K[router], generator=torch.Generator().manual_seed(seed), **kw)
    with torch.no_grad():  # non-zero router weights also for noisy top-k (zero-initialised)
        moe.router.proj.weight.normal_(0, 1.0)
    return moe


def per_token_reference(moe: MoE, x: torch.Tensor, routes) -> torch.Tensor:
    """y_t = sum_s keep * combine * FFN_e(x_t), one token and one slot at a time."""
    flat = x.reshape(-1, D)
    combine = routes.gate * routes.weight if moe.importance_weighting else routes.gate
    out = torch.zeros_like(flat)
    for t in range(flat.shape[0]):
        for s in range(routes.expert.shape[1]):
            if routes.keep[t, s]:
                e = int(routes.expert[t, s])
                out[t] += combine[t, s] * moe.experts.expert(e, flat[t : t + 1])[0]
    return out.reshape(x.shape)


@pytest.mark.parametrize("router", sorted(ROUTERS))
@pytest.mark.parametrize("dropless", [True, False])
def test_output_equals_per_token_reference(router: str, dropless: bool) -> None:
    moe = make(router, capacity_factor=None if dropless else 4.0)
    x = torch.randn(2, 8, D)
    y, routes = moe(x)
    assert routes.expert.shape[0] == 16
    if router != "batchwise":  # a batchwise mask may legitimately leave a token without experts
        assert routes.keep.any(-1).all(), "every token keeps a slot when nothing is dropped"
    assert float(routes.stats["dropped_fraction"]) == 0.0, "nothing may be dropped at this capacity"
    torch.testing.assert_close(y, per_token_reference(moe, x, routes), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("router", sorted(ROUTERS))
def test_output_equals_reference_with_drops(router: str) -> None:
    moe = make(router, capacity_factor=0.5 if router not in ("base", "gumbel_matching", "batchwise") else 1.0)
    x = torch.randn(16, D)
    y, routes = moe(x)
    torch.testing.assert_close(y, per_token_reference(moe, x, routes), rtol=1e-5, atol=1e-6)
    assert (routes.stats["tokens_per_expert"] <= int(routes.stats["capacity"])).all()


def test_topk_chooses_the_largest_logits_with_full_softmax_gates() -> None:
    moe = make("topk")
    x = torch.randn(10, D)
    _, routes = moe(x)
    probs = torch.softmax(x @ moe.router.proj.weight.t(), -1)
    top = probs.topk(2, -1)
    torch.testing.assert_close(routes.gate, top.values)
    assert torch.equal(routes.expert, top.indices)


@pytest.mark.parametrize("router", sorted(ROUTERS))
def test_gradients_reach_router_and_experts(router: str) -> None:
    moe = make(router, capacity_factor=2.0)
    x = torch.randn(16, D)
    y, routes = moe(x)
    loss = y.pow(2).sum() + sum(routes.aux.values(), torch.zeros(()))
    loss.backward()
    g = moe.router.proj.weight.grad
    assert g is not None and float(g.abs().sum()) > 0, f"router {router} received no gradient"
    assert float(moe.experts.w1.grad.abs().sum()) > 0
    if router == "noisy_topk":
        assert float(moe.router.noise.weight.grad.abs().sum()) > 0, "the load loss must train W_noise"


@pytest.mark.parametrize("router", sorted(ROUTERS))
def test_eval_mode_and_determinism(router: str) -> None:
    x = torch.randn(12, D)
    y1, r1 = make(router, seed=3)(x)
    y2, r2 = make(router, seed=3)(x)
    assert torch.equal(y1, y2) and torch.equal(r1.expert, r2.expert), "same seed must give the same result"
    moe = make(router).eval()
    with torch.no_grad():
        ya, _ = moe(x)
        yb, _ = moe(x)
    assert torch.equal(ya, yb), "inference must be deterministic"


# ---------------------------------------------------------------- capacity


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 40),
    E=st.integers(1, 6),
    k=st.integers(1, 3),
    cf=st.sampled_from([0.25, 0.5, 1.0, 1.5, 3.0, None]),
    policy=st.sampled_from(["position", "score", "random"]),
)
def test_capacity_respected_and_reference_holds(n, E, k, cf, policy) -> None:
    k = min(k, E)
    torch.manual_seed(n * 31 + E)
    moe = MoE(D, H, E, router="topk", k=k, capacity_factor=cf, drop_policy=policy,
              generator=torch.Generator().manual_seed(1))
    x = torch.randn(n, D)
    y, routes = moe(x)
    C = n if cf is None else min(n, math.ceil(cf * n * k / E - 1e-9))
    assert int(routes.stats["capacity"]) <= C
    counts = routes.tokens_per_expert(E)[..., :].reshape(-1)
    assert (counts <= C).all()
    # Drops happen only where an expert was over capacity, and fill it exactly.
    load = torch.bincount(routes.expert.reshape(-1), minlength=E)
    torch.testing.assert_close(counts, torch.minimum(load, torch.tensor(C)))
    torch.testing.assert_close(y, per_token_reference(moe, x, routes), rtol=1e-5, atol=1e-6)


def test_position_policy_keeps_first_choices_then_earlier_tokens() -> None:
    from routelab.routing import apply_capacity

    # All 4 tokens want expert 0 in slot 0 and expert 1 in slot 1.
    expert = torch.tensor([[0, 1]] * 4)
    d = apply_capacity(expert, torch.ones_like(expert, dtype=torch.bool), 3, 2)
    assert d.keep[:, 0].tolist() == [True, True, True, False]
    assert d.keep[:, 1].tolist() == [True, True, True, False]
    assert d.load.tolist() == [4, 4] and d.kept.tolist() == [3, 3]
    torch.testing.assert_close(d.skip_weight[:3, 0], torch.full((3,), 4 / 3))
    # Second choices never displace first choices of another token.
    expert = torch.tensor([[0, 1], [1, 0], [1, 0]])
    d = apply_capacity(expert, torch.ones_like(expert, dtype=torch.bool), 1, 2)
    assert d.keep.tolist() == [[True, False], [True, False], [False, False]]


def test_skip_iw_makes_the_per_expert_sum_unbiased() -> None:
    """Kool et al. eq. 3: with random drops, sum_t keep * (n_z / min(n_z, C)) h_t is unbiased."""
    torch.manual_seed(0)
    E, n = 3, 12
    moe = MoE(D, H, E, router="switch", capacity_factor=0.5, drop_policy="random", importance_weighting=True,
              generator=torch.Generator().manual_seed(0))
    x = torch.randn(n, D)
    with torch.no_grad():
        full = MoE(D, H, E, router=moe.router, capacity_factor=None)
        full.experts.load_state_dict(moe.experts.state_dict())
        target = full(x)[0].sum(0)
        draws = torch.stack([moe(x)[0].sum(0) for _ in range(4000)])
    assert float(moe(x)[1].stats["dropped_fraction"]) > 0.2, "the test needs drops"
    mean, se = draws.mean(0), draws.std(0) / math.sqrt(draws.shape[0])
    assert ((mean - target).abs() <= 4 * se + 1e-5).all(), (mean, target, se)


# ---------------------------------------------------------------- edge cases


@pytest.mark.parametrize("router", sorted(ROUTERS))
def test_single_token(router: str) -> None:
    if router == "batchwise":
        moe = make(router, E=4)  # k * 1 token / E is not an integer in training: quotas floor 0 / ceil 1
        _, routes = moe(torch.randn(1, D))
        k = moe.router.k
        assert int(routes.stats["tokens_per_expert"].sum()) == k and int(routes.keep.sum()) == k
        moe.eval()  # the threshold mask is App. F's answer for batch size 1
    else:
        moe = make(router)
    y, routes = moe(torch.randn(1, D))
    assert y.shape == (1, D) and torch.isfinite(y).all()


@pytest.mark.parametrize("router", ["topk", "noisy_topk", "batchwise", "sinkhorn"])
def test_k_equal_to_num_experts(router: str) -> None:
    moe = MoE(D, H, 4, router=router, k=4)
    x = torch.randn(8, D)
    y, routes = moe(x)
    assert (routes.stats["tokens_per_expert"] == 8).all()
    torch.testing.assert_close(y, per_token_reference(moe, x, routes), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("router", ["topk", "noisy_topk", "batchwise", "sinkhorn"])
def test_k_larger_than_num_experts_is_an_error(router: str) -> None:
    with pytest.raises(ValueError, match="k=5 is larger than num_experts=4"):
        MoE(D, H, 4, router=router, k=5)


def test_empty_experts_and_all_equal_logits() -> None:
    moe = MoE(D, H, 8, router="topk", k=1, capacity_factor=2.0)
    with torch.no_grad():
        moe.router.proj.weight.zero_()  # all logits equal: ties everywhere
    x = torch.randn(6, D)
    y, routes = moe(x)
    counts = routes.stats["tokens_per_expert"]
    assert (counts == 0).sum() >= 2, "most experts receive nothing"
    assert counts.sum() <= 6 and torch.isfinite(y).all()
    torch.testing.assert_close(y, per_token_reference(moe, x, routes), rtol=1e-5, atol=1e-6)
    y.sum().backward()  # empty experts have zero gradient, not NaN
    assert torch.isfinite(moe.experts.w1.grad).all()


@pytest.mark.parametrize("router", sorted(ROUTERS))
def test_all_equal_logits_every_router(router: str) -> None:
    moe = make(router)
    with torch.no_grad():
        moe.router.proj.weight.zero_()
    x = torch.randn(8, D)
    y, routes = moe(x)
    assert torch.isfinite(y).all()
    assert (routes.stats["tokens_per_expert"] <= int(routes.stats["capacity"])).all()


def test_capacity_larger_than_tokens_is_clamped() -> None:
    moe = MoE(D, H, 2, router="topk", k=1, capacity_factor=100.0)
    y, routes = moe(torch.randn(3, D))
    assert int(routes.stats["capacity"]) == 3 and float(routes.stats["dropped_fraction"]) == 0.0


def test_zero_tokens() -> None:
    for router in ("topk", "base", "softmax"):
        y, routes = make(router)(torch.randn(0, D))
        assert y.shape == (0, D)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="capacity_factor"):
        MoE(D, H, 4, capacity_factor=0.0)
    with pytest.raises(ValueError, match="unknown router"):
        MoE(D, H, 4, router="nope")
    with pytest.raises(ValueError, match="drop_policy"):
        MoE(D, H, 4, drop_policy="lifo")
    with pytest.raises(ValueError, match="d_model"):
        MoE(D, H, 4)(torch.randn(3, D + 1))
    with pytest.raises(ValueError, match="num_experts must be a positive integer"):
        MoE(D, H, 0)
    with pytest.raises(ValueError, match="dtype must be a floating dtype"):
        MoE(D, H, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="supports k=None or k=1"):
        MoE(D, H, 4, router="gumbel_matching", k=2)
    with pytest.raises(ValueError, match="capacity_factor >= 1"):  # when built (it failed at the first forward)
        MoE(D, H, 4, router="base", capacity_factor=0.5)
    with pytest.raises(ValueError, match="capacity_factor >= 1"):
        MoE(D, H, 4, router="gumbel_matching", capacity_factor=0.9)
    layer = MoE(D, H, 4, router="base", capacity_factor=1.0)
    layer.capacity_factor = 0.5  # changed since: the forward still says so
    with pytest.raises(ValueError, match="capacity_factor >= 1"):
        layer(torch.randn(8, D))
    with pytest.raises(ValueError, match="not finite"):
        MoE(D, H, 4)(torch.full((3, D), float("nan")))
    with pytest.raises(ValueError, match="not finite"):
        MoE(D, H, 4)(torch.full((3, D), float("inf")))
    router = make("topk").router
    with pytest.raises(ValueError, match="only with a router name"):
        MoE(D, H, 4, router=router, k=2)
    with pytest.raises(ValueError, match="built for"):
        MoE(D, H, 5, router=router)


def test_router_instance_is_accepted() -> None:
    router = ROUTERS["topk"](D, 4, 2)
    assert isinstance(router, Router)
    y, routes = MoE(D, H, 4, router=router)(torch.randn(4, 3, D))
    assert y.shape == (4, 3, D) and routes.expert.shape == (12, 2)


def test_bfloat16_on_cpu_matches_float32() -> None:
    moe = make("topk", capacity_factor=None)
    x = torch.randn(32, D)
    y32, r32 = moe(x)
    y16, r16 = moe.to(torch.bfloat16)(x.to(torch.bfloat16))
    assert y16.dtype == torch.bfloat16
    same = (r16.expert == r32.expert).all(-1)
    assert same.float().mean() > 0.8
    torch.testing.assert_close(y16[same].float(), y32[same], rtol=0.05, atol=0.05)


@pytest.mark.requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("router", sorted(ROUTERS))
def test_half_precision_on_gpu(router: str, dtype: torch.dtype) -> None:
    moe = make(router, capacity_factor=None).cuda()
    x = torch.randn(64, D, device="cuda")
    y32, r32 = moe(x)
    moe = moe.to(dtype)
    moe.router.float()  # routing runs in float32 on every dtype
    y, routes = moe(x.to(dtype))
    assert y.dtype == dtype and torch.isfinite(y).all()
    (y.float().sum() + sum(routes.aux.values(), torch.zeros((), device="cuda"))).backward()


def test_nothing_proposed_means_nothing_dropped() -> None:
    """A batchwise router at inference may propose no expert at all: that is not a capacity drop."""
    moe = MoE(D, H, 4, router="batchwise", k=1).eval()
    with torch.no_grad():
        moe.router.thresholds.fill_(2.0)  # no probability exceeds 2
        y, routes = moe(torch.randn(1, D))
    assert float(routes.stats["dropped_fraction"]) == 0.0
    assert float(routes.stats["tokens_dropped"]) == 1.0 and torch.equal(y, torch.zeros_like(y))


@pytest.mark.parametrize("router, kwargs", [("noisy_topk", {"k": 2}), ("gumbel_matching", {})])
def test_a_generator_assigned_after_construction_reaches_the_router(router: str, kwargs: dict) -> None:
    """One explicit seed reproduces the routing whatever torch's global seed: also when the
    generator is assigned to the built layer (it used to stay with the layer's random drops only)."""
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(0))
    layer = MoE(16, 32, 4, router=router, capacity_factor=1.25, **kwargs)
    layer.generator = torch.Generator()
    assert layer.router.generator is layer.generator
    runs = []
    for global_seed in (1, 2):
        layer.generator.manual_seed(7)
        torch.manual_seed(global_seed)
        y, routes = layer(x)
        runs.append((y, routes.expert))
    assert torch.equal(runs[0][1], runs[1][1]) and torch.equal(runs[0][0], runs[1][0])
    layer.generator = None
    assert layer.router.generator is None
    with pytest.raises(TypeError, match="generator must be a torch.Generator or None"):
        layer.generator = "seed"


def test_a_router_passed_with_its_own_generator_keeps_it_when_the_layer_gets_none() -> None:
    from routelab.routers import make_router
    own = torch.Generator().manual_seed(3)
    router = make_router("gumbel_matching", 16, 4)
    router.generator = own
    assert MoE(16, 32, 4, router=router).router.generator is own


@pytest.mark.parametrize("name", ["importance_weighting", "bias", "gated"])
@pytest.mark.parametrize("value", ["no", 1, None])
def test_flags_must_be_bools(name: str, value: object) -> None:
    with pytest.raises(TypeError, match=f"{name} must be True or False"):
        MoE(8, 16, 4, **{name: value})


def test_the_noisy_topk_load_loss_has_finite_gradients_for_huge_finite_logit_gaps() -> None:
    """App. A's Phi((clean - threshold) / std) saturates; its gradient is 0 there, not NaN
    (the division's backward overflowed at a gap of 1e35 over a noise scale of 0.01)."""
    from routelab.routing.rules import noisy_topk_routes
    logits = torch.tensor([[0.0, 0.0, -1e35]], requires_grad=True)
    noise_std = torch.tensor([[1.0, 1.0, 0.01]], requires_grad=True)
    r = noisy_topk_routes(logits, noise_std, 1, generator=torch.Generator().manual_seed(0), importance_coef=0.0,
                          load_coef=1.0)
    r.aux["load"].backward()
    assert torch.isfinite(logits.grad).all() and torch.isfinite(noise_std.grad).all()
    assert logits.grad[0, 2] == 0 and noise_std.grad[0, 2] == 0  # saturated: Phi is flat there
    # The other entries' gradients are those of a merely large gap (-100, saturated in float32 too,
    # where the division never overflowed).
    moderate = torch.tensor([[0.0, 0.0, -100.0]], requires_grad=True)
    std = torch.tensor([[1.0, 1.0, 0.01]], requires_grad=True)
    noisy_topk_routes(moderate, std, 1, generator=torch.Generator().manual_seed(0), importance_coef=0.0,
                      load_coef=1.0).aux["load"].backward()
    assert torch.allclose(logits.grad, moderate.grad) and torch.allclose(noise_std.grad, std.grad)
