"""Contracts of the experiments' model and training code that the experiment tests leave unchecked
(mutation round 6): evaluation metrics against hand computations, eval/train mode around evaluations,
learning-rate schedules, data splits and seeding, resumption, and the loss terms a run trains on.

Every oracle is independent of the code under test: a hand computation from the documented formula,
an identity between reported numbers, or a fabricated input whose answer is known. Tiny sizes, one
thread, about 10 s in all.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("transformers")

import test_lm_routers as lm_tests  # noqa: E402  (tests/experiments: tiny sizes and fixtures reused)
import test_moe_routers_experiment as mr_tests  # noqa: E402
from test_mae_experiment import _mha_reference_logits  # noqa: E402  (the MAE LM with plain attention, by hand)

from routelab.data.parallel_text import VersePair  # noqa: E402
from routelab.experiments.dselect import synthetic  # noqa: E402
from routelab.experiments.dselect.mtl_train import experts_selected, train_mtl  # noqa: E402
from routelab.experiments.kool_toy.model import RunSpec, ToyBatch, train_chunk  # noqa: E402
from routelab.experiments.lm_routers import data as lm_data  # noqa: E402
from routelab.experiments.lm_routers import model as lm_model  # noqa: E402
from routelab.experiments.mae import train as mae_train  # noqa: E402
from routelab.experiments.mae.model import LMConfig, TransformerLM, lm_loss  # noqa: E402
from routelab.experiments.moe_routers import model as mr_model  # noqa: E402
from routelab.gates import TopKGate  # noqa: E402
from routelab.layers import MultiGateMoE, StackedLinear  # noqa: E402
from routelab.layers.bcd import BCDTrainer  # noqa: E402
from routelab.layers.mae import set_routing  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

LM_TINY, MR_TINY = lm_tests.TINY, mr_tests.TINY
corpus = lm_tests.corpus  # the synthetic character corpus (module fixture)
tiny_data = mr_tests.tiny_data  # synthetic MNIST-shaped data (module fixture)


# ----------------------------------------------------------------------------- moe-routers (MNIST)


def test_mnist_moe_with_a_zero_moe_output_is_the_linear_classifier_of_its_embedding(tiny_data) -> None:
    """Module docstring: ``h = h + MoE(LN(h))``, so with the MoE's output zero the network is linear in x:
    ``head(out_norm(embed(x)))`` (not a constant, as it would be without the residual)."""
    torch.manual_seed(0)
    model = mr_model.MnistMoE(MR_TINY.spec("switch"), MR_TINY).eval()

    class ZeroMoE(nn.Module):
        num_experts = MR_TINY.num_experts

        def forward(self, x):
            return torch.zeros_like(x), None

    model.moe = ZeroMoE()
    x = tiny_data[2][:6]
    with torch.no_grad():
        logits, _ = model(x)
        want = model.head(F.layer_norm(model.embed(x), (MR_TINY.d_model,), model.out_norm.weight, model.out_norm.bias))
    torch.testing.assert_close(logits, want)
    assert (logits[0] - logits[1]).abs().max() > 1e-3


def test_mnist_pixels_are_scaled_to_unit_range_then_standardised(monkeypatch) -> None:
    """prepare_data: uint8 pixels / 255, minus the MNIST mean 0.1307, divided by its std 0.3081; the first images."""
    import routelab.data as rdata

    train_x = torch.zeros(6, 28, 28, dtype=torch.uint8)
    train_x[:, 0, 0] = 255
    train_x[:, 0, 1] = 51
    fake = SimpleNamespace(train_x=train_x, train_y=torch.arange(6), test_x=train_x[:4].clone(), test_y=torch.arange(4))
    monkeypatch.setattr(rdata, "load_mnist", lambda: fake)
    s = mr_model.Settings(train_images=4, test_images=2)
    tx, ty, vx, vy = mr_model.prepare_data(s)
    assert tx.shape == (4, 784) and vx.shape == (2, 784) and tx.dtype == torch.float32
    assert ty.tolist() == [0, 1, 2, 3] and vy.tolist() == [0, 1]
    assert tx[0, 0].item() == pytest.approx((1.0 - 0.1307) / 0.3081)
    assert tx[0, 1].item() == pytest.approx((0.2 - 0.1307) / 0.3081)
    assert tx[0, 2].item() == pytest.approx(-0.1307 / 0.3081)


def test_mnist_evaluation_counts_dropped_pairs_and_images(tiny_data) -> None:
    """Identities of evaluate(): a top-1 router proposes one pair per image, so with a small capacity the dropped
    fraction of pairs = the fraction of images with no expert = 1 - kept pairs per image; dense softmax with room
    for every pair drops none and keeps E pairs per image."""
    settings = replace(MR_TINY, capacity_factor=0.5)
    torch.manual_seed(0)
    x, y = tiny_data[2], tiny_data[3]
    top1 = mr_model.MnistMoE(settings.spec("switch"), settings)
    r = mr_model.evaluate(top1, x, y, settings.batch_size)
    assert r["dropped_fraction"] >= 0.4  # capacity ceil(0.5 * 40 / 8) = 3 of 5 images per expert at most
    assert r["dropped_fraction"] == pytest.approx(1 - r["experts_per_token"])
    assert r["tokens_dropped"] == pytest.approx(1 - r["experts_per_token"])
    dense = mr_model.MnistMoE(MR_TINY.spec("softmax"), MR_TINY)  # capacity factor 1: room for every pair
    d = mr_model.evaluate(dense, x, y, MR_TINY.batch_size)
    assert d["dropped_fraction"] == 0.0 and d["tokens_dropped"] == 0.0 and d["experts_per_token"] == 8


def test_mnist_evaluation_is_in_eval_mode_whatever_mode_the_model_was_in(tiny_data) -> None:
    """A model left in training mode (noisy top-2: noise and the training capacity) evaluates as in eval mode,
    and its accuracy is the hand count of argmax hits."""
    torch.manual_seed(0)
    model = mr_model.MnistMoE(MR_TINY.spec("noisy_top2"), MR_TINY, generator=torch.Generator().manual_seed(1))
    x, y = tiny_data[2], tiny_data[3]
    model.train()
    from_train = mr_model.evaluate(model, x, y, MR_TINY.batch_size)
    model.eval()
    with torch.no_grad():
        hits = sum(int((model(x[i:i + 40])[0].argmax(-1) == y[i:i + 40]).sum()) for i in range(0, 200, 40))
    assert from_train == mr_model.evaluate(model, x, y, MR_TINY.batch_size)
    assert from_train["acc"] == hits / 200


def test_mnist_load_curve_is_pairs_per_expert_per_image(tiny_data) -> None:
    """BASE is balanced in training: every expert gets batch / E of the batch's images, so each point of the load
    curve (kept pairs per expert / batch, averaged over log_every steps) is 1 / E for every expert."""
    rec = mr_model.train_run(MR_TINY.spec("base"), 0, MR_TINY, tiny_data)
    assert len(rec["load_curve"]) == 5
    for curve in (rec["load_curve"], rec["proposed_curve"]):
        for point in curve:
            assert point == pytest.approx([1 / MR_TINY.num_experts] * MR_TINY.num_experts)


def test_mnist_training_minimises_the_routers_balance_loss(tiny_data) -> None:
    """The run's loss is the task loss plus the router's aux losses: a large Switch balance coefficient changes
    training (and balances the proposed load more) compared with none."""
    settings = replace(MR_TINY, epochs=2)
    runs = {}
    for coef in (0.0, 10.0):
        spec = mr_model.RouterSpec("switch", "topk", k=1, router_kwargs={"balance_coef": coef})
        runs[coef] = mr_model.train_run(spec, 0, settings, tiny_data)
    assert runs[0.0]["train"]["loss"] != runs[10.0]["train"]["loss"]
    assert runs[10.0]["train"]["proposed_load_cv"] < runs[0.0]["train"]["proposed_load_cv"]


# ----------------------------------------------------------------------------- lm-routers


def test_lm_evaluation_is_the_hand_cross_entropy_in_eval_mode(corpus) -> None:
    """evaluate(): mean next-character CE over every predicted character (nats), ppl = exp, bpc = nats / ln 2,
    computed in eval mode (BASE: argmax routing, not the training batch's balanced assignment) and leaving the
    model in the mode it was in."""
    model = lm_tests._trained("base", corpus)
    windows = corpus.held_out("val", 3, LM_TINY.seq)
    model.train()
    r = lm_model.evaluate(model, windows, batch=2)
    assert model.training
    model.eval()
    assert lm_model.evaluate(model, windows, batch=2) == r  # the same computation whatever the mode before
    with torch.no_grad():
        logits = model(input_ids=windows[:, :-1]).logits
    ce = float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1)))
    assert r["loss"] == pytest.approx(ce, rel=1e-5)
    assert r["ppl"] == pytest.approx(math.exp(ce), rel=1e-5)
    assert r["bpc"] == pytest.approx(ce / math.log(2), rel=1e-5)
    assert r["dropped"] == 0.0


def test_lm_learning_rate_warms_up_linearly_then_decays_by_cosine_to_a_tenth() -> None:
    s = LM_TINY.with_(lr=1.0, warmup=10, steps=110)
    assert lm_model.lr_at(0, s) == pytest.approx(0.1)  # step 0 already trains: (0 + 1) / warmup
    assert lm_model.lr_at(9, s) == pytest.approx(1.0)
    assert lm_model.lr_at(10, s) == pytest.approx(1.0)  # the peak, then cosine
    assert lm_model.lr_at(60, s) == pytest.approx(0.55)  # half way: 0.1 + 0.9 / 2
    assert lm_model.lr_at(110, s) == pytest.approx(0.1)


def test_lm_first_training_loss_is_next_character_ce_on_the_seeds_first_batch(corpus) -> None:
    """The first curve point's training loss is the CE of the initial model (training mode) predicting each
    character from the ones before it, on the batch drawn from the generator seeded 10_000 + seed."""
    seed, settings = 1, LM_TINY.with_(steps=1, eval_every=1)
    spec = settings.spec("top2")
    rec = lm_model.train_run(spec, seed, settings, corpus)
    offsets = corpus.train_batches(1, settings.batch, settings.seq, torch.Generator().manual_seed(10_000 + seed))
    w = corpus.windows(offsets[0], settings.seq)
    model = lm_model.build_model(spec, settings, corpus.vocab, seed, generator=torch.Generator().manual_seed(20_001))
    with torch.no_grad():
        logits = model(input_ids=w[:, :-1]).logits
    ce = float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1)))
    assert [p["step"] for p in rec["curve"]] == [0, 1]
    assert rec["curve"][1]["train_loss"] == pytest.approx(ce, rel=1e-5)


def test_lm_weight_decay_applies_to_matrices_not_to_norm_gains(corpus, monkeypatch) -> None:
    groups = []

    class Recording(torch.optim.AdamW):
        def __init__(self, params, **kw):
            super().__init__(params, **kw)
            groups.extend(self.param_groups)

    monkeypatch.setattr(torch.optim, "AdamW", Recording)
    settings = LM_TINY.with_(steps=1, eval_every=1, weight_decay=0.05)
    lm_model.train_run(settings.spec("top2"), 0, settings, corpus)
    decayed = [p for g in groups if g["weight_decay"] > 0 for p in g["params"]]
    plain = [p for g in groups if g["weight_decay"] == 0 for p in g["params"]]
    assert {g["weight_decay"] for g in groups} == {0.0, 0.05}
    assert decayed and all(p.dim() >= 2 for p in decayed)
    assert plain and all(p.dim() == 1 for p in plain)  # RMSNorm gains (the Mixtral has no biases)


def _bible(monkeypatch) -> None:
    """Nine fake books: book 0 (test) alone holds 'Z', book 4 (val) alone 'Q'."""
    verses = {i: ["abc ab", "ba c"] for i in range(9)}
    verses[0] = ["Zab"]
    verses[4] = ["cQc", "cab"]
    pairs = [VersePair(f"B{i}", 1, v + 1, 1, "x", text) for i in range(9) for v, text in enumerate(verses[i])]
    monkeypatch.setattr(lm_data, "load_parallel_text", lambda cache_dir=None: pairs)


def test_lm_vocabulary_comes_from_training_books_only(monkeypatch) -> None:
    _bible(monkeypatch)
    c = lm_data.build_corpus()
    assert c.books["test"] == ["B0", "B8"] and c.books["val"] == ["B4"]
    assert c.itos == ["\x00", "\n", " ", "a", "b", "c"]  # no 'Z', no 'Q': held-out only
    assert c.streams["test"][0].item() == 0 and c.streams["val"][1].item() == 0


def test_lm_held_out_windows_are_read_from_their_own_split(monkeypatch) -> None:
    _bible(monkeypatch)
    c = lm_data.build_corpus()
    val = c.streams["val"]  # "cQc\ncab\n"
    w = c.held_out("val", 2, 3)
    assert torch.equal(w[0], val[:4]) and torch.equal(w[1], val[-4:])


# ----------------------------------------------------------------------------- mae


def test_mae_block_norms_each_feed_their_own_sublayer() -> None:
    """``x + MAE(ln1(x))`` then ``x + FFN(ln2(x))``: with the norms' gains and biases moved from their
    initial (identical) values, uniform routing must still equal the hand-built plain transformer."""
    torch.manual_seed(0)
    cfg = LMConfig(vocab=13, dim=16, heads=4, layers=2, ffn=32, seq=10, gate_hidden=8, gate_context=3, dropout=0.0)
    model = TransformerLM(cfg).eval()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.normal_(1.0, 0.5)
                m.bias.normal_(0.0, 0.5)
    set_routing(model, "uniform")
    ids = torch.randint(13, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), _mha_reference_logits(model, ids), atol=1e-5, rtol=1e-5)


def test_mae_learning_rate_warms_up_linearly_then_decays_by_cosine_to_a_tenth() -> None:
    s = mae_train.Schedule(lr=1.0, warmup=10)
    assert mae_train._lr_at(0, 110, s) == pytest.approx(0.1)
    assert mae_train._lr_at(9, 110, s) == pytest.approx(1.0)
    assert mae_train._lr_at(60, 110, s) == pytest.approx(0.55)
    assert mae_train._lr_at(110, 110, s) == pytest.approx(0.1)


def _mae_lm(dropout: float = 0.3) -> TransformerLM:
    torch.manual_seed(0)
    return TransformerLM(LMConfig(vocab=11, dim=16, heads=4, layers=1, ffn=16, seq=6, gate_hidden=8,
                                  gate_context=2, dropout=dropout))


def test_mae_evaluation_is_the_mean_over_every_target_in_eval_mode() -> None:
    """Batches of 2, 2 and 1 windows: the mean over all targets (not of the batch means), without dropout, and
    the model back in the mode it was in."""
    model = _mae_lm(dropout=0.5)
    windows = torch.randint(11, (5, 7), generator=torch.Generator().manual_seed(0))
    model.train()
    got = mae_train.evaluate(model, windows, "uniform", batch=2)
    assert model.training
    model.eval()
    set_routing(model, "uniform")
    with torch.no_grad():
        want = float(lm_loss(model, windows))
    assert got == pytest.approx(want, rel=1e-5)


def test_mae_evaluation_gives_the_mode_back_after_an_error_in_the_loss() -> None:
    """An error inside the loss leaves the model in the mode it was in (review s43: it stayed in eval)."""
    model = _mae_lm()
    model.train()

    def failing(model, batch):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        mae_train.evaluate(model, torch.zeros(2, 7, dtype=torch.long), "uniform", loss_fn=failing)
    assert model.training


def test_mae_consecutive_epochs_walk_through_a_pass_of_the_windows() -> None:
    windows = torch.arange(12).unsqueeze(1)
    s = mae_train.Schedule(batch=2, batches_per_epoch=3, seed=0)  # 6 batches a pass: two epochs per pass
    first = torch.cat(mae_train.epoch_batches(windows, s, 0) + mae_train.epoch_batches(windows, s, 1)).flatten()
    second = torch.cat(mae_train.epoch_batches(windows, s, 2) + mae_train.epoch_batches(windows, s, 3)).flatten()
    assert sorted(first.tolist()) == list(range(12)) and sorted(second.tolist()) == list(range(12))
    assert first.tolist() != second.tolist()  # each pass reshuffles


def _run(tmp: Path, s: mae_train.Schedule, name: str) -> tuple[TransformerLM, BCDTrainer, dict]:
    model = _mae_lm()
    trainer = BCDTrainer(model, lm_loss, mode="base", lr=s.lr, clip_norm=s.clip_norm)
    g = torch.Generator().manual_seed(3)
    train, dev = torch.randint(11, (16, 7), generator=g), torch.randint(11, (4, 7), generator=g)
    state = mae_train.run_training(model, trainer, train, dev, s, tmp / f"{name}.pt", name)
    return model, trainer, state | {"dev": dev}


def test_mae_a_resumed_run_equals_an_uninterrupted_one(tmp_path: Path) -> None:
    """Checkpoint after epoch 1, resume for epoch 2: the same curve and weights as two epochs in one go (dropout
    draws included), and each epoch's dev loss is the dev windows' loss of that epoch's model."""
    s = mae_train.Schedule(epochs=2, batches_per_epoch=2, batch=4, warmup=1, g_phase=0, seed=0)
    whole, trainer, a = _run(tmp_path, s, "whole")
    _run(tmp_path, replace(s, epochs=1), "cut")
    resumed, _, b = _run(tmp_path, s, "cut")
    assert [p["epoch"] for p in b["curve"]] == [1, 2]
    assert [p["train_loss"] for p in b["curve"]] == [p["train_loss"] for p in a["curve"]]
    assert [p["dev_loss"] for p in b["curve"]] == [p["dev_loss"] for p in a["curve"]]
    for (name, p), q in zip(whole.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(p, q), name
    assert a["curve"][-1]["dev_loss"] == pytest.approx(mae_train.evaluate(whole, a["dev"], trainer.eval_routing))


def test_mae_finetuning_picks_its_epoch_on_dev_not_on_test(tmp_path: Path, monkeypatch) -> None:
    curve = [{"epoch": 1, "step": 2, "dev_loss": 2.0, "test_loss": 1.0},
             {"epoch": 2, "step": 4, "dev_loss": 1.5, "test_loss": 3.0},
             {"epoch": 3, "step": 6, "dev_loss": 1.8, "test_loss": 0.5}]
    monkeypatch.setattr(mae_train, "run_training", lambda *a, **k: {"curve": curve, "epoch": 3, "seconds": 1.0})
    w = torch.zeros(2, 7, dtype=torch.long)
    out = mae_train.finetune(_mae_lm(), "FTG", w, w, w, mae_train.Schedule(), tmp_path, "x")
    assert (out["best_dev_loss"], out["test_loss_at_best"], out["best_step"]) == (1.5, 3.0, 4)


# ----------------------------------------------------------------------------- dselect


def test_experts_selected_is_per_example() -> None:
    g = torch.Generator().manual_seed(0)
    gates = [TopKGate(4, 2, generator=g), TopKGate(4, 1, generator=g)]
    model = MultiGateMoE(StackedLinear(4, 3, 1, generator=g), gates)
    batches = [torch.randn(5, 3, generator=g), torch.randn(3, 3, generator=g)]
    assert experts_selected(model, model, batches) == [2.0, 1.0]


def test_train_mtl_trains_on_the_regularization_and_tells_the_model_every_step() -> None:
    """A stub model whose only loss is its regularization (p - 3)^2: Adam drives p to 3; on_step sees
    (step, total) for every step."""

    class Stub(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.p = nn.Parameter(torch.zeros(()))
            self.calls: list[tuple[int, int]] = []

        def forward(self, x):
            return [x[:, :1] * 0 + self.p]

        def regularization(self):
            return (self.p - 3) ** 2

        def on_step(self, step, total):
            self.calls.append((step, total))

        def track(self, step):
            pass

        def report(self):
            return []

    model = Stub()
    x, y = torch.randn(20, 2), torch.zeros(20, 1)
    info = train_mtl(model, model, lambda out, yb: (out[0] * 0).sum(), x, y, epochs=25, batch=5, lr=0.1,
                     generator=torch.Generator().manual_seed(0))
    assert info["steps"] == 100 and model.calls == [(i, 100) for i in range(100)]
    assert abs(float(model.p.detach()) - 3.0) < 0.3


def test_synthetic_test_mse_is_measured_on_the_held_out_points() -> None:
    """x = 0 and training targets -1 collapse the model to predicting exactly 0 (see the collapse test); test
    targets +2 then give a test MSE of exactly 4 (the training points would give 1)."""
    s = synthetic.SyntheticSettings(tasks=(16,), reps=1, epochs=10, n_train=512, n_test=64, batch=128, lr=0.1)
    y = torch.cat([-torch.ones(512, 16), 2 * torch.ones(64, 16)])
    rec = synthetic.train_one("topk_static", 16, 0, s, (torch.zeros(576, 10), y))
    assert rec["constant_tasks"] == 16 and rec["test_mse"] == 4.0


def test_synthetic_jaccard_relates_tasks_of_the_same_group_of_16() -> None:
    sets = [{t // 16} for t in range(32)]  # every task of a group selects its group's expert
    assert synthetic._jaccard(sets, 32) == (1.0, 0.0)
    assert synthetic._jaccard([{0, 1}, {1, 2}] + [{0}] * 14, 16)[0] == pytest.approx(
        (1 / 3 + 14 * 0.5 + 14 * 0.0 + 91 * 1.0) / 120)  # pairs (0, 1), (0, t), (1, t), (t, t') for t, t' >= 2


# ----------------------------------------------------------------------------- kool toy


def test_toy_evaluation_is_the_hand_computed_expected_mse_and_load() -> None:
    """p(z = 1 | x) = sigmoid(a x + c); mse = mean_i sum_j p_ij (y_i - pred_ij)^2 with pred_ij = out_j(x_i)
    (REINFORCE) or p_ij out_j(x_i) (gating); load = mean p_i1; argmax_load = fraction with p_i1 > 1/2."""
    batch = ToyBatch([RunSpec("reinforce", "sample", 1.0, 0), RunSpec("gating", "sample", 1.0, 1)])
    ev = batch.evaluate()
    for i, gating in enumerate((False, True)):
        x, y = batch.x[i], batch.y[i]
        p1 = torch.sigmoid(batch.a[i] * x + batch.c[i]).detach()
        p = torch.stack([1 - p1, p1], -1)
        out = (batch.w[i] * x.unsqueeze(-1) + batch.b[i]).detach()
        pred = p * out if gating else out
        mse = (p * (y.unsqueeze(-1) - pred) ** 2).sum(-1).mean()
        torch.testing.assert_close(ev["mse"][i], mse)
        torch.testing.assert_close(ev["load"][i], p1.mean())
        torch.testing.assert_close(ev["argmax_load"][i], (p1 > 0.5).float().mean())


def test_toy_matching_routes_drop_nothing() -> None:
    """Gumbel-Matching assigns the 100 points 50 / 50 at capacity 50: no point is ever dropped."""
    (rec,) = train_chunk([RunSpec("reinforce", "gumbel_matching_iw", 1.0, 0)], 3)
    assert rec["dropped"] == 0.0 and rec["tokens_per_expert"] == [50, 50]


# ----------------------------------------------------------------------------- leftovers of the round (review s43)


def test_lm_training_backpropagates_the_routers_aux_loss_with_weight_one(corpus, monkeypatch) -> None:
    """The LM trains on ``ce + aux_loss(model)`` (the coefficients live inside the routers' aux losses): a probe
    added to the aux loss receives the gradient d loss / d aux = 1 on every step (LM10: a run on ``ce`` alone
    would silently train the Switch/GShard routers without their balance loss)."""
    real_aux = lm_model.aux_loss
    grads: list[float] = []

    def probed(model):
        probe = torch.zeros((), requires_grad=True)
        probe.register_hook(lambda g: grads.append(float(g)))
        return real_aux(model) + probe

    monkeypatch.setattr(lm_model, "aux_loss", probed)
    settings = LM_TINY.with_(steps=2, eval_every=2)
    lm_model.train_run(settings.spec("top2"), 0, settings, corpus)
    assert grads == [1.0, 1.0]


def test_lm_tokens_per_second_counts_every_character_of_every_window(corpus, monkeypatch) -> None:
    """``tokens_per_s`` = steps x batch x seq / training seconds. A fake clock that moves 0.25 s per reading makes
    the training seconds exact, so the identity holds exactly (LM11: without ``seq`` it is 16x too small)."""
    clock = [0.0]

    def tick() -> float:
        clock[0] += 0.25
        return clock[0]

    monkeypatch.setattr(lm_model, "time", SimpleNamespace(perf_counter=tick))
    settings = LM_TINY.with_(steps=2, eval_every=2)
    rec = lm_model.train_run(settings.spec("top2"), 0, settings, corpus)
    assert rec["train_s"] > 0
    assert rec["tokens_per_s"] * rec["train_s"] == pytest.approx(2 * settings.batch * settings.seq, rel=1e-12)


def test_mnist_tokens_dropped_counts_the_images_with_no_expert_kept_not_those_missing_one(tiny_data) -> None:
    """``tokens_dropped`` is the fraction of images with *no* expert kept. With top-2 and a small capacity some
    images keep one of their two experts: they are not dropped (MR5: counting every image that lost a pair)."""
    settings = replace(MR_TINY, capacity_factor=0.5)
    torch.manual_seed(0)
    model = mr_model.MnistMoE(settings.spec("top2"), settings)
    x, y = tiny_data[2], tiny_data[3]
    r = mr_model.evaluate(model, x, y, settings.batch_size)
    kept_per_image = []
    with torch.no_grad():
        for i in range(0, x.shape[0], settings.batch_size):
            kept_per_image += model(x[i:i + settings.batch_size])[1].keep.sum(-1).tolist()
    assert set(kept_per_image) <= {0, 1, 2} and 1 in kept_per_image  # the case that tells "none" from "not all"
    assert r["tokens_dropped"] == kept_per_image.count(0) / len(kept_per_image)
    assert r["experts_per_token"] == sum(kept_per_image) / len(kept_per_image)


def test_mnist_batchwise_diagnostics_give_the_router_its_inference_mode_back(tiny_data) -> None:
    """The diagnostics evaluate with ``inference="batchwise"`` and then put back the router's own mode: the
    batch-1 accuracy is the threshold mask's, one image at a time, and the router is left on
    "threshold" (MR9: left on "batchwise", the "threshold" numbers are batchwise ones)."""
    torch.manual_seed(0)
    model = mr_model.MnistMoE(MR_TINY.spec("batchwise"), MR_TINY)
    router = model.moe.router
    assert router.inference == "threshold"
    x, y = tiny_data[2][:40], tiny_data[3][:40]
    want = mr_model.evaluate(model, x, y, 1)["acc"]  # the threshold mask, one image at a time
    d = mr_model.batchwise_diagnostics(model, x, y, MR_TINY)
    assert router.inference == "threshold"
    assert d["acc_threshold_batch1"] == want
