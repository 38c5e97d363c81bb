"""Tests for routelab.estimators (Kool et al. 2021, Sec. 2 eq. 2-3 and 6, App. B, C, D.5, Sec. 3, 3.1).

Only the public API is used: ``sample_routes``, ``METHODS``, ``UNBIASED_METHODS``,
``CAPPED_METHODS``, ``switch_balance_loss``, ``reinforce_objective``, ``gating_objective`` and
``EMABaseline``.

Independent truths used here:

* the unbiasedness contract ``E[sum_i keep_i w_i h(i, z_i)] = sum_ij p_ij h_ij`` with
  ``p = softmax(logits)`` (module docstring, App. B, C, D.5), checked by Monte Carlo with the
  empirical standard error, for a random table ``h`` and for every indicator table (per cell);
* the documented weight formulas (``p / q``, ``(p / q) n / n_kept``, eq. 3's
  ``(p / q) n_z / min(n_z, c)``, Sinkhorn marginals from an independent numpy Sinkhorn);
* App. C's uniform skipping: ``E[keep_i n_{z_i} / min(n_{z_i}, c)] = 1``;
* the REINFORCE gradient identity of eq. 2 / App. B against the exact gradient of
  ``E_p[(1/n) sum_i f(i, z_i)]`` obtained by enumerating all ``k^n`` joint assignments;
* hand-computed Switch balance losses and EMA recursions.

Monte Carlo draws are batched: the logits are expanded to ``[R, n, k]`` and every instance is an
independent sample. All randomness comes from seeded ``torch.Generator`` objects, so every test
is deterministic; the z-score thresholds were chosen so that a correct implementation with a
different random stream would still pass with overwhelming probability (every Monte Carlo test
here was re-run under 15 further seed offsets without a failure).
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from scipy.stats import norm

from routelab import Routes
from routelab.estimators import (
    CAPPED_METHODS,
    METHODS,
    UNBIASED_METHODS,
    EMABaseline,
    gating_objective,
    reinforce_objective,
    sample_routes,
    switch_balance_loss,
)
from routes_view import PerToken, per_token

ALL_METHODS = (
    "sample",
    "sample_skip",
    "sample_skip_iw",
    "gumbel_matching",
    "gumbel_matching_iw",
    "gumbel_matching_sh",
)
UNBIASED = ("sample", "sample_skip_iw", "gumbel_matching_iw")
CAPPED = ALL_METHODS[1:]
SKIPPING = ("sample_skip", "sample_skip_iw")
GUMBEL = ("gumbel_matching", "gumbel_matching_iw", "gumbel_matching_sh")

NEG_INF = float("-inf")
R = 20_000  # Monte Carlo samples per unbiasedness check
Z_MAX = 4.5  # |z| bound for one statistic
ALPHA = 2 * norm.sf(Z_MAX)  # the matching two-sided level, Bonferroni-split over many statistics


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread():
    """Run this module's many small tensor ops on one intra-op thread.

    The batched Monte Carlo tensors are small ([20000, 8, 3]); with two threads on a 2-core machine
    that is also running anything else, every op waits for a descheduled worker thread and this
    module slows down about 20x (measured: 316 s instead of 16 s). One thread is as fast on an idle
    machine and robust on a busy one. The previous setting is restored afterwards.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def z_bound(m: int) -> float:
    """Bonferroni-adjusted |z| bound for ``m`` simultaneous statistics (4.5 for m = 1)."""
    return float(norm.isf(ALPHA / (2 * m)))


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)




def zscores(samples: torch.Tensor, truth: torch.Tensor | float) -> torch.Tensor:
    """z-scores of the mean over dim 0 against ``truth`` with the empirical standard error.

    A statistic with zero spread gets z = 0 when it equals the truth and inf otherwise.
    """
    x = samples.to(torch.float64)
    truth = torch.as_tensor(truth, dtype=torch.float64)
    diff = x.mean(0) - truth
    se = x.std(0) / math.sqrt(x.shape[0])
    z = diff / se
    exact = se == 0
    return torch.where(exact, torch.where(diff.abs() < 1e-9, 0.0, math.inf), z)


def two_sample_z(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """z-scores of the difference of the means over dim 0 of two independent samples."""
    a, b = a.to(torch.float64), b.to(torch.float64)
    diff = a.mean(0) - b.mean(0)
    se = (a.var(0) / a.shape[0] + b.var(0) / b.shape[0]).sqrt()
    return torch.where(se == 0, torch.where(diff.abs() < 1e-9, 0.0, math.inf), diff / se)


def contributions(routes: Routes, k: int) -> torch.Tensor:
    """``[..., n, k]`` float64: ``keep_i * weight_i * 1{expert_i = j}``."""
    t = per_token(routes)
    onehot = torch.nn.functional.one_hot(t.expert, k).to(torch.float64)
    w = (t.weight.detach().to(torch.float64) * t.keep.to(torch.float64)).unsqueeze(-1)
    return onehot * w


def skewed_logits(n: int, k: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Every token prefers expert 0 by a logit gap in [0.6, 1.4] (p_i0 ~ 0.73 for k = 2, ~ 0.58 for
    k = 3): expert 0 is over-subscribed, so a capacity of n/k binds in most samples; the gaps are
    bounded so that even at tau = 0.3 every pair is sampled often enough for per-cell z-scores."""
    g = gen(1000 * n + k)
    noise = (0.2 * torch.randn(n, k, dtype=torch.float64, generator=g)).clamp(-0.2, 0.2)
    base = torch.zeros(k, dtype=torch.float64)
    base[0] = 1.0
    return (base + noise).to(dtype)


def random_table(n: int, k: int) -> torch.Tensor:
    return torch.randn(n, k, dtype=torch.float64, generator=gen(7 * n + k))


def proposal(logits: torch.Tensor, tau: float) -> torch.Tensor:
    return torch.softmax(logits.detach().to(torch.float64) / tau, -1)


def np_sinkhorn(q: np.ndarray, iters: int = 100_000) -> np.ndarray:
    """Independent Sinkhorn: rows sum to 1, columns to n/k (plain alternating normalisation)."""
    n, k = q.shape
    x = q / q.sum(1, keepdims=True)
    for _ in range(iters):
        x = x * (n / k) / x.sum(0, keepdims=True)
        x = x / x.sum(1, keepdims=True)
        if np.abs(x.sum(0) - n / k).max() < 1e-13:
            break
    return x


def gathered(table: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
    """``table[..., i, expert_i]`` with ``table`` broadcast over the batch of ``expert``."""
    t = table.expand(*expert.shape, table.shape[-1])
    return t.gather(-1, expert.unsqueeze(-1)).squeeze(-1)


def load_of_own_expert(expert: torch.Tensor, k: int) -> torch.Tensor:
    """``n_{z_i}``: how many tokens (kept or not) chose the expert of token i."""
    counts = torch.nn.functional.one_hot(expert, k).sum(-2)  # [..., k]
    return counts.gather(-1, expert)


# ============================================================================ constants


def test_method_lists() -> None:
    assert tuple(METHODS) == ALL_METHODS
    assert set(UNBIASED_METHODS) == set(UNBIASED)
    assert set(CAPPED_METHODS) == set(CAPPED)
    assert set(UNBIASED_METHODS) <= set(METHODS) and set(CAPPED_METHODS) <= set(METHODS)


# ============================================================================ 1. unbiasedness

# (n, k, capacity): capacity None is n/k (exactly balanced); (8, 3, 3) has one free slot
# (n not divisible by k, c = ceil(n/k)); (6, 2, 4) is a slack case (c > n/k) that still binds.
MC_CASES = [(6, 2, None), (8, 2, None), (6, 3, None), (8, 3, 3), (6, 2, 4)]
TAUS = (0.3, 1.0, 3.0)


@pytest.mark.parametrize("tau", TAUS)
@pytest.mark.parametrize("sinkhorn", [False, True], ids=["plain", "sinkhorn"])
@pytest.mark.parametrize("method", UNBIASED)
@pytest.mark.parametrize(("n", "k", "capacity"), MC_CASES, ids=lambda v: str(v))
def test_unbiased_methods_are_unbiased(n: int, k: int, capacity: int | None, method: str,
                                       sinkhorn: bool, tau: float) -> None:
    """E[sum_i keep_i w_i h(i, z_i)] = sum_ij p_ij h_ij, for a random h and for every indicator h."""
    logits = skewed_logits(n, k)
    p = torch.softmax(logits.to(torch.float64), -1)
    c = capacity if capacity is not None else n // k
    assert float(p[:, 0].sum()) > c, "test design: expert 0 must be over-subscribed in expectation"

    routes = sample_routes(logits.expand(R, n, k), method, tau=tau, capacity=capacity,
                           sinkhorn=sinkhorn, generator=gen(2024))
    # random table, written exactly as in the contract
    h = random_table(n, k)
    t = per_token(routes)
    w = t.weight.to(torch.float64) * t.keep.to(torch.float64)
    est = (w * gathered(h, t.expert)).sum(-1)
    z = float(zscores(est, (p * h).sum()))
    assert abs(z) < Z_MAX, f"mean {float(est.mean()):.4f} vs truth {float((p * h).sum()):.4f} (z = {z:.2f})"
    # every indicator table: E[keep_i w_i 1{z_i = j}] = p_ij
    zc = zscores(contributions(routes, k), p)
    assert float(zc.abs().max()) < z_bound(n * k), f"per-cell z-scores\n{zc}"


# ============================================================================ 2. biased methods


def two_groups_logits() -> torch.Tensor:
    # three tokens strongly prefer expert 0 (gap 3), three only weakly (gap 0.5); capacity 3.
    return torch.tensor([[3.0, 0.0]] * 3 + [[0.5, 0.0]] * 3)


# Why these settings (each gives |z| >> 6 for h = indicator of the over-subscribed expert 0):
# * sample_skip at tau = 1 (q = p): every token's weight is n / n_kept instead of eq. 3's
#   n_z / min(n_z, c); expert 0 is over-subscribed (E n_0 ~ 5.8 > c = 4), so its kept tokens are
#   under-weighted and the estimate of sum_i p_i0 is far too small (z ~ -60).
# * gumbel_matching at tau = 3: the sample always puts exactly c = 4 tokens on expert 0 and the
#   weights p / q only undo the temperature, so the estimate stays near c while the truth is
#   sum_i p_i0 ~ 5.8 (z ~ -500).
# * gumbel_matching_sh at tau = 0.5 with two groups of tokens: the Gumbel-Matching sample almost
#   always gives the c = 3 slots of expert 0 to the three strong tokens, while the Sinkhorn
#   marginals (an entropic relaxation) give the weak tokens noticeably more mass on expert 0 than
#   they actually receive; dividing by these marginals under-weights the weak tokens' rare visits
#   to expert 0 (z ~ -25). With homogeneous tokens and c = n/k the Sinkhorn marginals are close
#   to the true ones (Sec. 2.3) and the bias would be too small to see reliably.
BIASED_CASES = [
    pytest.param("sample_skip", "gumbel_skewed", 1.0, "sample_skip_iw", id="sample_skip"),
    pytest.param("gumbel_matching", "gumbel_skewed", 3.0, "gumbel_matching_iw", id="gumbel_matching"),
    pytest.param("gumbel_matching_sh", "two_groups", 0.5, "gumbel_matching_iw", id="gumbel_matching_sh"),
]


@pytest.mark.parametrize(("method", "problem", "tau", "unbiased_twin"), BIASED_CASES)
def test_biased_methods_are_measurably_biased(method: str, problem: str, tau: float,
                                              unbiased_twin: str) -> None:
    logits = skewed_logits(8, 2) if problem == "gumbel_skewed" else two_groups_logits()
    n, k = logits.shape
    p = torch.softmax(logits.to(torch.float64), -1)
    truth = p[:, 0].sum()
    z = {}
    for m in (method, unbiased_twin):
        routes = sample_routes(logits.expand(R, n, k), m, tau=tau, generator=gen(99))
        z[m] = float(zscores(contributions(routes, k)[..., 0].sum(-1), truth))
    assert abs(z[method]) > 6, f"{method} should be visibly biased, z = {z[method]:.2f}"
    # control: the unbiased method on the same problem is not
    assert abs(z[unbiased_twin]) < Z_MAX, f"{unbiased_twin}: z = {z[unbiased_twin]:.2f}"


# ============================================================================ 3. structure


@pytest.mark.parametrize("sinkhorn", [False, True], ids=["plain", "sinkhorn"])
@pytest.mark.parametrize("method", ALL_METHODS)
def test_shapes_dtypes_and_fields(method: str, sinkhorn: bool) -> None:
    n, k = 6, 2
    logits = torch.randn(2, 3, n, k, generator=gen(1), requires_grad=True)
    r = sample_routes(logits, method, tau=0.7, sinkhorn=sinkhorn, generator=gen(2))
    assert isinstance(r, Routes) and r.num_slots == 1
    for name in ("expert", "keep", "weight", "gate", "log_prob"):
        assert getattr(r, name).shape == (2, 3, n, 1), name
    assert r.expert.dtype == torch.long and r.keep.dtype == torch.bool
    for name in ("weight", "gate", "log_prob"):
        assert getattr(r, name).dtype == torch.float32, name
    assert ((r.expert >= 0) & (r.expert < k)).all()
    assert r.aux["balance"].shape == (2, 3)
    assert r.stats["tokens_per_expert"].shape == (2, 3, k)
    assert r.stats["dropped_fraction"].shape == (2, 3)
    assert r.batch_shape == (2, 3) and r.num_tokens == n


@pytest.mark.parametrize(("n", "k", "capacity"),
                         [(8, 2, None), (6, 3, None), (8, 3, 3), (6, 2, 4), (9, 3, 5), (20, 10, None), (21, 10, 3)])
@pytest.mark.parametrize("method", CAPPED)
def test_capacity_is_respected(method: str, n: int, k: int, capacity: int | None) -> None:
    B = 300
    logits = skewed_logits(n, k).expand(B, n, k)
    r = sample_routes(logits, method, tau=0.5, capacity=capacity, generator=gen(3))
    c = capacity if capacity is not None else n // k
    t = per_token(r)
    counts = torch.nn.functional.one_hot(t.expert, k).mul(t.keep.unsqueeze(-1)).sum(-2)  # kept per expert
    assert (counts <= c).all()
    assert torch.equal(r.stats["tokens_per_expert"], counts)
    assert torch.equal(r.stats["tokens_per_expert"], r.tokens_per_expert(k))
    torch.testing.assert_close(r.stats["dropped_fraction"], (~t.keep).float().mean(-1))
    if method in GUMBEL:
        assert r.keep.all(), "Gumbel-Matching places every token"
        if capacity is None:
            assert (counts == n // k).all(), "capacity n/k: exactly balanced"
    else:
        before = torch.nn.functional.one_hot(t.expert, k).sum(-2)  # chosen, before skipping
        assert torch.equal(counts, before.clamp(max=c)), "skipping keeps min(n_j, c) tokens per expert"
        assert (~r.keep).any(), "test design: capacity should bind in some instances"


@pytest.mark.parametrize("method", SKIPPING)
def test_skipping_never_exceeds_capacity_on_a_large_batch(method: str) -> None:
    n, k, B = 64, 2, 20_000
    logits = torch.zeros(n, k)
    logits[:, 0] = 1.1  # ~48 tokens choose expert 0, capacity 32: many tokens compete for the cut
    t = per_token(sample_routes(logits.expand(B, n, k), method, generator=gen(2)))
    counts = torch.nn.functional.one_hot(t.expert, k).mul(t.keep.unsqueeze(-1)).sum(-2)
    assert int(counts.max()) <= n // k


def test_sample_keeps_everything_and_ignores_capacity() -> None:
    n, k, B = 8, 2, 300
    logits = skewed_logits(n, k).expand(B, n, k)
    for capacity in (None, 4, 5):
        r = sample_routes(logits, "sample", tau=0.5, capacity=capacity, generator=gen(4))
        assert r.keep.all()
        assert (r.stats["dropped_fraction"] == 0).all()
        # with this skew the unconstrained samples overload expert 0 in many instances
        assert (r.stats["tokens_per_expert"][..., 0] > 4).any()
    # n not divisible by k is fine for the uncapped method
    r = sample_routes(torch.randn(7, 2, generator=gen(0)), "sample", generator=gen(5))
    assert r.keep.all() and r.num_slots == 1 and r.expert.shape == (7, 1)


@pytest.mark.parametrize(("n", "k", "c"), [(8, 2, 4), (20, 10, 2)])  # few and many experts
@pytest.mark.parametrize("method", SKIPPING)
def test_skipping_is_uniform_within_each_expert(method: str, n: int, k: int, c: int) -> None:
    """App. C: a token at expert j is kept with probability min(n_j, c) / n_j."""
    Rs = 10_000
    logits = skewed_logits(n, k)
    t = per_token(sample_routes(logits.expand(Rs, n, k), method, tau=1.0, generator=gen(6)))
    load = load_of_own_expert(t.expert, k).to(torch.float64)
    ratio = t.keep.to(torch.float64) * load / load.clamp(max=c)
    z = zscores(ratio, 1.0)
    assert float(z.abs().max()) < z_bound(n), z


@pytest.mark.parametrize("tau", [0.5, 2.0])
@pytest.mark.parametrize("sinkhorn", [False, True], ids=["plain", "sinkhorn"])
@pytest.mark.parametrize("method", ["sample", "sample_skip", "sample_skip_iw", "gumbel_matching", "gumbel_matching_sh"])
def test_weights_follow_the_documented_formulas(method: str, sinkhorn: bool, tau: float) -> None:
    """Weights p/q, (p/q) n/n_kept, (p/q) n_z/min(n_z, c), with q the (Sinkhorn-balanced) proposal."""
    n, k, c, B = 6, 3, 2, 200
    logits = skewed_logits(n, k, torch.float64)
    t = per_token(sample_routes(logits.expand(B, n, k), method, tau=tau, sinkhorn=sinkhorn, generator=gen(8)))
    p = torch.softmax(logits, -1)
    q = proposal(logits, tau)
    q_sh = torch.from_numpy(np_sinkhorn(q.numpy()))
    if sinkhorn or method == "gumbel_matching_sh":
        q = q_sh
    base = gathered(p / q, t.expert)
    if method == "sample_skip":
        n_kept = t.keep.sum(-1, keepdim=True).to(torch.float64)
        base = base * n / n_kept
    elif method == "sample_skip_iw":
        load = load_of_own_expert(t.expert, k).to(torch.float64)
        base = base * load / load.clamp(max=c)
    expected = torch.where(t.keep, base, torch.zeros_like(base))
    torch.testing.assert_close(t.weight, expected, rtol=1e-4, atol=1e-9)


def test_gumbel_matching_iw_weights_are_positive_and_finite() -> None:
    n, k = 6, 3
    r = sample_routes(skewed_logits(n, k).expand(500, n, k), "gumbel_matching_iw", tau=0.5, generator=gen(9))
    assert torch.isfinite(r.weight).all() and (r.weight > 0).all()


@pytest.mark.parametrize("method", ALL_METHODS)
def test_weight_is_detached_and_zero_where_dropped(method: str) -> None:
    n, k, B = 8, 2, 200
    logits = skewed_logits(n, k).expand(B, n, k).clone().requires_grad_()
    r = sample_routes(logits, method, tau=0.5, generator=gen(10))
    assert not r.weight.requires_grad and r.weight.grad_fn is None
    assert (r.weight[~r.keep] == 0).all()
    assert (r.weight[r.keep] > 0).all() and torch.isfinite(r.weight).all()


@pytest.mark.parametrize("method", ALL_METHODS)
def test_gate_and_log_prob_are_router_probabilities_with_gradients(method: str) -> None:
    n, k, B = 6, 3, 4
    logits = torch.randn(B, n, k, dtype=torch.float64, generator=gen(11), requires_grad=True)
    r = sample_routes(logits, method, tau=0.8, generator=gen(12))
    t = per_token(r)
    p = torch.softmax(logits.detach(), -1)
    onehot = torch.nn.functional.one_hot(t.expert, k).to(torch.float64)
    torch.testing.assert_close(t.log_prob.detach(), gathered(torch.log(p), t.expert))
    torch.testing.assert_close(r.gate.detach(), torch.exp(r.log_prob.detach()))
    assert r.gate.requires_grad and r.log_prob.requires_grad
    # d log p_{i z_i} / d a_ij = 1{j = z_i} - p_ij ;  d p_{i z_i} / d a_ij = p_{i z_i} (1{j = z_i} - p_ij)
    (g_lp,) = torch.autograd.grad(r.log_prob.sum(), logits, retain_graph=True)
    torch.testing.assert_close(g_lp, onehot - p)
    (g_gate,) = torch.autograd.grad(r.gate.sum(), logits)
    torch.testing.assert_close(g_gate, t.gate.detach().unsqueeze(-1) * (onehot - p))


@pytest.mark.parametrize(("k", "sinkhorn"), [(2, False), (3, False), (3, True)])
@pytest.mark.parametrize("method", ALL_METHODS)
def test_aux_balance_is_the_switch_loss(method: str, k: int, sinkhorn: bool) -> None:
    """On the router's ``p``, whatever the proposal ``q`` (tau, Sinkhorn): with k = 2 experts every
    method takes the closed form of two experts, so k = 3 (a mutation review: ``q`` in place of ``p``
    survived, a loss without gradient at any tau)."""
    n, B = 9 if k == 3 else 8, 50
    logits = (skewed_logits(n, k, torch.float64).expand(B, n, k)
              + 0.5 * torch.randn(B, n, k, dtype=torch.float64, generator=gen(13))).requires_grad_()
    r = sample_routes(logits, method, tau=0.5, sinkhorn=sinkhorn, generator=gen(14))
    p = torch.softmax(logits, -1)
    # f_j: share of tokens whose router argmax is j, whatever was sampled or kept; P_j carries the gradient
    f = torch.nn.functional.one_hot(logits.detach().argmax(-1), k).sum(-2).to(torch.float64) / n
    expected = k * (f * p.mean(-2)).sum(-1)
    torch.testing.assert_close(r.aux["balance"], expected)
    (g,) = torch.autograd.grad(r.aux["balance"].sum(), logits)
    (g_ref,) = torch.autograd.grad(expected.sum(), logits)
    torch.testing.assert_close(g, g_ref)


@pytest.mark.parametrize("method", GUMBEL)
def test_aux_balance_is_one_for_uniform_router_and_balanced_routing(method: str) -> None:
    r = sample_routes(torch.zeros(5, 8, 4), method, generator=gen(15))
    assert (r.stats["tokens_per_expert"] == 2).all()
    torch.testing.assert_close(r.aux["balance"], torch.ones(5))


@pytest.mark.parametrize("sinkhorn", [False, True], ids=["plain", "sinkhorn"])
@pytest.mark.parametrize("method", ALL_METHODS)
def test_determinism(method: str, sinkhorn: bool) -> None:
    n, k, B = 6, 2, 40
    logits = torch.randn(B, n, k, generator=gen(16))
    a = sample_routes(logits, method, tau=0.7, sinkhorn=sinkhorn, generator=gen(17))
    torch.manual_seed(12345)  # the global RNG must play no part
    b = sample_routes(logits, method, tau=0.7, sinkhorn=sinkhorn, generator=gen(17))
    for name in ("expert", "keep", "weight", "gate", "log_prob"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert torch.equal(a.aux["balance"], b.aux["balance"])
    c = sample_routes(logits, method, tau=0.7, sinkhorn=sinkhorn, generator=gen(18))
    assert not torch.equal(a.expert, c.expert), "a different seed should give different routes"


def test_zero_dim_tensor_tau_is_the_number() -> None:
    logits = torch.randn(10, 6, 2, generator=gen(19))
    for method in ALL_METHODS:
        a = sample_routes(logits, method, tau=0.7, generator=gen(20))
        b = sample_routes(logits, method, tau=torch.tensor(0.7), generator=gen(20))
        assert torch.equal(a.expert, b.expert) and torch.equal(a.weight, b.weight), method


def test_tau_tensor_sets_the_proposal_per_instance_for_sample() -> None:
    """With tau of the batch shape, instance b is sampled from softmax(a / tau_b), weight p / q_b."""
    n, k, Rt = 6, 2, 6000
    taus = torch.tensor([0.3, 1.0, 3.0])
    logits = skewed_logits(n, k)
    t = per_token(sample_routes(logits.expand(Rt, 3, n, k), "sample", tau=taus.expand(Rt, 3), generator=gen(21)))
    onehot = torch.nn.functional.one_hot(t.expert, k).to(torch.float64)  # [Rt, 3, n, k]
    p = torch.softmax(logits.to(torch.float64), -1)
    for b, tau in enumerate(taus.tolist()):
        q = proposal(logits, tau)
        z = zscores(onehot[:, b], q)
        assert float(z.abs().max()) < z_bound(3 * n * k), (tau, z)
        torch.testing.assert_close(t.weight[:, b].to(torch.float64), gathered(p / q, t.expert[:, b]),
                                   rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("method", ALL_METHODS)
def test_tau_tensor_matches_separate_scalar_calls_in_distribution(method: str) -> None:
    """The generator streams differ, so compare per-instance Monte Carlo frequencies and weighted
    frequencies of the batched-tau call with those of separate calls at each scalar tau."""
    n, k, Rt = 6, 2, 4000
    taus = [0.3, 1.0, 3.0]
    logits = skewed_logits(n, k)
    batched = sample_routes(logits.expand(Rt, 3, n, k), method, tau=torch.tensor(taus).expand(Rt, 3),
                            generator=gen(22))
    m = 3 * 2 * n * k
    for b, t in enumerate(taus):
        single = sample_routes(logits.expand(Rt, n, k), method, tau=t, generator=gen(23 + b))
        for stat in (lambda r: torch.nn.functional.one_hot(per_token(r).expert, k), lambda r: contributions(r, k)):
            sb = stat(batched)[:, b]
            ss = stat(single)
            z = two_sample_z(sb, ss)
            assert float(z.abs().max()) < z_bound(m), (t, z)


# ============================================================================ 4. training signals


def exact_objective_and_grad(logits: torch.Tensor, f: torch.Tensor) -> tuple[float, torch.Tensor]:
    """E_{z ~ prod_i p_i}[(1/n) sum_i f(i, z_i)] and its gradient, by enumerating all k^n z."""
    n, k = logits.shape
    a = logits.detach().clone().requires_grad_()
    p = torch.softmax(a, -1)
    total = a.new_zeros(())
    for z in itertools.product(range(k), repeat=n):
        prob = torch.stack([p[i, z[i]] for i in range(n)]).prod()
        total = total + prob * sum(f[i, z[i]] for i in range(n)) / n
    (g,) = torch.autograd.grad(total, a)
    return float(total.detach()), g


GRAD_LOGITS = torch.tensor([[1.2, 0.0], [0.8, -0.2], [0.5, 0.3]], dtype=torch.float64)  # all prefer 0; c = 2
GRAD_LOSS = torch.tensor([[0.3, 1.5], [2.0, -0.4], [1.0, 0.1]], dtype=torch.float64)


@pytest.mark.parametrize("baseline", [0.0, 0.8], ids=["no-baseline", "baseline"])
@pytest.mark.parametrize(("method", "tau", "sinkhorn"), [
    ("sample", 1.0, False),
    ("sample", 0.5, True),
    ("sample_skip_iw", 1.0, False),
    ("sample_skip_iw", 2.0, True),
    ("gumbel_matching_iw", 1.0, False),
    ("gumbel_matching_iw", 0.5, False),
])
def test_reinforce_gradient_is_unbiased(method: str, tau: float, sinkhorn: bool, baseline: float) -> None:
    """Eq. 2 / 3 / 6: the mean of the surrogate's gradient is grad E_p[(1/n) sum_i f(i, z_i)]."""
    n, k = GRAD_LOGITS.shape
    Rg = 20_000
    value, g_exact = exact_objective_and_grad(GRAD_LOGITS, GRAD_LOSS)
    torch.testing.assert_close(g_exact, torch.autograd.functional.jacobian(
        lambda a: (torch.softmax(a, -1) * GRAD_LOSS).sum() / n, GRAD_LOGITS))
    logits = GRAD_LOGITS.expand(Rg, n, k).clone().requires_grad_()
    routes = sample_routes(logits, method, tau=tau, capacity=2, sinkhorn=sinkhorn, generator=gen(30))
    t = per_token(routes)
    loss = gathered(GRAD_LOSS, t.expert)
    obj = reinforce_objective(routes, loss, baseline=baseline)
    assert obj.shape == (Rg,)
    # the samples are independent, so the gradient of the sum holds each sample's gradient
    (g,) = torch.autograd.grad(obj.sum(), logits, retain_graph=True)
    z = zscores(g, g_exact)
    assert float(z.abs().max()) < z_bound(n * k), f"mean {g.mean(0)}\nexact {g_exact}\nz {z}"
    # the surrogate's value is the weighted mean loss, itself unbiased for E_p[(1/n) sum_i f]
    w = t.weight * t.keep
    torch.testing.assert_close(obj.detach(), (w * loss).mean(-1))
    assert abs(float(zscores(obj.detach(), value))) < Z_MAX
    if baseline:
        (g0,) = torch.autograd.grad(reinforce_objective(routes, loss).sum(), logits)
        assert not torch.allclose(g, g0), "the baseline should change individual gradients"


def test_reinforce_gradients_for_the_experts_and_the_router() -> None:
    n, k, B = 6, 2, 5
    logits = torch.randn(B, n, k, dtype=torch.float64, generator=gen(31), requires_grad=True)
    routes = sample_routes(logits, "sample_skip_iw", tau=0.7, generator=gen(32))
    loss = torch.rand(B, n, dtype=torch.float64, generator=gen(33)).requires_grad_()
    b = torch.rand(B, dtype=torch.float64, generator=gen(34))  # one baseline per run
    obj = reinforce_objective(routes, loss, baseline=b)
    g_logits, g_loss = torch.autograd.grad(obj.sum(), (logits, loss))
    t = per_token(routes)
    w = (t.weight * t.keep).detach()
    torch.testing.assert_close(g_loss, w / n)  # experts: d/d f_i = w_i keep_i / n
    p = torch.softmax(logits.detach(), -1)
    onehot = torch.nn.functional.one_hot(t.expert, k).to(torch.float64)
    adv = (loss.detach() - b.unsqueeze(-1)) * w / n
    torch.testing.assert_close(g_logits, adv.unsqueeze(-1) * (onehot - p))  # eq. 2 with baseline
    # the value is the weighted mean loss whatever the baseline (the baseline term is zero in value)
    torch.testing.assert_close(obj.detach(), (w * loss.detach()).mean(-1))


def _router_grad(routes: Routes, logits: torch.Tensor, loss: torch.Tensor, baseline) -> torch.Tensor:
    obj = reinforce_objective(routes, loss, baseline=baseline)
    assert obj.shape == routes.batch_shape
    (g,) = torch.autograd.grad(obj.sum(), logits, retain_graph=True)
    return g


@pytest.mark.parametrize(("method", "dtype", "scale"), [
    ("gumbel_matching_iw", torch.float16, 6e4), ("gumbel_matching", torch.float16, 6e4),
    ("gumbel_matching_iw", torch.float32, 3e38), ("gumbel_matching", torch.bfloat16, 3e38),
])
def test_reinforce_of_a_route_of_probability_zero_is_finite(method: str, dtype: torch.dtype, scale: float) -> None:
    """A balanced sample can force a token onto an expert whose log-probability is -inf in the
    logits' dtype (here both tokens prefer expert 0 and capacity 1 sends one to expert 1). The
    score-function term ``log p - stopgrad(log p)`` was ``-inf - (-inf) = NaN``; it is 0 in value,
    and the gradient is the one a float64 computation of the same objective gives."""
    logits = torch.tensor([[scale, -scale], [scale, -scale]], dtype=dtype, requires_grad=True)
    routes = sample_routes(logits, method, generator=torch.Generator().manual_seed(0))
    assert torch.isneginf(routes.log_prob).any()
    loss = torch.tensor([1.0, 2.0], dtype=dtype)
    objective = reinforce_objective(routes, loss, 0.5)
    (grad,) = torch.autograd.grad(objective, logits)
    assert torch.isfinite(objective) and torch.isfinite(grad).all()
    # float64 reference: the same routes, weights and losses; log p from the logits in float64 (finite).
    wide = logits.detach().double().requires_grad_(True)
    log_p = torch.log_softmax(wide, -1).gather(-1, routes.expert)[..., 0]
    w = routes.weight.double()[..., 0] * routes.keep[..., 0]
    advantage = loss.double() - 0.5
    reference = (w * (loss.double() + advantage * (log_p - log_p.detach()))).mean()
    (want,) = torch.autograd.grad(reference, wide)
    torch.testing.assert_close(objective.double(), reference.detach(), rtol=1e-3, atol=0)
    torch.testing.assert_close(grad.double(), want, rtol=1e-3, atol=1e-6)


def test_reinforce_forward_mode_equals_reverse_mode() -> None:
    """The score-function term is zero in value with log p's derivative in both modes: jvp gives
    <grad, v> and the Hessian (forward over reverse) runs (a review found the term dropped by jvp)."""
    from torch.func import grad, hessian, jvp

    g = torch.Generator().manual_seed(0)
    n, E = 6, 4
    theta, v = torch.randn(n, E, generator=g, dtype=torch.float64), torch.randn(n, E, generator=g, dtype=torch.float64)
    expert = torch.randint(0, E, (n, 1), generator=g)
    loss = torch.rand(n, generator=g, dtype=torch.float64)

    def objective(t: torch.Tensor) -> torch.Tensor:
        log_prob = torch.log_softmax(t, -1).gather(-1, expert)
        routes = Routes(expert=expert, gate=log_prob.exp(), keep=torch.ones_like(expert, dtype=torch.bool),
                        weight=torch.ones_like(log_prob), log_prob=log_prob)
        return reinforce_objective(routes, loss, 0.3)

    _, forward = jvp(objective, (theta,), (v,))
    torch.testing.assert_close(forward, (grad(objective)(theta) * v).sum())
    assert torch.isfinite(hessian(objective)(theta)).all()


def test_reinforce_baseline_shapes_agree() -> None:
    """A number, a [...] tensor (one per run), a [..., 1] tensor and a full [..., n] tensor holding
    the same values give the same router gradient (the baseline acts only through the gradient)."""
    n, k, B = 6, 2, 4
    logits = torch.randn(B, n, k, dtype=torch.float64, generator=gen(35), requires_grad=True)
    routes = sample_routes(logits, "sample", tau=0.7, generator=gen(36))
    loss = torch.rand(B, n, dtype=torch.float64, generator=gen(37))
    g_scalar = _router_grad(routes, logits, loss, 0.25)
    g_none = _router_grad(routes, logits, loss, 0.0)
    assert not torch.allclose(g_scalar, g_none)
    for b in (torch.tensor(0.25, dtype=torch.float64), torch.full((B,), 0.25, dtype=torch.float64),
              torch.full((B, 1), 0.25, dtype=torch.float64), torch.full((B, n), 0.25, dtype=torch.float64)):
        torch.testing.assert_close(_router_grad(routes, logits, loss, b), g_scalar, msg=str(tuple(b.shape)))
    # one different baseline per run: [B], [B, 1] and [B, n] agree
    b = torch.rand(B, dtype=torch.float64, generator=gen(38))
    g_run = _router_grad(routes, logits, loss, b)
    torch.testing.assert_close(_router_grad(routes, logits, loss, b.unsqueeze(-1)), g_run)
    torch.testing.assert_close(_router_grad(routes, logits, loss, b.unsqueeze(-1).expand(B, n)), g_run)


def test_reinforce_with_an_integer_reward_keeps_a_fractional_baseline() -> None:
    """A review case: the baseline took the loss's dtype, so with a 0/1 integer reward 0.7 became
    0 and the gradient silently was the one without baseline. Oracle: the same reward as floats.
    A NaN baseline is an error (it gave a NaN objective)."""
    n, k, B = 6, 2, 4
    logits = torch.randn(B, n, k, dtype=torch.float64, generator=gen(42), requires_grad=True)
    routes = sample_routes(logits, "sample", tau=0.7, generator=gen(43))
    reward = torch.randint(0, 2, (B, n), generator=gen(44))
    expected = _router_grad(routes, logits, reward.double(), 0.7)
    torch.testing.assert_close(_router_grad(routes, logits, reward, 0.7), expected)
    assert not torch.allclose(expected, _router_grad(routes, logits, reward.double(), 0.0))
    with pytest.raises(ValueError, match="baseline values are not finite"):
        reinforce_objective(routes, reward.double(), baseline=float("nan"))


@pytest.mark.parametrize("B", [4, 6])
def test_reinforce_per_token_baseline(B: int) -> None:
    n, k = 6, 2
    logits = torch.randn(B, n, k, dtype=torch.float64, generator=gen(39), requires_grad=True)
    routes = sample_routes(logits, "sample", tau=0.7, generator=gen(40))
    loss = torch.rand(B, n, dtype=torch.float64, generator=gen(41))
    b = torch.linspace(0.0, 1.0, n, dtype=torch.float64)  # one baseline per token, shared by the runs
    # Per token needs the loss's rank: [B, n] (or [1, n]) gives the per-token meaning ...
    expected = _router_grad(routes, logits, loss, b.expand(B, n))
    torch.testing.assert_close(_router_grad(routes, logits, loss, b.unsqueeze(0)), expected)
    # ... while a lower-rank baseline must be one per run; [n] is refused unless it is the batch shape.
    if B != n:
        with pytest.raises(ValueError, match="one per run"):
            reinforce_objective(routes, loss, baseline=b)


@pytest.mark.parametrize("method", ["sample_skip", "sample_skip_iw", "gumbel_matching_iw"])
def test_gating_objective(method: str) -> None:
    n, k, B = 8, 2, 6
    logits = (skewed_logits(n, k, torch.float64).expand(B, n, k)).clone().requires_grad_()
    routes = sample_routes(logits, method, tau=0.5, generator=gen(40))
    out = torch.randn(B, n, dtype=torch.float64, generator=gen(41))
    t = per_token(routes)
    loss = (t.gate * out - 1.0) ** 2  # the loss of the gated expert output
    w = t.weight * t.keep
    keep = t.keep.to(torch.float64)
    torch.testing.assert_close(gating_objective(routes, loss), (w * loss).mean(-1))
    torch.testing.assert_close(gating_objective(routes, loss, use_weights=False), (keep * loss).mean(-1))
    assert (~routes.keep).any() or method == "gumbel_matching_iw"
    # the router gets its gradient through the gate inside the loss
    (g,) = torch.autograd.grad(gating_objective(routes, loss).sum(), logits)
    p = torch.softmax(logits.detach(), -1)
    onehot = torch.nn.functional.one_hot(t.expert, k).to(torch.float64)
    dloss_dgate = 2 * (t.gate.detach() * out - 1.0) * out
    coef = w * dloss_dgate * t.gate.detach() / n
    torch.testing.assert_close(g, coef.unsqueeze(-1) * (onehot - p))


def test_ema_baseline_recursion() -> None:
    xs = [torch.tensor([1.0, -2.0, 3.0]), torch.tensor([2.0, 0.0, 1.0]), torch.tensor([5.0, 4.0, -1.0]),
          torch.tensor([0.5, 0.5, 0.5])]
    ema = EMABaseline()
    assert ema.decay == 0.99
    out0 = ema(xs[0])
    torch.testing.assert_close(out0, torch.zeros(3))  # first call: no value seen yet (never the observation itself)
    b = xs[0].clone()
    for x in xs[1:]:
        torch.testing.assert_close(ema(x), b)  # the baseline before seeing x ...
        b = 0.99 * b + 0.01 * x  # ... then b <- 0.99 b + 0.01 x, elementwise
    torch.testing.assert_close(ema(torch.zeros(3)), b)
    # numerically: after x0 = 1, x1 = 3 the baseline is 0.99 + 0.03 = 1.02
    e = EMABaseline()
    e(torch.tensor(1.0))
    e(torch.tensor(3.0))
    torch.testing.assert_close(e(torch.tensor(0.0)), torch.tensor(1.02))


def test_ema_baseline_custom_decay_and_detach() -> None:
    e = EMABaseline(decay=0.5)
    x = torch.tensor([2.0, 4.0], requires_grad=True)
    first = e(x * 1.0)
    assert not first.requires_grad
    e(torch.tensor([0.0, 0.0]))
    torch.testing.assert_close(e(torch.tensor([0.0, 0.0])), torch.tensor([1.0, 2.0]))
    e0 = EMABaseline(decay=0.0)  # decay 0: the previous observation
    e0(torch.tensor(1.0))
    e0(torch.tensor(7.0))
    torch.testing.assert_close(e0(torch.tensor(0.0)), torch.tensor(7.0))


@pytest.mark.parametrize("decay", [1.0, -0.01, 1.5, float("nan")])
def test_ema_baseline_bad_decay(decay: float) -> None:
    with pytest.raises(ValueError, match="decay"):
        EMABaseline(decay)


def test_switch_balance_loss_hand_computed() -> None:
    probs = torch.tensor([[0.7, 0.3], [0.4, 0.6], [0.5, 0.5], [0.2, 0.8]], dtype=torch.float64)
    # argmax experts 0, 1, 0 (tie: lower index), 1: f = (1/2, 1/2), P = (0.45, 0.55): 2 * (0.225 + 0.275) = 1
    torch.testing.assert_close(switch_balance_loss(probs), torch.tensor(1.0, dtype=torch.float64))
    skew = torch.tensor([[0.7, 0.3], [0.6, 0.4], [0.9, 0.1], [0.2, 0.8]], dtype=torch.float64)
    # f = (3/4, 1/4), P = (0.6, 0.4): 2 * (0.45 + 0.1) = 1.1
    torch.testing.assert_close(switch_balance_loss(skew), torch.tensor(1.1, dtype=torch.float64))
    # uniform router: 1 ; everything on one expert: k
    uni = torch.full((6, 3), 1 / 3, dtype=torch.float64)
    torch.testing.assert_close(switch_balance_loss(uni), torch.tensor(1.0, dtype=torch.float64))
    hot = torch.tensor([[1.0, 0.0, 0.0]] * 6, dtype=torch.float64)
    torch.testing.assert_close(switch_balance_loss(hot), torch.tensor(3.0, dtype=torch.float64))
    # batched
    torch.testing.assert_close(switch_balance_loss(torch.stack([probs, skew])),
                               torch.tensor([1.0, 1.1], dtype=torch.float64))
    # gradient: d/dP only (f is a count): d loss / d probs_ij = k f_j / n
    pr = skew.clone().requires_grad_()
    (g,) = torch.autograd.grad(switch_balance_loss(pr), pr)
    torch.testing.assert_close(g, (2 * torch.tensor([0.75, 0.25], dtype=torch.float64) / 4).expand(4, 2))
    # the old (expert, keep) arguments are refused, naming them
    with pytest.raises(TypeError, match="expert"):
        switch_balance_loss(probs, torch.tensor([0, 1, 1, 1]))
    with pytest.raises(TypeError, match="keep"):
        switch_balance_loss(probs, keep=torch.ones(4, dtype=torch.bool))


# ============================================================================ 5. bad input


def test_unknown_method_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="unknown method") as info:
        sample_routes(torch.zeros(4, 2), "topk", generator=gen(0))
    for m in ALL_METHODS:
        assert m in str(info.value)


@pytest.mark.parametrize("method", ALL_METHODS)
@pytest.mark.parametrize("tau", [0.0, -1.0, float("nan"), float("inf"), torch.tensor(0.0),
                                 torch.tensor([1.0, 0.0]), torch.tensor([1.0, float("nan")])],
                         ids=["zero", "negative", "nan", "inf", "tensor-zero", "tensor-has-zero", "tensor-has-nan"])
def test_bad_tau(method: str, tau) -> None:
    with pytest.raises(ValueError, match="tau"):
        sample_routes(torch.zeros(2, 4, 2), method, tau=tau, generator=gen(0))


@pytest.mark.parametrize("shape", [(3,), (1,), (2, 1), (4, 2)])
def test_tau_tensor_of_wrong_shape(shape: tuple[int, ...]) -> None:
    logits = torch.zeros(2, 4, 2)  # batch shape (2,)
    with pytest.raises(ValueError, match="batch shape"):
        sample_routes(logits, "sample", tau=torch.ones(shape), generator=gen(0))


@pytest.mark.parametrize("method", ALL_METHODS)
@pytest.mark.parametrize(("bad", "match"), [(float("nan"), "NaN"), (float("inf"), r"\+inf")], ids=["nan", "inf"])
def test_bad_logits(method: str, bad: float, match: str) -> None:
    logits = torch.zeros(3, 4, 2)
    logits[1, 2, 0] = bad
    with pytest.raises(ValueError, match=match):
        sample_routes(logits, method, generator=gen(0))


@pytest.mark.parametrize("method", CAPPED)
def test_capped_method_needs_capacity_when_k_does_not_divide_n(method: str) -> None:
    with pytest.raises(ValueError, match="capacity"):
        sample_routes(torch.zeros(7, 2), method, generator=gen(0))
    r = sample_routes(torch.zeros(7, 2), method, capacity=4, generator=gen(0))  # ceil(7/2) works
    assert r.stats["tokens_per_expert"].max() <= 4


@pytest.mark.parametrize("method", ALL_METHODS)
@pytest.mark.parametrize("capacity", [2, 0])
def test_capacity_too_small(method: str, capacity: int) -> None:
    with pytest.raises(ValueError, match="capacity"):
        sample_routes(torch.zeros(6, 2), method, capacity=capacity, generator=gen(0))


@pytest.mark.parametrize("objective", [reinforce_objective, gating_objective])
@pytest.mark.parametrize("shape", [(4, 5), (4, 6, 1), (6,), (2, 6)])
def test_objectives_reject_loss_of_wrong_shape(objective, shape: tuple[int, ...]) -> None:
    routes = sample_routes(torch.zeros(4, 6, 2), "sample", generator=gen(0))
    with pytest.raises(ValueError, match="loss must have"):
        objective(routes, torch.zeros(shape))


@pytest.mark.parametrize("objective", [reinforce_objective, gating_objective])
def test_objectives_reject_multi_slot_routes(objective) -> None:
    routes = Routes.from_expert(torch.tensor([[0, 1], [1, 0], [1, 1]]), add_slot_dim=False)  # [tokens, 2]
    assert routes.num_slots == 2 and routes.num_tokens == 3
    with pytest.raises(ValueError, match="got 2 slots per token"):
        objective(routes, torch.zeros(3))  # the per-token loss shape: only the slots are wrong


# ============================================================================ 6. edge cases


@pytest.mark.parametrize("sinkhorn", [False, True], ids=["plain", "sinkhorn"])
@pytest.mark.parametrize("method", ALL_METHODS)
def test_single_expert(method: str, sinkhorn: bool) -> None:
    logits = torch.randn(3, 5, 1, generator=gen(50), requires_grad=True)
    r = sample_routes(logits, method, tau=0.4, sinkhorn=sinkhorn, generator=gen(51))
    assert (r.expert == 0).all() and r.keep.all()
    torch.testing.assert_close(r.weight, torch.ones(3, 5, 1))
    torch.testing.assert_close(r.gate.detach(), torch.ones(3, 5, 1))
    torch.testing.assert_close(r.log_prob.detach(), torch.zeros(3, 5, 1))
    assert (r.stats["tokens_per_expert"] == 5).all()


@pytest.mark.parametrize("method", ALL_METHODS)
def test_as_many_experts_as_tokens(method: str) -> None:
    n = k = 4
    B = 200
    logits = skewed_logits(n, k).expand(B, n, k)
    r = sample_routes(logits, method, tau=0.5, generator=gen(52))
    counts = r.stats["tokens_per_expert"]
    if method in CAPPED:
        assert (counts <= 1).all()
    if method in GUMBEL:
        assert r.keep.all()
        assert torch.equal(per_token(r).expert.sort(-1).values, torch.arange(n).expand(B, n)), "a permutation"
    if method == "sample":
        assert r.keep.all()


@pytest.mark.parametrize("method", UNBIASED)
def test_as_many_experts_as_tokens_is_unbiased(method: str) -> None:
    n = k = 3
    logits = skewed_logits(n, k)
    p = torch.softmax(logits.to(torch.float64), -1)
    r = sample_routes(logits.expand(R, n, k), method, tau=1.0, generator=gen(53))
    zc = zscores(contributions(r, k), p)
    assert float(zc.abs().max()) < z_bound(n * k), zc


def forbidden_logits() -> torch.Tensor:
    logits = skewed_logits(6, 3).clone()
    logits[0, 2] = logits[1, 2] = logits[2, 2] = NEG_INF  # tokens 0-2 may not use expert 2
    logits[3, 0] = NEG_INF  # token 3 may not use the popular expert
    return logits


@pytest.mark.parametrize("sinkhorn", [False, True], ids=["plain", "sinkhorn"])
@pytest.mark.parametrize("method", ALL_METHODS)
def test_forbidden_pairs_are_never_chosen(method: str, sinkhorn: bool) -> None:
    logits = forbidden_logits()
    B = 2000
    r = sample_routes(logits.expand(B, 6, 3), method, tau=0.7, sinkhorn=sinkhorn, generator=gen(54))
    chosen = torch.nn.functional.one_hot(per_token(r).expert, 3).bool().any(0)  # [n, k] ever chosen
    assert not chosen[torch.isinf(logits)].any()
    assert chosen[~torch.isinf(logits)].all(), "every allowed pair should occur"
    assert torch.isfinite(r.weight).all() and torch.isfinite(r.log_prob).all()
    assert torch.isfinite(r.aux["balance"]).all()


@pytest.mark.parametrize("sinkhorn", [False, True], ids=["plain", "sinkhorn"])
@pytest.mark.parametrize("method", UNBIASED)
def test_forbidden_pairs_unbiased(method: str, sinkhorn: bool) -> None:
    logits = forbidden_logits()
    n, k = logits.shape
    p = torch.softmax(logits.to(torch.float64), -1)
    r = sample_routes(logits.expand(R, n, k), method, tau=0.7, sinkhorn=sinkhorn, generator=gen(55))
    zc = zscores(contributions(r, k), p)
    assert float(zc.abs().max()) < z_bound(n * k), zc


@pytest.mark.parametrize("method", ALL_METHODS)
def test_capacity_larger_than_n_never_binds(method: str) -> None:
    """With capacity >= n nothing is skipped and the balancing constraint is void: the weights are
    p / q with q = softmax(logits / tau) (Sinkhorn marginals for gumbel_matching_sh), and
    Gumbel-Matching samples are independent draws from q."""
    n, k, B, tau = 7, 2, 4000, 0.7
    logits = skewed_logits(n, k, torch.float64)
    r = sample_routes(logits.expand(B, n, k), method, tau=tau, capacity=100, generator=gen(56))
    assert r.keep.all()
    p = torch.softmax(logits, -1)
    q = proposal(logits, tau)
    if method == "gumbel_matching_sh":
        q_w = torch.from_numpy(np_sinkhorn(q.numpy()))
    else:
        q_w = q
    t = per_token(r)
    torch.testing.assert_close(t.weight, gathered(p / q_w, t.expert), rtol=1e-4, atol=1e-9)
    z = zscores(torch.nn.functional.one_hot(t.expert, k), q)
    assert float(z.abs().max()) < z_bound(n * k), z


@pytest.mark.parametrize("objective", [reinforce_objective, gating_objective])
def test_objectives_take_routes_with_one_slot(objective) -> None:
    """sample_routes returns the [..., n, 1] layout of every router; a one-slot record built by hand
    from the same per-token fields (Routes.from_expert) gives exactly the same objective."""
    logits = torch.randn(3, 6, 2, generator=gen(7), requires_grad=True)
    routes = sample_routes(logits, "sample_skip_iw", capacity=4, generator=gen(8))
    assert routes.num_slots == 1 and routes.expert.shape == (3, 6, 1) and routes.num_tokens == 6
    assert routes.batch_shape == (3,)
    t = per_token(routes)
    by_hand = Routes.from_expert(t.expert, gate=t.gate, keep=t.keep, weight=t.weight, log_prob=t.log_prob)
    for name in PerToken._fields:
        assert torch.equal(getattr(by_hand, name), getattr(routes, name)), name
    assert torch.equal(routes.dropped_fraction(), (~t.keep).float().mean(-1))
    assert torch.equal(by_hand.dropped_fraction(), routes.dropped_fraction())
    loss = torch.rand(3, 6, generator=gen(9))
    torch.testing.assert_close(objective(by_hand, loss), objective(routes, loss), rtol=0, atol=0)
    with pytest.raises(ValueError, match="loss must have"):
        objective(routes, loss.unsqueeze(-1))


@pytest.mark.parametrize(("method", "sinkhorn"), [("sample", True), ("sample_skip_iw", True),
                                                  ("gumbel_matching_iw", True), ("gumbel_matching_sh", False)])
def test_sinkhorn_with_an_expert_no_token_may_use_routes_the_others(method, sinkhorn):
    """Audit finding: the compiled Sinkhorn kernel divided by the empty column's sum (ZeroDivisionError)."""
    ninf = float("-inf")
    logits = torch.tensor([[0.0, 1.0, ninf], [1.0, 0.0, ninf], [0.5, 0.0, ninf], [0.0, 0.0, ninf]])
    r = sample_routes(logits, method, capacity=2, sinkhorn=sinkhorn, generator=torch.Generator().manual_seed(0))
    assert bool((r.expert < 2).all()) and torch.isfinite(r.weight).all()


def test_gumbel_matching_samples_the_sinkhorn_proposal_when_capacity_is_slack():
    """Audit finding: with capacity > n / k, sinkhorn=True sampled the unbalanced proposal. Oracle:
    eq. 4 solved by enumerating every assignment, on a proposal balanced by an independent Sinkhorn."""
    import itertools

    logits = torch.tensor([[2.0, 0.0, 0.0], [1.5, 0.0, 0.5], [2.0, 0.5, 0.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    n, k, c, R = 4, 3, 2, 20_000
    r = sample_routes(logits.expand(R, n, k), "gumbel_matching", capacity=c, sinkhorn=True,
                      generator=torch.Generator().manual_seed(0))
    got = torch.nn.functional.one_hot(r.expert.squeeze(-1), k).double().sum(-2)  # [R, k] tokens per expert
    q = torch.softmax(logits, -1)
    for _ in range(2000):
        q = q * (n / k) / q.sum(0, keepdim=True)
        q = q / q.sum(1, keepdim=True)
    feasible = torch.tensor([a for a in itertools.product(range(k), repeat=n)
                             if max(a.count(j) for j in range(k)) <= c])
    g = torch.Generator().manual_seed(1)
    gumbel = -torch.log(-torch.log(torch.rand(R, n, k, generator=g, dtype=torch.float64)))
    best = feasible[(q.log() + gumbel)[:, torch.arange(n), feasible].sum(-1).argmax(-1)]
    want = torch.nn.functional.one_hot(best, k).double().sum(-2)
    se = (got.var(0) / R + want.var(0) / R).sqrt()
    z = (got.mean(0) - want.mean(0)) / se
    assert float(z.abs().max()) < 4.5, z


def test_estimator_inputs_of_the_wrong_shape_are_named() -> None:
    """Review cases: batched logits reached gumbel_matching_routes' unpacking ("too many values to
    unpack"), and EMABaseline silently broadcast a value of another shape into its average."""
    from routelab.estimators import EMABaseline, gumbel_matching_routes

    with pytest.raises(ValueError, match=r"logits must have shape \[tokens, E\]"):
        gumbel_matching_routes(torch.randn(2, 10, 4), generator=gen(45))
    baseline = EMABaseline()
    baseline(torch.ones(3))
    with pytest.raises(ValueError, match=r"got \(2, 3\) after \(3,\)"):
        baseline(torch.zeros(2, 3))


def test_two_expert_gumbel_matching_weights_stay_unbiased_at_tiny_temperatures() -> None:
    """Review finding: the two-expert shortcut formed s / tau + noise in float32, so at
    |s| / tau = 1e7 the noise was rounded to whole numbers and E[w 1{z = 1}] ranged 0.57-0.92
    around the true 0.731. Monte Carlo (20000 draws): within 4 standard errors for every token."""
    from routelab.estimators import sample_routes

    draws, n = 20000, 4
    for dtype, tau in ((torch.float32, 1e-7), (torch.float64, 1e-15)):
        logits = torch.tensor([0.0, 1.0], dtype=dtype).expand(draws, n, 2)
        r = sample_routes(logits, "gumbel_matching_iw", tau=tau, generator=torch.Generator().manual_seed(0))
        est = (r.expert.squeeze(-1) == 1).double() * r.weight.squeeze(-1).double()
        p1 = torch.sigmoid(torch.tensor(1.0, dtype=torch.float64))
        z = (est.mean(0) - p1) / (est.std(0) / draws**0.5)
        assert (z.abs() < 4).all(), (dtype, z)


def test_a_temperature_outside_the_logits_dtype_names_it() -> None:
    from routelab.estimators import sample_routes

    for tau in (1e-50, 1e300):
        with pytest.raises(ValueError, match="not representable in the logits' dtype torch.float32"):
            sample_routes(torch.randn(4, 3), "sample", tau=tau, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="tau must be a finite number > 0"):
        sample_routes(torch.randn(4, 3), "sample", tau=-1.0, generator=torch.Generator().manual_seed(0))


# ===================================== pairs no balanced sample can use; temperatures below resolution

# tokens 0 and 1 may only use expert 0
STRANDED = torch.tensor([[0.0, NEG_INF], [0.5, NEG_INF], [0.0, 0.0], [0.3, 1.0]], dtype=torch.float64)


@pytest.mark.filterwarnings("ignore:gumbel_matching_iw. the -inf logits")
def test_unreachable_mass_is_reported_and_warned_where_gumbel_matching_iw_cannot_be_unbiased() -> None:
    """Capacity 2: tokens 0 and 1 fill expert 0, so no balanced sample gives it to token 2 or 3,
    whose router mass there (p_20 + p_30) no importance weight can recover: stated, not lost silently."""
    n, k = STRANDED.shape
    p = torch.softmax(STRANDED.double(), -1)
    missed = float(p[2:, 0].sum()) / n  # per token, as the stat is
    with pytest.warns(RuntimeWarning, match="unreachable_mass"):
        r = sample_routes(STRANDED.expand(200, n, k), "gumbel_matching_iw", capacity=2, generator=gen(60))
    assert torch.allclose(r.stats["unreachable_mass"].double(), torch.tensor(missed, dtype=torch.float64), atol=1e-6)
    # The estimate is unbiased for the reachable pairs and misses exactly that mass.
    est = contributions(sample_routes(STRANDED.expand(R, n, k), "gumbel_matching_iw", capacity=2,
                                      generator=gen(61)), k)
    reachable = p.clone()
    reachable[2:, 0] = 0.0
    zc = zscores(est, reachable)
    assert float(zc.abs().max()) < z_bound(n * k), zc


@pytest.mark.parametrize("method", ["sample", "sample_skip_iw"])
def test_unreachable_mass_is_zero_for_the_sampling_methods_on_the_same_input(method: str) -> None:
    r = sample_routes(STRANDED.expand(50, 4, 2), method, capacity=2, generator=gen(62))
    assert float(r.stats["unreachable_mass"].abs().max()) == 0.0


@pytest.mark.parametrize(("logits", "tau", "capacity"), [
    ([[0.0, 1.0]] * 4, 1e-20, 3),             # two experts, closed form: s / tau = 1e20
    ([[1e15, 1e15, 0.0]] * 4, 1.0, 2),        # general solver: a spread of 1e15 tau
], ids=["two-experts", "general"])
def test_gumbel_matching_iw_stays_unbiased_when_tau_is_far_below_the_logit_spread(
        logits: list, tau: float, capacity: int) -> None:
    """The noise of size tau falls under the float64 resolution of the scores: without the floor
    (BALANCED_TAU_FLOOR) every token tied and the last index took the spare slot (|z| > 50)."""
    x = torch.tensor(logits, dtype=torch.float64)
    n, k = x.shape
    p = torch.softmax(x, -1)
    r = sample_routes(x.expand(R, n, k), "gumbel_matching_iw", tau=tau, capacity=capacity, generator=gen(63))
    zc = zscores(contributions(r, k), p)
    assert float(zc.abs().max()) < z_bound(n * k), zc


def test_the_temperature_floor_ignores_a_tokens_logit_offset_and_survives_spreads_beyond_the_range() -> None:
    """A constant added to one token's logits changes no distribution, so not the sample either
    (the floor once read the instance's spread: one token far below the rest raised tau 20x)."""
    base = torch.randn(8, 4, dtype=torch.float64, generator=gen(70))
    shifted = base.clone()
    shifted[7] -= 1e9
    for logits in (base, shifted):
        r = sample_routes(logits, "gumbel_matching_iw", tau=0.05, generator=gen(71))
        s = sample_routes(base, "gumbel_matching_iw", tau=0.05, generator=gen(71))
        assert torch.equal(r.expert, s.expert) and torch.allclose(r.weight, s.weight)
    # rows that each span 1e300 within float64 while the instance spans beyond it: still floored
    huge = torch.tensor([[0.9e308, 0.9e308 - 1e300, 0.9e308 - 2e300], [-0.9e308, -0.9e308 + 1e300, -0.9e308]] * 2,
                        dtype=torch.float64)
    p = torch.softmax(huge, -1)
    r = sample_routes(huge.expand(R // 4, 4, 3), "gumbel_matching_iw", tau=1.0, capacity=2, generator=gen(72))
    zc = zscores(contributions(r, 3), p)
    assert float(zc.abs().max()) < z_bound(12), zc
