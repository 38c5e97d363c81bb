"""DSelectK: the per-example entropy summed over examples (paper Sec. 3.2, the default), the
batch mean as an option, and the "distinct" selector initialisation (a routelab option)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from routelab.gates import DSelectK, smooth_step
from routelab.gates.dselect import ALPHA_INIT, DISTINCT_CODE_OFFSET


def _smooth_step(t: float, gamma: float) -> float:
    """The smooth-step of eq. 3, written out."""
    if t <= -gamma / 2:
        return 0.0
    if t >= gamma / 2:
        return 1.0
    return -2 / gamma**3 * t**3 + 3 / (2 * gamma) * t + 0.5


def _selector(z: list[float], gamma: float) -> list[float]:
    """r(S(z)) over all 2^m codes by explicit loops (eq. 4): code e gets prod_j S or 1 - S."""
    m = len(z)
    out = []
    for e in range(2**m):
        p = 1.0
        for j in range(m):
            s = _smooth_step(z[j], gamma)
            p *= s if (e >> j) & 1 else 1.0 - s
        out.append(p)
    return out


def _entropy_terms(gate: DSelectK, x: torch.Tensor) -> list[float]:
    """Omega(W, x) = sum_i h(r(S(W^(i) x))) for every example, h(p) = -sum p log(p + 1e-6)."""
    codes = (x.double() @ gate.W.weight.double().T + gate.W.bias.double()).view(x.shape[0], gate.k, gate.m)
    terms = []
    for b in range(x.shape[0]):
        t = 0.0
        for i in range(gate.k):
            t += -sum(p * math.log(p + 1e-6) for p in _selector(codes[b, i].tolist(), gate.gamma))
        terms.append(t)
    return terms


@settings(max_examples=25, deadline=None)
@given(n=st.integers(2, 9), k=st.integers(1, 3), batch=st.integers(1, 7), reg=st.sampled_from([0.01, 0.3, 2.0]),
       seed=st.integers(0, 10_000))
def test_per_example_entropy_is_summed_over_examples_by_default(n, k, batch, reg, seed):
    k = min(k, n)
    g = torch.Generator().manual_seed(seed)
    gate = DSelectK(n, k, per_example=True, input_dim=3, entropy_reg=reg, generator=g)
    mean_gate = DSelectK(n, k, per_example=True, input_dim=3, entropy_reg=reg, entropy_reduction="mean",
                         generator=torch.Generator().manual_seed(seed))
    x = torch.randn(batch, 3, generator=g) * 20  # wide codes: some selectors binary, some not
    gate(x)
    mean_gate(x)
    terms = _entropy_terms(gate, x)
    assert gate.aux["entropy"].item() == pytest.approx(reg * sum(terms), rel=1e-4, abs=1e-6)
    assert mean_gate.aux["entropy"].item() == pytest.approx(reg * sum(terms) / batch, rel=1e-4, abs=1e-6)


def test_summed_entropy_gradient_is_batch_times_the_mean():
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))
    grads = {}
    for red in ("sum", "mean"):
        gate = DSelectK(8, 2, per_example=True, input_dim=4, entropy_reg=0.5, entropy_reduction=red,
                        generator=torch.Generator().manual_seed(0))
        gate(x)
        gate.aux["entropy"].backward()
        grads[red] = gate.W.weight.grad.clone()
    assert grads["sum"].abs().sum() > 0
    torch.testing.assert_close(grads["sum"], 6 * grads["mean"])


def test_static_gate_has_one_entropy_term_either_way():
    a = DSelectK(16, 4, entropy_reg=0.1, generator=torch.Generator().manual_seed(2))
    b = DSelectK(16, 4, entropy_reg=0.1, entropy_reduction="mean", generator=torch.Generator().manual_seed(2))
    a(32)
    b(32)
    want = 0.1 * sum(-sum(p * math.log(p + 1e-6) for p in _selector(z.tolist(), 1.0)) for z in a.z.detach())
    assert a.aux["entropy"].item() == pytest.approx(want, rel=1e-5)
    assert b.aux["entropy"].item() == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize(("kw", "name"), [(dict(entropy_reduction="avg"), "entropy_reduction"),
                                          (dict(selector_init="random"), "selector_init")])
def test_bad_options_name_the_argument(kw, name):
    with pytest.raises(ValueError, match=name):
        DSelectK(8, 2, **kw)


def test_official_init_is_unchanged():
    g = torch.Generator().manual_seed(5)
    gate = DSelectK(16, 4, gamma=2.0, generator=torch.Generator().manual_seed(5))
    alpha = (torch.rand(4, generator=g) * 2 - 1) * ALPHA_INIT
    z = (torch.rand(4, 4, generator=g) * 2 - 1) * (2.0 / 100)
    assert torch.equal(gate.alpha.detach(), alpha) and torch.equal(gate.z.detach(), z)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(2, 20), k=st.integers(1, 8), gamma=st.sampled_from([0.5, 1.0, 3.0]), seed=st.integers(0, 10_000),
       per_example=st.booleans())
def test_distinct_init_starts_selectors_on_distinct_real_experts(n, k, gamma, seed, per_example):
    k = min(k, n)
    gate = DSelectK(n, k, gamma=gamma, selector_init="distinct", per_example=per_example, input_dim=3,
                    generator=torch.Generator().manual_seed(seed))
    z = (gate.W.bias.view(k, gate.m) if per_example else gate.z).detach()   # per-example: the codes at x = 0
    picks = []
    for i in range(k):
        r = _selector(z[i].tolist(), gamma)
        picks.append(max(range(len(r)), key=r.__getitem__))
        # the pick holds (S(gamma/4 - noise))^m of the selector's mass: at least 0.84^m
        assert r[picks[-1]] >= (_smooth_step(DISTINCT_CODE_OFFSET * gamma - gamma / 100, gamma)) ** gate.m - 1e-6
    assert len(set(picks)) == k and max(picks) < n
    s = smooth_step(z, gamma)
    assert bool(((s > 0) & (s < 1)).all())  # every code bit still trainable
    again = DSelectK(n, k, gamma=gamma, selector_init="distinct", per_example=per_example, input_dim=3,
                     generator=torch.Generator().manual_seed(seed))
    assert all(torch.equal(p, q) for p, q in zip(gate.parameters(), again.parameters(), strict=True))
