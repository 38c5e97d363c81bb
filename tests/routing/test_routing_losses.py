"""routelab.routing.losses against independent truth.

Oracles:

* ``switch_balance``: ``E * sum_j f_j P_j`` written out in numpy for both ``fraction_of``
  options (``f`` over the counted slots or over the tokens), with batch dimensions and a keep
  mask; its gradient is ``E f_e / n`` for every token (``f`` is detached), checked in closed
  form.
* ``cv_squared``: numpy's population ``var / mean^2``.
* ``noisy_topk_load``: App. A of Shazeer et al. (2017), eq. 8-11, twice: the closed form
  ``Phi((clean_i - kth_excluding(H, k, i)) / std_i)`` from a plain sort of the other experts,
  and a Monte Carlo estimate of the probability that expert ``i`` is in the top ``k`` when only
  its own noise is redrawn (a full top-k of the perturbed vector, no kth_excluding formula).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import norm

from routelab.routing import switch_balance
from routelab.routing.losses import cv_squared, noisy_topk_load

FAST = settings(max_examples=40, deadline=None)
seeds = st.integers(0, 2**31 - 1)


# ------------------------------------------------------------------------- switch_balance


def np_switch_balance(probs: np.ndarray) -> float:
    """Fedus et al. (2021) eq. 4 written out: f_e = share of tokens whose argmax is e, P_e = mean prob."""
    n, E = probs.shape
    if n == 0:
        return 0.0
    counts = np.zeros(E)
    for t in range(n):
        best = 0
        for e in range(1, E):
            if probs[t, e] > probs[t, best]:
                best = e
        counts[best] += 1
    P = probs.mean(0)
    return float(E * sum(counts[j] / n * P[j] for j in range(E)))


@FAST
@given(B=st.sampled_from(((), (2,), (2, 3))), n=st.integers(0, 8), E=st.integers(1, 5), seed=seeds)
def test_switch_balance_formula_and_gradient(B, n, E, seed) -> None:
    g = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(*B, n, E, generator=g, dtype=torch.float64), -1).requires_grad_(True)
    loss = switch_balance(probs)
    assert loss.shape == B
    nb = math.prod(B)
    P = probs.detach().reshape(nb, n, E).numpy()
    want = [np_switch_balance(P[b]) for b in range(P.shape[0])]
    np.testing.assert_allclose(loss.detach().reshape(-1).numpy(), want, rtol=1e-12, atol=1e-15)
    if n:
        (grad,) = torch.autograd.grad(loss.sum(), probs)
        for b in range(P.shape[0]):
            f = np.bincount(P[b].argmax(-1), minlength=E) / n
            np.testing.assert_allclose(grad.reshape(nb, n, E)[b].numpy(), np.broadcast_to(E * f / n, (n, E)),
                                       rtol=1e-12, atol=1e-15)


def test_switch_balance_hand_computed() -> None:
    """n = 4 tokens, E = 2. Argmax experts 0, 0 (a tie goes to the lower index), 1, 0:
    f = (3/4, 1/4), P = (0.6, 0.4) -> 2 (0.45 + 0.1) = 1.1."""
    probs = torch.tensor([[0.9, 0.1], [0.5, 0.5], [0.3, 0.7], [0.7, 0.3]], dtype=torch.float64)
    assert float(switch_balance(probs)) == pytest.approx(1.1, rel=1e-12)
    assert float(switch_balance(torch.full((4, 4), 0.25))) == pytest.approx(1.0)  # uniform router: 1
    hot = torch.tensor([[1.0, 0.0, 0.0]] * 6, dtype=torch.float64)
    assert float(switch_balance(hot)) == pytest.approx(3.0)  # one expert takes everything: E
    assert switch_balance(torch.zeros(2, 0, 3)).tolist() == [0.0, 0.0]


def test_switch_balance_acts_where_the_routing_is_balanced_by_construction() -> None:
    """The issue it fixes: a Gumbel-Matching assignment keeps n/E tokens per expert, so a loss counting
    the *kept* tokens is the constant 1 with zero gradient. The router's argmax is not balanced, so the
    Switch loss is above 1 and pushes the router towards the under-used expert."""
    from routelab.estimators import sample_routes

    x = torch.linspace(-1, 1, 20, dtype=torch.float64)
    logits = torch.stack([torch.zeros_like(x), 0.3 + x], -1).requires_grad_(True)  # prefers expert 1
    r = sample_routes(logits, "gumbel_matching_iw", tau=0.01, generator=torch.Generator().manual_seed(0))
    assert r.stats["tokens_per_expert"].tolist() == [10, 10]
    p = torch.softmax(logits, -1).detach().numpy()
    value = float(r.aux["balance"].detach())
    assert value == pytest.approx(np_switch_balance(p), rel=1e-12)
    assert value > 1.0
    (g,) = torch.autograd.grad(r.aux["balance"], logits)
    assert float(g[:, 1].sum()) > 0  # descending it lowers the over-used expert's logits


# ------------------------------------------------------------------------- cv_squared


@FAST
@given(x=st.lists(st.floats(0.0, 1e3, allow_nan=False, allow_infinity=False), min_size=0, max_size=10))
def test_cv_squared_equals_numpy(x) -> None:
    t = torch.tensor(x, dtype=torch.float64)
    got = float(cv_squared(t))
    if len(x) <= 1:
        assert got == 0.0
        return
    a = np.asarray(x, dtype=np.float32).astype(np.float64)  # cv_squared computes in float32
    mean = a.mean()
    want = np.var(a) / (mean**2 + 1e-10)
    assert got == pytest.approx(want, rel=1e-4, abs=1e-6), (got, want)


def test_cv_squared_is_population_not_sample_variance() -> None:
    x = torch.tensor([1.0, 2.0, 3.0, 6.0])
    assert float(cv_squared(x)) == pytest.approx(3.5 / 9.0, rel=1e-6)  # sample variance would give 14/3 / 9
    assert float(cv_squared(torch.full((5,), 2.0))) == 0.0
    assert float(cv_squared(torch.tensor([0.0, 0.0]))) == 0.0  # eps keeps 0 / 0 finite


# ------------------------------------------------------------------------- noisy_topk_load


def kth_excluding_load(clean: np.ndarray, noisy: np.ndarray, std: np.ndarray, k: int) -> np.ndarray:
    """[n, E] P(x, i) = Phi((clean_i - kth largest of the other experts' noisy logits) / std_i)."""
    n, E = clean.shape
    P = np.ones((n, E))
    if k >= E:
        return P
    for x in range(n):
        for i in range(E):
            others = sorted((noisy[x, j] for j in range(E) if j != i), reverse=True)
            P[x, i] = norm.cdf((clean[x, i] - others[k - 1]) / std[x, i])
    return P


def call_load(clean, noisy, std, k):
    E = clean.shape[-1]
    top_values = noisy.topk(min(k + 1, E), dim=-1).values
    return noisy_topk_load(clean, noisy, std, top_values, k)


def draw(seed: int, n: int, E: int):
    g = torch.Generator().manual_seed(seed)
    clean = torch.randn(n, E, generator=g, dtype=torch.float64)
    std = torch.rand(n, E, generator=g, dtype=torch.float64) + 0.3
    noisy = clean + torch.randn(n, E, generator=g, dtype=torch.float64) * std
    return clean, noisy, std


@FAST
@given(n=st.integers(1, 6), E=st.integers(1, 6), k=st.integers(1, 6), seed=seeds)
def test_noisy_topk_load_equals_kth_excluding_formula(n, E, k, seed) -> None:
    k = min(k, E)
    clean, noisy, std = draw(seed, n, E)
    got = call_load(clean, noisy, std, k)
    want = kth_excluding_load(clean.numpy(), noisy.numpy(), std.numpy(), k).sum(0)
    np.testing.assert_allclose(got.detach().numpy(), want, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_noisy_topk_load_is_the_probability_of_staying_in_the_top_k(k) -> None:
    """Per token (n = 1 calls): redraw only expert i's noise M times, count how often i is in
    the top k of the perturbed vector; compare with P(x, i) within 5 binomial SE."""
    n, E, M = 4, 5, 20000
    clean, noisy, std = draw(100 + k, n, E)
    g = torch.Generator().manual_seed(7)
    for x in range(n):
        got = call_load(clean[x : x + 1], noisy[x : x + 1], std[x : x + 1], k)
        for i in range(E):
            H = noisy[x].expand(M, E).clone()
            H[:, i] = clean[x, i] + torch.randn(M, generator=g, dtype=torch.float64) * std[x, i]
            in_top = (H.topk(k, dim=-1).indices == i).any(-1).double().mean().item()
            p = float(got[i])
            se = math.sqrt(max(p * (1 - p), 1e-4) / M)
            assert abs(in_top - p) <= 5 * se, f"token {x}, expert {i}: Monte Carlo {in_top}, load term {p}"


def test_noisy_topk_load_every_expert_when_k_is_E_and_gradients() -> None:
    clean, noisy, std = draw(3, 4, 3)
    torch.testing.assert_close(call_load(clean, noisy, std, 3), torch.full((3,), 4.0, dtype=torch.float64))
    # The load is differentiable in clean and std (the noisy values and thresholds held fixed):
    # finite differences against autograd, and the analytic derivative phi(z) / std for clean.
    c = clean.clone().requires_grad_(True)
    s = std.clone().requires_grad_(True)
    top = noisy.topk(3, dim=-1).values
    assert torch.autograd.gradcheck(lambda a, b: noisy_topk_load(a, noisy, b, top, 2), (c, s))
    (gc,) = torch.autograd.grad(noisy_topk_load(c, noisy, std, top, 2).sum(), c)
    P = kth_excluding_load(clean.numpy(), noisy.numpy(), std.numpy(), 2)
    z = norm.ppf(np.clip(P, 1e-300, 1 - 1e-16))
    np.testing.assert_allclose(gc.numpy(), norm.pdf(z) / std.numpy(), rtol=1e-6, atol=1e-9)
