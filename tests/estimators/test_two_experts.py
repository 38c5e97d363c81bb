"""The two-expert closed forms of sample_routes against the general path and by Monte Carlo."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import routelab.assignment._two_experts as closed_forms
from routelab.assignment import gumbel_matching
from routelab.assignment._two_experts import two_expert_sinkhorn
from routelab.estimators import METHODS, sample_routes
from routelab.estimators.two_experts import _matching, _skip_two


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("n,c", [(6, 3), (7, 4), (8, 5), (8, 8), (5, 3), (10, 9)])
def test_matching_and_conditionals_equal_the_general_solver(n: int, c: int) -> None:
    """Same assignment and the same conditionals (eq. 6) as Floyd-Warshall on the expert graph."""
    g = torch.Generator().manual_seed(n * 100 + c)
    a = torch.randn(40, n, 2, dtype=torch.float64, generator=g)
    u = torch.rand(40, n, dtype=torch.float64, generator=g)
    noise = torch.log(u) - torch.log1p(-u)
    s = a[..., 1] - a[..., 0]
    z, t = _matching(s + noise, c)
    gumbels = torch.stack([torch.zeros_like(noise), noise], -1)
    ref = gumbel_matching(a, capacity=c, gumbels=gumbels)
    assert torch.equal(z.long(), ref.expert)
    ours = torch.stack([torch.nn.functional.logsigmoid(t - s), torch.nn.functional.logsigmoid(s - t)], -1)
    torch.testing.assert_close(ours, ref.conditional_log_probs, rtol=1e-9, atol=1e-9)


def test_conditional_is_the_probability_given_the_other_tokens() -> None:
    """Brute force eq. 6: redraw token i's noise many times with the others fixed."""
    g = torch.Generator().manual_seed(0)
    n, c = 6, 3
    s = torch.randn(n, dtype=torch.float64, generator=g)
    u = torch.rand(n, dtype=torch.float64, generator=g)
    noise = torch.log(u) - torch.log1p(-u)
    _, t = _matching(s + noise, c)
    for i in range(n):
        draws = 20_000
        u_i = torch.rand(draws, dtype=torch.float64, generator=g)
        v = (s + noise).expand(draws, n).clone()
        v[:, i] = s[i] + torch.log(u_i) - torch.log1p(-u_i)
        z, _ = _matching(v, c)
        freq = z[:, i].double().mean()
        p = torch.sigmoid(s[i] - t[i])
        assert abs(float(freq - p)) < 4.5 * math.sqrt(float(p * (1 - p)) / draws) + 1e-12


def test_skip_keeps_a_uniform_subset_of_each_expert() -> None:
    g = torch.Generator().manual_seed(0)
    z = torch.tensor([[True, True, True, False, True, False, False, True]]).expand(40_000, 8)
    keep, load = _skip_two(z, 3, g)
    assert (keep[:, z[0]].sum(-1) == 3).all() and (keep[:, ~z[0]].sum(-1) == 3).all()
    assert load[0].tolist() == [5, 5, 5, 3, 5, 3, 3, 5]
    freq = keep.double().mean(0)
    expect = torch.where(z[0], 3 / 5, 1.0).double()
    assert ((freq - expect).abs() < 4.5 * (expect * (1 - expect) / 40_000).sqrt() + 1e-12).all()


def test_two_expert_sinkhorn_matches_plain_sweeps() -> None:
    g = torch.Generator().manual_seed(0)
    log_p = torch.log_softmax(3 * torch.randn(5, 30, 2, dtype=torch.float64, generator=g), -1)
    target = torch.tensor([12.0, 18.0], dtype=torch.float64)
    fast, err = two_expert_sinkhorn(log_p, target, tol=1e-10, max_iter=100)
    assert err <= 1e-10
    x = log_p.numpy().copy()  # independent reference: alternating normalisation in numpy
    for _ in range(20_000):
        x = x - np.logaddexp.reduce(x, axis=-2, keepdims=True) + np.log(target.numpy())
        x = x - np.logaddexp.reduce(x, axis=-1, keepdims=True)
    np.testing.assert_allclose(fast.numpy(), x, atol=1e-8)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(("sinkhorn", "capacity"), [(False, 3), (True, 3), (True, 4)])
def test_fast_path_draws_the_same_distribution_as_the_general_path(method: str, sinkhorn: bool, capacity: int,
                                                                    monkeypatch) -> None:
    """E[keep * weight * onehot(expert)] agrees between the two paths (two-sample z-test).

    Capacity 4 > n / 2: the Sinkhorn-balanced proposal then has another Gumbel-Matching
    distribution than the unbalanced one (the general path once sampled the unbalanced one, z = -145).
    """
    g = torch.Generator().manual_seed(1)
    n, R = 6, 20_000
    logits = torch.stack([torch.zeros(n), 1.0 + 0.4 * torch.randn(n, generator=g)], -1).double()
    batch = logits.expand(R, n, 2)

    def stats() -> torch.Tensor:
        r = sample_routes(batch, method, tau=0.7, capacity=capacity, sinkhorn=sinkhorn,
                          generator=torch.Generator().manual_seed(7))
        onehot = torch.nn.functional.one_hot(r.expert, 2).double()
        return onehot * (r.weight * r.keep).unsqueeze(-1)

    fast = stats()
    monkeypatch.setattr(closed_forms, "ENABLED", False)  # the one switch of the k <= 2 closed forms
    general = stats()
    a, b = fast.reshape(R, -1), general.reshape(R, -1)
    se = (a.var(0) / R + b.var(0) / R).sqrt()
    diff = a.mean(0) - b.mean(0)
    z = torch.where(se == 0, torch.where(diff.abs() < 1e-12, 0.0, math.inf), diff / se)
    assert float(z.abs().max()) < 4.5, z


def test_fast_path_is_taken_and_gradients_flow() -> None:
    logits = torch.randn(3, 10, 2, requires_grad=True)
    r = sample_routes(logits, "gumbel_matching_iw", tau=0.5, generator=torch.Generator().manual_seed(0))
    assert (r.stats["tokens_per_expert"] == 5).all()
    (r.gate.sum() + r.log_prob.sum() + r.aux["balance"].sum()).backward()
    assert logits.grad is not None and float(logits.grad.abs().sum()) > 0


def test_a_pair_of_tiny_proposal_probability_can_still_be_drawn(monkeypatch) -> None:
    """Audit finding: float32 logistic noise never left +-15.9, so at tau = 0.1 the expert 2 logits
    behind (proposal probability 2e-9, importance weight 6e7 < MAX_WEIGHT) was never sampled. The
    most extreme uniform the sampler can draw must reach it."""
    real_rand = torch.rand

    def lowest(*args, **kwargs):
        return torch.zeros(args[0], dtype=kwargs.get("dtype", torch.float32), device=kwargs.get("device"))

    monkeypatch.setattr(torch, "rand", lowest)
    for method in ("sample", "sample_skip_iw"):
        r = sample_routes(torch.tensor([[0.0, 2.0]]), method, tau=0.1, capacity=1, generator=torch.Generator())
        assert r.expert.item() == 0, method
    monkeypatch.setattr(torch, "rand", real_rand)
