"""The kool-toy estimates against independent truth: the Sec. 2.3 marginals check (``kool_toy/marginals.py``) and
claim 2's expected-gradient check (``kool_toy/gradients.py``).

* Marginals: for n = 2 tokens (capacity 1) both sides of the comparison have a closed form, so the reported
  differences are checked against an exact oracle, within their stated Monte Carlo standard error.
* ``gradient_check``: its cosines and norm ratios are checked on stubbed gradient estimates whose values are
  set by hand, so each entry's expected value is exact arithmetic from the definitions of the module docstring.
* ``expected_gradient``: a Monte Carlo estimate of Sample's expected gradient must match the exact gradient of
  the expected loss (autograd on the closed form) within 5 standard errors.
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from scipy.integrate import quad

from routelab.experiments.kool_toy import gradients as gr
from routelab.experiments.kool_toy.marginals import marginals_check
from routelab.experiments.kool_toy.model import init_params, make_data

# ----------------------------------------------------------------------------- marginals


def _sigmoid(v: float) -> float:
    return 1.0 / (1.0 + math.exp(-v))


def gumbel_matching_p_diagonal(logits: list[list[float]]) -> float:
    """Exact P(token 0 -> expert 0) of Gumbel-Matching at τ = 1 for n = 2 tokens, k = 2 experts, capacity 1.

    Each expert takes one token, so the matching is either the diagonal (0->0, 1->1) or the anti-diagonal, and
    the diagonal wins iff ``D + (g00 - g01) + (g11 - g10) > 0`` with ``D = l00 + l11 - l01 - l10``. A difference
    of two independent standard Gumbels is a standard logistic L, so P = P(L1 + L2 > -D) = E_L[σ(D + L)], the
    integral of σ(D + x) against the logistic density σ(x) σ(-x) (numerical quadrature, error < 1e-10).
    """
    d = logits[0][0] + logits[1][1] - logits[0][1] - logits[1][0]
    return quad(lambda x: _sigmoid(d + x) * _sigmoid(x) * _sigmoid(-x), -60, 60, epsabs=1e-13)[0]


def sinkhorn_p_diagonal(logits: list[list[float]]) -> float:
    """The Sinkhorn-balanced matrix for n = 2, k = 2 (rows and columns summing to 1) is [[p, 1-p], [1-p, p]]; row
    and column scaling keep the cross ratio q00 q11 / (q01 q10) = exp(D), so p² / (1 - p)² = exp(D): p = σ(D / 2)."""
    d = logits[0][0] + logits[1][1] - logits[0][1] - logits[1][0]
    return _sigmoid(d / 2)


def test_marginals_for_two_tokens_match_the_exact_oracle() -> None:
    """``marginals_check((2,))`` compares Gumbel-Matching marginals at τ = 1 (Monte Carlo) with the Sinkhorn
    marginals ``exp(sinkhorn(log_softmax(logits)))`` and, for scale, with the softmax. For n = 2 each matrix m has
    one free marginal P_m (token 0 -> expert 0; the other three entries are 1 - P_m, 1 - P_m, P_m), so:

    * mean_abs_diff = mean_m |P_m - σ(D_m / 2)|;
    * max_abs_diff = max_m |P_m - σ(D_m / 2)|;
    * mean_abs_diff_unbalanced = mean_m (|P_m - s_m,00| + |P_m - s_m,11|) / 2, s the row softmax.

    The logits are those the function documents (``N(0, 1)`` from ``manual_seed(seed * 1000 + n)``). The Monte
    Carlo noise of a mean of |·| over matrices is at most the mean noise of one marginal (about 0.8 ``mean_se``),
    so 4 ``mean_se`` is a wide tolerance; for the maximum, 5 ``max_se``. ``mean_se`` itself is the documented
    ``sqrt(m (1 - m) / S)`` averaged over the entries, at the exact marginals. Comparing against the softmax instead of
    Sinkhorn, or sampling at another τ, moves mean_abs_diff by 0.08 or more (30 ``mean_se`` here).
    """
    matrices, samples, seed = 8, 20_000, 0
    row = marginals_check((2,), matrices=matrices, samples=samples, seed=seed)[0]
    g = torch.Generator().manual_seed(seed * 1000 + 2)
    logits = torch.randn(matrices, 2, 2, generator=g, dtype=torch.float64).tolist()
    to_sinkhorn, to_softmax, se = [], [], []
    for lg in logits:
        p = gumbel_matching_p_diagonal(lg)
        to_sinkhorn.append(abs(p - sinkhorn_p_diagonal(lg)))
        s00, s11 = _sigmoid(lg[0][0] - lg[0][1]), _sigmoid(lg[1][1] - lg[1][0])
        to_softmax.append((abs(p - s00) + abs(p - s11)) / 2)
        se.append(math.sqrt(p * (1 - p) / samples))
    assert row["n"] == 2 and row["matrices"] == matrices and row["samples"] == samples
    tol = 4 * row["mean_se"]
    assert row["mean_abs_diff"] == pytest.approx(sum(to_sinkhorn) / matrices, abs=tol)
    assert row["max_abs_diff"] == pytest.approx(max(to_sinkhorn), abs=5 * row["max_se"])
    assert row["mean_abs_diff_unbalanced"] == pytest.approx(sum(to_softmax) / matrices, abs=tol)
    # the documented standard error sqrt(m (1 - m) / S) of one marginal, at the exact m (the estimate's m is
    # within 0.01 of it, which moves the standard error by well under 5 %)
    assert row["mean_se"] == pytest.approx(sum(se) / matrices, rel=0.05)


# ----------------------------------------------------------------------------- gradient_check

# Hand-set "expected gradients" over (w0, w1, b0, b1, a, c), one row per group. Sample's is the reference.
SAMPLE = (0.0, 0.0, 1.0, 0.0, 3.0, 4.0)  # every group; |all| = sqrt(26), router (a, c) = (3, 4), |router| = 5
C, D = (1.0, 2.0, 3.0, 4.0), (1.0, -1.0, 1.0, -1.0)  # Sample Skip's group g: router c_g (3, 4) + d_g (4, -3)
IW = tuple(2 * v for v in SAMPLE)  # the control: every group at twice Sample's length, same direction


def _stub(method: str, tau: float, seed: int, *, copies: int, groups: int, generator: torch.Generator) -> torch.Tensor:
    """A stand-in for :func:`expected_gradient` returning the hand-set groups above (float64)."""
    assert groups == len(C) and isinstance(generator, torch.Generator)
    if method == "sample":
        return torch.tensor([SAMPLE] * groups, dtype=torch.float64)
    if method == "sample_skip":
        return torch.tensor([[0, 0, 0, 0, 3 * c + 4 * d, 4 * c - 3 * d] for c, d in zip(C, D)], dtype=torch.float64)
    if method == "sample_skip_iw":
        return torch.tensor([IW] * groups, dtype=torch.float64)
    raise AssertionError(f"unexpected method {method!r}")


def test_gradient_check_entries_follow_their_definitions(monkeypatch: pytest.MonkeyPatch) -> None:
    """``gradient_check`` (module docstring): the cosine between a method's expected gradient and Sample's, and the
    **ratio of their norms, method over Sample**; the reference is **Sample's** pooled estimate; the parts are all
    six parameters and the **router's (a, c)**, columns 4 and 5; each ``*_se`` is the standard deviation over the
    groups of each group's statistic against the reference, over sqrt(groups).

    Stubbed estimates: Sample (0, 0, 1, 0, 3, 4) in every group; Sample Skip's group g is c_g (3, 4) + d_g (4, -3)
    on (a, c) and 0 elsewhere, with c = 1, 2, 3, 4 and d = ±1, so its pooled mean is 2.5 (3, 4), of norm 12.5;
    Sample Skip IW is twice Sample. By hand:

    * skip, all: dot 2.5 · 25, so cos = 62.5 / (12.5 sqrt(26)) = 5 / sqrt(26); ratio = 12.5 / sqrt(26);
    * skip, router: cos = 1; ratio = 12.5 / 5 = 2.5;
    * iw, both parts: cos = 1, ratio = 2, every group alike (se 0); a reference read from Sample Skip IW
      itself would give ratio 1, and a ratio inverted 0.5;
    * skip per group: |g| = 5 sqrt(c² + 1) and g · ref = 25 c, so the router cosine is c / sqrt(c² + 1) and the
      ratio sqrt(c² + 1); over all six, cos 5 c / (sqrt(26) sqrt(c² + 1)) and ratio 5 sqrt(c² + 1) / sqrt(26).
      Their sample standard deviations (``statistics.stdev``) over 2 = sqrt(4 groups) are the ``*_se``.
    """
    monkeypatch.setattr(gr, "expected_gradient", _stub)
    (row,) = gr.gradient_check([3], [2.0], copies=10, groups=4)
    assert (row["seed"], row["tau"], row["copies"]) == (3, 2.0, 40)
    r26 = math.sqrt(26)
    h = [math.sqrt(c * c + 1) for c in C]

    def se(values: list[float]) -> float:
        return statistics.stdev(values) / 2

    expected = {
        "cos_skip_all": 5 / r26, "ratio_skip_all": 12.5 / r26,
        "cos_skip_router": 1.0, "ratio_skip_router": 2.5,
        "cos_iw_all": 1.0, "ratio_iw_all": 2.0, "cos_iw_router": 1.0, "ratio_iw_router": 2.0,
        "cos_iw_all_se": 0.0, "ratio_iw_all_se": 0.0, "cos_iw_router_se": 0.0, "ratio_iw_router_se": 0.0,
        "cos_skip_router_se": se([c / x for c, x in zip(C, h)]), "ratio_skip_router_se": se(h),
        "cos_skip_all_se": se([5 * c / (r26 * x) for c, x in zip(C, h)]),
        "ratio_skip_all_se": se([5 * x / r26 for x in h]),
    }
    for key, value in expected.items():
        # the per-group cosines are gathered into a float32 tensor (torch.tensor of Python floats): their
        # standard error is exact to float32 rounding only
        rel = 1e-6 if key.startswith("cos_") and key.endswith("_se") else 1e-12
        assert row[key] == pytest.approx(value, rel=rel, abs=1e-12), key


# ----------------------------------------------------------------------------- expected_gradient


def exact_gradient(seed: int) -> torch.Tensor:
    """The gradient over (w0, w1, b0, b1, a, c) of the expected loss ``(1/n) sum_i sum_j p_ij (y_i - out_j(x_i))^2``
    at ``seed``'s initial parameters, by autograd on that closed form (float64); p = softmax([0, a x + c])."""
    x, y = make_data(seed, dtype=torch.float64)
    p0 = {k: v.clone().requires_grad_(True) for k, v in init_params(seed, dtype=torch.float64).items()}
    p = torch.softmax(torch.stack([torch.zeros_like(x), p0["a"] * x + p0["c"]], -1), -1)
    out = p0["w"] * x.unsqueeze(-1) + p0["b"]
    loss = (p * (y.unsqueeze(-1) - out) ** 2).sum(-1).mean()
    gw, gb, ga, gc = torch.autograd.grad(loss, [p0["w"], p0["b"], p0["a"], p0["c"]])
    return torch.cat([gw, gb, ga.reshape(1), gc.reshape(1)])


def test_sample_expected_gradient_is_unbiased_on_the_router() -> None:
    """Sample (REINFORCE without capacity) is unbiased for the gradient of the expected loss, provided its baseline
    does not depend on the route it multiplies: the module uses "the same constant for every copy of a method
    (the mean observed loss of its copies)". So the mean over 16 groups × 2000 copies at seed 1, τ = 1 must lie
    within 5 standard errors (the spread of the 16 group means over 4) of :func:`exact_gradient` in every
    coordinate; for a t distribution with 15 degrees of freedom a coordinate exceeds that with probability
    about 1.6e-4. The router coordinates (a, c) are the ones a route-dependent baseline (e.g. each copy's own
    loss) biases: here by 12 to 18 standard errors on a (measured with three generator seeds).
    """
    truth = exact_gradient(1)
    est = gr.expected_gradient("sample", 1.0, 1, copies=2_000, groups=16, generator=torch.Generator().manual_seed(0))
    mean, se = est.mean(0), est.std(0) / math.sqrt(est.shape[0])
    z = (mean - truth) / se
    assert bool((z.abs() <= 5).all()), z
