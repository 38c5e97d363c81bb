"""DSelect-k contracts that mutation testing of ``routelab/gates/dselect.py`` found unguarded.

Each test names the behaviour it pins: penalties computed in >= float32 for a half-precision gate,
the gradient of the App. B.2 unused-code penalty below its floor, ``is_binary`` with the gate's own
smooth-step width (static and per-example), ``k <= num_experts`` (not ``<= 2^m``) in
``dselect_weights``, and a bool ``binary_step`` rejected by ``load_state_dict``.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_dselect_entropy_and_init import _selector
from test_dselect_entropy_and_init import _smooth_step as _s

from routelab.gates import DSelectK, dselect_weights, smooth_step
from routelab.gates.dselect import ENTROPY_EPS, UNUSED_FLOOR

torch.set_num_threads(1)


# ---------------------------------------------------------------------------- penalty dtype
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_gate_computes_its_penalties_in_float32(dtype):
    """A float16 / bfloat16 gate returns its entropy and unused-code penalties in float32 (class
    docstring: "Penalties are computed in float32"), with the values of the half-precision
    selectors r(S(z)) (not a half-precision sum of logs, which loses the small terms)."""
    gate = DSelectK(5, 2, entropy_reg=0.5, generator=torch.Generator().manual_seed(0)).to(dtype)
    with torch.no_grad():
        gate.z.copy_(torch.tensor([[0.1, -0.2, 0.3], [-0.05, 0.15, -0.4]]))
    gate(torch.zeros(3, 1, dtype=dtype))
    assert gate.aux["entropy"].dtype == torch.float32
    assert gate.aux["unused_codes"].dtype == torch.float32
    z = gate.z.detach().double().tolist()
    ent = sum(-sum(p * math.log(p + ENTROPY_EPS) for p in _selector(zi, 1.0)) for zi in z)
    unused = sum(1.0 / sum(_selector(zi, 1.0)[:5]) for zi in z)
    assert gate.aux["entropy"].item() == pytest.approx(0.5 * ent, rel=2e-2)
    assert gate.aux["unused_codes"].item() == pytest.approx(unused, rel=2e-2)
    assert gate.regularization().dtype == torch.float32


# ---------------------------------------------------------------------------- unused-code floor
def test_unused_code_penalty_below_the_floor_keeps_the_unfloored_gradient():
    """App. B.2 penalty 1 / (selector mass on the real experts), floored at UNUSED_FLOOR for the
    value only: a selector almost entirely on an unused code (mass 3e-8 on the real experts) gets
    the value 1 / UNUSED_FLOOR and the gradient d(1/floor)/d real * d real/dz, nonzero and pointing
    back to the real experts (UNUSED_FLOOR docstring: "the gradient still flows through the
    unfloored mass"). Without it a selector stuck on unused codes could never come back."""
    gate = DSelectK(5, 1, generator=torch.Generator().manual_seed(0)).double()  # m = 3, codes 5..7 unused
    t0 = 0.5 - 1e-4                     # S(t0) = 1 - 3e-8: code 5 (bits 101) holds almost all the mass
    with torch.no_grad():
        gate.z.copy_(torch.tensor([[t0, -1.0, 1.0]], dtype=torch.float64))
    gate(1)
    real = 1.0 - _s(t0, 1.0)            # only code 4 (bits 100) is real and reachable
    assert 0 < real < UNUSED_FLOOR
    assert gate.aux["unused_codes"].item() == pytest.approx(1.0 / UNUSED_FLOOR, rel=1e-12)
    gate.aux["unused_codes"].backward()
    s_prime = -6 * t0**2 + 1.5          # S'(t0) for gamma = 1
    want = s_prime / UNUSED_FLOOR**2    # d(1/f)/dz0 = -1/f^2 * d(1 - S(z0))/dz0
    assert gate.z.grad[0, 0].item() == pytest.approx(want, rel=1e-9)
    assert gate.z.grad[0, 0].item() > 0  # a descent step lowers z0: mass moves to the real code 4
    assert gate.z.grad[0, 1:].abs().max().item() == 0  # binary bits: S' = 0


# ---------------------------------------------------------------------------- gamma in is_binary
@pytest.mark.parametrize(("gamma", "zabs", "binary"), [(4.0, 1.0, False), (4.0, 2.0, True),
                                                       (0.5, 0.3, True), (0.5, 0.2, False)])
def test_static_is_binary_uses_the_gates_gamma(gamma, zabs, binary):
    """Static gate: S(Z) is binary iff every |z| >= gamma / 2 for the gate's own gamma (eq. 3),
    and track() records the first such step; gamma = 1 would give the opposite answer here."""
    gate = DSelectK(4, 2, gamma=gamma, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        gate.z.copy_(torch.tensor([[zabs, -zabs], [-zabs, zabs]]))
    w = gate(1)
    assert gate.is_binary() is binary
    assert gate.report()["binary"] is binary
    gate.track(3)
    assert gate.binary_step == (3 if binary else None)
    if binary:  # binary codes: experts 1 (bits 01) and 2 (bits 10) only
        assert set(torch.nonzero(w[0]).flatten().tolist()) == {1, 2}


@pytest.mark.parametrize(("gamma", "zabs", "binary"), [(4.0, 1.0, False), (4.0, 2.0, True),
                                                       (0.5, 0.3, True), (0.5, 0.2, False)])
def test_per_example_smooth_step_stats_and_is_binary_use_the_gates_gamma(gamma, zabs, binary):
    """Per-example gate: ``stats["smooth_step"]`` is S(W x) with the gate's gamma, and is_binary /
    track read it (W = 0, bias = the codes, so every example has the codes of the bias)."""
    gate = DSelectK(4, 2, gamma=gamma, per_example=True, input_dim=3, generator=torch.Generator().manual_seed(0))
    codes = torch.tensor([zabs, -zabs, -zabs, zabs])
    with torch.no_grad():
        gate.W.weight.zero_()
        gate.W.bias.copy_(codes)
    x = torch.randn(2, 3, generator=torch.Generator().manual_seed(1))
    out = gate.gate(x)
    want = torch.tensor([_s(v, gamma) for v in codes.tolist()]).view(1, 2, 2).expand(2, 2, 2)
    torch.testing.assert_close(out.stats["smooth_step"], want)
    gate(x)
    assert gate.is_binary() is binary
    gate.track(7)
    assert gate.binary_step == (7 if binary else None)


# ---------------------------------------------------------------------------- argument checks
def test_dselect_weights_rejects_k_above_num_experts_even_below_2_to_the_m():
    """k <= num_experts (not <= 2^m): for n = 5 (m = 3, 8 codes) k = 6 is an error naming k."""
    with pytest.raises(ValueError, match="k = 6"):
        dselect_weights(torch.zeros(6), torch.zeros(6, 3), 5)
    assert dselect_weights(torch.zeros(5), torch.zeros(5, 3), 5).shape == (5,)  # k = n is fine


@pytest.mark.parametrize("bad", [True, False])
def test_a_bool_binary_step_in_the_extra_state_is_a_clear_error(bad):
    """``binary_step`` is an int or None; a bool (an Integral in Python) is a ValueError naming the
    extra state, not step 1 / 0."""
    gate = DSelectK(4, 2)
    state = {**gate.state_dict(), "_extra_state": {"binary_step": bad}}
    with pytest.raises(ValueError, match="extra state"):
        gate.load_state_dict(state)
    assert gate.binary_step is None
    gate.load_state_dict({**gate.state_dict(), "_extra_state": {"binary_step": 4}})
    assert gate.binary_step == 4 and type(gate.binary_step) is int


def test_smooth_step_reference_agrees():
    """Sanity of this file's reference: _s matches routelab's smooth_step."""
    t = torch.linspace(-2, 2, 41, dtype=torch.float64)
    for gamma in (0.5, 1.0, 4.0):
        want = torch.tensor([_s(v, gamma) for v in t.tolist()], dtype=torch.float64)
        torch.testing.assert_close(smooth_step(t, gamma), want)
