"""MultiGateMoE and SharedBottom: against an explicit per-task, per-expert loop; any gate fits."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

from routelab.gates import DSelectK, GumbelSoftmaxGate, SoftmaxGate, SoftmaxSelectorGate, TopKGate, ablation_entropy
from routelab.layers import MultiGateMoE, SharedBottom, StackedLinear

torch.set_num_threads(1)


def _experts(n: int, p: int, d: int, seed: int) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Linear(p, d), nn.ReLU()) for _ in range(n)]


@pytest.mark.parametrize("per_example", [False, True])
def test_matches_explicit_loop(per_example):
    g = torch.Generator().manual_seed(0)
    n, p, d = 4, 5, 3
    experts = _experts(n, p, d, 0)
    gates = [DSelectK(n, 2, per_example=per_example, input_dim=p, generator=g),
             TopKGate(n, 2, per_example=per_example, input_dim=p, generator=g)]
    towers = [nn.Linear(d, 1), nn.Linear(d, 2)]
    model = MultiGateMoE(experts, gates, towers)
    x = torch.randn(6, p, generator=g)
    out = model(x)
    assert [o.shape for o in out] == [(6, 1), (6, 2)]
    for t in range(2):
        w = gates[t](x)
        for b in range(6):
            mix = sum(w[b, i] * experts[i](x[b:b + 1])[0] for i in range(n))
            torch.testing.assert_close(out[t][b], towers[t](mix), rtol=1e-5, atol=1e-6)


def test_stacked_experts_match_list_and_skip_unused():
    g = torch.Generator().manual_seed(1)
    n, p, d = 4, 3, 2
    stacked = StackedLinear(n, p, d, activation=torch.relu, generator=g)
    as_list = [nn.Linear(p, d) for _ in range(n)]
    with torch.no_grad():
        for i, lin in enumerate(as_list):
            lin.weight.copy_(stacked.weight[i].T)
            lin.bias.copy_(stacked.bias[i])
    calls = [0] * n

    def counted(i: int) -> nn.Module:
        class C(nn.Module):
            def forward(self, x):
                calls[i] += 1
                return torch.relu(as_list[i](x))
        return C()

    # binary DSelect-k codes: task 0 -> experts {1}, task 1 -> experts {1, 2}
    gates = [DSelectK(n, 1), DSelectK(n, 2)]
    with torch.no_grad():
        gates[0].z.copy_(torch.tensor([[1.0, -1.0]]))
        gates[1].z.copy_(torch.tensor([[1.0, -1.0], [-1.0, 1.0]]))
    x = torch.randn(5, p, generator=g)
    a = MultiGateMoE(stacked, gates)(x)
    b = MultiGateMoE([counted(i) for i in range(n)], gates)(x)
    for ya, yb in zip(a, b):
        torch.testing.assert_close(ya, yb, rtol=1e-5, atol=1e-6)
    assert calls == [0, 1, 1, 0]


def test_gradients_reach_experts_gates_towers_and_regularization():
    g = torch.Generator().manual_seed(2)
    n, p = 8, 4
    gates = [DSelectK(n, 2, entropy_reg=0.1, generator=g), SoftmaxGate(n),
             GumbelSoftmaxGate(n, sparsity_reg=0.01), ablation_entropy(n, 2)]
    model = MultiGateMoE(StackedLinear(n, p, 3, generator=g), gates,
                         [nn.Linear(3, 1) for _ in gates])
    x = torch.randn(16, p, generator=g)
    loss = sum(o.pow(2).mean() for o in model(x)) + model.regularization()
    loss.backward()
    assert model.experts.weight.grad.abs().sum() > 0
    assert gates[0].z.grad.abs().sum() > 0 and gates[0].alpha.grad.abs().sum() > 0
    assert all(t.weight.grad is not None for t in model.towers)
    assert model.regularization().item() != 0
    assert len(model.report()) == 4 and len(model.last_weights) == 4


def test_shared_bottom():
    bottom = nn.Linear(4, 3)
    towers = [nn.Linear(3, 1), nn.Linear(3, 5)]
    model = SharedBottom(bottom, towers)
    x = torch.randn(2, 4)
    out = model(x)
    assert len(out) == 2
    for t in range(2):
        torch.testing.assert_close(out[t], towers[t](bottom(x)))
    assert model.regularization().item() == 0 and model.report() == []


def test_bad_configuration_raises():
    with pytest.raises(ValueError, match="gate 0 weighs 3"):
        MultiGateMoE(_experts(4, 2, 2, 0), [SoftmaxGate(3)])
    with pytest.raises(ValueError, match="towers"):
        MultiGateMoE(_experts(4, 2, 2, 0), [SoftmaxGate(4)], [nn.Identity(), nn.Identity()])
    with pytest.raises(ValueError, match="gates"):
        MultiGateMoE(_experts(4, 2, 2, 0), [])
    with pytest.raises(ValueError, match="num_experts"):
        MultiGateMoE(nn.Linear(2, 2), [SoftmaxGate(4)])
    with pytest.raises(ValueError, match="x must be"):
        StackedLinear(2, 3, 4)(torch.zeros(1, 5))
    with pytest.raises(ValueError, match="in_dim"):
        StackedLinear(2, True, 4)


def test_a_straight_through_gate_keeps_the_gradient_of_experts_it_switched_off():
    """Audit finding: a list of experts skipped the experts GumbelSoftmaxGate weighed 0 in the
    forward, losing the straight-through gradient of those zeros (App. D). Truth: the naive
    mixture of every expert's output."""
    from routelab.gates import GumbelSoftmaxGate

    torch.manual_seed(0)
    experts = [nn.Linear(3, 2) for _ in range(4)]
    gate = GumbelSoftmaxGate(4, seed=0)
    with torch.no_grad():
        gate.beta.copy_(torch.tensor([4.0, 4.0, -4.0, 4.0]))  # expert 2 off in this draw
    x = torch.randn(5, 3)
    layer = MultiGateMoE(experts, [gate])
    gate.noise.manual_seed(0)
    layer(x)[0].sum().backward()
    assert layer.last_weights[0][0, 2] == 0
    got = gate.beta.grad.clone()
    gate.beta.grad = None
    gate.noise.manual_seed(0)
    w = gate(x)
    naive = torch.einsum("bn,bnd->bd", w, torch.stack([e(x) for e in experts], 1))
    naive.sum().backward()
    assert gate.beta.grad[2] != 0
    torch.testing.assert_close(got, gate.beta.grad)


def test_experts_are_still_skipped_without_gradients_and_under_exact_zero_gates():
    calls = [0] * 4

    def counted(i: int) -> nn.Module:
        class C(nn.Module):
            def forward(self, x):
                calls[i] += 1
                return x[:, :2] * (i + 1)
        return C()

    from routelab.gates import GumbelSoftmaxGate

    gate = GumbelSoftmaxGate(4, seed=0)
    with torch.no_grad():
        gate.beta.copy_(torch.tensor([4.0, 4.0, -4.0, 4.0]))
    layer = MultiGateMoE([counted(i) for i in range(4)], [gate])
    with torch.no_grad():
        layer(torch.randn(5, 3))
    assert calls[2] == 0 and calls[0] == 1  # no gradient to lose: skipped
    gate.eval()
    layer(torch.randn(5, 3))
    assert calls[2] == 0 and calls[0] == 2  # eval: the gate's zeros are exact


@pytest.mark.parametrize("make_gate", [
    lambda: DSelectK(5, 2, per_example=True, input_dim=4),  # 5 is no power of 2: the unused-codes penalty
    lambda: DSelectK(4, 2, per_example=True, input_dim=4, entropy_reg=0.1),
    lambda: GumbelSoftmaxGate(4, sparsity_reg=0.1),
    lambda: SoftmaxSelectorGate(4, 2, entropy_reg=0.1),
], ids=["dselect-unused-codes", "dselect-entropy", "gumbel-sparsity", "selector-entropy"])
def test_a_model_deep_copies_and_pickles_after_a_training_step(make_gate):
    """An EMA or best-model snapshot (``copy.deepcopy``, ``torch.save``) after a training step: the
    gates' last penalties are graph tensors, detached in the copy (a review found the copy raised
    "Only Tensors created explicitly by the user ..."). The copy computes what the model does."""
    torch.manual_seed(0)
    gate = make_gate()
    model = MultiGateMoE(StackedLinear(gate.num_experts, 4, 6), [gate])
    x = torch.randn(3, 4)
    (model(x)[0].sum() + model.regularization()).backward()
    assert model.regularization().requires_grad
    twin = copy.deepcopy(model)
    loaded = pickle.loads(pickle.dumps(model))
    for other in (twin, loaded):
        assert not other.regularization().requires_grad
        torch.testing.assert_close(other.regularization(), model.regularization().detach())
        model.eval()
        other.eval()
        torch.testing.assert_close(other(x)[0], model(x)[0], rtol=0, atol=0)
        model.train()


@pytest.mark.parametrize("make_gate", [
    lambda: DSelectK(5, 2, per_example=True, input_dim=4),
    lambda: DSelectK(4, 2, per_example=True, input_dim=4, entropy_reg=0.1, entropy_reduction="mean"),
    lambda: DSelectK(4, 2, per_example=True, input_dim=4, entropy_reg=0.1),
    lambda: TopKGate(4, 2, per_example=True, input_dim=4),
    lambda: SoftmaxGate(4, per_example=True, input_dim=4),
], ids=["dselect-unused-codes", "dselect-entropy-mean", "dselect-entropy-sum", "topk", "softmax"])
def test_a_batch_of_no_examples_has_no_penalty(make_gate):
    """Zero examples: empty outputs and a regularization of exactly 0 (it was NaN: the mean of an
    empty penalty), which backward passes through."""
    gate = make_gate()
    model = MultiGateMoE(StackedLinear(gate.num_experts, 4, 6), [gate])
    outs = model(torch.randn(0, 4))
    assert [tuple(o.shape) for o in outs] == [(0, 6)]
    penalty = model.regularization()
    assert float(penalty) == 0.0
    (sum(o.sum() for o in outs) + penalty).backward()


def test_a_half_precision_layer_skips_no_expert_whose_weight_has_a_gradient() -> None:
    """Review finding: a float32 gate's weight of 6e-9 is 0 in float16 and kept its gradient, so a
    float16 layer that skipped the expert lost part of the gate's gradient (15 %). A weight the
    cast rounds to 0 is now detached (``exact_zeros``): the layer's gradient equals the full
    mixture's under the same weights."""
    gate = DSelectK(4, 1, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        gate.z.copy_(torch.tensor([[-(0.5 - 1e-4), 0.3]]))  # one weight just inside the smooth step's band
    w32 = gate(torch.zeros(1, 1))
    w16 = gate(torch.zeros(1, 1, dtype=torch.float16))
    assert float(w32[0, 1]) > 0 and float(w16[0, 1]) == 0.0  # the cast makes the zero
    assert torch.autograd.grad(w16[0, 1].float(), gate.z, allow_unused=True)[0].abs().max() == 0
    torch.manual_seed(0)
    experts = [nn.Linear(3, 2).half() for _ in range(4)]
    layer = MultiGateMoE(experts, [gate])
    x = torch.randn(4, 3, dtype=torch.float16)
    layer(x)[0].float().sum().backward()
    skipped = gate.z.grad.clone()
    gate.z.grad = None
    w = gate(x)
    full = torch.einsum("bn,bnd->bd", w, torch.stack([e(x) for e in experts], 1))
    full.float().sum().backward()
    torch.testing.assert_close(skipped, gate.z.grad)


def test_gate_x_needs_one_row_per_example() -> None:
    """Review finding: a one-row ``gate_x`` was broadcast over the batch (every example routed as the
    first), another mismatch was einsum's error."""
    layer = MultiGateMoE([nn.Linear(3, 2) for _ in range(4)], [SoftmaxGate(4, per_example=True, input_dim=5)])
    for rows in (1, 2):
        with pytest.raises(ValueError, match="gate_x must have one row per example of x: x has 5"):
            layer(torch.randn(5, 3), gate_x=torch.randn(rows, 5))
    assert layer(torch.randn(5, 3), gate_x=torch.randn(5, 5))[0].shape == (5, 2)


def test_non_finite_static_gates_and_inputs_the_experts_dtype_cannot_hold_are_errors() -> None:
    """Review findings: a static gate with an infinite parameter returned NaN weights silently, and
    float64 input of 1e300 passed the check, then overflowed in the cast to the experts' float32."""
    gate = DSelectK(4, 2)
    with torch.no_grad():
        gate.alpha[0] = float("inf")
    with pytest.raises(ValueError, match="DSelectK weights are not finite"):
        gate(3)
    gate.check_finite = False
    assert torch.isnan(gate(3)).all()  # (opted out: no host sync, no check)
    layer = MultiGateMoE([nn.Linear(3, 2) for _ in range(4)], [SoftmaxGate(4)])
    with pytest.raises(ValueError, match="x are not finite"):
        layer(torch.full((2, 3), 1e300, dtype=torch.float64))
    assert layer(torch.full((2, 3), 1e30, dtype=torch.float64))[0].dtype == torch.float64


def test_a_layer_names_its_non_finite_static_gate_and_reads_all_gates_in_one_sync() -> None:
    """The static gates' finite checks are read with the experts' flags (tests/layers/
    test_host_syncs.py counts the syncs); a failure still names the gate."""
    gates = [DSelectK(4, 2), SoftmaxGate(4)]
    with torch.no_grad():
        gates[1].logits[0] = float("nan")
    layer = MultiGateMoE([nn.Linear(3, 2) for _ in range(4)], gates)
    with pytest.raises(ValueError, match="SoftmaxGate weights are not finite"):
        layer(torch.randn(2, 3))
    stacked = MultiGateMoE(StackedLinear(4, 3, 2), gates)  # (no flags to read: the check alone)
    with pytest.raises(ValueError, match="SoftmaxGate weights are not finite"):
        stacked(torch.randn(2, 3))


@pytest.mark.compile
def test_stacked_experts_under_static_gates_compile_as_one_graph() -> None:
    """The static gates' finite checks are value reads: skipped while torch.compile traces (as
    every routelab value check), so the layer stays one graph (fullgraph=True)."""
    torch.manual_seed(0)
    layer = MultiGateMoE(StackedLinear(4, 3, 2), [DSelectK(4, 2), SoftmaxGate(4)])
    x = torch.randn(5, 3)
    compiled = torch.compile(layer, fullgraph=True, backend="eager")
    for got, want in zip(compiled(x), layer(x), strict=True):
        torch.testing.assert_close(got, want)
