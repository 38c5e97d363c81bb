"""Tests for routelab.layers.bcd.BCDTrainer (Peng et al. 2020, Alg. 1-3)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from routelab.layers import MixtureOfAttentiveExperts
from routelab.layers.bcd import BCDTrainer, gate_parameter_names

torch.set_num_threads(1)

D, H, V, L = 16, 4, 11, 6


class Tiny(nn.Module):
    """Embedding -> MAE self-attention -> linear head over V classes per position."""

    def __init__(self, drop_heads: int = 1) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.att = MixtureOfAttentiveExperts(D, H, drop_heads=drop_heads, batch_first=True)
        self.head = nn.Linear(D, V)
        self.last_resp: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = self.emb(x)
        out, resp = self.att(e, e, e)
        self.last_resp = resp.detach()
        return self.head(out + e)


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x).reshape(-1, V), y.reshape(-1))


def _batch(n: int = 4, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(V, (n, L), generator=g), torch.randint(V, (n, L), generator=g)


def _model(seed: int = 0, drop_heads: int = 1) -> Tiny:
    torch.manual_seed(seed)
    m = Tiny(drop_heads)
    with torch.no_grad():  # a non-uniform gate
        m.att.gate.out.weight.normal_(0, 1.0)
    return m


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _changed(model: nn.Module, before: dict[str, torch.Tensor]) -> set[str]:
    return {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}


def test_gate_parameter_names() -> None:
    assert gate_parameter_names(_model()) == {
        "att.gate.hidden.weight", "att.gate.hidden.bias", "att.gate.out.weight", "att.gate.out.bias"
    }


def test_g_step_changes_only_gate_parameters() -> None:
    model = _model()
    trainer = BCDTrainer(model, loss_fn, mode="bcd", gate_lr=1.0)
    before = _snapshot(model)
    trainer.g_step(_batch())
    changed = _changed(model, before)
    assert changed and changed <= gate_parameter_names(model)
    assert trainer.gate_optimizer is not None and trainer.gate_optimizer.defaults["momentum"] == 0.0
    # the gradient of the gates is the mixture's: a manual SGD step reproduces the update
    ref = _model()
    loss_fn(ref, _batch()).backward()
    for n, p in ref.named_parameters():
        if n in gate_parameter_names(ref):
            torch.testing.assert_close(dict(model.named_parameters())[n], p.detach() - 1.0 * p.grad)


def test_f_step_never_changes_gate_parameters() -> None:
    model = _model()
    trainer = BCDTrainer(model, loss_fn, mode="bcd", generator=torch.Generator().manual_seed(0))
    before = _snapshot(model)
    for seed in range(3):
        trainer.f_step(_batch(seed=seed))
    changed = _changed(model, before)
    assert not changed & gate_parameter_names(model)
    assert {"emb.weight", "head.weight", "att.in_proj_weight", "att.out_proj.weight"} <= changed


def _grads_at_step(trainer: BCDTrainer) -> dict[int, torch.Tensor]:
    """Record theta's gradients just before each Adam step."""
    seen: dict[int, torch.Tensor] = {}

    def hook(opt, args, kwargs):  # noqa: ANN001
        for p in trainer.theta_params:
            seen[id(p)] = p.grad.clone() if p.grad is not None else torch.zeros_like(p)

    assert trainer.optimizer is not None
    trainer.optimizer.register_step_pre_hook(hook)
    return seen


def _head_grad_norms(model: Tiny, seen: dict[int, torch.Tensor]) -> torch.Tensor:
    """``[h]``: gradient norm of each head's q/k/v rows and out_proj columns."""
    att = model.att
    hd = D // H
    w_in = seen[id(att.in_proj_weight)].view(3, H, hd, D)
    b_in = seen[id(att.in_proj_bias)].view(3, H, hd)
    w_out = seen[id(att.out_proj.weight)].view(D, H, hd)
    return torch.stack([
        w_in[:, i].norm() + b_in[:, i].norm() + w_out[:, i].norm() for i in range(H)
    ])


@pytest.mark.parametrize("drop", [1, 2])
def test_f_step_gives_gradient_only_to_the_sampled_experts_heads(drop: int) -> None:
    for seed in range(4):
        model = _model(seed, drop)
        trainer = BCDTrainer(model, loss_fn, mode="bcd", generator=torch.Generator().manual_seed(seed))
        seen = _grads_at_step(trainer)
        trainer.f_step(_batch(n=1, seed=seed))  # one instance: one sampled expert
        resp = model.last_resp
        assert resp is not None and resp.shape == (1, model.att.num_experts)
        assert ((resp == 0) | (resp == 1)).all() and resp.sum() == 1
        e = int(resp[0].argmax())
        norms = _head_grad_norms(model, seen)
        dropped = set(model.att.dropped_heads[e])
        for i in range(H):
            if i in dropped:
                assert norms[i] == 0, (e, i)
            else:
                assert norms[i] > 0, (e, i)


def test_f_step_batch_updates_the_union_of_the_sampled_experts() -> None:
    model = _model(1, drop_heads=3)  # experts keep a single head
    trainer = BCDTrainer(model, loss_fn, mode="bcd", generator=torch.Generator().manual_seed(3))
    seen = _grads_at_step(trainer)
    trainer.f_step(_batch(n=2, seed=5))
    kept = (model.last_resp @ model.att.keep).amax(0) > 0
    norms = _head_grad_norms(model, seen)
    assert ((norms > 0) == kept).all()


def test_sampling_follows_the_gate() -> None:
    model = _model(2)
    with torch.no_grad():
        model.att.gate.out.weight.zero_()
        model.att.gate.out.bias.copy_(torch.tensor([3.0, 0.0, 0.0, 0.0]))
    trainer = BCDTrainer(model, loss_fn, mode="bcd", generator=torch.Generator().manual_seed(0))
    counts = torch.zeros(H)
    for seed in range(20):
        trainer.f_step(_batch(n=50, seed=seed))
        counts += model.last_resp.sum(0)
    p0 = torch.softmax(torch.tensor([3.0, 0, 0, 0]), 0)[0]
    assert abs(counts[0] / counts.sum() - p0) < 0.04


def test_uni_mode_samples_uniformly_and_never_trains_gates() -> None:
    model = _model(0)
    trainer = BCDTrainer(model, loss_fn, mode="uni", generator=torch.Generator().manual_seed(0))
    assert trainer.gate_optimizer is None and trainer.eval_routing == "uniform"
    before = _snapshot(model)
    counts = torch.zeros(H)
    for seed in range(10):
        trainer.train_step(_batch(n=40, seed=seed), epoch=0)
        counts += model.last_resp.sum(0)
    assert not _changed(model, before) & gate_parameter_names(model)
    assert (counts / counts.sum() - 0.25).abs().max() < 0.06
    with pytest.raises(ValueError, match="no G step"):
        trainer.g_step(_batch())


def test_bcd_epochs_take_g_steps_every_g_every_epochs() -> None:
    model = _model(0)
    trainer = BCDTrainer(model, loss_fn, mode="bcd", g_every=3, generator=torch.Generator().manual_seed(0))
    batches = [_batch(seed=s) for s in range(2)]
    g_per_epoch = [trainer.train_epoch(batches, epoch)["g_steps"] for epoch in range(7)]
    assert g_per_epoch == [2, 0, 0, 2, 0, 0, 2]
    assert trainer.steps["f"] == 14 and trainer.steps["g"] == 6
    assert model.att.routing == "gate"  # test-time routing after an epoch


def test_nobcd_updates_gates_and_theta_together_base_never_gates() -> None:
    model = _model(0)
    before = _snapshot(model)
    BCDTrainer(model, loss_fn, mode="nobcd").train_step(_batch(), epoch=1)
    changed = _changed(model, before)
    assert gate_parameter_names(model) <= changed and "att.in_proj_weight" in changed
    model = _model(0)
    before = _snapshot(model)
    BCDTrainer(model, loss_fn, mode="base").train_step(_batch(), epoch=0)
    changed = _changed(model, before)
    assert not changed & gate_parameter_names(model) and "att.in_proj_weight" in changed


def test_trainable_filter_restricts_fine_tuning() -> None:
    model = _model(0)
    before = _snapshot(model)
    ftg_plus = BCDTrainer(model, loss_fn, mode="nobcd", trainable=lambda n, p: "out_proj" in n)
    ftg_plus.train_step(_batch(), epoch=0)
    changed = _changed(model, before)
    assert changed == gate_parameter_names(model) | {"att.out_proj.weight", "att.out_proj.bias"}
    assert all(p.requires_grad for p in model.parameters())


def test_resume_repeats_the_same_updates() -> None:
    batches = [_batch(seed=s) for s in range(3)]

    def run(split: bool) -> dict[str, torch.Tensor]:
        model = _model(0)
        trainer = BCDTrainer(model, loss_fn, mode="bcd", g_every=2, generator=torch.Generator().manual_seed(9))
        trainer.train_epoch(batches, 0)
        if split:  # save, rebuild from the saved state, continue
            state, weights = trainer.state_dict(), model.state_dict()
            model = _model(5)
            model.load_state_dict(weights)
            trainer = BCDTrainer(model, loss_fn, mode="bcd", g_every=2, generator=torch.Generator())
            trainer.load_state_dict(state)
        trainer.train_epoch(batches, 1)
        trainer.train_epoch(batches, 2)
        return _snapshot(model)

    a, b = run(False), run(True)
    for n in a:
        torch.testing.assert_close(a[n], b[n], atol=0, rtol=0)


def test_bad_arguments_raise() -> None:
    with pytest.raises(ValueError, match="mode"):
        BCDTrainer(_model(), loss_fn, mode="joint")
    with pytest.raises(ValueError, match="g_every"):
        BCDTrainer(_model(), loss_fn, g_every=0)
    with pytest.raises(ValueError, match="MixtureOfAttentiveExperts"):
        BCDTrainer(nn.Linear(2, 2), loss_fn)


@pytest.mark.parametrize("bad", [{"clip_norm": -1.0}, {"clip_norm": 0.0}, {"clip_norm": float("nan")},
                                 {"gate_lr": float("nan")}, {"gate_lr": float("inf")}, {"lr": float("nan")},
                                 {"lr": 0.0}, {"weight_decay": -0.1}])
def test_bad_training_settings_raise_naming_them(bad) -> None:
    """A review: a negative clip_norm scaled every gradient by a negative factor (the loss rose
    2.69 -> 3.24 in 30 steps), and a NaN gate_lr filled the gates with NaN, failing later in
    torch.multinomial."""
    (name,) = bad
    with pytest.raises(ValueError, match=name):
        BCDTrainer(_model(), loss_fn, **bad)
    BCDTrainer(_model(), loss_fn, clip_norm=float("inf"))  # never clips, as clip_grad_norm_(max_norm=inf)


@pytest.mark.parametrize("mode", ["bcd", "uni", "nobcd", "base"])
def test_every_step_leaves_the_test_time_routing(mode) -> None:
    """A review: after train_step the layers stayed on ``routing="sample"``, so an evaluation
    after ``model.eval()`` drew one expert per call (two forwards differed). Oracle: the routing of
    EVAL_ROUTING, and two evaluation forwards are equal."""
    from routelab.layers.bcd import EVAL_ROUTING

    model = _model()
    trainer = BCDTrainer(model, loss_fn, mode=mode, g_every_steps=1 if mode == "bcd" else None,
                         generator=torch.Generator().manual_seed(0))
    x, _ = _batch()
    trainer.train_step(_batch(), epoch=0)
    layers = [m for m in model.modules() if isinstance(m, MixtureOfAttentiveExperts)]
    assert {m.routing for m in layers} == {EVAL_ROUTING[mode]}
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x), model(x), atol=0, rtol=0)
    if mode in ("bcd", "uni"):  # also a bare F step, and one that raises
        trainer.f_step(_batch())
        assert {m.routing for m in layers} == {EVAL_ROUTING[mode]}
        with pytest.raises((ValueError, RuntimeError)):
            trainer.f_step((x, torch.zeros(2, dtype=torch.long)))  # a loss of the wrong shape raises inside the step
        assert {m.routing for m in layers} == {EVAL_ROUTING[mode]}


def test_a_step_keeps_the_layers_own_generators_and_rejects_a_bad_epoch() -> None:
    """Review findings: every step reset each MAE layer's generator to None (a generator the user
    set was lost after the first step), and train_step took epoch -1 or 1.5."""
    model = _model(0)
    own = torch.Generator().manual_seed(7)
    model.att.generator = own
    trainer = BCDTrainer(model, loss_fn, mode="bcd")  # no trainer generator: the layer's own draws
    trainer.f_step(_batch(n=4, seed=1))
    first = model.last_resp.clone()
    assert model.att.generator is own
    own.manual_seed(7)
    trainer.f_step(_batch(n=4, seed=1))
    torch.testing.assert_close(model.last_resp, first)  # the layer's generator drew them
    shared = torch.Generator().manual_seed(0)
    BCDTrainer(model, loss_fn, mode="bcd", generator=shared).f_step(_batch(n=4, seed=1))
    assert model.att.generator is own  # (the trainer's generator for its steps only)
    for epoch in (-1, 1.5, True):
        with pytest.raises(ValueError, match="epoch must be a non-negative integer"):
            trainer.train_step(_batch(n=4, seed=1), epoch)
