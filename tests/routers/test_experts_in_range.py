"""``Router.experts_in_range``: the declaration that lets a layer skip its value check of the routes.

A layer with its default checks used to make two host syncs per forward: the router's finite check
of its scores, then the capacity step's check that every expert is in ``[0, E)``. Every built-in
rule names experts by a top-k, an argmax or an assignment, so the second check can never fail for
them: they declare it, and the layer skips that check (the drain of the GPU's queue that comes
with it) unless its drop policy ranks by the gates. The declaration must therefore never be
wrong, and a router that does not make it keeps the check and its clear error.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from routelab.layers import MoE
from routelab.routers import ROUTERS, TopKRouter, make_router
from routelab.routers.base import experts_in_range, routes_need_value_check
from routelab.routing import expert_capacity

FIXED_K = ("switch", "gumbel_matching", "softmax")
METHODS = ("sample", "sample_skip", "sample_skip_iw", "gumbel_matching")
VARIANTS = [(name, {}) for name in sorted(ROUTERS)] + [("gumbel_matching", {"method": method}) for method in METHODS]
IDS = [f"{name}-{kw['method']}" if kw else name for name, kw in VARIANTS]


@pytest.mark.parametrize(("name", "kw"), VARIANTS, ids=IDS)
@settings(max_examples=12, deadline=None)
@given(tokens=st.integers(1, 40), experts=st.integers(1, 9), scale=st.sampled_from([0.0, 1e-3, 1.0, 30.0, 1e4]),
       train=st.booleans(), seed=st.integers(0, 2**16), data=st.data())
def test_every_built_in_router_declares_it_and_names_only_experts_in_range(name, kw, tokens, experts, scale,
                                                                           train, seed, data):
    """In training and eval, on tied (scale 0), tiny, skewed and huge scores, under a capacity
    that binds or not: every expert a declaring router names is in ``[0, E)``."""
    k = None if name in FIXED_K else data.draw(st.integers(1, experts), label="k")
    if name == "noisy_topk" and k is not None and k > experts:
        k = experts
    gen = torch.Generator().manual_seed(seed)
    router = make_router(name, 8, experts, k=k, **kw)
    router.generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.proj.weight.normal_(generator=gen)
    router.train(train)
    assert experts_in_range(router), name
    factor = data.draw(st.sampled_from([1.0, 1.5, 4.0]), label="capacity factor")
    capacity = expert_capacity(tokens, experts, router.slots, factor)
    x = torch.randn(tokens, 8, generator=gen) * scale
    routes = router(x, capacity)
    assert routes.expert.dtype == torch.long
    assert bool(((routes.expert >= 0) & (routes.expert < experts)).all()), (name, routes.expert)


class OutOfRange(TopKRouter):
    """Names the expert ``E`` for every token's first slot: a bug a user's router could have."""

    def route(self, logits, capacity):
        routes = super().route(logits, capacity)
        return dataclasses.replace(routes, expert=torch.full_like(routes.expert, self.num_experts))


class Redeclared(OutOfRange):
    experts_in_range = True


def test_a_router_that_reroutes_without_declaring_keeps_the_check_and_its_error():
    """The declaration counts from the class that defines the routing: a subclass that overrides
    ``route`` is not trusted (the layer checks its routes and names the fault) unless it declares
    it again, and then the layer believes it."""
    assert experts_in_range(TopKRouter(8, 4, k=1))
    assert not experts_in_range(OutOfRange(8, 4, k=1))
    assert experts_in_range(Redeclared(8, 4, k=1))
    moe = MoE(8, 16, 4, router=OutOfRange(8, 4, k=1), capacity_factor=1.0)
    with pytest.raises(ValueError, match=r"expert must hold expert indices in \[0, num_experts=4\)"):
        moe(torch.randn(12, 8))
    for policy in ("position", "random", "score"):
        assert routes_need_value_check(OutOfRange(8, 4, k=1), policy)


def test_the_check_is_skipped_only_for_a_checking_declared_router_under_a_policy_that_ignores_the_gates():
    router = TopKRouter(8, 4, k=2)
    assert not routes_need_value_check(router, "position")
    assert not routes_need_value_check(router, "random")
    assert routes_need_value_check(router, "score")  # NaN gates cannot be ranked: still checked
    router.check_finite = False
    assert not routes_need_value_check(router, "score")  # the user's choice of no host sync
    hooked = TopKRouter(8, 4, k=2)
    hooked.register_forward_hook(lambda module, args, out: out)
    assert routes_need_value_check(hooked, "position")  # a hook could change the routes
    opted_out = TopKRouter(8, 4, k=2)
    opted_out.experts_in_range = False
    assert routes_need_value_check(opted_out, "position")


@pytest.mark.parametrize("dispatch", ["buffers", "grouped"])
@pytest.mark.parametrize("capacity_factor", [1.0, None])
def test_skipping_the_check_changes_no_output_or_gradient(dispatch, capacity_factor):
    """The same layer with its routes checked (the router opts out of the declaration) and
    unchecked (the default): equal outputs, statistics and gradients."""
    torch.manual_seed(0)
    a = MoE(16, 32, 4, router="topk", k=2, capacity_factor=capacity_factor, dispatch=dispatch)
    if dispatch == "grouped" and not a.uses_grouped(2, torch.device("cpu")):
        pytest.skip("grouped matmuls do not run on this CPU")
    b = MoE(16, 32, 4, router="topk", k=2, capacity_factor=capacity_factor, dispatch=dispatch)
    b.load_state_dict(a.state_dict())
    b.router.experts_in_range = False
    assert routes_need_value_check(b.router, b.drop_policy) and not routes_need_value_check(a.router, a.drop_policy)
    x = torch.randn(40, 16)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    (ya, ra), (yb, rb) = a(xa), b(xb)
    assert torch.equal(ya, yb)
    assert ra.stats.keys() == rb.stats.keys()
    assert all(torch.equal(ra.stats[key], rb.stats[key]) for key in ra.stats)
    ya.square().sum().backward()
    yb.square().sum().backward()
    assert torch.equal(xa.grad, xb.grad)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa.grad, pb.grad), name
