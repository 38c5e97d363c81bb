"""Tests for routelab.assignment.gumbel_matching (Kool et al. 2021, Sec. 2.2, App. D.3-D.5).

Independent truths used here:

* the sample is the balanced assignment of the perturbed scores ``logits / tau + gumbels`` (eq. 4),
  checked against scipy's Hungarian solver;
* the conditionals ``q(z_i = j | A, G_-i)`` against eq. 8-9 evaluated by brute force:
  ``q_ij ∝ exp(v*_{-ij} + a_ij / tau)`` with ``v*_{-ij}`` the optimal value (scipy) of the
  problem without token ``i`` and with one slot fewer at expert ``j``;
* the conditionals against Monte Carlo frequencies when only ``g_i`` is resampled;
* the unbiasedness identity of App. D.5.

Only the public API is used.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats
from scipy.optimize import linear_sum_assignment
from scipy.special import logsumexp

from routelab.assignment import (
    GumbelMatching,
    balanced_assignment,
    base_assignment,
    gumbel_matching,
    sample_gumbel,
)

NEG_INF = float("-inf")
DTYPES = [torch.float32, torch.float64]


# ----------------------------------------------------------------------------- oracles


def _np64(x: torch.Tensor) -> np.ndarray:
    return x.detach().cpu().to(torch.float64).numpy()


def assignment_value(s: np.ndarray, caps: list[int]) -> float:
    """Optimal value of assigning every row of ``s`` with ``caps[j]`` slots at expert ``j``;
    ``-inf`` if no assignment avoids the ``-inf`` entries."""
    n, k = s.shape
    if n == 0:
        return 0.0
    caps = [min(c, n) for c in caps]
    if sum(caps) < n:
        return NEG_INF
    forbidden = np.isneginf(s)
    finite = s[~forbidden]
    m = float(np.abs(finite).max()) if finite.size else 0.0
    big = 4.0 * (n + 1) * (m + 1.0)
    w = np.where(forbidden, -big, s)
    expert_of_col = np.repeat(np.arange(k), caps)
    rows, cols = linear_sum_assignment(w[:, expert_of_col], maximize=True)
    z = expert_of_col[cols]
    if forbidden[rows, z].any():
        return NEG_INF
    return float(s[rows, z].sum())


def oracle_conditionals(logits: np.ndarray, gumbels: np.ndarray, tau: float, c: int) -> np.ndarray:
    """``log q(z_i = j | A, G_-i)`` by eq. 8-9: one reduced assignment problem per (i, j)."""
    n, k = logits.shape
    s = logits / tau + gumbels
    out = np.full((n, k), NEG_INF)
    for i in range(n):
        rest = np.delete(s, i, axis=0)
        v = np.full(k, NEG_INF)
        for j in range(k):
            if np.isneginf(logits[i, j]):
                continue
            caps = [c] * k
            caps[j] -= 1
            v[j] = assignment_value(rest, caps) + logits[i, j] / tau
        out[i] = v - logsumexp(v)
    return out


def resolved_capacity(n: int, k: int, capacity: int | None) -> int:
    return n // k if capacity is None else min(capacity, n)


def gumbels_like(shape, dtype=torch.float64, seed: int = 0) -> torch.Tensor:
    return sample_gumbel(shape, dtype=dtype, generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------- the sample


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("n", "k", "capacity"), [(12, 3, None), (10, 4, 3), (8, 2, 6), (6, 6, None)])
@pytest.mark.parametrize("tau", [0.5, 1.0, 3.0])
def test_expert_is_balanced_assignment_of_perturbed_scores(n, k, capacity, tau, dtype) -> None:
    gen = torch.Generator().manual_seed(n * 100 + k * 10 + int(tau * 2))
    logits = torch.randn(20, n, k, generator=gen, dtype=dtype) * 2
    g = sample_gumbel((20, n, k), dtype=dtype, generator=gen)
    m = gumbel_matching(logits, tau=tau, capacity=capacity, gumbels=g)
    assert isinstance(m, GumbelMatching)
    scores = logits / tau + g
    assert torch.allclose(m.scores, scores, rtol=1e-6 if dtype == torch.float32 else 1e-14, atol=0)
    assert torch.equal(m.gumbels, g)
    assert m.tau == tau and m.capacity == resolved_capacity(n, k, capacity)
    assert m.expert.dtype == torch.long and m.expert.shape == (20, n)
    assert m.conditional_log_probs.shape == (20, n, k) and m.conditional_log_probs.dtype == dtype
    assert m.shortest_paths.shape == (20, k, k)
    assert torch.equal(m.expert, balanced_assignment(m.scores, capacity=capacity))
    # and that assignment is optimal for the perturbed scores (independent solver)
    c = resolved_capacity(n, k, capacity)
    S, Z = _np64(m.scores), m.expert.numpy()
    for b in range(20):
        assert np.bincount(Z[b], minlength=k).max() <= c
        best = assignment_value(S[b], [c] * k)
        assert (
            abs(S[b][np.arange(n), Z[b]].sum() - best)
            <= (1e-4 if dtype == torch.float32 else 1e-10) * n * np.abs(S[b]).max()
        )


def test_seeded_generator_is_reproducible_and_the_only_randomness() -> None:
    logits = torch.randn(4, 12, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    torch.manual_seed(1234)
    global_state = torch.get_rng_state()
    a = gumbel_matching(logits, generator=torch.Generator().manual_seed(7))
    b = gumbel_matching(logits, generator=torch.Generator().manual_seed(7))
    c = gumbel_matching(logits, generator=torch.Generator().manual_seed(8))
    assert torch.equal(torch.get_rng_state(), global_state), "the global RNG was used"
    assert torch.equal(a.expert, b.expert) and torch.equal(a.gumbels, b.gumbels)
    assert torch.equal(a.conditional_log_probs, b.conditional_log_probs)
    assert not torch.equal(a.gumbels, c.gumbels)
    assert not torch.equal(a.expert, c.expert)
    # the returned noise reproduces the sample
    again = gumbel_matching(logits, gumbels=a.gumbels)
    assert torch.equal(again.expert, a.expert)
    assert torch.allclose(again.conditional_log_probs, a.conditional_log_probs, atol=1e-12)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sample_gumbel_is_standard_gumbel(dtype: torch.dtype) -> None:
    g = sample_gumbel((200, 100), dtype=dtype, generator=torch.Generator().manual_seed(3))
    assert g.shape == (200, 100) and g.dtype == dtype and torch.isfinite(g).all()
    x = _np64(g).ravel()
    assert stats.kstest(x, stats.gumbel_r.cdf).pvalue > 1e-3
    se_mean = math.pi / math.sqrt(6) / math.sqrt(x.size)
    assert abs(x.mean() - np.euler_gamma) < 4.5 * se_mean
    assert abs(x.var() - math.pi**2 / 6) < 0.05
    again = sample_gumbel((200, 100), dtype=dtype, generator=torch.Generator().manual_seed(3))
    assert torch.equal(g, again)


# ----------------------------------------------------------------------------- tau = 0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("n", "k", "capacity"), [(12, 3, None), (10, 4, 3), (7, 2, 7)])
def test_tau_zero_is_the_deterministic_base_assignment(n, k, capacity, dtype) -> None:
    logits = torch.randn(2, 5, n, k, generator=torch.Generator().manual_seed(n + k), dtype=dtype)
    m1 = gumbel_matching(logits, tau=0, capacity=capacity, generator=torch.Generator().manual_seed(1))
    m2 = gumbel_matching(logits, tau=0.0, capacity=capacity, generator=torch.Generator().manual_seed(2))
    base = base_assignment(logits, capacity=capacity)
    assert torch.equal(m1.expert, base) and torch.equal(m2.expert, base)
    assert torch.equal(base, balanced_assignment(logits, capacity=capacity))
    assert (m1.gumbels == 0).all()
    # generic logits: the optimum is unique, so the tau -> 0 conditionals are one-hot on the sample
    q = m1.conditional_log_probs.exp()
    assert torch.allclose(q, torch.nn.functional.one_hot(base, k).to(dtype), atol=1e-6)
    # and a small positive temperature approaches them
    cold = gumbel_matching(logits, tau=1e-4, capacity=capacity, gumbels=torch.zeros_like(logits))
    assert torch.equal(cold.expert, base)


# ----------------------------------------------------------------------------- conditionals: exact oracle


CONDITIONAL_CASES = [
    # (n, k, capacity, tau)
    (6, 3, None, 1.0),
    (8, 4, None, 1.0),
    (9, 3, None, 0.5),
    (4, 2, None, 2.0),
    (7, 3, 3, 1.0),  # n not divisible: slack
    (6, 2, 4, 1.0),  # slack
    (5, 4, 2, 0.7),  # slack
    (6, 3, 6, 1.0),  # capacity = n: no constraint
    (3, 3, None, 1.0),  # permutation
    (1, 3, 1, 1.0),  # single token: plain softmax
    (6, 1, None, 1.0),  # single expert
]


@pytest.mark.parametrize(("n", "k", "capacity", "tau"), CONDITIONAL_CASES)
def test_conditionals_match_exact_oracle(n, k, capacity, tau) -> None:
    B = 6
    gen = torch.Generator().manual_seed(10 * n + k)
    logits = torch.randn(B, n, k, generator=gen, dtype=torch.float64) * 1.5
    g = sample_gumbel((B, n, k), dtype=torch.float64, generator=gen)
    m = gumbel_matching(logits, tau=tau, capacity=capacity, gumbels=g)
    c = resolved_capacity(n, k, capacity)
    for b in range(B):
        want = oracle_conditionals(_np64(logits[b]), _np64(g[b]), tau, c)
        got = _np64(m.conditional_log_probs[b])
        np.testing.assert_allclose(got, want, atol=1e-8, rtol=0, err_msg=f"instance {b}")


def test_conditionals_of_single_token_are_the_softmax() -> None:
    logits = torch.randn(5, 1, 4, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    m = gumbel_matching(logits, tau=2.0, capacity=1, generator=torch.Generator().manual_seed(1))
    assert torch.allclose(m.conditional_log_probs, torch.log_softmax(logits / 2.0, -1), atol=1e-12)


def test_conditionals_match_exact_oracle_float32() -> None:
    n, k = 8, 4
    gen = torch.Generator().manual_seed(12)
    logits = torch.randn(8, n, k, generator=gen)
    g = sample_gumbel((8, n, k), dtype=torch.float32, generator=gen)
    m = gumbel_matching(logits, gumbels=g)
    assert torch.allclose(m.conditional_log_probs.exp().sum(-1), torch.ones(8, n), atol=1e-5)
    for b in range(8):
        want = oracle_conditionals(_np64(logits[b]), _np64(g[b]), 1.0, n // k)
        np.testing.assert_allclose(_np64(m.conditional_log_probs[b]), want, atol=1e-3, rtol=0)


def _forbidden_instances(B: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, n, k, generator=gen, dtype=torch.float64)
    mask = torch.rand(B, n, k, generator=gen) < 0.3
    mask[:, torch.arange(n), torch.arange(n) % k] = False  # keep a balanced assignment allowed
    return logits.masked_fill(mask, NEG_INF), sample_gumbel((B, n, k), dtype=torch.float64, generator=gen)


def test_conditionals_with_forbidden_pairs_match_exact_oracle() -> None:
    """Forbidden pairs get probability exactly 0; the rest follows eq. 8-9.

    Only (i, j) whose conditional problem stays feasible are compared here (the other case is
    ``test_conditionals_are_zero_when_forcing_makes_the_rest_infeasible``)."""
    n, k = 6, 3
    logits, g = _forbidden_instances(40, n, k, 13)
    m = gumbel_matching(logits, gumbels=g)
    forbidden = torch.isneginf(logits)
    assert torch.isneginf(m.conditional_log_probs[forbidden]).all()
    assert (m.conditional_log_probs.exp()[forbidden] == 0).all()
    assert not forbidden.gather(-1, m.expert.unsqueeze(-1)).any()
    compared = 0
    for b in range(40):
        want = oracle_conditionals(_np64(logits[b]), _np64(g[b]), 1.0, n // k)
        if np.isneginf(want[~forbidden[b].numpy()]).any():
            continue  # some allowed pair is conditionally infeasible
        np.testing.assert_allclose(_np64(m.conditional_log_probs[b]), want, atol=1e-8, rtol=0)
        compared += 1
    assert compared >= 10


def test_conditionals_are_zero_when_forcing_makes_the_rest_infeasible() -> None:
    # Token 0 can only use expert 0 (capacity 1), so token 1 can never be at expert 0.
    logits = torch.tensor([[0.0, NEG_INF], [0.0, 0.0]], dtype=torch.float64)
    m = gumbel_matching(logits, gumbels=torch.zeros(2, 2, dtype=torch.float64))
    want = oracle_conditionals(_np64(logits), np.zeros((2, 2)), 1.0, 1)
    assert np.isneginf(want[1, 0]) and want[1, 1] == 0.0
    assert m.conditional_log_probs[1, 0].exp().item() == 0.0
    np.testing.assert_allclose(_np64(m.conditional_log_probs), want, atol=1e-12)


# ----------------------------------------------------------------------------- conditionals: Monte Carlo


@pytest.mark.parametrize(
    ("n", "k", "capacity", "tau", "i"),
    [(6, 3, None, 1.0, 2), (8, 4, None, 0.5, 0), (5, 2, 3, 1.0, 4), (6, 3, None, 2.0, 5)],
)
def test_conditionals_match_monte_carlo_over_g_i(n, k, capacity, tau, i) -> None:
    """Fix G_-i, resample g_i R times: the frequency of z_i = j is q(z_i = j | A, G_-i)."""
    R = 4000
    gen = torch.Generator().manual_seed(20 + n + k + i)
    logits = torch.randn(n, k, generator=gen, dtype=torch.float64) * 1.5
    G = sample_gumbel((n, k), dtype=torch.float64, generator=gen)
    gumbels = G.expand(R, n, k).clone()
    gumbels[:, i] = sample_gumbel((R, k), dtype=torch.float64, generator=gen)
    m = gumbel_matching(logits.expand(R, n, k), tau=tau, capacity=capacity, gumbels=gumbels)
    q = m.conditional_log_probs[0, i].exp().numpy()
    freq = np.bincount(m.expert[:, i].numpy(), minlength=k) / R
    bound = 4.5 * np.sqrt(q * (1 - q) / R) + 1e-3
    assert (np.abs(freq - q) < bound).all(), f"freq {freq} vs q {q}"
    assert (q > 0.02).sum() >= 2, "degenerate instance: the check would have no power"
    # and the same conditionals come out whatever g_i was
    assert torch.allclose(m.conditional_log_probs[:, i], m.conditional_log_probs[0, i].expand(R, k), atol=1e-9, rtol=0)


def test_conditionals_do_not_depend_on_g_i() -> None:
    n, k, R = 9, 3, 200
    gen = torch.Generator().manual_seed(30)
    logits = torch.randn(n, k, generator=gen, dtype=torch.float64) * 2
    G = sample_gumbel((n, k), dtype=torch.float64, generator=gen)
    for i in range(n):
        gumbels = G.expand(R, n, k).clone()
        gumbels[:, i] = sample_gumbel((R, k), dtype=torch.float64, generator=gen) * 3  # wide spread
        m = gumbel_matching(logits.expand(R, n, k), gumbels=gumbels)
        assert m.expert[:, i].unique().numel() >= 2, "token i's expert never changed"
        cond = m.conditional_log_probs[:, i]
        finite = torch.isfinite(cond)
        assert finite.all()
        assert (cond - cond[0]).abs().max() <= 1e-9


# ----------------------------------------------------------------------------- conditionals: structure


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_conditionals_are_normalised_and_batched(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(40)
    logits = torch.randn(2, 3, 8, 4, generator=gen, dtype=dtype)
    logits[0, 1, 2, 3] = NEG_INF
    m = gumbel_matching(logits, generator=gen)
    assert m.expert.shape == (2, 3, 8)
    assert m.conditional_log_probs.shape == (2, 3, 8, 4)
    assert m.shortest_paths.shape == (2, 3, 4, 4)
    atol = 1e-5 if dtype == torch.float32 else 1e-12
    q = m.conditional_log_probs.exp()
    assert torch.allclose(q.sum(-1), torch.ones(2, 3, 8, dtype=dtype), atol=atol)
    assert q[0, 1, 2, 3] == 0
    lp = m.log_prob_of_sample()
    assert lp.shape == (2, 3, 8)
    assert torch.equal(lp, m.conditional_log_probs.gather(-1, m.expert.unsqueeze(-1)).squeeze(-1))
    assert torch.isfinite(lp).all(), "a sampled expert must have positive conditional probability"
    for a in range(2):
        for b in range(3):
            single = gumbel_matching(logits[a, b], gumbels=m.gumbels[a, b])
            assert torch.equal(single.expert, m.expert[a, b])
            assert torch.allclose(single.conditional_log_probs, m.conditional_log_probs[a, b], atol=atol, rtol=0)
            assert torch.allclose(single.shortest_paths, m.shortest_paths[a, b], atol=atol, rtol=0)


def test_sampled_expert_maximises_the_conditional_value() -> None:
    """z_i maximises v*|z_ij=1 = v* - s_iz_i + s_ij - d*[j, z_i] (eq. 7), so z_i is the argmax of
    log q_ij + g_ij over j (eq. 9: q_ij ∝ exp(v*|z_ij=1 - g_ij))."""
    gen = torch.Generator().manual_seed(41)
    logits = torch.randn(50, 9, 3, generator=gen, dtype=torch.float64)
    m = gumbel_matching(logits, generator=gen)
    assert torch.equal((m.conditional_log_probs + m.gumbels).argmax(-1), m.expert)


# ----------------------------------------------------------------------------- unbiasedness (App. D.5)


@pytest.mark.parametrize(("n", "k", "capacity"), [(4, 2, None), (6, 3, None), (5, 2, 3)])
def test_importance_weighted_estimator_is_unbiased(n: int, k: int, capacity: int | None) -> None:
    """E_G[sum_i p(z_i) / q(z_i | G_-i) h(i, z_i)] = sum_ij p_ij h_ij with z = GM(log p, G)."""
    N = 20_000
    gen = torch.Generator().manual_seed(50 + n + k)
    bias = torch.zeros(k, dtype=torch.float64)
    bias[0] = 1.5  # everyone prefers expert 0: the balanced samples are far from independent p
    log_p = torch.log_softmax(torch.randn(n, k, generator=gen, dtype=torch.float64) + bias, -1)
    h = torch.randn(n, k, generator=gen, dtype=torch.float64)
    m = gumbel_matching(log_p.expand(N, n, k), tau=1.0, capacity=capacity, generator=gen)
    z = m.expert
    lp = log_p.expand(N, n, k).gather(-1, z.unsqueeze(-1)).squeeze(-1)
    hz = h.expand(N, n, k).gather(-1, z.unsqueeze(-1)).squeeze(-1)
    est = (torch.exp(lp - m.log_prob_of_sample()) * hz).sum(-1).numpy()
    truth = float((log_p.exp() * h).sum())
    zscore = (est.mean() - truth) / (est.std(ddof=1) / math.sqrt(N))
    assert abs(zscore) < 4.5, f"mean {est.mean()} vs truth {truth} (z = {zscore:.2f})"
    # power check: without the importance weights the same samples are clearly biased
    naive = hz.sum(-1).numpy()
    naive_z = (naive.mean() - truth) / (naive.std(ddof=1) / math.sqrt(N))
    assert abs(naive_z) > 4.5


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        pytest.param({"gumbels": torch.zeros(6, 2)}, "shape of logits", id="gumbels-wrong-shape"),
        pytest.param({"gumbels": torch.zeros(1, 6, 3)}, "shape of logits", id="gumbels-extra-batch-dim"),
        pytest.param(
            {"gumbels": torch.zeros(6, 3).index_fill(0, torch.tensor([2]), float("inf"))},
            "finite",
            id="gumbels-inf",
        ),
        pytest.param(
            {"gumbels": torch.zeros(6, 3).index_fill(0, torch.tensor([2]), float("nan"))},
            "finite",
            id="gumbels-nan",
        ),
        pytest.param(
            {"gumbels": torch.zeros(6, 3).index_fill(0, torch.tensor([2]), float("-inf"))},
            "finite",
            id="gumbels-minus-inf",
        ),
        pytest.param({"tau": -1.0}, "tau", id="negative-tau"),
        pytest.param({"tau": float("nan")}, "tau", id="nan-tau"),
        pytest.param({"tau": float("inf")}, "tau", id="inf-tau"),
        pytest.param({"capacity": 1}, "capacity", id="capacity-too-small"),
        pytest.param({"capacity": 0}, "capacity", id="capacity-zero"),
    ],
)
def test_bad_arguments_raise(kwargs: dict, match: str) -> None:
    logits = torch.zeros(6, 3)
    with pytest.raises(ValueError, match=match):
        gumbel_matching(logits, **kwargs)


@pytest.mark.parametrize(
    ("logits", "match"),
    [
        pytest.param(torch.tensor([[0.0, float("nan")], [0.0, 0.0]]), "NaN", id="nan-logits"),
        pytest.param(torch.tensor([[0.0, float("inf")], [0.0, 0.0]]), r"\+inf", id="plus-inf-logits"),
        pytest.param(torch.zeros(4), "at least 2 dimensions", id="1-d-logits"),
        pytest.param(torch.zeros(4, 2, dtype=torch.long), "floating", id="integer-logits"),
        pytest.param(torch.zeros(5, 2), "not divisible", id="n-not-divisible"),
        pytest.param(torch.tensor([[0.0, NEG_INF], [0.0, NEG_INF]]), "no feasible assignment", id="infeasible"),
    ],
)
def test_bad_logits_raise(logits: torch.Tensor, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        gumbel_matching(logits, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=match):
        base_assignment(logits)


# ----------------------------------------------------------------------------- host syncs


def test_gumbel_matching_reads_the_values_once_outside_the_solver(monkeypatch: pytest.MonkeyPatch) -> None:
    """The logits' value check and the overflow test of the perturbed scores share one read (on a
    GPU, one synchronisation); the power-of-two rescalings need none when their exponents are
    known on the host (the literal scores' are 0). On the compiled CPU path, whatever
    ``ROUTELAB_PURE_TORCH`` says (the PyTorch path reads once more, for the solver's start)."""
    from host_syncs import record_host_syncs
    from routelab.assignment import _compiled

    if not _compiled.HAVE_NUMBA:
        pytest.skip("numba is not installed: the compiled path this counts on")
    monkeypatch.setattr(_compiled, "ENABLED", True)

    logits = torch.randn(3, 32, 4, generator=torch.Generator().manual_seed(0))
    gumbel_matching(logits, generator=torch.Generator().manual_seed(1))
    with record_host_syncs() as found:
        gumbel_matching(logits, generator=torch.Generator().manual_seed(1))
    outside = [str(f) for f in found if "gumbel.py" in f.where or "_checks.py" in f.where]
    assert len(outside) == 1, outside


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_bad_logits_are_named_first_and_draw_no_noise(bad: float) -> None:
    """NaN/+inf logits are the first error reported (before a bad tau or bad noise), and the
    generator is left as it was: nothing was sampled for a call that fails."""
    logits = torch.zeros(8, 2)
    logits[3, 1] = bad
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="logits contains"):
        gumbel_matching(logits, generator=gen)
    assert torch.equal(torch.randn(3, generator=gen), torch.randn(3, generator=torch.Generator().manual_seed(0)))
    for bad_too in ({"tau": -1.0}, {"gumbels": torch.full((8, 2), float("inf"))}):
        with pytest.raises(ValueError, match="logits contains"):
            gumbel_matching(logits, **bad_too)


def test_overflowing_perturbed_scores_are_still_found() -> None:
    """The host-side bound (|a| / tau + |g| below half the range) only skips the overflow test
    when it cannot fail; logits near float32's maximum at tau < 1 still take the rescaled path."""
    logits = torch.randn(2, 16, 4, generator=torch.Generator().manual_seed(0)).clamp(-1, 1) * 3e38
    gm = gumbel_matching(logits, tau=0.5, generator=torch.Generator().manual_seed(1))
    assert bool((gm.log2_scale > 0).all())
    lq = gm.conditional_log_probs
    assert not lq.isnan().any() and not lq.isposinf().any()
    torch.testing.assert_close(lq.double().logsumexp(-1), torch.zeros(2, 16, dtype=torch.float64), atol=1e-5, rtol=0)


def test_ldexp_with_a_known_bound_reads_nothing() -> None:
    from host_syncs import record_host_syncs
    from routelab.assignment._normalise import ldexp

    x, e = torch.randn(4, 3), torch.tensor([0, 3, -2, 1])
    with record_host_syncs() as found:
        got = ldexp(x, e, 3)
    assert not found
    assert torch.equal(got, ldexp(x, e)) and torch.equal(got, x * 2.0 ** e.view(-1, 1).double().float())


@pytest.mark.requires_cuda
def test_gumbel_matching_on_cuda_equals_the_cpu_sample_with_few_syncs() -> None:
    """On a GPU a small problem is solved on the host (balanced_assignment's on_host policy): the
    same sample as the CPU's for the same noise, and few synchronisations (the values' read, the
    copy to the host; without numba the solve stays on the device and syncs more)."""
    from routelab.assignment._compiled import HAVE_NUMBA
    from routelab.bench.assignment import count_host_syncs

    logits = torch.randn(4, 64, 8, generator=torch.Generator().manual_seed(0)).cuda()
    gm = gumbel_matching(logits, generator=torch.Generator(device="cuda").manual_seed(0))
    ref = gumbel_matching(logits.cpu(), gumbels=gm.gumbels.cpu())
    assert gm.expert.is_cuda and torch.equal(gm.expert.cpu(), ref.expert)
    torch.testing.assert_close(gm.conditional_log_probs.cpu(), ref.conditional_log_probs, rtol=1e-5, atol=1e-6)
    if HAVE_NUMBA:
        syncs = count_host_syncs(lambda: gumbel_matching(logits, gumbels=gm.gumbels), device="cuda")
        assert syncs <= 4, syncs


@pytest.mark.parametrize(("dtype", "tau"), [(torch.float32, 1e-7), (torch.float32, 1e-5), (torch.float64, 1e-12)])
def test_identical_tokens_are_exchangeable_at_any_temperature(dtype: torch.dtype, tau: float) -> None:
    """Review finding: a / tau + g was formed in the logits' dtype, so at |a| / tau = 5e7 in float32
    the noise was rounded away and identical tokens went to the lowest index (P(z_0 = 0) = 0.86
    for four tokens that must be 1/2 each), while the conditionals, exact, described another
    distribution. Monte Carlo over 4000 samples: every token takes expert 0 half of the time."""
    n, k, draws = 4, 2, 4000
    logits = torch.full((draws, n, k), 5.0, dtype=dtype)
    gm = gumbel_matching(logits, tau=tau, generator=torch.Generator().manual_seed(0))
    freq = (gm.expert == 0).double().mean(0)
    assert ((freq - 0.5).abs() <= 4 * (0.25 / draws) ** 0.5).all(), freq
    torch.testing.assert_close(gm.conditional_log_probs.double().exp().mean((0, 1)),
                               torch.full((k,), 0.5, dtype=torch.float64), atol=0.02, rtol=0)


def test_float32_noise_reaches_the_tail_that_the_weights_assume() -> None:
    """Review finding: float32 uniforms capped the Gumbel noise at 16.6, so a pair of proposal
    probability 7.6e-10 (weight 8e7, under MAX_WEIGHT) could never be drawn by Gumbel-Matching in
    float32 while the estimator weighs it as drawable. The noise now comes from float64 uniforms."""
    from routelab.assignment import sample_gumbel

    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        g = sample_gumbel((200_000,), dtype=dtype, generator=torch.Generator().manual_seed(0))
        assert g.dtype == dtype and torch.isfinite(g).all()
    # the largest uniform float64 gives can reach 36; float32's stopped at 16.6
    u = torch.tensor([1.0 - torch.finfo(torch.float64).eps])
    assert float(-torch.log(-torch.log(u))) > 35

    def extreme(*args, **kwargs):  # noqa: ANN202 - the most favourable uniforms for expert 1
        out = torch.zeros(args[0], dtype=kwargs.get("dtype") or torch.float32)
        out[..., 1] = 1.0 - torch.finfo(out.dtype).eps / 2
        return out

    logits = torch.tensor([[0.0, -2.7, -32.7]])  # one token, capacity 1, three experts
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "rand", extreme)
        z = gumbel_matching(logits, tau=2.7 / 21, capacity=1, generator=torch.Generator()).expert
    assert int(z[0]) == 1


@pytest.mark.parametrize(("n", "k"), [(4, 2), (6, 3), (8, 4), (9, 3)])
def test_tau_zero_conditionals_split_the_mass_evenly_over_tied_experts(n, k):
    """tau -> 0: the conditional of a token is uniform over the maximisers of eq. 9 (a mutation review:
    dropping the renormalisation survived, rows summing to the number of ties). With every score equal,
    every expert is a maximiser for every token."""
    gm = gumbel_matching(torch.zeros(n, k), tau=0.0)
    q = gm.conditional_log_probs.exp()
    torch.testing.assert_close(q, torch.full((n, k), 1.0 / k))
