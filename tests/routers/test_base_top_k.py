"""BASE with ``k > 1``: the router, its rule, ``make_router``/``MoE`` plumbing and training.

The balanced rule with ``k`` slots is the exact b-matching (its exactness is tested against an
LP oracle in tests/assignment/test_b_matching.py); here: the rule returns that b-matching with
the BASE gate, and an MoE layer with ``router="base", k=2`` trains, giving every token two
distinct experts and every expert exactly ``2 n / E`` (token, expert) pairs.
"""

from __future__ import annotations

import pytest
import torch

from routelab.assignment import balanced_assignment, balanced_b_matching
from routelab.layers import MoE
from routelab.routers import BASERouter, make_router
from routelab.routing import balanced_routes

D, H, E = 8, 16, 4


def test_rule_is_the_b_matching_with_sigmoid_gates():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(24, E, generator=g, requires_grad=True)
    routes = balanced_routes(logits, k=2)
    assert torch.equal(routes.expert, balanced_b_matching(logits.detach(), 2))
    assert torch.equal(routes.gate, torch.sigmoid(logits.gather(-1, routes.expert)))
    assert torch.equal(routes.log_prob, torch.log_softmax(logits, -1).gather(-1, routes.expert))
    assert routes.keep.all() and (routes.weight == 1).all()
    routes.gate.sum().backward()  # the router learns through the gate
    assert logits.grad is not None and logits.grad.abs().sum() > 0
    # balanced means balanced: the quotas k n / E = 12 whatever the buffer capacity (at least 12)
    assert torch.equal(balanced_routes(logits, 12, k=2).expert, routes.expert)
    assert torch.equal(balanced_routes(logits, 20, k=2).expert, routes.expert)
    # unbalanced (BASE's greedy inference): the top-k
    assert torch.equal(balanced_routes(logits, balanced=False, k=2).expert, logits.detach().topk(2).indices)
    assert balanced_routes(logits[:0], k=2).expert.shape == (0, 2)


def test_k1_rule_unchanged():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(16, E, generator=g)
    assert torch.equal(balanced_routes(logits).expert.squeeze(-1), balanced_assignment(logits, 4))
    assert torch.equal(balanced_routes(logits, k=1).expert, balanced_routes(logits).expert)


def test_router_and_make_router():
    torch.manual_seed(0)
    router = make_router("base", D, E, k=2)
    assert isinstance(router, BASERouter) and router.k == 2 and router.slots == 2
    assert make_router("base", D, E).k == 1
    x = torch.randn(10, D)
    routes = router(x, 5)
    assert routes.expert.shape == (10, 2)
    assert torch.bincount(routes.expert.flatten(), minlength=E).tolist() == [5, 5, 5, 5]
    router.eval()
    router.eval_balanced = False
    assert torch.equal(router(x, 5).expert, router.logits(x).topk(2).indices)


def test_k_errors_name_the_supported_k():
    with pytest.raises(ValueError, match=r"k=5 .*\[1, 4\]"):
        make_router("base", D, E, k=5)
    with pytest.raises(ValueError, match="k"):
        BASERouter(D, E, k=0)
    with pytest.raises(ValueError, match="capacity_factor >= 1"):  # 4 * 3 < 2 * 10 pairs
        balanced_routes(torch.zeros(10, E), 3, k=2)


def test_moe_with_base_k2_trains_balanced():
    torch.manual_seed(0)
    n = 64
    moe = MoE(D, H, E, router="base", k=2, capacity_factor=1.0)
    x = torch.randn(n, D)
    target = torch.sin(x @ torch.randn(D, D))
    opt = torch.optim.Adam(moe.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        y, routes = moe(x)
        expert = routes.expert.view(n, 2)
        assert all(len(set(row)) == 2 for row in expert.tolist()), "a token got the same expert twice"
        assert torch.bincount(expert.flatten(), minlength=E).tolist() == [2 * n // E] * E
        assert bool(routes.keep.all()), "the balanced capacity dropped a pair"
        loss = torch.nn.functional.mse_loss(y, target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert moe.router.proj.weight.grad is not None and moe.router.proj.weight.grad.abs().sum() > 0
    assert losses[-1] < 0.5 * losses[0], (losses[0], losses[-1])


def test_an_eval_capacity_below_the_quota_of_a_router_balanced_at_inference_is_refused_when_built() -> None:
    """A review case: ``eval_capacity_factor < 1`` with ``base(eval_balanced=True)`` was accepted
    and failed at the first eval forward, in an error naming ``capacity_factor``."""
    with pytest.raises(ValueError, match=r"eval_capacity_factor=0.5 is below 1, but the BASERouter assigns every "
                                         r"token .*also at inference: eval_balanced=True"):
        MoE(8, 16, 4, router="base", eval_capacity_factor=0.5, router_kwargs={"eval_balanced": True})
    # balanced in training only: inference routes by each token's own scores, any eval capacity
    layer = MoE(8, 16, 4, router="base", eval_capacity_factor=0.5).eval()
    layer(torch.randn(16, 8))
    assert layer.last_stats["tokens_per_expert"].max() <= 2  # C = ceil(0.5 * 16 / 4)
