"""DSelect-k: formulas against an explicit-loop reference, sparsity, gradients, penalties, errors."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from routelab.gates import DSelectK, dselect_weights, smooth_step

torch.set_num_threads(1)


# ------------------------------------------------------------------ independent references
def ref_smooth_step(t: float, gamma: float) -> float:
    if t <= -gamma / 2:
        return 0.0
    if t >= gamma / 2:
        return 1.0
    return -2.0 / gamma**3 * t**3 + 3.0 / (2.0 * gamma) * t + 0.5


def ref_weights(alpha: list[float], z: list[list[float]], n: int, gamma: float) -> list[float]:
    """sum_i softmax(alpha)_i r(S(z_i)) by explicit loops over selectors, experts and bits (eq. 4)."""
    m = max(1, math.ceil(math.log2(n))) if n > 1 else 0
    mx = max(alpha)
    ex = [math.exp(a - mx) for a in alpha]
    sm = [e / sum(ex) for e in ex]
    out = [0.0] * n
    for i, zi in enumerate(z):
        for e in range(n):  # expert e (0-based) is code e
            prod = 1.0
            for j in range(m):
                s = ref_smooth_step(zi[j], gamma)
                prod *= s if (e >> j) & 1 else 1.0 - s
            out[e] += sm[i] * prod
    return out


# ------------------------------------------------------------------ smooth-step
@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-3, 3), min_size=1, max_size=20), st.floats(0.05, 5.0))
def test_smooth_step_matches_reference(ts, gamma):
    t = torch.tensor(ts, dtype=torch.float64)
    got = smooth_step(t, gamma)
    want = torch.tensor([ref_smooth_step(v, gamma) for v in ts], dtype=torch.float64)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_value_rounded_to_0_or_1_inside_the_band_has_no_gradient(dtype):
    """A review case: in float32, S(0.5 - 5e-5) is exactly 1 although the cubic's slope there is
    3e-4, so a DSelect-k gate looked binary (and its zero weights' experts were skipped) while z
    still moved. Now every exactly-binary value has a zero gradient, and the others keep theirs."""
    t = torch.tensor([0.5 - 5e-5, -0.5 + 5e-5, 0.5 - 1e-3, 0.3, -0.49999]).to(dtype).requires_grad_(True)
    s = smooth_step(t, 1.0)
    s.sum().backward()
    binary = (s == 0) | (s == 1)
    assert binary[:2].all()  # rounded to 0/1 in every one of these dtypes
    assert (t.grad[binary] == 0).all()
    assert (t.grad[~binary] > 0).all()
    exact = smooth_step(t.detach().double(), 1.0)  # the values themselves are unchanged: rounded cubic
    torch.testing.assert_close(s.detach().double(), exact.to(dtype).double())


def test_smooth_step_is_c1_at_band_edges():
    gamma = 2.0
    t = torch.tensor([-1.0, 1.0], dtype=torch.float64, requires_grad=True)
    smooth_step(t, gamma).sum().backward()
    torch.testing.assert_close(t.grad, torch.zeros(2, dtype=torch.float64))
    # derivative at 0 is 3/(2 gamma)
    t0 = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    smooth_step(t0, gamma).sum().backward()
    assert t0.grad.item() == pytest.approx(3 / (2 * gamma))


# ------------------------------------------------------------------ dselect_weights
@settings(max_examples=60, deadline=None)
@given(st.integers(2, 13), st.data())
def test_dselect_weights_matches_loop_reference(n, data):
    k = data.draw(st.integers(1, n))
    m = math.ceil(math.log2(n))
    gamma = data.draw(st.floats(0.2, 4.0))
    flt = st.floats(-2.0, 2.0)
    alpha = data.draw(st.lists(flt, min_size=k, max_size=k))
    z = [data.draw(st.lists(flt, min_size=m, max_size=m)) for _ in range(k)]
    got = dselect_weights(torch.tensor(alpha, dtype=torch.float64),
                          torch.tensor(z, dtype=torch.float64), n, gamma)
    want = torch.tensor(ref_weights(alpha, z, n, gamma), dtype=torch.float64)
    torch.testing.assert_close(got, want)
    assert got.shape == (n,)
    assert (got >= 0).all()
    if n & (n - 1) == 0:  # power of 2: probability vector (Prop. 2)
        assert got.sum().item() == pytest.approx(1.0)
    else:
        assert got.sum().item() <= 1.0 + 1e-12


def test_dselect_weights_batched_leading_dims():
    g = torch.Generator().manual_seed(0)
    alpha = torch.randn(3, 2, 4, generator=g, dtype=torch.float64)
    z = torch.randn(3, 2, 4, 3, generator=g, dtype=torch.float64)
    out = dselect_weights(alpha, z, 6, gamma=1.5)
    assert out.shape == (3, 2, 6)
    for a, b in itertools.product(range(3), range(2)):
        want = ref_weights(alpha[a, b].tolist(), z[a, b].tolist(), 6, 1.5)
        torch.testing.assert_close(out[a, b], torch.tensor(want, dtype=torch.float64))


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 16), st.data())
def test_binary_codes_select_exactly_the_encoded_experts(n, data):
    k = data.draw(st.integers(1, n))
    m = math.ceil(math.log2(n))
    experts = data.draw(st.lists(st.integers(0, n - 1), min_size=k, max_size=k))
    gamma = 1.0
    # z_j = +gamma (S = 1) where bit j of the expert is set, -gamma (S = 0) otherwise
    z = torch.tensor([[gamma if (e >> j) & 1 else -gamma for j in range(m)] for e in experts],
                     dtype=torch.float64)
    alpha = torch.tensor(data.draw(st.lists(st.floats(-2, 2), min_size=k, max_size=k)),
                         dtype=torch.float64)
    w = dselect_weights(alpha, z, n, gamma)
    assert set(torch.nonzero(w).flatten().tolist()) == set(experts)
    sm = torch.softmax(alpha, 0)
    for e in set(experts):
        want = sum(sm[i].item() for i, ei in enumerate(experts) if ei == e)
        assert w[e].item() == pytest.approx(want)
    assert (w != 0).sum().item() <= k


# ------------------------------------------------------------------ the module
def test_static_init_and_forward_shape():
    gate = DSelectK(16, 4, gamma=2.0, generator=torch.Generator().manual_seed(0))
    assert gate.alpha.shape == (4,) and gate.z.shape == (4, 4) and gate.Z is gate.z
    assert gate.z.abs().max().item() <= 2.0 / 100
    assert gate.alpha.abs().max().item() <= 0.05
    w = gate(torch.randn(5, 3))
    assert w.shape == (5, 16)
    torch.testing.assert_close(w[0], dselect_weights(gate.alpha, gate.z, 16, 2.0))
    assert not gate.is_binary()
    assert gate.report()["experts_selected_mean"] == 16


def test_same_seed_same_init():
    a = DSelectK(8, 2, per_example=True, input_dim=5, generator=torch.Generator().manual_seed(3))
    b = DSelectK(8, 2, per_example=True, input_dim=5, generator=torch.Generator().manual_seed(3))
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)


def test_per_example_matches_functional_and_gradients_flow():
    g = torch.Generator().manual_seed(1)
    gate = DSelectK(6, 3, per_example=True, input_dim=4, generator=g)
    x = torch.randn(7, 4, generator=g)
    w = gate(x)
    alpha = gate.G(x)
    z = gate.W(x).view(7, 3, 3)
    torch.testing.assert_close(w, dselect_weights(alpha, z, 6, 1.0))
    target = torch.randn(7, 6, generator=g)
    ((w * target).sum() + gate.regularization()).backward()
    for p in (gate.G.weight, gate.G.bias, gate.W.weight, gate.W.bias):
        assert p.grad is not None and p.grad.abs().sum() > 0


def test_static_gradients_reach_alpha_and_z():
    gate = DSelectK(8, 2, entropy_reg=0.1, generator=torch.Generator().manual_seed(0))
    w = gate(4)
    (w * torch.arange(8.0)).sum().backward()
    assert gate.alpha.grad.abs().sum() > 0 and gate.z.grad.abs().sum() > 0


def test_entropy_regularizer_matches_definition():
    gate = DSelectK(4, 2, entropy_reg=0.3, generator=torch.Generator().manual_seed(0))
    gate(1)
    total = 0.0
    for i in range(2):
        r = ref_weights([0.0], [gate.z[i].tolist()], 4, 1.0)  # one selector alone = r(S(z_i))
        total += -sum(p * math.log(p + 1e-6) for p in r)
    assert gate.aux["entropy"].item() == pytest.approx(0.3 * total, rel=1e-5)
    assert "unused_codes" not in gate.aux  # power of 2: no penalty


def test_unused_code_penalty_definition_and_effect():
    torch.manual_seed(0)
    gate = DSelectK(5, 2, generator=torch.Generator().manual_seed(0))  # m = 3, codes 5..7 unused
    # push both selectors towards unused codes (bits 0 and 2 set -> code 5 / 7)
    with torch.no_grad():
        gate.z.copy_(torch.tensor([[0.3, -0.1, 0.3], [0.3, 0.3, 0.3]]))
    w = gate(1)
    reach = [sum(ref_weights([0.0], [gate.z[i].tolist()], 5, 1.0)) for i in range(2)]
    assert gate.aux["unused_codes"].item() == pytest.approx(sum(1 / r for r in reach), rel=1e-5)
    before = w.sum().item()
    opt = torch.optim.SGD(gate.parameters(), lr=0.05)
    for _ in range(200):
        opt.zero_grad()
        gate(1)
        gate.regularization().backward()
        opt.step()
    after = gate(1).sum().item()
    assert before < 0.6 and after > 0.99  # mass moved onto the 5 real experts


def test_becomes_binary_and_reports_step():
    gate = DSelectK(4, 2, entropy_reg=1.0, generator=torch.Generator().manual_seed(0))
    opt = torch.optim.Adam(gate.parameters(), lr=0.01)
    target = torch.tensor([0.0, 1.0, 0.0, 0.0])
    for step in range(300):
        opt.zero_grad()
        w = gate(1)[0]
        (((w - target) ** 2).sum() + gate.regularization()).backward()
        opt.step()
        gate.track(step)
    rep = gate.report()
    assert rep["binary"] and rep["binary_step"] is not None and rep["binary_step"] < 300
    assert gate(1)[0].argmax().item() == 1
    assert rep["experts_selected_mean"] <= 2


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_experts=4, k=5), "k = 5"),
        (dict(num_experts=4, k=0), "k must be"),
        (dict(num_experts=4, k=2, gamma=0.0), "gamma"),
        (dict(num_experts=4, k=2, gamma=-1.0), "gamma"),
        (dict(num_experts=4, k=2, per_example=True), "input_dim"),
        (dict(num_experts=4, k=2, entropy_reg=-1.0), "entropy_reg"),
        (dict(num_experts=0, k=1), "num_experts"),
    ],
)
def test_bad_constructor_args_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DSelectK(**kwargs)


def test_bad_functional_args_raise():
    with pytest.raises(ValueError, match="gamma"):
        smooth_step(torch.zeros(2), gamma=0.0)
    with pytest.raises(ValueError, match="k = 5"):
        dselect_weights(torch.zeros(5), torch.zeros(5, 2), 4)
    with pytest.raises(ValueError, match="z must have shape"):
        dselect_weights(torch.zeros(2), torch.zeros(2, 3), 4)
    with pytest.raises(ValueError, match="z must have shape"):
        dselect_weights(torch.zeros(2), torch.zeros(3, 2), 4)
    with pytest.raises(ValueError, match="gamma"):
        dselect_weights(torch.zeros(2), torch.zeros(2, 2), 4, gamma=-2.0)


def test_per_example_wrong_input_shape_raises():
    gate = DSelectK(4, 2, per_example=True, input_dim=3)
    with pytest.raises(ValueError, match=r"\[batch, 3\]"):
        gate(torch.zeros(2, 4))
    with pytest.raises(ValueError, match="x must"):
        gate(3)
