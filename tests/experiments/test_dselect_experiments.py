"""Pieces of the DSelect-k experiments: the synthetic gate bank, Jaccard reference, data builders."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from routelab.data import DataUnavailable, make_overlays
from routelab.experiments.dselect import recovery, synthetic
from routelab.experiments.registry import REGISTRY
from routelab.gates import DSelectK, SoftmaxSelectorGate, TopKGate

torch.set_num_threads(1)


def test_registered():
    for name in ("dselect-recovery", "dselect-synthetic", "dselect-movielens", "dselect-multimnist"):
        assert name in REGISTRY


@pytest.mark.parametrize("kind", synthetic.GATES)
def test_gate_bank_equals_separate_gate_modules(kind):
    T, n, k = 5, 6, 3
    bank = synthetic.StaticGateBank(kind, T, n, k, gamma=2.0, entropy_reg=0.05, anneal=(1.0, 0.1),
                                    generator=torch.Generator().manual_seed(0))
    bank.on_step(3, 10)
    w = bank()
    reg = 0.0
    for t in range(T):
        if kind == "dselect_static":
            gate = DSelectK(n, k, gamma=2.0, entropy_reg=0.05)
            with torch.no_grad():
                gate.alpha.copy_(bank.alpha[t])
                gate.z.copy_(bank.z[t])
        elif kind == "topk_static":
            gate = TopKGate(n, k)
            with torch.no_grad():
                gate.logits.copy_(bank.logits[t])
        else:
            ann = kind == "ablation_annealing"
            gate = SoftmaxSelectorGate(n, k, temperature=1.0, final_temperature=0.1 if ann else None,
                                       entropy_reg=0.0 if ann else 0.05)
            gate.on_step(3, 10)
            with torch.no_grad():
                gate.alpha.copy_(bank.alpha[t])
                gate.beta.copy_(bank.beta[t])
        torch.testing.assert_close(w[t], gate(1)[0], rtol=1e-5, atol=1e-6)
        reg = reg + gate.regularization()
    torch.testing.assert_close(bank.aux.reshape(()), torch.as_tensor(reg, dtype=torch.float32).reshape(()),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n", [4, 5, 6, 8])
def test_random_gate_jaccard_bruteforce(n):
    subsets = list(itertools.combinations(range(n), 4))
    want = sum(len(set(a) & set(b)) / len(set(a) | set(b)) for a in subsets for b in subsets) / len(subsets) ** 2
    assert synthetic.random_gate_jaccard(n) == pytest.approx(want)


def test_synthetic_data_groups_are_correlated():
    s = synthetic.SyntheticSettings(tasks=(32,), reps=1, epochs=1, n_train=3000, n_test=10)
    x, y = synthetic.make_data(0, s)
    assert x.shape == (3010, 10) and y.shape == (3010, 128)
    c = torch.corrcoef(y[:, :32].T).abs()
    within = c[:16, :16][~torch.eye(16, dtype=torch.bool)].mean()
    across = c[:16, 16:32].mean()
    assert within > across


def test_recovery_problem_true_experts_reproduce_labels():
    s = recovery.RecoverySettings(reps=1, epochs=1, lrs=(0.01,), entropy_regs=(0.0,), n_train=500, n_val=500)
    prob = recovery.make_problem(0, s)
    gate_w = torch.zeros(16)
    gate_w[prob["true"]] = 0.25

    class Fixed(torch.nn.Module):
        def forward(self, b: int) -> torch.Tensor:
            return gate_w.expand(b, 16)

    logits = recovery._forward(Fixed(), prob, prob["x_va"])
    assert torch.equal((logits > 0).float(), prob["y_va"])
    assert len(set(prob["true"])) == 4


def test_make_overlays_positions_and_labels():
    g = torch.Generator().manual_seed(0)
    imgs = torch.zeros(3, 28, 28, dtype=torch.uint8)
    imgs[0, 0, 0] = 255            # marks the top-left corner of image 0
    imgs[1, 27, 27] = 255          # the bottom-right corner of image 1
    labels = torch.tensor([7, 8, 9])
    x, y = make_overlays(imgs, labels, 50, g)
    assert x.shape == (50, 1, 36, 36) and y.shape == (50, 2)
    assert (y[:, 0] != y[:, 1]).all()  # two different images
    for i in range(50):
        assert (x[i, 0, 0, 0] == 1.0) == (y[i, 0] == 7)        # image 0 placed at offset 0
        assert (x[i, 0, 35, 35] == 1.0) == (y[i, 1] == 8)      # image 1 placed at offset 8
    with pytest.raises(ValueError, match="images"):
        make_overlays(torch.zeros(3, 20, 20, dtype=torch.uint8), labels, 2, g)
    with pytest.raises(ValueError, match="n must"):
        make_overlays(imgs, labels, 0, g)


def test_movielens_negatives_are_unrated():
    from routelab.experiments.dselect import movielens

    try:
        ex = movielens.build_examples(0, subsample=2000)
    except DataUnavailable:
        pytest.skip("MovieLens-100k not installed (make data)")
    ml = ex["ml"]
    rated = set(zip(ml.user.tolist(), ml.movie.tolist()))
    for split in ("train", "val", "test"):
        ids, y = ex[split]["ids"], ex[split]["y"]
        for (u, m), (w, r) in zip(ids.tolist(), y.tolist()):
            assert ((u, m) in rated) == (w == 1.0)
            assert (r >= 1) == (w == 1.0)
    n = sum(ex[s]["ids"].shape[0] for s in ("train", "val", "test"))
    assert n == 4000 and math.isclose(ex["train"]["ids"].shape[0] / n, 0.8)


def test_train_mtl_binary_step_is_the_last_gate_to_turn_binary():
    from routelab.experiments.dselect.mtl_train import train_mtl
    from routelab.layers import MultiGateMoE, StackedLinear

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 3, generator=g), torch.randn(64, 2, generator=g)
    gates = [DSelectK(4, 1, entropy_reg=1.0, generator=g), DSelectK(4, 2, entropy_reg=1.0, generator=g)]
    model = MultiGateMoE(StackedLinear(4, 3, 1, generator=g), gates)
    info = train_mtl(model, model, lambda out, yb: sum(((o[:, 0] - yb[:, t]) ** 2).mean() for t, o in enumerate(out)),
                     x, y, epochs=60, batch=16, lr=0.05, generator=g)
    assert info["steps"] == 60 * 4
    steps = [gt.binary_step for gt in gates]
    assert info["binary_all"] == all(gt.is_binary() for gt in gates)
    assert info["binary_step"] == (max(steps) if None not in steps else None)
    assert info["binary_all"] and info["binary_step"] is not None  # the run is long enough to converge
    with pytest.raises(ValueError, match="batch"):
        train_mtl(model, model, lambda out, yb: out[0].sum(), x, y, epochs=1, batch=65, lr=0.1, generator=g)


def test_write_csv_and_report_helpers(tmp_path):
    from routelab.experiments.dselect.common import binary_step_percent, experts_per_run, write_csv

    recs = [{"a": 1, "experts": [1.0, 3.0], "binary_step": 5, "steps": 20},
            {"a": 2, "experts": None, "binary_step": None, "steps": 20}]
    path = write_csv(tmp_path / "r.csv", recs, ("a", "experts"))
    assert path.read_text() == "a,experts\n1,[1.0; 3.0]\n2,None\n"
    assert experts_per_run(recs) == [2.0]
    assert binary_step_percent(recs) == [25.0]


@pytest.mark.parametrize("drop_last", [True, False])
def test_minibatches_cover_each_epoch_once(drop_last: bool) -> None:
    from routelab.experiments.dselect.common import minibatches, steps_per_epoch

    n, batch, epochs = 10, 4, 3
    steps = list(minibatches(n, batch, epochs, torch.Generator().manual_seed(5), drop_last=drop_last))
    per_epoch = steps_per_epoch(n, batch, drop_last=drop_last)
    assert per_epoch == (2 if drop_last else 3)
    assert [s for _, s, _ in steps] == list(range(epochs * per_epoch))
    reference = torch.Generator().manual_seed(5)  # one permutation per epoch, drawn in order
    for epoch in range(epochs):
        perm = torch.randperm(n, generator=reference)
        got = torch.cat([idx for e, _, idx in steps if e == epoch])
        assert torch.equal(got, perm[: per_epoch * batch] if drop_last else perm)
