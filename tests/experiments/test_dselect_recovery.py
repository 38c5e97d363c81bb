"""dselect-recovery (App. C.2.2): the batched trainer against one run at a time, the trainable and
frozen output units, the identifiability check against brute force and scipy, the paper's
binary-S(Z) tuning rule and the report."""

from __future__ import annotations

import dataclasses
from itertools import combinations
from math import comb
from pathlib import Path

import pytest
import torch
from scipy.optimize import minimize
from torch.nn import functional as F

from routelab.experiments.dselect import identifiability as ident
from routelab.experiments.dselect import recovery as rc
from routelab.experiments.dselect.recovery_report import best_settings, counted
from routelab.experiments.kit.store import read_jsonl

torch.set_num_threads(1)

TINY = rc.RecoverySettings(reps=1, epochs=2, checkpoints=(1, 2), lrs=(0.1, 0.003), entropy_regs=(0.0, 0.05),
                           units=("fresh", "generator", "frozen"), inits=("official", "distinct"), n_train=600,
                           n_val=300, batch=128)


def _key(r):
    return (r["gate"], r["unit"], r["init"], r["lr"], r["entropy_reg"])


def test_batched_rows_equal_separate_runs():
    prob = rc.make_problem(3, TINY)
    rows = rc.configs(TINY)
    assert len(rows) == 3 * (2 + 2 * 2 * 2)
    recs = rc.train_rep(rows, 3, TINY, prob, record_traj=True)
    assert len(recs) == 2 * len(rows)
    for epochs in (1, 2):
        one = dataclasses.replace(TINY, epochs=epochs, checkpoints=())
        for c in rows:
            want = rc.train_one(c.gate, c.lr, c.entropy_reg, 3, one, prob, record_traj=False, unit=c.unit,
                                init=c.init or "official")
            got = next(r for r in recs if _key(r) == (c.gate, c.unit, c.init, c.lr, c.entropy_reg)
                       and r["epochs"] == epochs)
            assert got["steps"] == want["steps"]
            torch.testing.assert_close(torch.tensor(got["weights"]), torch.tensor(want["weights"]), atol=2e-5, rtol=0)
            torch.testing.assert_close(torch.tensor(got["unit_w"]), torch.tensor(want["unit_w"]), atol=2e-5, rtol=0)
            assert got["val_loss"] == pytest.approx(want["val_loss"], abs=2e-5)
            for f in ("selected", "recovered", "binary", "binary_step", "selector_picks", "support_changes",
                      "support_changes_second_half"):
                assert got[f] == want[f], (c, epochs, f)


def test_units_frozen_fixed_trained_move():
    s = dataclasses.replace(TINY, checkpoints=(), lrs=(0.1,), entropy_regs=(0.0,), inits=("official",))
    prob = rc.make_problem(0, s)
    recs = rc.train_rep(rc.configs(s), 0, s, prob, record_traj=False)
    gen = [round(v, 6) for v in prob["head_w"].tolist()]
    fresh0, _ = rc.initial_unit("fresh", prob, 0)
    for r in recs:
        if r["unit"] == "frozen":
            assert r["unit_w"] == gen and r["unit_b"] == round(float(prob["head_b"]), 6)
        else:
            start = prob["head_w"] if r["unit"] == "generator" else fresh0
            assert (torch.tensor(r["unit_w"]) - start).abs().max() > 1e-3


def test_set_losses_frozen_unit_is_the_brute_force_loss():
    prob = rc.make_problem(1, dataclasses.replace(TINY, n_train=300))
    e = rc.expert_outputs(prob, prob["x_tr"])
    sets, loss = ident.set_losses(e, prob["y_tr"], prob["head_w"], prob["head_b"], 4, fit_unit=False, chunk=100)
    assert sets.shape == (comb(16, 4), 4) and len({tuple(x) for x in sets.tolist()}) == comb(16, 4)
    for i in (0, 77, 1000, comb(16, 4) - 1):
        mix = e[:, sets[i]].double().mean(1)
        want = F.binary_cross_entropy_with_logits(mix @ prob["head_w"].double() + float(prob["head_b"]),
                                                  prob["y_tr"].double())
        assert float(loss[i]) == pytest.approx(float(want), rel=1e-10)
    rank = ident.true_set_rank(sets, loss, prob["true"])
    true_loss = loss[[tuple(x) == tuple(prob["true"]) for x in sets.tolist()]]
    assert rank == 1 + int((loss < true_loss).sum())


def test_fitted_unit_matches_scipy_and_ranks_the_separable_true_set_first():
    s = dataclasses.replace(TINY, n_train=400)
    prob = rc.make_problem(2, s)
    e = rc.expert_outputs(prob, prob["x_tr"])
    x, y = e.double(), prob["y_tr"].double()
    sets, loss = ident.set_losses(e, prob["y_tr"], prob["head_w"], prob["head_b"], 4, fit_unit=True)
    assert ident.true_set_rank(sets, loss, prob["true"]) == 1  # labels are a linear function of the true mix
    for i in (5, 900):
        feats = x[:, sets[i]].mean(1)

        def objective(theta, feats=feats):
            t = torch.tensor(theta)
            logit = feats @ t[:4] + t[4]
            return float(F.binary_cross_entropy_with_logits(logit, y) + 0.5 * ident.RIDGE * (t[:4] ** 2).sum())

        res = minimize(objective, x0=[0.0] * 5, method="Nelder-Mead",
                       options=dict(xatol=1e-9, fatol=1e-12, maxiter=20_000, maxfev=40_000))
        t = torch.tensor(res.x)
        scipy_loss = float(F.binary_cross_entropy_with_logits(feats @ t[:4] + t[4], y))
        assert float(loss[i]) == pytest.approx(scipy_loss, abs=2e-4)


def test_true_set_rank_counts_strictly_lower():
    sets = torch.tensor(list(combinations(range(5), 2)))
    loss = torch.tensor([0.3, 0.1, 0.5, 0.3, 0.2, 0.9, 0.3, 0.0, 1.0, 0.4], dtype=torch.float64)
    assert ident.true_set_rank(sets, loss, [0, 1]) == 4  # 0.1, 0.2, 0.0 are lower; ties are not
    with pytest.raises(ValueError, match="true"):
        ident.true_set_rank(sets, loss, [0, 9])


def _rec(gate, lr, er, seed, val_loss, binary, recovered=2):
    return {"gate": gate, "unit": "fresh", "init": "official" if gate == "dselect_static" else None, "lr": lr,
            "entropy_reg": er, "epochs": 50, "seed": seed, "val_loss": val_loss, "binary": binary,
            "recovered": recovered}


def test_tuning_rule_keeps_only_settings_binary_in_every_run():
    recs = [_rec("dselect_static", 0.1, 0.0, 0, 0.30, True), _rec("dselect_static", 0.1, 0.0, 1, 0.30, False),
            _rec("dselect_static", 0.01, 0.01, 0, 0.40, True), _rec("dselect_static", 0.01, 0.01, 1, 0.40, True),
            _rec("topk_static", 0.1, 0.0, 0, 0.50, None), _rec("topk_static", 0.01, 0.0, 0, 0.20, None)]
    best = best_settings(recs)
    assert best[("dselect_static", "fresh", "official")][0] == (0.01, 0.01, 50)  # the lower loss is not binary
    assert best[("topk_static", "fresh", None)][0] == (0.01, 0.0, 50)
    assert [r["seed"] for r in counted(recs[:2])] == [0]  # recovery counts only the binary run
    assert len(counted(recs[4:])) == 2


def test_settings_validation():
    with pytest.raises(ValueError, match="units"):
        dataclasses.replace(TINY, units=("trained",))
    with pytest.raises(ValueError, match="inits"):
        dataclasses.replace(TINY, inits=("random",))
    with pytest.raises(ValueError, match="checkpoints"):
        dataclasses.replace(TINY, checkpoints=(3,))


def test_run_writes_report_resumes_and_judges(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    s = dataclasses.replace(TINY, reps=2, identifiability=True, identifiability_fitted=1, n_train=300, n_val=200,
                            quick=True)
    text = rc.run_recovery(tmp_path, s).read_text()
    runs = read_jsonl(tmp_path / "runs.jsonl")
    idents = read_jsonl(tmp_path / "identifiability.jsonl")
    assert len(runs) == 2 * 2 * len(rc.configs(s)) and len(idents) == 2
    assert len({r["commit"] for r in runs + idents}) == 1 and "code of the runs: " in text
    assert idents[0]["fitted_rank"] is not None and idents[1]["fitted_rank"] is None
    for part in ("## Identifiability", "## Chosen settings", "## Claims (QUICK verdicts)", "## Every setting"):
        assert part in text
    claims = text.split("## Claims")[1].split("## ")[0]
    assert claims.count("(quick)**") == 3
    monkeypatch.setattr(rc, "train_rep", lambda *a, **k: pytest.fail("a recorded repetition was trained again"))
    monkeypatch.setattr(rc, "identifiability_record", lambda *a, **k: pytest.fail("identifiability rerun"))
    assert rc.run_recovery(tmp_path, s).read_text().split("Wall time")[1].split("\n", 1)[1] == \
        text.split("Wall time")[1].split("\n", 1)[1]


def test_full_run_after_quick_run_completes_the_fitted_identifiability_check(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch):
    """Review finding B3: the quick form fits the unit on repetition 0 only (``fitted_rank: null`` on the
    others); a full run into its directory took those records as done, so its report covered fewer
    repetitions than planned and no rerun filled them in. Each form now gets (and reports) its own plan."""
    import re

    small = dict(reps=2, epochs=1, checkpoints=(), lrs=(0.1,), entropy_regs=(0.0,), units=("frozen",),
                 inits=("official",), n_train=300, n_val=200, identifiability=True)
    quick = dataclasses.replace(TINY, **small, identifiability_fitted=1, quick=True)
    full = dataclasses.replace(TINY, **small, identifiability_fitted=None)

    def fitted_reps(text: str) -> int:
        (n,) = re.findall(r"unit fitted to each set: the true set ranks 1st in \d+/(\d+) repetitions", text)
        return int(n)

    assert fitted_reps(rc.run_recovery(tmp_path, quick).read_text()) == 1
    assert [r["fitted_rank"] is None for r in read_jsonl(tmp_path / "identifiability.jsonl")] == [False, True]
    text = rc.run_recovery(tmp_path, full).read_text()
    assert fitted_reps(text) == 2  # was 1: repetition 1's quick record counted as done
    idents = read_jsonl(tmp_path / "identifiability.jsonl")
    assert [(r["seed"], r["fitted_rank"] is None) for r in idents] == [(0, False), (1, True), (1, False)]
    assert idents[2]["frozen_rank"] == idents[1]["frozen_rank"]  # the same check, now with the fitted part
    # both forms are now complete: neither trains nor checks again, and each reports its own plan
    monkeypatch.setattr(rc, "train_rep", lambda *a, **k: pytest.fail("a recorded repetition was trained again"))
    monkeypatch.setattr(rc, "identifiability_record", lambda *a, **k: pytest.fail("identifiability rerun"))
    assert fitted_reps(rc.run_recovery(tmp_path, full).read_text()) == 2
    assert fitted_reps(rc.run_recovery(tmp_path, quick).read_text()) == 1  # quick after full: its own plan
    assert len(read_jsonl(tmp_path / "identifiability.jsonl")) == 3
