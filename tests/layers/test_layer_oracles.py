"""Layers against independent oracles: tests a mutation review asked for (mutants of the gated experts'
activation, the multi-gate penalty, MAE's responsibility check and padded sampling, and BCD's clipping that the
suite did not notice)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from routelab.gates.mtl_baselines import GumbelSoftmaxGate
from routelab.layers import MixtureOfAttentiveExperts
from routelab.layers.bcd import BCDTrainer
from routelab.layers.experts import StackedExperts
from routelab.layers.multigate import MultiGateMoE


@pytest.mark.parametrize(("name", "act"), [("swiglu", F.silu), ("geglu", F.gelu), ("reglu", F.relu)])
def test_every_gated_activation_is_its_glu(name, act):
    """Shazeer 2020: ``(act(x W1) * x W3) W2`` per expert; a GEGLU computed with SiLU survived the suite."""
    torch.manual_seed(0)
    e = StackedExperts(4, 6, 2, activation=name, bias=False)
    x = torch.randn(2, 3, 4)
    with torch.no_grad():
        want = torch.stack([(act(x[i] @ e.w1[i]) * (x[i] @ e.w3[i])) @ e.w2[i] for i in range(2)])
        torch.testing.assert_close(e(x), want)


def test_the_multigate_penalty_is_every_gates_penalty():
    """Oracle: the sum over the task gates; returning the first gate's alone survived the suite."""
    torch.manual_seed(0)
    gates = [GumbelSoftmaxGate(3, sparsity_reg=0.1, seed=s) for s in (1, 2, 3)]
    m = MultiGateMoE([torch.nn.Linear(4, 3) for _ in range(3)], gates)
    m(torch.randn(5, 4))
    total = m.regularization()
    torch.testing.assert_close(total, sum(g.regularization() for g in gates))
    total.backward()
    assert all(any(p.grad is not None and p.grad.abs().sum() > 0 for p in g.parameters()) for g in gates)


@pytest.mark.parametrize(("off", "accepted"), [(1e-6, True), (1e-3, False)])
def test_responsibilities_must_sum_to_one(off, accepted):
    """A tolerance of 1e-1 in place of 1e-4 survived: rows summing to 1.05 scaled the output silently."""
    torch.manual_seed(0)
    m = MixtureOfAttentiveExperts(8, 4, drop_heads=1, batch_first=True)
    x = torch.randn(2, 3, 8)
    r = torch.full((2, 4), 0.25)
    r[:, 0] += off
    if accepted:
        m(x, x, x, responsibilities=r)
    else:
        with pytest.raises(ValueError, match="responsibilities must sum to 1"):
            m(x, x, x, responsibilities=r)


def test_a_sampled_expert_is_drawn_from_the_last_real_positions_window():
    """Alg. 2 with ``gate_context``: the per-instance gate reads the window of the last unpadded position (a
    mutant reading position seq - 1, padding, survived)."""
    torch.manual_seed(0)
    m = MixtureOfAttentiveExperts(8, 4, drop_heads=1, batch_first=True, gate_context=2)
    m.routing = "sample"
    seen = []
    route = m.route_summary
    m.route_summary = lambda s: (seen.append(s.clone()), route(s))[1]
    x = torch.randn(1, 5, 8)
    m(x, x, x, key_padding_mask=torch.tensor([[False, False, False, True, True]]))
    torch.testing.assert_close(seen[-1][0], x[0, 1:3].mean(0))


def test_bcd_clips_thetas_gradient_before_the_adam_step():
    """``clip_norm`` bounds the norm of theta's gradient at the Adam step (clipping the gates' gradient instead
    survived: 2123 at clip 1e-3)."""
    torch.manual_seed(0)
    model = MixtureOfAttentiveExperts(8, 4, drop_heads=1, batch_first=True)
    x = torch.randn(4, 3, 8)
    tr = BCDTrainer(model, lambda m, b: (m(b, b, b)[0] * 100).pow(2).mean(), mode="uni", clip_norm=1e-3, lr=1.0,
                    generator=torch.Generator().manual_seed(1))
    norms = []
    step = tr.optimizer.step

    def spy(*args, **kwargs):
        norms.append(float(torch.stack([p.grad.norm() for p in tr.theta_params if p.grad is not None]).norm()))
        return step(*args, **kwargs)

    tr.optimizer.step = spy
    tr.f_step(x)
    assert norms and norms[0] <= 1e-3 * (1 + 1e-5)
