"""The experiments' run code (mutation round 6): what the DSelect-k sweeps train and evaluate (task losses,
per-task metrics, the test split, the towers and experts each task owns, resume), and how the kool-toy sweep is
planned and trained in chunks (every run once, results back whatever the workers). The data loading is stubbed
with tiny tensors; every number is checked against a hand computation from the model's own outputs."""

from __future__ import annotations

import itertools
import time
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

import routelab.experiments.kool_toy as kt
from routelab.experiments.dselect import movielens, multimnist
from routelab.experiments.dselect.common import MTL_MODELS
from routelab.experiments.kit.store import read_jsonl
from routelab.experiments.kool_toy.model import CONFIGS
from routelab.experiments.kool_toy.parallel import train_chunks

pytestmark = pytest.mark.usefixtures("one_thread")

ML_TINY = movielens.MovieLensSettings(reps=1, epochs=1, batch=16, hidden=8, emb=4, bottom_units=8, alphas=(0.1,))
MM_TINY = multimnist.MultiMnistSettings(reps=1, epochs=1, n_train=16, n_test=24, batch=8)


def _fake_movielens() -> SimpleNamespace:
    g = torch.Generator().manual_seed(0)
    users, movies = 6, 9
    return SimpleNamespace(num_users=users, num_movies=movies, occupations=["a", "b", "c"],
                           user_age=torch.randint(18, 60, (users,), generator=g).float(),
                           user_gender=torch.randint(0, 2, (users,), generator=g),
                           user_occupation=torch.randint(0, 3, (users,), generator=g),
                           movie_genres=torch.randint(0, 2, (movies, 19), generator=g).float())


def _fake_split(n: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randint(0, 6, (n,), generator=g), torch.randint(0, 9, (n,), generator=g)], 1)
    watch = torch.arange(n).remainder(2).float()  # half watched
    rating = torch.where(watch > 0, torch.randint(1, 6, (n,), generator=g).float(), torch.zeros(n))
    return {"ids": ids, "y": torch.stack([watch, rating], 1)}


def _fake_examples(seed: int, subsample: int | None = None) -> dict[str, Any]:
    return {"ml": _fake_movielens(), "train": _fake_split(32, 1), "val": _fake_split(16, 2),
            "test": _fake_split(24, 3)}


def _no_training(calls: list[dict]):
    """A stand-in for train_mtl that trains nothing and keeps what it was given (the model stays as built)."""

    def train(model, forward, loss_fn, x, y, *, epochs, batch, lr, generator, **kw):
        calls.append({"model": model, "loss_fn": loss_fn, "x": x, "y": y, "seed": generator.initial_seed()})
        model.eval()
        return {"steps": 1, "binary_step": None, "binary_all": None}

    return train


def _bce(logit: torch.Tensor, target: torch.Tensor) -> float:
    p = torch.sigmoid(logit.double())
    return float(-(target * p.log() + (1 - target) * (1 - p).log()).mean())


# ----------------------------------------------------------------------------- MovieLens


def test_movielens_rating_error_is_taken_over_watched_pairs_only() -> None:
    y = torch.tensor([[1.0, 4.0], [0.0, 0.0], [1.0, 2.0], [0.0, 0.0]])
    out = [torch.tensor([[0.5], [-1.0], [2.0], [0.0]]), torch.tensor([[3.0], [9.0], [2.5], [-7.0]])]
    bce, mse = movielens.task_losses(out, y)
    assert float(mse) == pytest.approx(((3 - 4) ** 2 + (2.5 - 2) ** 2) / 2)  # the unwatched rows have no rating
    assert float(bce) == pytest.approx(_bce(out[0][:, 0], y[:, 0]))


def test_movielens_evaluate_weighs_the_task_losses_by_alpha_and_counts_accuracy() -> None:
    ml, split = _fake_movielens(), _fake_split(40, 5)
    model = movielens.build_model("softmax", ml, ML_TINY, 0).eval()
    with torch.no_grad():
        watch_logit, rating = (o[:, 0] for o in model(split["ids"]))
    watch, true_rating = split["y"][:, 0], split["y"][:, 1]
    bce = _bce(watch_logit, watch)
    seen = watch > 0
    mse = float(((rating - true_rating)[seen] ** 2).mean())
    acc = sum(int(lg > 0) == int(w) for lg, w in zip(watch_logit.tolist(), watch.tolist())) / 40
    got = movielens.evaluate(model, split, 0.1)
    assert got["t1_bce"] == pytest.approx(bce, rel=1e-5) and got["t2_mse"] == pytest.approx(mse, rel=1e-5)
    assert got["t1_acc"] == pytest.approx(acc)
    assert got["loss"] == pytest.approx(0.1 * bce + 0.9 * mse, rel=1e-5)


@pytest.fixture
def movielens_sweep(tmp_path, monkeypatch):
    """run_movielens on the fake data with training stubbed; yields (out_dir, train calls, evaluate calls)."""
    monkeypatch.setattr(movielens, "build_examples", _fake_examples)
    calls: list[dict] = []
    monkeypatch.setattr(movielens, "train_mtl", _no_training(calls))
    evaluated: list[tuple] = []
    real_evaluate = movielens.evaluate

    def spy(model, split, alpha):
        res = real_evaluate(model, split, alpha)
        evaluated.append((split, alpha, res))
        return res

    monkeypatch.setattr(movielens, "evaluate", spy)
    movielens.run_movielens(tmp_path, ML_TINY)
    return tmp_path, calls, evaluated


def test_movielens_sweep_trains_on_the_alpha_weighted_loss_and_reports_the_test_split(movielens_sweep) -> None:
    out, calls, evaluated = movielens_sweep
    assert len(calls) == len(evaluated) == len(MTL_MODELS)
    test = _fake_examples(0)["test"]
    for (split, alpha, _), call in zip(evaluated, calls, strict=True):
        assert alpha == 0.1 and torch.equal(split["ids"], test["ids"]) and torch.equal(split["y"], test["y"])
        assert torch.equal(call["x"], _fake_examples(0)["train"]["ids"])
        y = torch.tensor([[1.0, 4.0], [0.0, 0.0], [1.0, 2.0], [0.0, 0.0]])
        o = [torch.tensor([[0.5], [-1.0], [2.0], [0.0]]), torch.tensor([[3.0], [9.0], [2.5], [-7.0]])]
        mse = ((3 - 4) ** 2 + (2.5 - 2) ** 2) / 2
        assert float(call["loss_fn"](o, y)) == pytest.approx(0.1 * _bce(o[0][:, 0], y[:, 0]) + 0.9 * mse)
    records = read_jsonl(out / "runs.jsonl")
    assert [r["model"] for r in records] == list(MTL_MODELS)
    for r, (_, _, res) in zip(records, evaluated, strict=True):
        assert r["loss"] == res["loss"] and r["alpha"] == 0.1 and r["seed"] == 0


def test_movielens_rerun_trains_no_recorded_run(movielens_sweep, monkeypatch) -> None:
    out, calls, _ = movielens_sweep
    before = read_jsonl(out / "runs.jsonl")
    monkeypatch.setattr(movielens, "train_mtl", lambda *a, **k: pytest.fail("a recorded run was trained again"))
    movielens.run_movielens(out, ML_TINY)
    assert read_jsonl(out / "runs.jsonl") == before


def _shared_parameters(a: nn.Module, b: nn.Module) -> set[int]:
    return {id(p) for p in a.parameters()} & {id(p) for p in b.parameters()}


@pytest.mark.parametrize("kind", MTL_MODELS)
def test_each_task_has_a_tower_of_its_own(kind: str) -> None:
    for core in (movielens.build_model(kind, _fake_movielens(), ML_TINY, 0).core,
                 multimnist.build_model(kind, MM_TINY, 0)):
        t0, t1 = core.towers
        assert t0 is not t1 and not _shared_parameters(t0, t1)


# ----------------------------------------------------------------------------- Multi-MNIST


def test_multimnist_loss_sums_each_tasks_cross_entropy() -> None:
    out = [torch.tensor([[2.0, 0.0, -1.0], [0.0, 1.0, 0.0]]), torch.tensor([[0.0, 0.0, 3.0], [1.0, -2.0, 0.5]])]
    y = torch.tensor([[0, 2], [1, 0]])

    def ce(logits: torch.Tensor, labels: torch.Tensor) -> float:
        return float(sum(torch.logsumexp(row, 0) - row[c] for row, c in zip(logits, labels.tolist())) / len(labels))

    assert float(multimnist._loss(out, y)) == pytest.approx(ce(out[0], y[:, 0]) + ce(out[1], y[:, 1]))


def test_multimnist_experts_are_independent_cnns() -> None:
    """Changing expert 0's first convolution changes expert 0's output only (grouped convolutions)."""
    experts = multimnist.CNNExperts(4, torch.Generator().manual_seed(0))
    x = torch.rand(3, 1, 36, 36, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = experts(x)
        experts.conv1.weight[:10] += 1.0  # expert 0's 10 filters
        after = experts(x)
    assert not torch.equal(before[:, 0], after[:, 0])
    assert torch.equal(before[:, 1:], after[:, 1:])


def _fake_overlays(name: str, seed: int, s: multimnist.MultiMnistSettings) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x_tr, x_te = torch.rand(s.n_train, 1, 36, 36, generator=g), torch.rand(s.n_test, 1, 36, 36, generator=g)
    y_tr, y_te = torch.randint(0, 10, (s.n_train, 2), generator=g), torch.randint(0, 10, (s.n_test, 2), generator=g)
    y_te[:, 1] = (y_te[:, 0] + 1 + y_te[:, 1] % 9) % 10  # task 2's label never equals task 1's
    return x_tr, y_tr, x_te, y_te


def test_multimnist_sweep_records_each_tasks_test_accuracy(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(multimnist, "_data", _fake_overlays)
    monkeypatch.setattr(multimnist, "DATASETS", ("multi_fashion",))
    calls: list[dict] = []
    monkeypatch.setattr(multimnist, "train_mtl", _no_training(calls))
    s = multimnist.MultiMnistSettings(reps=2, epochs=1, n_train=16, n_test=24, batch=8)
    multimnist.run_multimnist(tmp_path, s)
    records = read_jsonl(tmp_path / "runs.jsonl")
    assert len(records) == len(calls) == 2 * len(multimnist.DATASETS) * len(MTL_MODELS)
    for r, call in zip(records, calls, strict=True):
        _, _, x_te, y_te = _fake_overlays(r["dataset"], r["seed"], s)
        with torch.no_grad():
            out = call["model"](x_te)
        for t in range(2):
            hits = sum(int(row.argmax()) == c for row, c in zip(out[t], y_te[:, t].tolist()))
            assert r[f"acc{t + 1}"] == pytest.approx(hits / s.n_test), (r["model"], t)
    # each repetition draws its own minibatch order (as it draws its own data and initialisation)
    assert {c["seed"] for c, r in zip(calls, records) if r["seed"] == 0}.isdisjoint(
        {c["seed"] for c, r in zip(calls, records) if r["seed"] == 1})


# ----------------------------------------------------------------------------- kool-toy: the sweep's plan and chunks


@pytest.mark.parametrize("form", ["FULL", "QUICK"])
def test_kool_toy_plan_holds_every_combination_once_in_chunks_of_their_own(form: str) -> None:
    s = getattr(kt, form)
    chunks = kt.plan_chunks(s)
    got = [r.key for c in chunks for r in c.runs]
    want = list(itertools.product(s.configs, s.methods, s.taus, s.seeds))
    assert len(got) == len(want) and sorted(got) == sorted(want)
    names = [c.name for c in chunks]
    assert len(set(names)) == len(names)
    assert len({c.seed for c in chunks}) == len(chunks)  # each chunk its own sampling noise
    assert kt.planned_keys(s) == [(*r.key, s.steps, c.name) for c in chunks for r in c.runs]
    for c in chunks:
        sinkhorn = "sinkhorn" in c.name
        assert all((CONFIGS[r.config].sinkhorn or r.method == "gumbel_matching_sh") == sinkhorn for r in c.runs)
        groups = [(CONFIGS[r.config].sinkhorn, r.method) for r in c.runs]
        starts = [g for i, g in enumerate(groups) if i == 0 or groups[i - 1] != g]
        assert len(starts) == len(set(starts)), c.name  # every (sinkhorn, method) group is one contiguous slice


def test_kool_toy_settings_reject_repeats_and_no_steps() -> None:
    for bad in (dict(taus=(0.5, 0.5)), dict(seeds=(0, 0))):
        with pytest.raises(ValueError, match="must not repeat"):
            kt.Settings(**bad)
    with pytest.raises(ValueError, match="steps"):
        kt.Settings(steps=0)


def test_kool_toy_one_process_trains_each_chunk_once_in_order_and_keeps_going_after_an_error() -> None:
    small = replace(kt.QUICK, configs=("reinforce", "gating"), methods=("sample", "gumbel_matching_sh"), taus=(1.0,),
                    seeds=(0,))
    chunks = kt.plan_chunks(small)
    assert len(chunks) == 2
    calls, progress, done = [], [], []

    def train(runs, steps, *, chunk_seed, progress, timings):
        calls.append((runs, steps, chunk_seed))
        progress(steps)
        if len(calls) == 1:
            raise ValueError("sinkhorn did not converge")
        return [{"n": len(runs)}]

    t0 = time.perf_counter()
    train_chunks(chunks, 7, workers=1, threads=None, on_progress=progress.append, on_done=done.append, train=train)
    elapsed = time.perf_counter() - t0
    assert [(r, s, seed) for r, s, seed in calls] == [(c.runs, 7, c.seed) for c in chunks]
    assert [d.chunk for d in done] == chunks and progress == [7] * len(chunks)
    assert done[0].results is None and done[0].error == "ValueError: sinkhorn did not converge"
    assert all(d.error is None and d.results == [{"n": len(d.chunk.runs)}] for d in done[1:])
    assert all(0 <= d.wall_s <= elapsed for d in done)  # seconds, each within the call's own wall time


def test_kool_toy_one_process_lets_an_error_of_on_done_through_once() -> None:
    """A ValueError raised by the caller's ``on_done`` is the caller's error, as on the worker path: it
    propagates, and the chunk is not reported a second time as failed (review s43: it was, so a chunk
    could land in runs.jsonl and in errors.jsonl)."""
    small = replace(kt.QUICK, configs=("reinforce",), methods=("sample",), taus=(1.0,), seeds=(0,))
    chunks = kt.plan_chunks(small)
    done = []

    def on_done(result) -> None:
        done.append(result)
        raise ValueError("the caller's own bug")

    def train(runs, steps, *, chunk_seed, progress, timings):
        return [{"n": len(runs)}]

    with pytest.raises(ValueError, match="the caller's own bug"):
        train_chunks(chunks, 3, workers=1, threads=None, on_progress=lambda n: None, on_done=on_done, train=train)
    assert len(done) == 1 and done[0].error is None


# ----------------------------------------------------------------------------- lm-routers: one training loop


@pytest.mark.parametrize("name", ["top2", "dense"])
def test_lm_train_steps_in_one_process_is_train_runs_training(name: str) -> None:
    """train_steps' docstring: the batches, optimiser and schedule of model.train_run. One process, same seed:
    its per-step loss (mean CE + aux) equals train_run's recorded per-step CE plus the aux losses."""
    pytest.importorskip("transformers")
    from routelab.experiments.lm_routers.data import CharCorpus
    from routelab.experiments.lm_routers.model import Settings, train_run
    from routelab.experiments.lm_routers.parallel import build_routelab_model, train_steps

    s = Settings(seeds=(0,), steps=4, batch=4, seq=16, d_model=16, layers=2, heads=2, experts=4, unit_hidden=8,
                 warmup=2, clip=0.2, threads=1, eval_every=1, eval_windows=4, eval_batch=4, test_windows=4,
                 lr=0.05, weight_decay=0.5)  # large enough that the decay shows in the loss
    stream = torch.randint(0, 12, (4000,), generator=torch.Generator().manual_seed(0))
    corpus = CharCorpus([chr(97 + i) for i in range(12)], {"train": stream, "val": stream, "test": stream},
                        {"train": ["A"], "val": ["A"], "test": ["A"]})
    rec = train_run(s.spec(name), 3, s, corpus)
    want = [p["train_loss"] + sum(p["aux"].values()) for p in rec["curve"][1:]]
    got = train_steps(build_routelab_model(s.spec(name), s, corpus.vocab, 3, torch.Generator().manual_seed(20_003)),
                      s, corpus, s.steps, 3)
    assert len(got) == s.steps and got[0] != got[-1]
    assert got == pytest.approx(want, abs=1e-6)
