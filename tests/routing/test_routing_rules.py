"""routelab.routing.rules against independent truth.

Oracles:

* ``softmax_routes``: the softmax itself, numpy's ``var / mean^2`` for the importance loss.
* ``topk_routes``: a sort-based top-k per token (plain Python), the full-softmax probabilities
  of the chosen experts or the softmax over the chosen logits (``renormalize``), and the Switch
  loss ``E sum_e f_e P_e`` written out in numpy.
* ``noisy_topk_routes``: eq. 3-5 of Shazeer et al. (2017) recomputed from the same noise
  (``logits + eps * noise_std``, ``eps`` from the same seed) and App. A's load written out with
  scipy's normal CDF.
* ``batchwise_routes``: App. F (eq. 16, 18-20): per-column sort for the mask (exactly
  ``k n / E`` per expert, the top ones), the normalised gate, and eq. 20 as a double loop.
* ``balanced_routes``: ``scipy.optimize.linear_sum_assignment`` on the column-expanded score
  matrix (``capacity`` copies of every expert); the total score is compared, not indices.
* ``sinkhorn_routes``: the balanced matrix has rows 1 and columns ``n / E`` (within the
  documented 1%), is a diagonal rescaling of ``softmax(logits)`` (Sinkhorn's form), agrees with a
  numpy Sinkhorn run to convergence, and the chosen experts are its top ``k``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import linear_sum_assignment
from scipy.stats import norm

from routelab.routing import (
    balanced_routes,
    batchwise_routes,
    noisy_topk_routes,
    sinkhorn_routes,
    softmax_routes,
    topk_routes,
)
from routelab.routing.rules import sinkhorn_balanced_log_probs

FAST = settings(max_examples=30, deadline=None)
seeds = st.integers(0, 2**31 - 1)


def np_softmax(a: np.ndarray) -> np.ndarray:
    z = np.exp(a - a.max(-1, keepdims=True))
    return z / z.sum(-1, keepdims=True)


def np_cv2(x: np.ndarray) -> float:
    return float(np.var(x) / np.mean(x) ** 2) if x.size > 1 else 0.0


def np_switch(probs: np.ndarray, expert: np.ndarray) -> float:
    n, E = probs.shape
    """Switch loss: f from each token's argmax of the router probabilities (not the chosen slots)."""
    f = np.bincount(probs.argmax(-1), minlength=E) / n
    return float(E * (f * probs.mean(0)).sum())


def sorted_topk(row: list[float], k: int) -> list[int]:
    """Indices of the k largest entries, largest first (inputs here have no ties)."""
    return sorted(range(len(row)), key=lambda i: -row[i])[:k]


def logits_for(seed: int, n: int, E: int, dtype=torch.float32, scale: float = 1.5) -> torch.Tensor:
    return (torch.randn(n, E, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale).to(dtype)


# ------------------------------------------------------------------------- softmax_routes


@FAST
@given(n=st.integers(1, 8), E=st.integers(1, 5), coef=st.sampled_from((0.0, 0.3)), seed=seeds)
def test_softmax_routes_is_the_softmax(n, E, coef, seed) -> None:
    logits = logits_for(seed, n, E, torch.float64)
    r = softmax_routes(logits, importance_coef=coef)
    p = np_softmax(logits.numpy())
    np.testing.assert_allclose(r.gate.detach().numpy(), p, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(r.log_prob.detach().numpy(), np.log(p), rtol=1e-12, atol=1e-12)
    assert r.expert.tolist() == [list(range(E))] * n
    assert bool(r.keep.all()) and bool((r.weight == 1).all())
    if coef:
        assert float(r.aux["importance"]) == pytest.approx(coef * np_cv2(p.sum(0)), rel=1e-5, abs=1e-9)
    else:
        assert "importance" not in r.aux


# ------------------------------------------------------------------------- topk_routes


@FAST
@given(n=st.integers(1, 8), E=st.integers(1, 6), k=st.integers(1, 6), renormalize=st.booleans(),
       coef=st.sampled_from((0.0, 0.01, 1.0)), seed=seeds)
def test_topk_routes_equals_sort_reference(n, E, k, renormalize, coef, seed) -> None:
    k = min(k, E)
    logits = logits_for(seed, n, E, torch.float64)
    r = topk_routes(logits, k, renormalize=renormalize, balance_coef=coef)
    L = logits.numpy()
    p = np_softmax(L)
    want_e = [sorted_topk(row, k) for row in L.tolist()]
    assert r.expert.tolist() == want_e, "not the k largest logits, largest first"
    idx = np.array(want_e)
    chosen_p = np.take_along_axis(p, idx, -1)
    want_gate = np_softmax(np.take_along_axis(L, idx, -1)) if renormalize else chosen_p
    np.testing.assert_allclose(r.gate.detach().numpy(), want_gate, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(r.log_prob.detach().numpy(), np.log(chosen_p), rtol=1e-12, atol=1e-12)
    if renormalize:
        np.testing.assert_allclose(r.gate.detach().sum(-1).numpy(), 1.0, rtol=1e-12)
    assert bool(r.keep.all()) and bool((r.weight == 1).all())
    if coef:
        assert float(r.aux["balance"]) == pytest.approx(coef * np_switch(p, idx), rel=1e-10)
    else:
        assert "balance" not in r.aux


def test_topk_gate_oracle_distinguishes_the_two_normalisations() -> None:
    """With k < E the two gate conventions differ, so the reference above would catch a swap."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]], dtype=torch.float64)
    a = topk_routes(logits, 2, renormalize=False).gate
    b = topk_routes(logits, 2, renormalize=True).gate
    p = torch.softmax(logits, -1)[0]
    torch.testing.assert_close(a[0], p[:2])
    torch.testing.assert_close(b[0], p[:2] / p[:2].sum())
    assert not torch.allclose(a, b)


# ------------------------------------------------------------------------- noisy_topk_routes


def ref_noisy_load(clean: np.ndarray, noisy: np.ndarray, std: np.ndarray, k: int) -> np.ndarray:
    """App. A, eq. 8-10: Load_i = sum_x Phi((clean_i - kth_excluding(noisy, k, i)) / std_i)."""
    n, E = clean.shape
    if k >= E:
        return np.full(E, float(n))
    load = np.zeros(E)
    for x in range(n):
        for i in range(E):
            others = sorted((noisy[x, j] for j in range(E) if j != i), reverse=True)
            load[i] += norm.cdf((clean[x, i] - others[k - 1]) / std[x, i])
    return load


@FAST
@given(n=st.integers(1, 7), E=st.integers(1, 5), k=st.integers(1, 5), training=st.booleans(), seed=seeds)
def test_noisy_topk_routes_equals_eq_3_to_11(n, E, k, training, seed) -> None:
    k = min(k, E)
    logits = logits_for(seed, n, E, torch.float64)
    std = torch.rand(n, E, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64) + 0.2
    r = noisy_topk_routes(logits, std, k, training=training, importance_coef=0.1, load_coef=0.2,
                          generator=torch.Generator().manual_seed(seed + 2))
    if training:  # H = logits + eps * std, eps ~ N(0, 1) from the generator (eq. 4)
        eps = torch.randn(n, E, generator=torch.Generator().manual_seed(seed + 2), dtype=torch.float64)
        H = (logits + eps * std).numpy()
    else:
        H = logits.numpy()
    want_e = [sorted_topk(row, k) for row in H.tolist()]
    assert r.expert.tolist() == want_e
    idx = np.array(want_e)
    gate = np_softmax(np.take_along_axis(H, idx, -1))  # softmax(KeepTopK(H, k)) on the kept entries
    np.testing.assert_allclose(r.gate.detach().numpy(), gate, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(r.log_prob.detach().numpy(), np.take_along_axis(np.log(np_softmax(H)), idx, -1),
                               rtol=1e-10, atol=1e-12)
    full = np.zeros((n, E))
    np.put_along_axis(full, idx, gate, -1)
    assert float(r.aux["importance"]) == pytest.approx(0.1 * np_cv2(full.sum(0)), rel=1e-5, abs=1e-9)
    load = ref_noisy_load(logits.numpy(), H, std.numpy(), k)
    assert float(r.aux["load"]) == pytest.approx(0.2 * np_cv2(load), rel=1e-5, abs=1e-9)


def test_noisy_topk_noise_has_the_given_scale() -> None:
    """Without a seed to replay: the chance that expert 1 beats expert 0 for k = 1 is
    P(N(0, s0^2 + s1^2) > l0 - l1), over many independent tokens (binomial bound)."""
    n = 20000
    logits = torch.tensor([[0.5, 0.0]]).expand(n, 2).contiguous()
    std = torch.tensor([[0.6, 0.8]]).expand(n, 2).contiguous()
    r = noisy_topk_routes(logits, std, 1, generator=torch.Generator().manual_seed(0))
    rate = float((r.expert[:, 0] == 1).double().mean())
    want = float(norm.sf(0.5 / 1.0))  # sqrt(0.36 + 0.64) = 1
    assert abs(rate - want) <= 5 * math.sqrt(want * (1 - want) / n), (rate, want)


def test_noisy_topk_keeps_a_nan_noise_scale_visible() -> None:
    """A NaN noise scale (e.g. a corrupted noise projection) must not turn into a silent 0 logit:
    the token's noisy scores stay NaN, so its gate does too, where a finite check sees it. (With
    ``check=True``, the default, the rule refuses it first: tests/routing/test_rule_arguments.py; the router
    passes ``check=False``.)"""
    logits = torch.tensor([[2.0, 0.0, -1.0], [0.5, 0.4, 0.3]])
    std = torch.ones(2, 3)
    std[0, 1] = float("nan")
    r = noisy_topk_routes(logits, std, 1, generator=torch.Generator().manual_seed(0), check=False)
    assert torch.isfinite(r.gate[1]).all()
    assert not torch.isfinite(r.log_prob[0]).all()


# ------------------------------------------------------------------------- batchwise_routes


def ref_batchwise_mask(probs: np.ndarray, m: int) -> np.ndarray:
    n, E = probs.shape
    mask = np.zeros((n, E), dtype=bool)
    for e in range(E):
        order = sorted(range(n), key=lambda t: (-probs[t, e], t))  # ties to the earlier example
        mask[order[:m], e] = True
    return mask


def ref_eq20(X: np.ndarray, T: np.ndarray, M: np.ndarray) -> float:
    n, E = X.shape
    return sum((float(X[j, i] > T[i]) - float(M[j, i])) * (X[j, i] - T[i]) for j in range(n) for i in range(E))


@FAST
@given(E=st.integers(1, 5), k=st.integers(1, 5), mult=st.integers(1, 4), coef=st.sampled_from((1.0, 0.5)),
       ties=st.booleans(), seed=seeds)
def test_batchwise_training_mask_gate_and_threshold_loss(E, k, mult, coef, ties, seed) -> None:
    k = min(k, E)
    n = mult * E // math.gcd(k, E)  # k * n divisible by E
    logits = logits_for(seed, n, E, torch.float64)
    if ties:
        logits = logits.round()
    T = torch.rand(E, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64) * 0.6
    T.requires_grad_(True)
    r = batchwise_routes(logits, k, T, training=True, threshold_coef=coef)
    # The probabilities as the rule forms them (exp of log_softmax): with tied logits, two
    # columns' entries can differ in their last bit between softmax implementations (numpy's,
    # torch 2.11's, 2.13's), and the mask's order must be judged on the rule's own values.
    p = torch.log_softmax(logits, -1).exp().numpy()
    np.testing.assert_allclose(p, np_softmax(logits.numpy()), rtol=1e-12)
    m = k * n // E
    M = ref_batchwise_mask(p, m)
    keep = r.keep.numpy()
    assert (keep.sum(0) == m).all(), "every expert takes exactly k n / E tokens"
    assert (keep == M).all(), "the mask is not the top k n / E probabilities of every expert"
    masked = p * M
    tot = masked.sum(-1, keepdims=True)
    want_gate = np.where(tot > 0, masked / np.where(tot > 0, tot, 1.0), 0.0)
    np.testing.assert_allclose(r.gate.detach().numpy(), want_gate, rtol=1e-12, atol=1e-15)
    assert r.expert.tolist() == [list(range(E))] * n
    want_loss = coef * ref_eq20(p, T.detach().numpy(), M) / n
    assert float(r.aux["threshold"].detach()) == pytest.approx(want_loss, rel=1e-9, abs=1e-12)
    # The loss trains T only: dL/dT_i = -coef / n * sum_j (M_threshold - M_batchwise)_{j,i}.
    (gT,) = torch.autograd.grad(r.aux["threshold"], T)
    want_g = -coef / n * ((p > T.detach().numpy()).astype(float) - M).sum(0)
    np.testing.assert_allclose(gT.numpy(), want_g, rtol=1e-12, atol=1e-12)


def test_batchwise_mask_oracle_sees_per_row_topk() -> None:
    """The batchwise mask is per column, not per row: here every token's top-1 is expert 0, yet
    expert 1 gets half the tokens."""
    logits = torch.tensor([[3.0, 0.0], [2.0, 1.5], [3.0, 0.1], [2.0, 1.9]])
    r = batchwise_routes(logits, 1, torch.zeros(2), training=True)
    assert r.keep.tolist() == [[True, False], [False, True], [True, False], [False, True]]


@pytest.mark.parametrize("inference", ["threshold", "batchwise"])
def test_batchwise_inference_masks(inference) -> None:
    logits = logits_for(4, 6, 3, torch.float64)
    T = torch.tensor([0.3, 0.2, 0.5], dtype=torch.float64)
    r = batchwise_routes(logits, 1, T, training=False, inference=inference)
    p = np_softmax(logits.numpy())
    M = p > T.numpy() if inference == "threshold" else ref_batchwise_mask(p, 2)
    assert (r.keep.numpy() == M).all()
    assert "threshold" not in r.aux
    tot = (p * M).sum(-1, keepdims=True)
    np.testing.assert_allclose(r.gate.numpy(), np.where(tot > 0, p * M / np.where(tot > 0, tot, 1), 0), rtol=1e-12)


@pytest.mark.parametrize("n,E,k", [(5, 4, 2), (7, 3, 1), (9, 4, 3)])
def test_batchwise_takes_any_batch_with_floor_ceil_quotas(n, E, k) -> None:
    """A batch whose k*n pairs E does not divide: every expert keeps floor or ceil of k*n/E tokens,
    all k*n pairs are placed, and each expert's tokens are the top ones of its column."""
    logits = logits_for(11, n, E, torch.float64)
    r = batchwise_routes(logits, k, torch.zeros(E, dtype=torch.float64), training=True)
    M = r.keep.numpy()
    per_expert = M.sum(0)
    assert int(per_expert.sum()) == k * n
    assert set(per_expert.tolist()) <= {k * n // E, -(-k * n // E)}
    p = np_softmax(logits.numpy())
    for e in range(E):
        kept, dropped = p[M[:, e], e], p[~M[:, e], e]
        if kept.size and dropped.size:
            assert kept.min() >= dropped.max(), f"expert {e} kept a token below one it dropped"


# ------------------------------------------------------------------------- balanced_routes


def best_balanced_total(L: np.ndarray, C: int) -> float:
    """Maximum of sum_i L[i, z_i] with at most C tokens per expert (linear_sum_assignment on
    C copies of every expert's column)."""
    big = np.repeat(L, C, axis=1)
    rows, cols = linear_sum_assignment(big, maximize=True)
    assert len(rows) == L.shape[0]
    return float(big[rows, cols].sum())


def best_quota_total(L: np.ndarray) -> float:
    """Maximum of sum_i L[i, z_i] with every expert at floor(n/E) or ceil(n/E) tokens (the balanced
    quotas): linear_sum_assignment on floor(n/E) "mandatory" copies of every expert's column, each
    raised by a bonus larger than any score difference (so every mandatory copy is filled: n >=
    E floor(n/E) rows can fill them), plus one optional copy per expert; the bonus is removed."""
    n, E = L.shape
    lo = n // E
    spread = float(L.max() - L.min()) if L.size else 0.0
    bonus = 4 * (spread + 1) * n
    mandatory = np.repeat(L, lo, axis=1) + bonus
    big = np.concatenate([mandatory, L], axis=1)
    rows, cols = linear_sum_assignment(big, maximize=True)
    assert len(rows) == n
    filled = int((cols < mandatory.shape[1]).sum())
    assert filled == E * lo, "the oracle must fill every mandatory copy"
    return float(big[rows, cols].sum() - filled * bonus)


@FAST
@given(n=st.integers(1, 10), E=st.integers(1, 4), extra=st.integers(0, 3), default=st.booleans(),
       seed=seeds)
def test_balanced_routes_is_optimal(n, E, extra, default, seed) -> None:
    logits = logits_for(seed, n, E, torch.float64)
    need = -(-n // E)
    C = need + extra
    r = balanced_routes(logits, None if default else C)
    # Balanced means balanced: every expert gets the quota floor(n/E) or ceil(n/E), whatever the buffer.
    expert = r.expert[:, 0]
    assert r.expert.shape == (n, 1)
    load = torch.bincount(expert, minlength=E)
    assert int(load.max()) <= need and int(load.min()) >= n // E, f"loads {load.tolist()} off the quotas"
    L = logits.numpy()
    ours = float(L[np.arange(n), expert.numpy()].sum())
    assert ours == pytest.approx(best_quota_total(L), abs=1e-9), "not the optimal balanced assignment"
    assert best_quota_total(L) <= best_balanced_total(L, need) + 1e-9  # the quotas only constrain more
    chosen = L[np.arange(n), expert.numpy()]
    np.testing.assert_allclose(r.gate[:, 0].detach().numpy(), 1 / (1 + np.exp(-chosen)), rtol=1e-12)
    np.testing.assert_allclose(r.log_prob[:, 0].detach().numpy(), np.log(np_softmax(L))[np.arange(n), expert.numpy()],
                               rtol=1e-10, atol=1e-12)
    assert bool(r.keep.all()) and bool((r.weight == 1).all())


def test_balanced_routes_float32_and_unbalanced_inference() -> None:
    logits = logits_for(9, 12, 3, torch.float32, scale=3.0)
    r = balanced_routes(logits, 4)
    L = logits.double().numpy()
    ours = float(L[np.arange(12), r.expert[:, 0].numpy()].sum())
    assert ours == pytest.approx(best_balanced_total(L, 4), abs=1e-4)
    greedy = balanced_routes(logits, 4, balanced=False)
    assert greedy.expert[:, 0].tolist() == L.argmax(-1).tolist()
    assert ours < float(L.max(-1).sum()) - 1e-3, "the test wants a case where balancing costs score"
    with pytest.raises(ValueError):
        balanced_routes(logits, 3)  # 3 * 3 < 12 tokens


# ------------------------------------------------------------------------- sinkhorn_routes


def np_sinkhorn(p: np.ndarray, iters: int = 5000) -> np.ndarray:
    n, E = p.shape
    q = p.copy()
    for _ in range(iters):
        q *= (n / E) / q.sum(0, keepdims=True)
        q /= q.sum(1, keepdims=True)
        if np.abs(q.sum(0) - n / E).max() < 1e-10 * n:
            break
    return q


@FAST
@given(n=st.integers(1, 12), E=st.integers(2, 5), k=st.integers(1, 4), renormalize=st.booleans(), seed=seeds)
def test_sinkhorn_routes_choose_top_k_of_the_balanced_matrix(n, E, k, renormalize, seed) -> None:
    k = min(k, E)
    logits = logits_for(seed, n, E, torch.float32, scale=1.0)
    sweeps = 200
    log_p = torch.log_softmax(logits, -1)
    log_q = sinkhorn_balanced_log_probs(log_p, sweeps)
    q = log_q.double().exp().numpy()
    # Marginals: rows 1, columns n / E (the rule stops within 1% of n / E).
    np.testing.assert_allclose(q.sum(1), 1.0, atol=1e-5)
    assert np.abs(q.sum(0) - n / E).max() <= 0.01 * n / E + 1e-5
    # Sinkhorn's form: log q - log p = a_i + b_j (a diagonal rescaling of p).
    D = log_q.double().numpy() - log_p.double().numpy()
    resid = D - D[:, :1] - D[:1, :] + D[0, 0]
    assert np.abs(resid).max() <= 1e-4
    # ... hence close to the exact balanced matrix of a converged numpy Sinkhorn.
    p = np_softmax(logits.double().numpy())
    q_ref = np_sinkhorn(p)
    assert np.abs(q - q_ref).max() <= 0.05

    r = sinkhorn_routes(logits, k, sweeps=sweeps, renormalize=renormalize, balance_coef=0.5)
    expert = r.expert.numpy()
    for t in range(n):
        chosen = sorted(q[t, expert[t]].tolist(), reverse=True)
        best = sorted(q[t].tolist(), reverse=True)[:k]
        np.testing.assert_allclose(chosen, best, rtol=1e-6, err_msg="not the top k of the balanced matrix")
        assert len(set(expert[t].tolist())) == k
    chosen_p = np.take_along_axis(p, expert, -1)
    want = chosen_p / chosen_p.sum(-1, keepdims=True) if renormalize else chosen_p
    np.testing.assert_allclose(r.gate.detach().double().numpy(), want, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(r.log_prob.detach().double().numpy(), np.log(chosen_p), rtol=1e-5, atol=1e-6)
    assert float(r.aux["balance"]) == pytest.approx(0.5 * np_switch(p, expert), rel=1e-5)
    # Without balancing: plain top-k of p.
    plain = sinkhorn_routes(logits, k, balanced=False)
    assert plain.expert.tolist() == [sorted_topk(row, k) for row in p.tolist()]


@pytest.mark.parametrize("k", [1, 2])
def test_sinkhorn_renormalised_gates_stay_finite_where_probabilities_underflow(k: int) -> None:
    """Balancing can send a token to experts whose float32 probability underflows to 0 (a logit
    gap above ~104): the renormalised gate is then still p_i / sum_j p_j over the chosen experts,
    computed here in float64 from the logits (it was 0 / 0 = NaN)."""
    logits = torch.tensor([[200.0, 0.0, 1.0], [300.0, 0.0, 2.0], [250.0, 3.0, 0.0]], requires_grad=True)
    r = sinkhorn_routes(logits, k, sweeps=50, renormalize=True)
    assert torch.isfinite(r.gate).all()
    chosen = logits.detach().double().gather(-1, r.expert)
    torch.testing.assert_close(r.gate.detach().double(), torch.softmax(chosen, -1), rtol=1e-6, atol=1e-12)
    (torch.randn(r.gate.shape, generator=torch.Generator().manual_seed(0)) * r.gate).sum().backward()
    assert torch.isfinite(logits.grad).all()


def test_sinkhorn_balancing_changes_the_choice() -> None:
    """A shared preference for expert 0: unbalanced top-1 sends every token there, the balanced
    choice spreads them, one per expert here (each column of q sums to 1)."""
    logits = torch.tensor([[3.0, 0.0, 0.0], [3.0, 2.5, 0.0], [3.0, 0.0, 2.5]])
    assert sinkhorn_routes(logits, 1, balanced=False).expert[:, 0].tolist() == [0, 0, 0]
    r = sinkhorn_routes(logits, 1, sweeps=200)
    assert r.expert[:, 0].tolist() == [0, 1, 2]
