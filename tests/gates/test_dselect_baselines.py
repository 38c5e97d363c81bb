"""The baseline gates of the DSelect-k paper: Top-k, softmax, Gumbel-softmax, the C.1 ablations."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from routelab.gates import (
    DSelectK,
    GumbelSoftmaxGate,
    SoftmaxGate,
    SoftmaxSelectorGate,
    TopKGate,
    ablation_annealing,
    ablation_entropy,
)
from routelab.gates.protocol import GateOutput

torch.set_num_threads(1)


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 10), st.data())
def test_topk_matches_bruteforce(n, data):
    k = data.draw(st.integers(1, n))
    perm = data.draw(st.permutations(list(range(n))))  # distinct logits (ties are float-ambiguous)
    shift = data.draw(st.floats(-2, 2))
    logits = [0.37 * p + shift for p in perm]
    gate = TopKGate(n, k)
    with torch.no_grad():
        gate.logits.copy_(torch.tensor(logits))
    w = gate(2)[0]
    top = sorted(range(n), key=lambda i: -logits[i])[:k]
    z = sum(math.exp(logits[i]) for i in top)
    want = [math.exp(logits[i]) / z if i in top else 0.0 for i in range(n)]
    torch.testing.assert_close(w, torch.tensor(want), rtol=1e-5, atol=1e-6)
    assert gate.report()["experts_selected_mean"] == k


def test_per_example_topk_and_softmax_depend_on_x():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 5, generator=g)
    tk = TopKGate(8, 2, per_example=True, input_dim=5, generator=g)
    w = tk(x)
    assert w.shape == (6, 8) and ((w != 0).sum(1) == 2).all()
    torch.testing.assert_close(w.sum(1), torch.ones(6))
    w.pow(2).sum().backward()
    assert tk.A.weight.grad.abs().sum() > 0
    sm = SoftmaxGate(8, per_example=True, input_dim=5, generator=g)
    ws = sm(x)
    torch.testing.assert_close(ws, torch.softmax(sm.A(x), -1))


def test_gumbel_gate_binary_u_and_penalty():
    gate = GumbelSoftmaxGate(6, sparsity_reg=0.5, seed=0, generator=torch.Generator().manual_seed(0))
    w = gate(3)
    sm = torch.softmax(gate.alpha, 0)
    u = (w[0] / sm).detach()
    assert torch.all((u.round() - u).abs() < 1e-6) and set(u.round().tolist()) <= {0.0, 1.0}
    assert gate.aux["sparsity"].item() == pytest.approx(0.5 * torch.log(torch.sigmoid(gate.beta)).sum().item())
    # gradients reach both alpha and beta (straight-through); a loss that is not constant in alpha
    # (w.sum() is when every U_i = 1: softmax sums to 1)
    assert 0 < u.round().sum() < 6
    ((w * torch.arange(1.0, 7.0)).sum() + gate.regularization()).backward()
    assert gate.alpha.grad.abs().sum() > 0 and gate.beta.grad.abs().sum() > 0
    # the sparsity penalty alone switches experts off
    opt = torch.optim.Adam(gate.parameters(), lr=0.1)
    for _ in range(100):
        opt.zero_grad()
        gate(1)
        gate.regularization().backward()
        opt.step()
    gate.eval()
    assert (gate(1) == 0).all()
    assert gate.report()["expected_nonzeros"] < 0.5


def test_gumbel_same_seed_same_samples():
    a = GumbelSoftmaxGate(8, seed=5, generator=torch.Generator().manual_seed(1))
    b = GumbelSoftmaxGate(8, seed=5, generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        assert torch.equal(a(2), b(2))


def test_ablations():
    ann = ablation_annealing(8, 2, temperature=1.0, final_temperature=1e-4,
                             generator=torch.Generator().manual_seed(0))
    ann.on_step(0, 11)
    assert ann.temperature == pytest.approx(1.0)
    ann.on_step(10, 11)
    assert ann.temperature == pytest.approx(1e-4)
    w = ann(1)[0]
    # at T -> 0 each selector is (nearly) one-hot on its argmax
    want = torch.zeros(8)
    sm = torch.softmax(ann.alpha, 0)
    for i, e in enumerate(ann.beta.argmax(1).tolist()):
        want[e] += sm[i]
    torch.testing.assert_close(w, want, atol=1e-4, rtol=0)
    ent = ablation_entropy(8, 2, entropy_reg=0.2, generator=torch.Generator().manual_seed(0))
    ent(1)
    r = torch.softmax(ent.beta, -1)
    assert ent.aux["entropy"].item() == pytest.approx(0.2 * -(r * torch.log(r + 1e-6)).sum().item(), rel=1e-5)


@pytest.mark.parametrize(
    "make",
    [
        lambda: DSelectK(6, 2),
        lambda: DSelectK(6, 2, per_example=True, input_dim=3),
        lambda: TopKGate(6, 2),
        lambda: TopKGate(6, 2, per_example=True, input_dim=3),
        lambda: SoftmaxGate(6),
        lambda: GumbelSoftmaxGate(6, sparsity_reg=0.01),
        lambda: ablation_annealing(6, 2),
        lambda: ablation_entropy(6, 2),
    ],
)
def test_interchangeable_interface(make):
    gate = make()
    x = torch.randn(4, 3)
    gate.on_step(0, 10)
    w = gate(x)
    # the protocol: gate.gate(x) returns a GateOutput and stores nothing (forward remembered w's call)
    aux, last = dict(gate.aux), gate._last_weights
    out = gate.gate(x)
    assert isinstance(out, GateOutput) and out.scores.shape == (4, 6) and isinstance(out.aux, dict)
    assert gate._last_weights is last and gate.aux.keys() == aux.keys()
    assert all(gate.aux[name] is aux[name] for name in aux)
    assert w.shape == (4, 6) and (w >= 0).all()
    # every gate mixes convexly (or sub-convexly: DSelect-k with n = 6 not a power of 2, Gumbel U = 0)
    assert (w.sum(dim=1) <= 1 + 1e-6).all()
    if not gate.per_example:  # a static gate gives every row the same weights
        assert torch.equal(w, w[:1].expand_as(w))
    assert torch.equal(gate.selected_experts(w), (w != 0).sum(dim=1).float())
    loss = (w * torch.arange(6.0)).sum() + gate.regularization()
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in gate.parameters())
    gate.track(0)
    rep = gate.report()
    assert rep["experts_selected_mean"] == pytest.approx(float((w != 0).sum(dim=1).float().mean()))
    assert 0 < rep["experts_selected_mean"] <= 6


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: TopKGate(4, 5), "k = 5"),
        (lambda: TopKGate(4, 2, per_example=True), "input_dim"),
        (lambda: SoftmaxSelectorGate(4, 5), "k = 5"),
        (lambda: SoftmaxSelectorGate(4, 2, temperature=0.0), "temperature"),
        (lambda: GumbelSoftmaxGate(4, sparsity_reg=-1.0), "sparsity_reg"),
        (lambda: GumbelSoftmaxGate(4, temperature=-1.0), "temperature"),
        (lambda: SoftmaxGate(0), "num_experts"),
        (lambda: SoftmaxSelectorGate(4, 2, entropy_reg=float("nan")), "entropy_reg"),
        (lambda: DSelectK(4, 2, entropy_reg=True), "entropy_reg"),
        (lambda: DSelectK(4, 2, unused_penalty=-0.5), "unused_penalty"),
    ],
)
def test_bad_args_raise(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_gumbel_softmax_gate_trains_where_its_parameters_are():
    """Audit finding: its Gumbel noise, drawn on the CPU generator, stayed on the CPU. The meta device
    stands in for CUDA (the CUDA run of the same path is in tests/test_cuda_gate.py where a GPU exists)."""
    from routelab.gates import GumbelSoftmaxGate

    gate = GumbelSoftmaxGate(4).to("meta").train()
    assert gate(3).device.type == "meta"


def test_gumbel_softmax_gate_noise_is_replayed_by_activation_checkpointing():
    from torch.utils.checkpoint import checkpoint

    from routelab.gates import GumbelSoftmaxGate

    gate = GumbelSoftmaxGate(6, seed=3, temperature=0.5).train()
    x = torch.randn(4, 6)
    grads = []
    for use_checkpoint in (False, True):
        gate.zero_grad()
        gate.noise.manual_seed(3)
        def fn(t):
            return (gate(t.shape[0]) * t).sum()

        loss = checkpoint(fn, x, use_reentrant=False) if use_checkpoint else fn(x)
        loss.backward()
        grads.append((gate.alpha.grad.clone(), gate.beta.grad.clone()))
    for eager, ckpt in zip(*grads, strict=True):
        torch.testing.assert_close(ckpt, eager, rtol=0, atol=0)


@pytest.mark.parametrize(("name", "num_experts"), [("DSelectK", 8), ("DSelectK", 1), ("TopKGate", 8)])
def test_a_gate_built_with_a_generator_draws_nothing_from_the_global_one(name: str, num_experts: int) -> None:
    """Review finding: the per-example gates' nn.Linear ran its default initialisation from torch's
    global generator before being overwritten, shifting every later draw of the user's model."""
    from routelab import gates

    def make():  # noqa: ANN202
        return getattr(gates, name)(num_experts, 1, per_example=True, input_dim=5,
                                    generator=torch.Generator().manual_seed(1))

    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    gate = make()
    torch.testing.assert_close(torch.rand(3), expected)
    again = make()  # and the generator alone fixes the values
    for a, b in zip(gate.parameters(), again.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_the_unused_code_penalty_is_averaged_or_summed_over_the_batch() -> None:
    """App. B.2's penalty of a per-example gate: averaged by default (routelab), summed with
    ``unused_reduction="sum"`` (the official code): B copies of one example give B times the mean."""
    from routelab.gates import DSelectK

    gates = {r: DSelectK(5, 2, per_example=True, input_dim=3, unused_reduction=r,
                         generator=torch.Generator().manual_seed(0)) for r in ("mean", "sum")}
    x = torch.randn(1, 3).expand(64, 3)
    for gate in gates.values():
        gate(x)
    mean, total = (float(gates[r].aux["unused_codes"]) for r in ("mean", "sum"))
    assert mean > 0 and total == pytest.approx(64 * mean, rel=1e-5)
    with pytest.raises(ValueError, match="unused_reduction must be one of"):
        DSelectK(5, 2, unused_reduction="max")


def test_ablation_annealing_ends_at_the_papers_temperature_in_every_dtype() -> None:
    """App. D.4 anneals down to T = 1e-16; beta / T overflows half precision, so the selectors are
    computed in float32 there."""
    from routelab.gates import ablation_annealing

    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        gate = ablation_annealing(6, 2).to(dtype)
        gate.on_step(99, 100)
        assert gate.temperature == pytest.approx(1e-16)
        w = gate(torch.randn(3, 4, dtype=dtype))
        assert torch.isfinite(w).all() and torch.allclose(w.float().sum(-1), torch.ones(3), atol=1e-2)
