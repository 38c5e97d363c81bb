"""Contracts of BCDTrainer (Peng et al. 2020, Alg. 1-3) and MultiGateMoE (Hazimeh et al. 2021) that
a mutation review (s45, bcdmulti) found unguarded: each test names the deliberate bug it catches.

Oracles are independent of the code under test: Adam and SGD updates recomputed by hand from the
gradients the optimizers saw, the norm ``clip_grad_norm_`` must leave, the loss of a model routed
by hand, and an explicit per-task, per-expert loop for the multi-gate layer.
"""

from __future__ import annotations

import pytest
import torch
from test_bcd_step_schedule import L, Tiny, V, loss_fn
from torch import nn

from routelab.gates import SoftmaxGate, TopKGate
from routelab.layers import MultiGateMoE
from routelab.layers.bcd import BCDTrainer, gate_parameter_names

torch.set_num_threads(1)



def _batch(seed: int, n: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(V, (n, L), generator=g), torch.randint(V, (n, L), generator=g)


def _model(seed: int = 0) -> Tiny:
    torch.manual_seed(seed)
    m = Tiny()
    with torch.no_grad():  # a clearly non-uniform gate
        m.att.gate.out.weight.normal_(0, 1.0)
        m.att.gate.out.bias.copy_(torch.tensor([2.0, -1.0, 0.5, -2.0]))
    return m


def _record_grads(opt: torch.optim.Optimizer, params: list[nn.Parameter]) -> list[dict[int, torch.Tensor]]:
    """Per optimizer step, the gradients (and values) of ``params`` just before the step."""
    seen: list[dict[int, torch.Tensor]] = []

    def hook(o, args, kwargs):  # noqa: ANN001
        seen.append({id(p): (p.detach().clone(), None if p.grad is None else p.grad.clone()) for p in params})

    opt.register_step_pre_hook(hook)
    return seen


# ------------------------------------------------------------------ BCDTrainer


def test_g_step_is_plain_sgd_with_the_gate_lr() -> None:
    """Guards ``gate_lr`` reaching the gates' SGD (mutant: lr fixed at the paper's 1). Oracle: each
    gate parameter after a G step is ``p - gate_lr * grad`` for the gradient SGD saw."""
    model = _model()
    trainer = BCDTrainer(model, loss_fn, mode="bcd", gate_lr=0.3)
    assert trainer.gate_optimizer is not None
    seen = _record_grads(trainer.gate_optimizer, trainer.gate_params)
    trainer.g_step(_batch(0))
    (before,) = seen
    for p in trainer.gate_params:
        p0, g = before[id(p)]
        assert g is not None and g.abs().max() > 0
        torch.testing.assert_close(p.detach(), p0 - 0.3 * g, rtol=0, atol=1e-7)


def test_theta_steps_are_adam_with_the_given_lr_betas_and_weight_decay() -> None:
    """Guards ``betas`` and ``weight_decay`` reaching theta's Adam (mutants: either dropped, torch's
    defaults used). Oracle: Adam (L2 weight decay, bias correction) recomputed by hand over three
    steps from the gradients the optimizer saw; betas only matter from the second step on."""
    lr, b1, b2, wd, eps = 0.01, 0.5, 0.7, 0.2, 1e-8
    model = _model()
    trainer = BCDTrainer(model, loss_fn, mode="base", lr=lr, betas=(b1, b2), weight_decay=wd)
    assert trainer.optimizer is not None
    p = model.head.weight
    seen = _record_grads(trainer.optimizer, [p])
    m = torch.zeros_like(p)
    v = torch.zeros_like(p)
    for t in range(1, 4):
        trainer.train_step(_batch(t), epoch=0)
        p0, g = seen[-1][id(p)]
        g = g + wd * p0
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        want = p0 - lr * (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + eps)
        torch.testing.assert_close(p.detach(), want, rtol=1e-5, atol=1e-7)


def test_base_mode_trains_with_uniform_responsibilities() -> None:
    """Guards BASE (plain transformer, eq. 5): its steps route uniformly (mutant: the gate mixture).
    Oracle: the step's loss equals the loss of the same model routed ``"uniform"`` by hand (and
    differs from the gate mixture's, so the test can tell them apart)."""
    model = _model()
    batch = _batch(4)
    with torch.no_grad():
        model.att.routing = "uniform"
        uniform = float(loss_fn(model, batch))
        model.att.routing = "gate"
        gate = float(loss_fn(model, batch))
    assert abs(uniform - gate) > 1e-4
    loss = BCDTrainer(model, loss_fn, mode="base").train_step(batch, epoch=0)["loss"]
    assert loss == pytest.approx(uniform, rel=0, abs=1e-6)


def test_clip_norm_clips_theta_by_its_own_norm_in_a_joint_step() -> None:
    """Guards ``clip_norm`` clipping theta's gradient by theta's norm (mutants: the norm taken over
    every parameter, the gates' too, in the NOBCD joint step; clipping skipped). Oracle: the
    gradient Adam sees has norm exactly ``clip_norm`` and the direction of the unclipped one, which
    a reference backward through the same routing gives."""
    clip = 1e-3
    model = _model()
    batch = _batch(5)
    ref = _model()
    loss_fn(ref, batch).backward()  # routing "gate": NOBCD's joint step
    gates = gate_parameter_names(ref)
    ref_theta = [p.grad for n, p in ref.named_parameters() if n not in gates]
    ref_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in ref_theta]))
    assert ref_norm > 100 * clip
    trainer = BCDTrainer(model, loss_fn, mode="nobcd", clip_norm=clip)
    assert trainer.optimizer is not None
    seen = _record_grads(trainer.optimizer, trainer.theta_params)
    trainer.train_step(batch, epoch=0)
    got = [seen[0][id(p)][1] for p in trainer.theta_params]
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in got]))
    assert float(norm) == pytest.approx(clip, rel=1e-4)
    for g, r in zip(got, ref_theta, strict=True):
        torch.testing.assert_close(g, r * (clip / ref_norm), rtol=1e-4, atol=1e-9)


# ------------------------------------------------------------------ MultiGateMoE


def _experts(n: int, p: int, d: int, seed: int) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Linear(p, d), nn.Tanh()) for _ in range(n)]


def _loop(x: torch.Tensor, experts: list[nn.Module], w: torch.Tensor) -> torch.Tensor:
    """The mixture ``sum_i w[:, i] * expert_i(x)``, example by example, expert by expert."""
    rows = []
    for b in range(x.shape[0]):
        rows.append(sum(w[b, i] * experts[i](x[b:b + 1])[0] for i in range(len(experts))))
    return torch.stack(rows)


class MaskedSoftmaxGate(SoftmaxGate):
    """A user's gate that overrides ``forward`` (here: never weighs expert 0, renormalised)."""

    def forward(self, x: torch.Tensor | int) -> torch.Tensor:
        w = super().forward(x)
        w = torch.cat([torch.zeros_like(w[:, :1]), w[:, 1:]], dim=1)
        return w / w.sum(dim=1, keepdim=True)


def test_a_gate_that_overrides_forward_is_called_through_its_forward() -> None:
    """Guards the layer's fast path for routelab's own gates (``gate()`` + one batched finite check)
    being taken only when the gate's ``forward`` is MTLGate's (mutant: every MTLGate goes through
    ``gate()``, so a subclass's own ``forward`` is silently bypassed). Oracle: the explicit loop with
    the weights the gate's ``forward`` returns (expert 0 never weighed)."""
    n, p, d = 4, 3, 2
    experts = _experts(n, p, d, 0)
    gate = MaskedSoftmaxGate(n)
    with torch.no_grad():
        gate.logits.copy_(torch.tensor([3.0, 0.0, 1.0, -1.0]))
    layer = MultiGateMoE(experts, [gate])
    x = torch.randn(5, p, generator=torch.Generator().manual_seed(1))
    (out,) = layer(x)
    w = gate(x)
    assert (w[:, 0] == 0).all()
    torch.testing.assert_close(layer.last_weights[0], w)
    torch.testing.assert_close(out, _loop(x, experts, w), rtol=1e-5, atol=1e-6)


def test_an_expert_only_a_later_example_needs_is_still_evaluated() -> None:
    """Guards the skip of unneeded experts looking at every example of every task (mutant: only the
    first example's weights, so an expert that a per-example gate picks for a later row only is
    skipped and that row's output silently becomes 0). Oracle: the explicit loop, and the calls."""
    n, p, d = 4, 4, 3
    calls = [0] * n
    base = _experts(n, p, d, 2)

    class Counted(nn.Module):
        def __init__(self, i: int) -> None:
            super().__init__()
            self.i = i
            self.inner = base[i]

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            calls[self.i] += 1
            return self.inner(x)

    gate = TopKGate(n, 1, per_example=True, input_dim=p, generator=torch.Generator().manual_seed(0))
    x = torch.eye(p) * 5.0  # row b: a strong one-hot input
    with torch.no_grad():  # example b picks expert b (a one-hot top-1 gate)
        for prm in gate.parameters():
            prm.zero_()
        lin = [m for m in gate.modules() if isinstance(m, nn.Linear)][-1]
        lin.weight.copy_(torch.eye(n, p))
    w = gate(x)
    assert torch.equal(w, torch.eye(n))  # four examples, four different experts
    layer = MultiGateMoE([Counted(i) for i in range(n)], [gate])
    calls[:] = [0] * n
    with torch.no_grad():
        (out,) = layer(x)
    assert calls == [1, 1, 1, 1]
    torch.testing.assert_close(out, _loop(x, base, w), rtol=1e-5, atol=1e-6)


def test_float64_gate_input_mixes_float32_experts() -> None:
    """Guards the gates' weights being cast to the experts' dtype before the mixture (mutant: no
    cast; a float64 ``gate_x`` gives a per-example gate float64 weights and the float32 mixture
    fails). Oracle: the explicit loop in float32, output in ``x``'s dtype."""
    n, p, d = 3, 2, 2
    experts = _experts(n, p, d, 3)
    gate = SoftmaxGate(n, per_example=True, input_dim=5, generator=torch.Generator().manual_seed(0))
    layer = MultiGateMoE(experts, [gate])
    g = torch.Generator().manual_seed(4)
    x = torch.randn(6, p, generator=g)
    gate_x = torch.randn(6, 5, generator=g, dtype=torch.float64)
    (out,) = layer(x, gate_x=gate_x)
    assert out.dtype == torch.float32
    w = gate(gate_x).to(torch.float32)
    torch.testing.assert_close(out, _loop(x, experts, w), rtol=1e-5, atol=1e-6)


def test_train_epoch_reports_the_mean_loss_of_its_g_steps() -> None:
    """Guards ``train_epoch``'s ``g_loss`` being the mean over the G steps taken (mutant: the sum
    divided by the batches, wrong whenever the step schedule skips G steps). Oracle: the mean of the
    ``g_loss`` values that the same steps return one by one, from an identical twin trainer."""
    batches = [_batch(s) for s in range(5)]

    def trainer() -> BCDTrainer:
        return BCDTrainer(_model(), loss_fn, mode="bcd", g_every_steps=2, generator=torch.Generator().manual_seed(0))

    res = trainer().train_epoch(batches, epoch=0)
    twin = trainer()
    outs = [twin.train_step(b, epoch=0) for b in batches]
    g = [o["g_loss"] for o in outs if "g_loss" in o]
    assert res["g_steps"] == len(g) == 3 and res["batches"] == 5
    assert res["g_loss"] == pytest.approx(sum(g) / len(g), rel=1e-6)
    assert res["loss"] == pytest.approx(sum(o["loss"] for o in outs) / 5, rel=1e-6)
