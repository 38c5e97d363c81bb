"""Token masks and balanced quotas (issue 15, items 4-6).

Oracles: the same layer/router/rule on the batch with the padding removed (masks), scipy's
linear_sum_assignment on the column-repeated problem (BASE's quota), counting (quotas), and the
errors' own words (k).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_routing_rules import best_quota_total

import routelab.routing as R
from routelab._checks import balanced_quotas, expert_capacity
from routelab.estimators import gumbel_matching_routes
from routelab.layers import MoE
from routelab.routers import ROUTERS, make_router
from routelab.routing.masks import real_tokens, scatter_routes

D, H = 8, 16
FIELDS = ("expert", "gate", "keep", "weight", "log_prob")
#: k per router for the layer tests (k > 1 where the router takes it).
ROUTER_K = {"softmax": None, "topk": 2, "switch": 1, "noisy_topk": 2, "batchwise": 2, "base": 1, "sinkhorn": 2,
            "gumbel_matching": 1}


def layer(name: str, E: int = 4, *, seed: int = 0, **kw) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(D, H, E, router=name, k=ROUTER_K[name], generator=torch.Generator().manual_seed(seed), **kw)
    with torch.no_grad():  # non-zero router weights also for noisy top-k (zero-initialised)
        moe.router.proj.weight.normal_(0, 1.0)
        if name == "noisy_topk":
            moe.router.noise.weight.normal_(0, 0.5)
    return moe


def padded_batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """x [3, 7, D] with right padding (lengths 7, 4, 2) and its mask; padding holds large junk."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 7, D, generator=g)
    lengths = torch.tensor([7, 4, 2])
    mask = torch.arange(7).unsqueeze(0) < lengths.unsqueeze(1)
    x[~mask] = 1e4 * torch.randn(int((~mask).sum()), D, generator=g)
    return x, mask


# ---------------------------------------------------------------- masks: MoE layer


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("capacity_factor", [1.0, None], ids=["cf1", "dropless"])
@pytest.mark.parametrize("name", sorted(ROUTERS))
def test_padded_batch_equals_the_batch_without_padding(name: str, capacity_factor, training: bool) -> None:
    """Real tokens of a padded batch: the outputs, routes, stats and aux losses of the same layer on
    the real tokens alone (same generator state: stochastic routers draw the same noise); masked
    outputs exactly 0 and masked slots routed nowhere."""
    x, mask = padded_batch()
    moe_a = layer(name, capacity_factor=capacity_factor, drop_policy="random" if name == "topk" else "position")
    moe_b = layer(name, capacity_factor=capacity_factor, drop_policy="random" if name == "topk" else "position")
    moe_a.train(training)
    moe_b.train(training)
    y, routes = moe_a(x, mask=mask)
    y_real, routes_real = moe_b(x[mask])
    assert y.shape == x.shape
    assert torch.equal(y[~mask], torch.zeros_like(y[~mask])), "masked tokens must get exactly 0"
    torch.testing.assert_close(y[mask], y_real, rtol=0, atol=1e-6)
    idx = mask.reshape(-1)
    for f in FIELDS:
        torch.testing.assert_close(getattr(routes, f)[idx], getattr(routes_real, f), rtol=0, atol=1e-6, msg=f)
    assert not routes.keep[~idx].any() and (routes.gate[~idx] == 0).all()
    for key in ("tokens_per_expert", "load_cv", "dropped_fraction", "tokens_dropped", "capacity"):
        torch.testing.assert_close(routes.stats[key], routes_real.stats[key], msg=key)
    assert routes.aux.keys() == routes_real.aux.keys()
    for key in routes.aux:
        torch.testing.assert_close(routes.aux[key], routes_real.aux[key], msg=key)


@pytest.mark.parametrize("name", ["topk", "noisy_topk", "gumbel_matching", "base"])
def test_masked_tokens_get_no_gradient_and_real_gradients_match(name: str) -> None:
    x, mask = padded_batch(2)
    moe_a, moe_b = layer(name), layer(name)
    xa = x.clone().requires_grad_(True)
    xb = x[mask].clone().requires_grad_(True)
    (moe_a(xa, mask=mask)[0] ** 2).sum().backward()
    (moe_b(xb)[0] ** 2).sum().backward()
    assert torch.equal(xa.grad[~mask], torch.zeros_like(xa.grad[~mask]))
    torch.testing.assert_close(xa.grad[mask], xb.grad, rtol=0, atol=1e-5)
    torch.testing.assert_close(moe_a.router.proj.weight.grad, moe_b.router.proj.weight.grad, rtol=1e-5, atol=1e-5)


def test_all_masked_batch_gives_zeros() -> None:
    moe = layer("topk")
    x = torch.randn(2, 3, D)
    y, routes = moe(x, mask=torch.zeros(2, 3, dtype=torch.bool))
    assert torch.equal(y, torch.zeros_like(y)) and not routes.keep.any()
    assert int(routes.stats["tokens_per_expert"].sum()) == 0


def test_mask_errors_name_the_argument() -> None:
    moe = layer("topk")
    x = torch.randn(2, 3, D)
    with pytest.raises(ValueError, match="mask must be a BoolTensor"):
        moe(x, mask=torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"mask must have the token shape \(2, 3\)"):
        moe(x, mask=torch.ones(6, dtype=torch.bool))
    with pytest.raises(TypeError, match="mask must be a BoolTensor"):
        moe(x, mask=[[True] * 3] * 2)
    with pytest.raises(ValueError, match="mask"):
        moe.router(x.reshape(6, D), mask=torch.ones(2, 3, dtype=torch.bool))


# ---------------------------------------------------------------- masks: routers and rules


@pytest.mark.parametrize("name", sorted(ROUTERS))
def test_router_mask_routes_the_real_tokens_alone(name: str) -> None:
    x, mask = padded_batch(3)
    flat, m = x.reshape(-1, D), mask.reshape(-1)
    r = make_router(name, D, 4, k=ROUTER_K[name])
    with torch.no_grad():
        r.proj.weight.normal_(0, 1.0)
    r.generator = torch.Generator().manual_seed(5)
    got = r(flat, None, mask=m)
    r.generator = torch.Generator().manual_seed(5)
    want = r(flat[m])
    for f in FIELDS:
        assert torch.equal(getattr(got, f)[m], getattr(want, f)), f
    assert not got.keep[~m].any()


def test_rules_take_a_mask() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(10, 4, generator=g)
    noise = torch.rand(10, 4, generator=g) + 0.1
    m = torch.tensor([True, False, True, True, False, True, True, True, False, True])
    idx = real_tokens(m)
    cases = [
        (lambda **kw: R.topk_routes(logits, 2, **kw), lambda: R.topk_routes(logits[m], 2)),
        (lambda **kw: R.softmax_routes(logits, **kw), lambda: R.softmax_routes(logits[m])),
        (lambda **kw: R.noisy_topk_routes(logits, noise, 2, training=False, **kw),
         lambda: R.noisy_topk_routes(logits[m], noise[m], 2, training=False)),
        (lambda **kw: R.batchwise_routes(logits, 1, torch.zeros(4), **kw),
         lambda: R.batchwise_routes(logits[m], 1, torch.zeros(4))),
        (lambda **kw: R.balanced_routes(logits, **kw), lambda: R.balanced_routes(logits[m])),
        (lambda **kw: R.sinkhorn_routes(logits, 1, **kw), lambda: R.sinkhorn_routes(logits[m], 1)),
        (lambda **kw: gumbel_matching_routes(logits, training=False, **kw),
         lambda: gumbel_matching_routes(logits[m], training=False)),
    ]
    for masked, alone in cases:
        got, want = masked(mask=m), alone()
        expanded = scatter_routes(want, idx, 10)
        for f in FIELDS:
            assert torch.equal(getattr(got, f), getattr(expanded, f)), f
        assert got.aux.keys() == want.aux.keys()
        for key in got.aux:
            assert torch.equal(got.aux[key], want.aux[key])


# ---------------------------------------------------------------- balanced quotas


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 40), E=st.integers(1, 9), k=st.integers(1, 9))
def test_balanced_quotas_are_floor_and_ceil(n: int, E: int, k: int) -> None:
    k = min(k, E)
    lo, hi = balanced_quotas(n, E, k)
    assert lo == (k * n) // E and hi == -(-(k * n) // E) and hi <= n
    # r = k n mod E experts at the ceiling, the rest at the floor: exactly k n pairs
    r = k * n - lo * E
    assert 0 <= r < E and (r == 0) == (lo == hi)


def test_balanced_quotas_name_bad_arguments() -> None:
    with pytest.raises(ValueError, match="num_tokens"):
        balanced_quotas(-1, 4)
    with pytest.raises(ValueError, match="k=5 is larger than num_experts=4"):
        balanced_quotas(3, 4, 5)
    for bad in (True, np.bool_(True), 2.0, torch.tensor(3)):
        with pytest.raises(ValueError, match="num_tokens must be an integer >= 0"):
            balanced_quotas(bad, 4)


def test_token_counts_may_be_numpy_integers() -> None:
    """np.int64 counts (e.g. from np.bincount) are integers, as for num_experts: review s42 found
    num_tokens=np.int64(8) refused while num_experts=np.int64(4) was taken in the same call."""
    assert balanced_quotas(np.int64(9), np.int64(4), 2) == (4, 5)
    assert expert_capacity(np.int64(8), np.int64(4), 2, 1.0) == 4
    assert type(expert_capacity(np.int64(8), 4, 1, None)) is int


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 30), E=st.integers(2, 6), k=st.integers(1, 6), cf=st.sampled_from([None, 1.0, 2.0]),
       seed=st.integers(0, 50))
def test_batchwise_balances_any_token_count(n: int, E: int, k: int, cf, seed: int) -> None:
    """Training batchwise gating: every expert keeps floor or ceil of k n / E tokens, k n in all,
    whatever the buffer capacity (no divisibility error)."""
    k = min(k, E)
    torch.manual_seed(seed)
    moe = MoE(D, H, E, router="batchwise", k=k, capacity_factor=cf)
    _, routes = moe(torch.randn(n, D))
    lo, hi = balanced_quotas(n, E, k)
    load = routes.stats["tokens_per_expert"]
    assert bool(((load == lo) | (load == hi)).all()), (load, lo, hi)
    assert int(load.sum()) == k * n and float(routes.stats["dropped_fraction"]) == 0.0


@pytest.mark.parametrize("name", ["base", "gumbel_matching"])
@pytest.mark.parametrize("cf", [None, 1.0, 1.5, 4.0])
@pytest.mark.parametrize("n", [12, 13, 7])
def test_balanced_routers_balance_whatever_the_capacity(name: str, cf, n: int) -> None:
    """Dropless or any factor >= 1: at most ceil(n / E) tokens per expert, every token routed (the
    issue's dropless BASE/Gumbel-Matching turned into argmax: [120, 27, 19, 0, ...])."""
    E = 4
    torch.manual_seed(0)
    moe = MoE(D, H, E, router=name, capacity_factor=cf, generator=torch.Generator().manual_seed(0))
    x = torch.randn(n, D) + 3.0  # a shared offset makes argmax routing collapse onto few experts
    with torch.no_grad():
        moe.router.proj.weight.normal_(0, 1.0)
    assert torch.bincount(moe.router.logits(x).argmax(-1), minlength=E).max() > -(-n // E), "needs imbalance"
    _, routes = moe(x)
    load = routes.stats["tokens_per_expert"]
    assert int(load.max()) <= -(-n // E) and int(load.sum()) == n, load


@pytest.mark.parametrize("n, E", [(12, 4), (13, 4), (7, 3)])
def test_base_dropless_is_the_optimal_assignment_at_the_quota(n: int, E: int) -> None:
    """scipy oracle: the best assignment with floor(n / E) or ceil(n / E) tokens per expert."""
    torch.manual_seed(1)
    moe = MoE(D, H, E, router="base", capacity_factor=None)
    x = torch.randn(n, D)
    _, routes = moe(x)
    logits = moe.router.logits(x).detach().double().numpy()
    load = np.bincount(routes.expert[:, 0].numpy(), minlength=E)
    assert load.min() >= n // E and load.max() <= -(-n // E), load
    ours = logits[np.arange(n), routes.expert[:, 0].numpy()].sum()
    assert ours == pytest.approx(best_quota_total(logits), abs=1e-9)


def test_balanced_routers_still_need_capacity_factor_at_least_one() -> None:
    with pytest.raises(ValueError, match="capacity_factor >= 1"):
        MoE(D, H, 4, router="base", capacity_factor=0.5)(torch.randn(8, D))
    with pytest.raises(ValueError, match="capacity_factor >= 1"):
        MoE(D, H, 4, router="gumbel_matching", capacity_factor=0.5)(torch.randn(8, D))


# ---------------------------------------------------------------- every router takes k


@pytest.mark.parametrize("name, k, supported", [
    ("softmax", 2, "k=None or k=num_experts=4"),
    ("switch", 2, "k=None or k=1"),
    ("gumbel_matching", 3, "k=None or k=1"),
])
def test_fixed_k_routers_say_which_k_they_support(name: str, k: int, supported: str) -> None:
    with pytest.raises(ValueError, match=f"router '{name}' got k={k} but supports {supported}"):
        make_router(name, D, 4, k=k)
    with pytest.raises(ValueError, match="supports"):
        MoE(D, H, 4, router=name, k=k)


@pytest.mark.parametrize("name, k", [("softmax", 4), ("switch", 1), ("base", 1), ("gumbel_matching", 1),
                                     ("topk", 3), ("noisy_topk", 3), ("batchwise", 3), ("sinkhorn", 3)])
def test_every_router_takes_the_models_k(name: str, k: int) -> None:
    moe = MoE(D, H, 4, router=name, k=k)
    assert moe.router.slots == k
    y, _ = moe(torch.randn(2, 5, D))
    assert y.shape == (2, 5, D)
