"""Contracts of routelab.gates.mtl_gate / mtl_baselines / smooth_step pinned by mutation testing.

Each test guards one rule that the other tests of these modules left unchecked: the temperature
of the Gumbel-softmax gate's straight-through gradient (App. D of Hazimeh et al. 2021) and the end
of the ablation's log-linear annealing schedule (App. C.1). Oracles are hand-computed values (the
gate's noise redrawn from its documented seed, the schedule's closed form).
"""

from __future__ import annotations

import pytest
import torch

from routelab.gates import GumbelSoftmaxGate
from routelab.gates.mtl_baselines import SoftmaxSelectorGate


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_gumbel_straight_through_gradient_is_the_relaxed_sample_at_its_temperature(temperature: float) -> None:
    """Guards the temperature of App. D's Gumbel-softmax trick in the backward pass: the forward U is
    exactly binary (argmax, the same at every temperature), its gradient is that of the relaxed
    sample soft_i = sigmoid((beta_i + G_i0 - G_i1) / T), so d sum(d) / d beta_i = softmax(alpha)_i
    soft_i (1 - soft_i) / T. Dropping T from the relaxation leaves the forward unchanged and only
    the gradient wrong. The noise is redrawn by hand from the gate's documented seed."""
    n, seed = 5, 1234
    gate = GumbelSoftmaxGate(n, temperature=temperature, seed=seed, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        gate.beta.copy_(torch.tensor([0.3, -0.2, 1.0, 0.05, -0.7]))
    gate.train()
    w = gate(1)
    w.sum().backward()

    # the gate's first training forward draws u ~ U(0, 1) of shape [n, 2] from Generator(seed)
    u = torch.rand((n, 2), generator=torch.Generator().manual_seed(seed)).clamp(1e-10, 1 - 1e-10).double()
    g = -torch.log(-torch.log(u))
    beta = gate.beta.detach().double()
    soft = torch.sigmoid((beta + g[:, 0] - g[:, 1]) / temperature)  # log pi - log(1 - pi) = beta
    hard = (soft > 0.5).double()
    a = torch.softmax(gate.alpha.detach().double(), dim=-1)
    torch.testing.assert_close(w[0].detach().double(), a * hard, rtol=1e-6, atol=1e-7)
    want = a * soft * (1 - soft) / temperature
    torch.testing.assert_close(gate.beta.grad.double(), want, rtol=1e-5, atol=1e-8)


def test_ablation_annealing_holds_the_final_temperature_past_the_last_step() -> None:
    """Guards the clamp of the log-linear schedule T = T0 (T1 / T0)^(step / (total_steps - 1)):
    a step past the last one (an extra evaluation step, a resumed loop) keeps T at the final
    temperature instead of extrapolating below it (1e-16 ** (10 / 9) would be ~1e-18), and a
    negative step keeps the initial one."""
    gate = SoftmaxSelectorGate(4, 2, temperature=1.0, final_temperature=1e-4)
    gate.on_step(9, 10)
    assert gate.temperature == pytest.approx(1e-4, rel=1e-12)
    gate.on_step(10, 10)
    assert gate.temperature == pytest.approx(1e-4, rel=1e-12)
    gate.on_step(25, 10)
    assert gate.temperature == pytest.approx(1e-4, rel=1e-12)
    gate.on_step(-3, 10)
    assert gate.temperature == pytest.approx(1.0, rel=1e-12)
    gate.on_step(3, 10)  # a step inside the schedule: 1e-4 ** (3 / 9), by hand
    assert gate.temperature == pytest.approx(10 ** (-4 / 3), rel=1e-12)
