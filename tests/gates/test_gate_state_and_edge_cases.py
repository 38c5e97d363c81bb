"""Review findings on the multi-task gates: empty batches in report()/track(), Gumbel seeds, flag and
number arguments, input dtypes, and the training state kept in state_dict (extra state)."""

from __future__ import annotations

import copy
import io

import numpy as np
import pytest
import torch
from torch import nn

from routelab.gates import (
    DSelectK,
    GumbelSoftmaxGate,
    SoftmaxGate,
    SoftmaxSelectorGate,
    TopKGate,
    ablation_annealing,
    ablation_entropy,
    batchwise_mask,
    batchwise_threshold_loss,
    dselect_weights,
    smooth_step,
)
from routelab.gates.smooth_step import check_gamma
from routelab.layers import MultiGateMoE, StackedLinear

torch.set_num_threads(1)


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ----------------------------------------------------------------------------- A3: report() after an empty batch

STATIC_GATES = {
    "dselect": lambda: DSelectK(6, 2, generator=gen()),
    "dselect-pow2": lambda: DSelectK(4, 2, entropy_reg=0.1, generator=gen()),
    "topk": lambda: TopKGate(6, 2, generator=gen()),
    "softmax": lambda: SoftmaxGate(6, generator=gen()),
    "gumbel": lambda: GumbelSoftmaxGate(6, seed=1, generator=gen()),
    "selector": lambda: SoftmaxSelectorGate(6, 2, generator=gen()),
    "annealing": lambda: ablation_annealing(6, 2, generator=gen()),
    "entropy": lambda: ablation_entropy(6, 2, generator=gen()),
}


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("make", STATIC_GATES.values(), ids=STATIC_GATES.keys())
def test_static_gate_reports_its_parameters_after_an_empty_batch(make, training):
    """A static gate's selection does not depend on the batch: after a forward on zero examples its
    report is the one of its parameters (it raised IndexError)."""
    gate = make()
    if isinstance(gate, GumbelSoftmaxGate):  # pi = 0.73 / 0.27: some experts on, some off in eval
        with torch.no_grad():
            gate.beta.copy_(torch.tensor([1.0, -1.0, 1.0, 1.0, -1.0, 1.0]))
    assert "experts_selected" not in gate.report()  # nothing before the first forward
    gate.eval()
    gate(1)
    want = gate.report()  # eval mode: the weights of the parameters
    gate.train(training)
    w = gate(torch.zeros(0, 3))
    assert w.shape == (0, gate.num_experts)
    noise = gate.noise.get_state() if isinstance(gate, GumbelSoftmaxGate) else None
    rep = gate.report()
    assert rep == want
    assert rep["experts_selected"] == rep["experts_selected_mean"] > 0
    if noise is not None:
        assert torch.equal(gate.noise.get_state(), noise), "report() drew Gumbel noise"
    gate.track(3)  # no error either


PER_EXAMPLE_GATES = {
    "dselect": lambda: DSelectK(6, 2, per_example=True, input_dim=3, generator=gen()),
    "topk": lambda: TopKGate(6, 2, per_example=True, input_dim=3, generator=gen()),
    "softmax": lambda: SoftmaxGate(6, per_example=True, input_dim=3, generator=gen()),
}


@pytest.mark.parametrize("make", PER_EXAMPLE_GATES.values(), ids=PER_EXAMPLE_GATES.keys())
def test_per_example_gate_reports_no_examples_after_an_empty_batch(make):
    gate = make()
    gate(torch.randn(2, 3, generator=gen(1)))
    gate(torch.zeros(0, 3))
    rep = gate.report()
    assert rep["experts_selected"] == [] and rep["experts_selected_mean"] is None


def test_multigate_moe_reports_after_an_empty_batch():
    gates = [DSelectK(4, 2, generator=gen(1)), TopKGate(4, 1, generator=gen(2)),
             DSelectK(4, 2, per_example=True, input_dim=4, generator=gen(3)),
             GumbelSoftmaxGate(4, seed=4, generator=gen(4))]
    model = MultiGateMoE(StackedLinear(4, 4, 5, generator=gen(5)), gates)
    model(torch.randn(3, 4, generator=gen(6)))
    before = model.report()
    outs = model(torch.zeros(0, 4))
    assert [tuple(o.shape) for o in outs] == [(0, 5)] * 4
    model.track(1)
    reps = model.report()
    assert reps[0] == before[0] and reps[1] == before[1]
    assert reps[2]["experts_selected"] == [] and reps[2]["experts_selected_mean"] is None
    assert reps[2]["binary_step"] is None


# ----------------------------------------------------------------------------- A4: is_binary / track and empty batches


def _binary_per_example_gate() -> DSelectK:
    """A per-example gate whose codes are binary for every input: W x = ±gamma (bias only)."""
    gate = DSelectK(4, 2, per_example=True, input_dim=3, generator=gen())
    with torch.no_grad():
        gate.W.weight.zero_()
        gate.W.bias.copy_(torch.tensor([1.0, -1.0, -1.0, 1.0]))
    return gate


def test_an_empty_batch_does_not_make_per_example_codes_binary():
    gate = DSelectK(8, 2, per_example=True, input_dim=3, generator=gen())
    gate(torch.randn(4, 3, generator=gen(1)))
    assert not gate.is_binary()
    gate(torch.zeros(0, 3))
    assert not gate.is_binary(), "S(z) of zero examples is vacuously binary"
    gate.track(7)
    assert gate.binary_step is None
    gate(torch.randn(4, 3, generator=gen(2)))
    gate.track(8)
    rep = gate.report()
    assert rep["binary"] is False and rep["binary_step"] is None


def test_an_empty_batch_first_is_not_binary():
    gate = DSelectK(4, 2, per_example=True, input_dim=3, generator=gen())
    gate(torch.zeros(0, 3))
    assert not gate.is_binary()
    gate.track(0)
    assert gate.binary_step is None


def test_an_empty_batch_keeps_the_last_batchs_binary_state_but_records_no_step():
    gate = _binary_per_example_gate()
    gate(torch.randn(2, 3, generator=gen(1)))
    assert gate.is_binary()
    gate(torch.zeros(0, 3))
    assert gate.is_binary()  # the last non-empty batch's S(z)
    gate.track(4)
    assert gate.binary_step is None, "an empty batch must not record the convergence step"
    gate(torch.randn(2, 3, generator=gen(2)))
    gate.track(5)
    assert gate.binary_step == 5


# ----------------------------------------------------------------------------- B4: Gumbel seeds


def _draws(gate: GumbelSoftmaxGate, steps: int = 20) -> torch.Tensor:
    gate.train()
    with torch.no_grad():
        gate.beta.zero_()  # pi = 1/2: U uniform over {0, 1}^n
        return torch.stack([(gate(1)[0] != 0) for _ in range(steps)])


def test_gumbel_gates_default_to_independent_noise():
    """The per-task gates of a multi-gate MoE built with default arguments drew the same noise."""
    torch.manual_seed(0)
    a, b = GumbelSoftmaxGate(8), GumbelSoftmaxGate(8)
    assert a.seed != b.seed
    assert not torch.equal(_draws(a), _draws(b))


def test_gumbel_default_seed_is_reproducible_under_torch_manual_seed():
    torch.manual_seed(3)
    a = GumbelSoftmaxGate(8)
    torch.manual_seed(3)
    b = GumbelSoftmaxGate(8)
    assert a.seed == b.seed
    assert torch.equal(a.alpha, b.alpha) and torch.equal(a.beta, b.beta)
    assert torch.equal(_draws(a), _draws(b))


def test_gumbel_explicit_seed_is_kept():
    a, b = GumbelSoftmaxGate(8, seed=5), GumbelSoftmaxGate(8, seed=5)
    assert a.seed == b.seed == 5
    assert torch.equal(a.noise.get_state(), torch.Generator().manual_seed(5).get_state())
    assert torch.equal(_draws(a), _draws(b))


# ----------------------------------------------------------------------------- C1: flags


@pytest.mark.parametrize("make", [
    lambda v: DSelectK(4, 2, per_example=v, input_dim=3),
    lambda v: TopKGate(4, 2, per_example=v, input_dim=3),
    lambda v: SoftmaxGate(4, per_example=v, input_dim=3),
], ids=["dselect", "topk", "softmax"])
@pytest.mark.parametrize("bad", ["False", "True", 0, 1, None])
def test_per_example_must_be_a_bool(make, bad):
    with pytest.raises(TypeError, match="per_example"):
        make(bad)


def test_per_example_takes_numpy_bools():
    assert DSelectK(4, 2, per_example=np.bool_(True), input_dim=3).per_example is True
    assert DSelectK(4, 2, per_example=np.bool_(False)).per_example is False


# ----------------------------------------------------------------------------- C2: gamma


@pytest.mark.parametrize("gamma", [np.float32(0.5), np.float64(0.5), np.int64(2), torch.tensor(0.5),
                                   torch.tensor(2), torch.tensor(0.5, dtype=torch.float64), 0.5, 2])
def test_gamma_takes_real_numbers_and_0_dim_tensors(gamma):
    want = float(gamma)
    assert check_gamma(gamma) == want and type(check_gamma(gamma)) is float
    gate = DSelectK(4, 2, gamma=gamma)
    assert gate.gamma == want
    t = torch.tensor([-1.0, 0.0, 0.1, 1.0])
    torch.testing.assert_close(smooth_step(t, gamma), smooth_step(t, want), rtol=0, atol=0)
    dselect_weights(torch.zeros(2), torch.zeros(2, 2), 4, gamma)


@pytest.mark.parametrize("gamma", [True, np.bool_(True), "1", torch.tensor([1.0]), torch.tensor(True),
                                   torch.tensor(1 + 1j), np.float32("nan"), torch.tensor(float("inf")), 0.0,
                                   np.float32(-1.0), 1e31, None])
def test_gamma_rejects_non_numbers_and_bad_values(gamma):
    with pytest.raises(ValueError, match="gamma"):
        check_gamma(gamma)


# ----------------------------------------------------------------------------- C3: input dtypes


@pytest.mark.parametrize("dtype", [torch.long, torch.int32, torch.bool])
def test_dselect_weights_rejects_a_non_floating_alpha_naming_it(dtype):
    with pytest.raises(ValueError, match="alpha must be a floating tensor"):
        dselect_weights(torch.zeros(2, dtype=dtype), torch.zeros(2, 2), 4)


@pytest.mark.parametrize("make_mask", [
    lambda s: s,                                          # the scores themselves
    lambda s: torch.full_like(s, 2, dtype=torch.long),    # a mask of 2s
    lambda s: batchwise_mask(s, 1).float(),               # the right mask, as floats
    lambda s: batchwise_mask(s, 1).to(torch.uint8),
], ids=["scores", "twos", "float", "uint8"])
def test_batchwise_threshold_loss_requires_a_bool_mask(make_mask):
    s = torch.softmax(torch.randn(4, 2, generator=gen()), -1)
    with pytest.raises(ValueError, match="mask must be a torch.bool tensor"):
        batchwise_threshold_loss(s, torch.zeros(2), make_mask(s))
    assert torch.isfinite(batchwise_threshold_loss(s, torch.zeros(2), batchwise_mask(s, 1)))


# ----------------------------------------------------------------------------- C5: state_dict holds the training state


def _gumbel_steps(gate: GumbelSoftmaxGate, opt: torch.optim.Optimizer, steps: int, x: torch.Tensor) -> list:
    out = []
    for _ in range(steps):
        opt.zero_grad()
        w = gate(x.shape[0])
        loss = (w * x).sum() + gate.regularization()
        loss.backward()
        opt.step()
        out.append(w.detach().clone())
    return out


def _round_trip(state: dict) -> dict:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_gumbel_resumed_from_state_dict_matches_the_uninterrupted_run():
    x = torch.randn(3, 6, generator=gen(9))

    def build(seed):
        gate = GumbelSoftmaxGate(6, sparsity_reg=0.05, temperature=0.5, seed=seed, generator=gen(1)).train()
        return gate, torch.optim.Adam(gate.parameters(), lr=0.05)

    gate, opt = build(11)
    full = _gumbel_steps(gate, opt, 10, x)

    first, opt1 = build(11)
    head = _gumbel_steps(first, opt1, 4, x)
    saved = _round_trip({"model": first.state_dict(), "opt": opt1.state_dict()})
    resumed, opt2 = build(12345)  # another seed: the noise must come from the checkpoint
    resumed.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    tail = _gumbel_steps(resumed, opt2, 6, x)
    for a, b in zip(full, head + tail, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    torch.testing.assert_close(resumed.beta, gate.beta, rtol=0, atol=0)


def test_dselect_binary_step_is_in_the_state_dict():
    gate = DSelectK(4, 2, generator=gen())
    with torch.no_grad():
        gate.z.copy_(torch.tensor([[1.0, -1.0], [-1.0, 1.0]]))
    gate(1)
    gate.track(5)
    assert gate.binary_step == 5
    fresh = DSelectK(4, 2, generator=gen(1))
    fresh.load_state_dict(_round_trip(gate.state_dict()))
    assert fresh.binary_step == 5
    for g in (fresh, gate):  # continue both: the first binary step stays
        g(1)
        g.track(9)
    assert fresh.report() == gate.report()
    assert fresh.report()["binary_step"] == 5
    # and a gate that had not converged loads as not converged
    fresh.load_state_dict(DSelectK(4, 2, generator=gen(2)).state_dict())
    assert fresh.binary_step is None


def test_multigate_state_dict_carries_every_gates_extra_state():
    gates = [GumbelSoftmaxGate(4, seed=s, generator=gen(s)) for s in (1, 2)] + [DSelectK(4, 2, generator=gen(3))]
    model = MultiGateMoE(StackedLinear(4, 3, 2, generator=gen(4)), gates)
    x = torch.randn(2, 3, generator=gen(5))
    model(x)
    model.gates[2].binary_step = 7
    twin = copy.deepcopy(model)
    for g in twin.gates[:2]:
        g.noise.manual_seed(999)
    twin.gates[2].binary_step = None
    twin.load_state_dict(_round_trip(model.state_dict()))
    assert twin.gates[2].binary_step == 7
    for _ in range(3):
        for a, b in zip(model(x), twin(x), strict=True):
            torch.testing.assert_close(b, a, rtol=0, atol=0)


@pytest.mark.parametrize("make", [
    lambda: GumbelSoftmaxGate(5, seed=3, generator=gen()),
    lambda: DSelectK(5, 2, generator=gen()),
    lambda: DSelectK(5, 2, per_example=True, input_dim=3, generator=gen()),
], ids=["gumbel", "dselect", "dselect-per-example"])
def test_a_state_dict_without_extra_state_still_loads_strictly(make):
    """A checkpoint saved before the extra state existed loads with strict=True; the gate keeps its
    current extra state. Missing parameters and unexpected keys still fail under strict=True."""
    src, dst = make(), make()
    old = {k: v for k, v in src.state_dict().items() if not k.endswith("_extra_state")}
    assert len(old) == len(src.state_dict()) - 1
    if isinstance(dst, GumbelSoftmaxGate):
        dst.noise.manual_seed(77)
        keep = dst.noise.get_state()
    else:
        dst.binary_step = 4
    result = dst.load_state_dict(old, strict=True)
    assert result.missing_keys == [] and result.unexpected_keys == []
    if isinstance(dst, GumbelSoftmaxGate):
        assert torch.equal(dst.noise.get_state(), keep)
    else:
        assert dst.binary_step == 4
    for name, value in old.items():
        torch.testing.assert_close(dst.state_dict()[name], value, rtol=0, atol=0)
    # inside a model too (the key is prefixed)
    model = nn.ModuleDict({"gate": make()})
    model.load_state_dict({f"gate.{k}": v for k, v in old.items()}, strict=True)
    # strictness is otherwise unchanged
    missing = dict(old)
    missing.pop(next(iter(missing)))
    with pytest.raises(RuntimeError, match="Missing key"):
        make().load_state_dict(missing, strict=True)
    with pytest.raises(RuntimeError, match="Unexpected key"):
        make().load_state_dict({**src.state_dict(), "bogus": torch.zeros(1)}, strict=True)


@pytest.mark.parametrize("make, bad", [
    (lambda: GumbelSoftmaxGate(4, seed=1), {"noise": torch.zeros(3)}),
    (lambda: GumbelSoftmaxGate(4, seed=1), {"noise": torch.zeros(3, dtype=torch.uint8)}),
    (lambda: GumbelSoftmaxGate(4, seed=1), None),
    (lambda: DSelectK(4, 2), {"binary_step": "3"}),
    (lambda: DSelectK(4, 2), {}),
    (lambda: DSelectK(4, 2), 3),
])
def test_bad_extra_state_is_a_clear_error(make, bad):
    gate = make()
    state = {**gate.state_dict(), "_extra_state": bad}
    with pytest.raises(ValueError, match="extra state"):
        gate.load_state_dict(state)
