"""BCD's G steps scheduled in steps and G-only phases (issue 13, part 3; Peng et al. 2020 Alg. 1-3).

Oracles: the documented schedule (a G step before F steps 0, m, 2m, ... whatever the epoch),
which parameters a G-only phase may change (the gates only, Alg. 1), and bit-for-bit equality of a
resumed schedule with an uninterrupted one.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from routelab.layers import MixtureOfAttentiveExperts
from routelab.layers.bcd import BCDTrainer, gate_parameter_names

torch.set_num_threads(1)

D, H, V, L = 8, 4, 7, 5


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.att = MixtureOfAttentiveExperts(D, H, batch_first=True)
        self.head = nn.Linear(D, V)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = self.emb(x)
        return self.head(self.att(e, e, e)[0] + e)


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x).reshape(-1, V), y.reshape(-1))


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(V, (3, L), generator=g), torch.randint(V, (3, L), generator=g)


def _model(seed: int = 0) -> Tiny:
    torch.manual_seed(seed)
    return Tiny()


@settings(max_examples=12, deadline=None, derandomize=True)
@given(m=st.integers(1, 4), n=st.integers(1, 9), epochs=st.lists(st.integers(0, 7), min_size=9, max_size=9))
def test_one_g_step_per_m_f_steps_whatever_the_epoch(m: int, n: int, epochs: list[int]) -> None:
    trainer = BCDTrainer(_model(), loss_fn, mode="bcd", g_every=3, g_every_steps=m,
                         generator=torch.Generator().manual_seed(0))
    with_g = [("g_loss" in trainer.train_step(_batch(i), epoch=epochs[i])) for i in range(n)]
    assert with_g == [i % m == 0 for i in range(n)]  # the epoch (g_every=3) plays no part
    assert trainer.steps["g"] == sum(with_g) == -(-n // m) and trainer.steps["f"] == n


def test_g_phase_updates_only_the_gates_and_counts_its_steps() -> None:
    model = _model(1)
    trainer = BCDTrainer(model, loss_fn, mode="bcd", gate_lr=10.0, g_every_steps=5,
                         generator=torch.Generator().manual_seed(0))
    trainer.train_step(_batch(0), epoch=0)  # G + F
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    losses = trainer.g_phase([_batch(s) for s in range(1, 5)])
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed == gate_parameter_names(model)  # Alg. 1: no expert parameter moves
    assert len(losses) == 4 and trainer.steps == {"g": 5, "f": 1, "joint": 0, "base": 0}
    assert model.att.routing == "gate"  # test-time routing after the phase


@pytest.mark.parametrize("mode", ["uni", "base"])
def test_g_phase_needs_trained_gates(mode: str) -> None:
    with pytest.raises(ValueError, match="no G step"):
        BCDTrainer(_model(), loss_fn, mode=mode).g_phase([_batch(0)])


def test_no_g_steps_when_the_gates_are_frozen() -> None:
    trainer = BCDTrainer(_model(), loss_fn, mode="bcd", g_every_steps=1, train_gates=False,
                         generator=torch.Generator().manual_seed(0))
    assert all("g_loss" not in trainer.train_step(_batch(i), epoch=0) for i in range(3))
    assert trainer.steps["g"] == 0


def test_step_schedule_resumes_where_it_stopped() -> None:
    batches = [_batch(s) for s in range(7)]

    def run(split_at: int | None) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
        model = _model(2)
        trainer = BCDTrainer(model, loss_fn, mode="bcd", gate_lr=5.0, g_every_steps=3,
                             generator=torch.Generator().manual_seed(4))
        for i, b in enumerate(batches):
            if i == split_at:  # save, rebuild from the saved state, continue
                state, weights = trainer.state_dict(), model.state_dict()
                model = _model(9)
                model.load_state_dict(weights)
                trainer = BCDTrainer(model, loss_fn, mode="bcd", gate_lr=5.0, g_every_steps=3,
                                     generator=torch.Generator())
                trainer.load_state_dict(state)
            trainer.train_step(b, epoch=0)
        return {n: p.detach().clone() for n, p in model.named_parameters()}, trainer.steps

    (a, sa), (b, sb) = run(None), run(4)
    assert sa == sb == {"g": 3, "f": 7, "joint": 0, "base": 0}
    for n in a:
        torch.testing.assert_close(a[n], b[n], atol=0, rtol=0)


def test_bad_g_every_steps_raises() -> None:
    with pytest.raises(ValueError, match="g_every_steps"):
        BCDTrainer(_model(), loss_fn, g_every_steps=0)
