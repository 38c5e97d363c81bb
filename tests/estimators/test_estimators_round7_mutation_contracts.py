"""Round-7 mutation contracts of the sampling estimators (Kool, Maddison, Mnih 2021).

Each test checks sample_routes, the training signals or the EMA baseline against an independent
truth: hand-computed values, brute-force enumeration of the balanced assignments of a tiny
instance, or Monte Carlo with a fixed generator and a tolerance of a few standard errors.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from test_two_experts import _one_thread  # noqa: F401 (the autouse one-thread fixture)

from routelab.estimators import EMABaseline, gating_objective, reinforce_objective, sample_routes

# ----------------------------------------------------------------------------- EMA baseline


def test_ema_baseline_hand_values() -> None:
    """The baseline of a step is 0 first, then decay * old + (1 - decay) * new (eq. 2's EMA), by hand."""
    b = EMABaseline(decay=0.9)
    assert float(b(torch.tensor(1.0))) == 0.0  # nothing seen yet: 0, not the value itself
    assert float(b(torch.tensor(2.0))) == pytest.approx(1.0)
    assert float(b(torch.tensor(3.0))) == pytest.approx(0.9 * 1.0 + 0.1 * 2.0)
    assert float(b.value) == pytest.approx(0.9 * 1.1 + 0.1 * 3.0)


def test_ema_baseline_first_call_is_zero_per_run() -> None:
    """Batched values: the first baseline is 0 for every run, whatever the observed values."""
    b = EMABaseline()
    out = b(torch.tensor([5.0, -2.0, 7.0]))
    assert torch.equal(out, torch.zeros(3))


# ----------------------------------------------------------------------------- signals


def test_reinforce_gradient_equals_score_function_reference() -> None:
    """grad of the surrogate w.r.t. the logits is (1/n) sum_i w_i (f_i - b) grad log p(z_i) (eq. 2),
    computed here directly from log_softmax."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 3, dtype=torch.float64, generator=g, requires_grad=True)
    routes = sample_routes(logits, "sample", tau=1.5, generator=g)
    f = torch.tensor([1.0, 2.0, 0.5, -1.0, 3.0], dtype=torch.float64)
    b = 0.7
    obj = reinforce_objective(routes, f, baseline=b)
    w = routes.weight.squeeze(-1)
    assert float(obj.detach()) == pytest.approx(float((w * f).mean()), rel=1e-12)
    (grad,) = torch.autograd.grad(obj, logits)
    lp = torch.log_softmax(logits, -1).gather(-1, routes.expert).squeeze(-1)
    (ref,) = torch.autograd.grad((w * (f - b) * lp).mean(), logits)
    torch.testing.assert_close(grad, ref, rtol=1e-10, atol=1e-12)


def test_gating_objective_without_weights_is_plain_mean() -> None:
    """use_weights=False ignores the importance weights: the mean of the kept losses times n_kept / n."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(6, 3, dtype=torch.float64, generator=g)
    routes = sample_routes(logits, "sample", tau=3.0, generator=g)  # weights p/q != 1
    assert not torch.allclose(routes.weight, torch.ones_like(routes.weight))
    f = torch.arange(6, dtype=torch.float64)
    assert float(gating_objective(routes, f, use_weights=False)) == pytest.approx(2.5)
    w = routes.weight.squeeze(-1)
    assert float(gating_objective(routes, f)) == pytest.approx(float((w * f).mean()))


# ----------------------------------------------------------------------------- skip statistics


@pytest.mark.parametrize("k", [2, 3])
def test_skip_stats_and_plain_average_weight(k: int) -> None:
    """sample_skip: tokens_per_expert counts only kept tokens (at most c), dropped_fraction is the
    dropped share, and at tau = 1 (p = q) each kept weight is n / n_kept (the plain average)."""
    g = torch.Generator().manual_seed(5 + k)
    n, c = 6, 3 if k == 2 else 2
    logits = torch.tensor([[0.0] * (k - 1) + [4.0]] * n, dtype=torch.float64).expand(50, n, k)
    r = sample_routes(logits, "sample_skip", capacity=c, generator=g)
    keep = r.keep.squeeze(-1)
    n_kept = keep.sum(-1)
    assert bool((n_kept < n).any())  # some instance dropped tokens
    counts = r.stats["tokens_per_expert"]
    assert torch.equal(counts.sum(-1), n_kept)
    assert bool((counts <= c).all())
    ref = torch.zeros(50, k, dtype=torch.long).scatter_add_(-1, r.expert.squeeze(-1), keep.long())
    assert torch.equal(counts, ref)
    torch.testing.assert_close(r.stats["dropped_fraction"], 1 - n_kept.float() / n)
    w = r.weight.squeeze(-1)
    expected = torch.where(keep, n / n_kept.to(torch.float64).unsqueeze(-1), torch.zeros_like(w))
    torch.testing.assert_close(w, expected, rtol=1e-9, atol=0)


# ----------------------------------------------------------------------------- unreachable mass


def test_unreachable_mass_is_per_token_hand_value() -> None:
    """Token 0 may use only expert 0, capacity 1: token 1 (uniform over 3 experts) never gets expert 0,
    missing p = 1/3 of its mass; per token over n = 2 tokens that is 1/6 (not 1/9: divide by n, not k)."""
    logits = torch.tensor([[0.0, -math.inf, -math.inf], [0.0, 0.0, 0.0]], dtype=torch.float64)
    with pytest.warns(RuntimeWarning, match="unreachable_mass"):
        r = sample_routes(logits, "gumbel_matching_iw", capacity=1, generator=torch.Generator().manual_seed(0))
    assert float(r.stats["unreachable_mass"]) == pytest.approx(1 / 6, rel=1e-12)


# ----------------------------------------------------------------------------- Gumbel-Matching


def test_balanced_tau_floor_uses_largest_row_spread() -> None:
    """The temperature floor is 1e-9 times the *largest* row spread of the instance: with spreads 1e9
    and 2 it is 1, so the biased gumbel_matching weight p/q of the second row (p = q at T = 1) is 1."""
    logits = torch.tensor([[0.0, 1e9], [0.0, 2.0]], dtype=torch.float64)
    r = sample_routes(logits, "gumbel_matching", tau=1e-12, capacity=1, generator=torch.Generator().manual_seed(1))
    assert r.expert.squeeze(-1).tolist() == [1, 0]
    assert float(r.weight[1, 0]) == pytest.approx(1.0, rel=1e-9)
    assert int(r.stats["weights_clamped"]) == 0


def _sinkhorn_reference(q: torch.Tensor, sweeps: int = 5000) -> torch.Tensor:
    """Plain alternating row/column normalisation to rows 1 and columns n / k."""
    n, k = q.shape[-2:]
    x = q.clone()
    for _ in range(sweeps):
        x = x * (n / k) / x.sum(-2, keepdim=True)
        x = x / x.sum(-1, keepdim=True)
    return x


def test_gumbel_matching_sh_weight_is_p_over_sinkhorn_marginal() -> None:
    """gumbel_matching_sh: weight = p_z / q_sh(z) with q_sh the Sinkhorn-balanced proposal (Sec. 2.3)."""
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(6, 3, dtype=torch.float64, generator=g) * 2
    tau = 1.3
    r = sample_routes(logits, "gumbel_matching_sh", tau=tau, capacity=2, generator=g)
    p = torch.softmax(logits, -1)
    q_sh = _sinkhorn_reference(torch.softmax(logits / tau, -1))
    z = r.expert
    expected = (p.gather(-1, z) / q_sh.gather(-1, z))
    torch.testing.assert_close(r.weight, expected, rtol=1e-4, atol=0)


def _iw_marginals(logits: torch.Tensor, capacity: int, tau: float, draws: int, seed: int):
    """Monte Carlo of E[w_i 1[z_i = j]] for gumbel_matching_iw, with its standard error."""
    batch = logits.expand(draws, *logits.shape)
    r = sample_routes(batch, "gumbel_matching_iw", tau=tau, capacity=capacity,
                      generator=torch.Generator().manual_seed(seed))
    onehot = torch.zeros(draws, *logits.shape, dtype=torch.float64).scatter_(-1, r.expert, 1.0)
    x = onehot * r.weight.to(torch.float64)
    return x.mean(0), x.std(0) / math.sqrt(draws)


@pytest.mark.parametrize("n,k,c", [(3, 3, 1), (4, 2, 2), (3, 2, 2)])
def test_gumbel_matching_iw_is_unbiased_per_pair(n: int, k: int, c: int) -> None:
    """App. D.5: E[w_i 1[z_i = j]] = p_ij for every pair (Monte Carlo, 5 standard errors + 1e-3).
    (4, 2, 2) is the closed form with centred scores (n = 2c), (3, 2, 2) the one without."""
    g = torch.Generator().manual_seed(10 * n + k)
    logits = torch.randn(n, k, dtype=torch.float64, generator=g) + torch.arange(k, dtype=torch.float64)
    mean, se = _iw_marginals(logits, c, 0.8, 40000, seed=n * k + c)
    p = torch.softmax(logits, -1)
    assert bool(((mean - p).abs() <= 5 * se + 1e-3).all()), (mean, p, se)


def test_two_expert_gumbel_matching_matches_brute_force() -> None:
    """n = 3, k = 2, capacity 2: the closed-form sample is the argmax over all feasible assignments
    of sum (scores + Gumbel) (eq. 4), enumerated here with our own noise; per-token marginals agree
    within 5 standard errors."""
    n, c, draws, tau = 3, 2, 40000, 1.0
    logits = torch.tensor([[0.0, 1.5], [0.0, 1.0], [0.0, -0.5]], dtype=torch.float64)
    r = sample_routes(logits.expand(draws, n, 2), "gumbel_matching", tau=tau, capacity=c,
                      generator=torch.Generator().manual_seed(11))
    ours = r.expert.squeeze(-1).to(torch.float64).mean(0)
    g = torch.Generator().manual_seed(12)
    gumbel = -torch.log(-torch.log(torch.rand(draws, n, 2, dtype=torch.float64, generator=g)))
    pert = logits / tau + gumbel
    feasible = [z for z in itertools.product((0, 1), repeat=n) if max(z.count(0), z.count(1)) <= c]
    zs = torch.tensor(feasible)  # [A, n]
    total = pert.gather(-1, zs.T.unsqueeze(0).expand(draws, n, len(feasible))).sum(1)  # [draws, A]
    ref = zs[total.argmax(-1)].to(torch.float64).mean(0)
    se = (ours * (1 - ours) / draws + ref * (1 - ref) / draws).sqrt()
    assert bool(((ours - ref).abs() <= 5 * se + 1e-3).all()), (ours, ref)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("k", [2, 3])
def test_half_precision_logits_keep_float32_weights(dtype: torch.dtype, k: int) -> None:
    """Half-precision logits: gate and log_prob in the logits' dtype, the importance weight in float32
    (a weight of 2 ** 20, far below MAX_WEIGHT, is inf in float16 and rounded in bfloat16)."""
    logits = torch.tensor([[0.0] + [-20.0] * (k - 1)] * 4, dtype=dtype)
    r = sample_routes(logits, "sample", tau=1e3, generator=torch.Generator().manual_seed(2))
    assert r.gate.dtype == dtype and r.log_prob.dtype == dtype
    assert r.weight.dtype == torch.float32
    p = torch.softmax(logits.double(), -1)
    q = torch.softmax(logits.double() / 1e3, -1)
    expected = (p.gather(-1, r.expert) / q.gather(-1, r.expert)).float()
    assert bool(torch.isfinite(r.weight).all())
    torch.testing.assert_close(r.weight, expected, rtol=1e-4, atol=0)
