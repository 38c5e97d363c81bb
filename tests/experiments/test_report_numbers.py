"""The numbers the experiments' reports print, from small synthetic recorded runs (mutation round 6 of the
report code: kit/tables.py, dselect/recovery_report.py, moe_routers/report.py, lm_routers/report.py,
kool_toy/report.py, mae/report.py).

Every expected cell is computed by hand from the records written here: the mean ± s.e. of two seeds
``a, b`` is ``(a + b) / 2 ± |a - b| / 2``; medians, units (%, s, min) and the rows chosen follow the
documented contract of each table. Tables are read back cell by cell (``_table``), so a value in the
wrong column fails as surely as a wrong value.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from routelab.experiments.kit.tables import csv_cell, md_table, md_uncell

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _cells(line: str) -> list[str]:
    """The cells of one markdown table row (an escaped ``\\|`` stays inside its cell)."""
    return [md_uncell(c.strip()) for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]


def _table(text: str, first_header: str, second_header: str | None = None) -> list[list[str]]:
    """The rows (header first) of the markdown table whose header row starts with ``first_header`` (and,
    when given, has ``second_header`` as its second cell)."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("|") and _cells(line)[0] == first_header and (
                second_header is None or _cells(line)[1] == second_header):
            rows = [_cells(line)]
            for row in lines[i + 2:]:
                if not row.startswith("|"):
                    break
                rows.append(_cells(row))
            return rows
    raise AssertionError(f"no table headed {first_header!r} / {second_header!r}")


def _row(table: list[list[str]], *first: str) -> dict[str, str]:
    """The row whose first cells are ``first``, as ``{header: cell}``."""
    for r in table[1:]:
        if tuple(r[:len(first)]) == first:
            assert len(r) == len(table[0]), (table[0], r)
            return dict(zip(table[0], r, strict=True))
    raise AssertionError(f"no row {first!r} in {table}")


# ----------------------------------------------------------------------------- kit/tables.py


def test_md_table_is_one_line_per_row_with_pipes_escaped_and_a_separator_per_column() -> None:
    text = md_table(["a", "b|c"], [["x | y", "1\n 2"], [3, None]])
    assert text.splitlines() == ["| a | b\\|c |", "|---|---|", "| x \\| y | 1 2 |", "| 3 | None |"]
    assert md_table(["a", "b"], [], "---|---:|") == "| a | b |\n|---|---:|"
    assert _cells(text.splitlines()[2]) == ["x | y", "1 2"]
    assert csv_cell(1 / 3) == "0.333333" and csv_cell(123456789.0) == "1.23457e+08"


# ----------------------------------------------------------------------------- dselect/recovery_report.py


def _rec(gate, unit, init, lr, er, seed, *, val_loss, recovered=4, mistakes=0, distinct=4, val_acc=0.9,
         train_loss=0.1, late=0, binary=True, wall=10.0):
    return {"gate": gate, "unit": unit, "init": init, "lr": lr, "entropy_reg": er, "epochs": 10, "seed": seed,
            "recovered": recovered, "mistakes": mistakes, "distinct": distinct, "mass_on_true": 1.0,
            "val_loss": val_loss, "val_acc": val_acc, "train_loss": train_loss, "support_changes": late,
            "support_changes_second_half": late, "binary": binary, "binary_step": 1, "steps": 100,
            "wall_s": wall}


def _recovery_records() -> list[dict]:
    T, D = "topk_static", "dselect_static"
    return [
        # Top-k, fresh unit: setting lr 0.1 has the lower mean val loss (0.6 < 0.85): chosen
        _rec(T, "fresh", None, 0.1, 0.0, 0, val_loss=0.5, recovered=4, mistakes=0, val_acc=0.9, train_loss=0.4,
             late=3, wall=30.0),
        _rec(T, "fresh", None, 0.1, 0.0, 1, val_loss=0.7, recovered=3, mistakes=1, val_acc=0.8, train_loss=0.6,
             late=5, wall=20.0),
        _rec(T, "fresh", None, 0.01, 0.0, 0, val_loss=0.8, recovered=3, mistakes=1, val_acc=0.7, wall=50.0),
        _rec(T, "fresh", None, 0.01, 0.0, 1, val_loss=0.9, recovered=3, mistakes=1, val_acc=0.7, wall=70.0),
        # DSelect-k, fresh unit, paper's init: λ 0.001 binary in both runs (chosen); λ 0.01 binary in one of
        # two, lower val loss (not eligible), its non-binary run does not count towards recovery / mistakes
        _rec(D, "fresh", "official", 0.1, 0.001, 0, val_loss=0.6, recovered=4, mistakes=0, distinct=4,
             val_acc=0.85, late=0),
        _rec(D, "fresh", "official", 0.1, 0.001, 1, val_loss=0.6, recovered=3, mistakes=1, distinct=3,
             val_acc=0.75, late=1),
        _rec(D, "fresh", "official", 0.1, 0.01, 0, val_loss=0.3, recovered=4, mistakes=0, distinct=4,
             val_acc=0.95),
        _rec(D, "fresh", "official", 0.1, 0.01, 1, val_loss=0.3, recovered=1, mistakes=3, distinct=1,
             val_acc=0.5, binary=False),
        # DSelect-k, generator unit: no setting binary in most runs (1 of 2 is not most): the lowest val loss
        _rec(D, "generator", "official", 0.1, 0.01, 0, val_loss=0.3, binary=True),
        _rec(D, "generator", "official", 0.1, 0.01, 1, val_loss=0.3, binary=False),
        _rec(D, "generator", "official", 0.1, 0.1, 0, val_loss=0.2, binary=False),
        _rec(D, "generator", "official", 0.1, 0.1, 1, val_loss=0.2, binary=False),
    ]


@pytest.mark.filterwarnings("ignore:No artists with labels")  # the figure's legend: these records have no trajectory
def test_recovery_report_tables_hold_each_settings_own_numbers(tmp_path: Path) -> None:
    from routelab.experiments.dselect.recovery_report import write_report

    s = SimpleNamespace(quick=False, n_train=100, n_val=50, gamma=1.0, batch=16, lrs=(0.1, 0.01),
                        entropy_regs=(0.001, 0.01, 0.1), eval_epochs=(10,), inits=("official",), reps=2)
    idents = [{"n_sets": 1820, "frozen_rank": rank, "frozen_true_loss": 0.1, "frozen_best_loss": 0.1,
               "frozen_best_true_count": 4, "wall_s": 1.0} for rank in (1, 1, 5)]
    text = write_report(tmp_path, _recovery_records(), s, 3.0, idents).read_text(encoding="utf-8")
    every = _table(text, "gate", "unit")
    top = _row(every, "Top-k (static)", "fresh", "—", "0.1")
    assert (top["runs"], top["recovered (of 4)"], top["all 4"], top["mistakes"]) == ("2", "3.50 ± 0.50", "1/2",
                                                                                     "0.50 ± 0.50")
    assert (top["val accuracy"], top["val loss"], top["support changes (2nd half)"]) == (
        "0.850 ± 0.050", "0.600 ± 0.100", "4.0 ± 1.0")
    assert top[""] == "**chosen**" and _row(every, "Top-k (static)", "fresh", "—", "0.01")[""] == ""
    half = _row(every, "DSelect-k (static)", "fresh", "official", "0.1", "0.01")
    # val accuracy over every run (0.95, 0.5); recovery and mistakes over the binary run only
    assert (half["binary S(Z)"], half["recovered (of 4)"], half["all 4"], half["mistakes"]) == (
        "1/2", "4.00", "1/1", "0.00")
    assert half["val accuracy"] == "0.725 ± 0.225" and half[""] == ""
    assert _row(every, "DSelect-k (static)", "fresh", "official", "0.1", "0.001")[""] == "**chosen**"
    gen = _row(every, "DSelect-k (static)", "generator", "official", "0.1", "0.1")
    assert gen[""] == "**chosen**" and _row(every, "DSelect-k (static)", "generator", "official", "0.1",
                                            "0.01")[""] == ""
    chosen = _table(text, "gate", "output unit")
    assert _row(chosen, "DSelect-k (static)", "trained, started at the generating unit")["rule"] == (
        "no setting with a binary S(Z) in most runs")
    # per repetition the longest run's wall_s (the batched repetition's time): seed 0 50 s, seed 1 70 s
    assert "recorded training wall time 120 s over 2 repetitions" in text
    ident = _row(_table(text, "output unit", "reps"), "frozen generating unit (the earlier setting)")
    assert ident["median rank of the true set"] == "1" and ident["true set ranked 1st"] == "2/3"
    # the best binary-in-half setting over all settings: λ 0.01, 4 of 4 in its one binary run
    assert ("DSelect-k (paper's init, unit fresh) recovers at most 4.00 of 4 on average in any setting binary "
            "in at least half its runs (lr 0.1, λ 0.01, 10 epochs; 1/2 runs binary)") in text


# ----------------------------------------------------------------------------- moe_routers/report.py


def _moe_records() -> list[dict]:
    out = []
    accs = {"switch": (0.90, 0.92), "batchwise": (0.93, 0.93), "base": (0.95, 0.95)}
    for router, (a0, a1) in accs.items():
        for seed, acc in enumerate((a0, a1)):
            r = {"router": router, "seed": seed, "steps": 10, "train_s": 120.0 + 60 * seed, "eval_s": 5.0,
                 "test": {"acc": acc, "proposed_load_cv": 0.2, "load_cv": 0.1, "dropped_fraction": 0.04 + 0.02 * seed,
                          "tokens_dropped": 0.05, "experts_per_token": 1.0},
                 "test_dropless": {"acc": acc + 0.01}, "test_subset": {"acc": 0.90},
                 "test_batch1": {"acc": 0.95 + 0.02 * seed},
                 "train": {"proposed_load_cv": 0.0, "load_cv": 0.0, "dropped_fraction": 0.0,
                           "tokens_dropped": 0.01 + 0.02 * seed, "loss": 0.5, "experts_per_token": 1.0}}
            if router == "batchwise":
                r["batchwise"] = {"acc_batchwise": {"40": 0.95 - 0.01 * seed, "8": 0.90}, "mask_agreement": 0.96,
                                  "acc_threshold_batch1": 0.94, "threshold_experts_per_token": 2.0,
                                  "threshold_load_cv": 0.3, "thresholds": [0.5, 0.25]}
            out.append(r)
    return out


def test_moe_routers_tables_print_the_mean_and_se_over_seeds_in_their_units() -> None:
    from routelab.experiments import moe_routers as mr
    from routelab.experiments.moe_routers.report import render_report, results_csv

    settings = mr.Settings(routers=("switch", "batchwise", "base"), seeds=(0, 1), epochs=1, train_images=400,
                           test_images=200, batch_size=40, d_model=16, d_hidden=16, batch1_images=40,
                           batchwise_eval_batches=(40, 8), log_every=2)
    records = _moe_records()
    text = render_report(settings, records, wall_s=7.0, resumed=0)
    acc = _row(_table(text, "router", "test, batch 40"), "switch")
    assert acc["test, batch 40"] == "91.00 ± 1.00" and acc["test, dropless, batch 40"] == "92.00 ± 1.00"
    assert acc["batch 1 − batch (points)"] == "6.00 ± 1.00"  # batch-1 minus the same images in batches
    assert acc["train s / run"] == "150"  # seconds, the mean of 120 and 180
    load = _row(_table(text, "router", "train CV proposed"), "switch")
    assert load["train images w/o expert %"] == "2.00 ± 1.00" and load["test images w/o expert %"] == "5.00 ± 0.00"
    assert load["test pairs dropped %"] == "5.00 ± 1.00"
    assert "best to worst: base 95.00, batchwise 93.00, switch 91.00 %." in text
    assert "training 900 s, evaluation 30 s in all" in text  # sums over the six runs
    bw = _table(text, "seed", "batchwise mask, batch 40")
    assert bw[0][1:3] == ["batchwise mask, batch 40", "batchwise mask, batch 8"]
    seed1 = _row(bw, "1")
    assert (seed1["batchwise mask, batch 40"], seed1["batchwise mask, batch 8"]) == ("94.00 %", "90.00 %")
    mean = _row(bw, "mean ± s.e.")
    assert mean["batchwise mask, batch 40"] == "94.50 ± 0.50 %" and mean["threshold, batch 40"] == "93.00 ± 0.00 %"
    assert results_csv(records).splitlines()[0].endswith("batchwise.acc_batchwise@8,batchwise.acc_batchwise@40")


# ----------------------------------------------------------------------------- lm_routers/report.py


def _lm_record(router: str, seed: int, *, ppl: float, drop: tuple[float, float], speed: float, share: float) -> dict:
    def layers(scale):
        return [{"proposed_cv": scale * 0.2, "load_cv": scale * 0.05, "dropped": scale * drop[0],
                 "tokens_dropped": 0.0, "proposed_share": None},
                {"proposed_cv": scale * 0.4, "load_cv": scale * 0.07, "dropped": scale * drop[1],
                 "tokens_dropped": 0.0, "proposed_share": None}]
    curve = [{"step": 0, "val_loss": 3.0, "val_ppl": 20.0, "train_s": 0.0, "aux": {}, "layers": layers(9.0)},
             {"step": 5, "val_loss": 2.5, "val_ppl": 12.0, "train_s": 5.0, "aux": {}, "layers": layers(3.0)},
             {"step": 10, "val_loss": 2.0, "val_ppl": 7.5, "train_s": 10.0, "aux": {"a": 0.01},
              "layers": layers(1.0)}]
    r = {"router": router, "seed": seed, "test_ppl": ppl, "final_val_ppl": ppl + 0.5, "curve": curve,
         "time_share": {"routing_of_moe": share, "routing_of_layer": share / 2}, "tokens_per_s": speed,
         "train_s": 10.0 + seed}
    if router == "batchwise":
        r["val_ppl_batchwise_mask"] = ppl + 1.0 + seed
    return r


def test_lm_routers_tables_print_the_last_windows_balance_per_layer_in_percent() -> None:
    from routelab.experiments import lm_routers as lm
    from routelab.experiments.lm_routers.report import render_report, results_csv

    settings = lm.FULL.with_(routers=("top2", "batchwise"), seeds=(0, 1), layers=2)
    records = [_lm_record("top2", 0, ppl=5.0, drop=(0.1, 0.3), speed=100.0, share=0.2),
               _lm_record("top2", 1, ppl=5.2, drop=(0.3, 0.5), speed=120.0, share=0.2),
               _lm_record("batchwise", 0, ppl=4.0, drop=(0.0, 0.0), speed=300.0, share=0.4),
               _lm_record("batchwise", 1, ppl=4.4, drop=(0.0, 0.0), speed=300.0, share=0.4)]
    text = render_report(settings, records, wall_s=1.0)
    top2 = _row(_table(text, "router", "test ppl"), "top2")
    # last logging window, mean over the two layers: dropped (0.1 + 0.3) / 2 and (0.3 + 0.5) / 2
    assert top2["dropped %"] == "30.00 ± 10.00" and top2["kept-load CV"] == "0.060 ± 0.000"
    assert top2["proposed-load CV"] == "0.300 ± 0.000" and top2["val ppl"] == "5.600 ± 0.100"
    assert top2["routing % of MoE time"] == "20.00 ± 0.00" and top2["tokens/s"] == "110 ± 10"
    per_layer = _row(_table(text, "router", "layer 0"), "top2")
    assert (per_layer["layer 0"], per_layer["layer 1"]) == ("0.200 / 20.00", "0.400 / 40.00")
    assert "Test perplexity, best to worst: batchwise 4.200, top2 5.100." in text
    assert "Routing takes 20 % (top2) to 40 % (batchwise)" in text
    assert "with the learned thresholds (causal) 4.700 ± 0.200, with the batchwise mask" in text
    assert "batches of 64 windows (not causal) 5.700 ± 0.700." in text.replace(
        f"batches of {settings.eval_batch} windows", "batches of 64 windows")
    rows = results_csv(records, settings).splitlines()
    head, first = rows[0].split(","), rows[1].split(",")
    assert dict(zip(head, first))["layer1.proposed_cv"] == "0.4" and dict(zip(head, first))["layer1.dropped"] == "0.3"


# ----------------------------------------------------------------------------- kool_toy/report.py


def _kool(config="reinforce", method="sample", tau=1.0, seed=0, **kw) -> dict:
    return {"config": config, "method": method, "tau": tau, "seed": seed, **kw}


def test_kool_toy_importance_weight_table_is_the_median_of_maxima_and_the_mean_of_means() -> None:
    from routelab.experiments.kool_toy.report import iw_markdown

    records = [_kool(seed=s, iw_max=m, iw_mean=a) for s, (m, a) in enumerate(((1.0, 1.0), (2.0, 1.0), (10.0, 4.0)))]
    row = _row(_table(iw_markdown(records, "reinforce"), "method"), "Sample")
    assert row["mean weight"] == "2" and row["max, τ=1"] == "2"


def test_kool_toy_diagnostics_and_collapse_tables_count_per_configuration() -> None:
    from routelab.experiments.kool_toy.report import collapse_markdown, collapse_note, diagnostics_markdown

    records = [_kool(seed=s, params={"a": a}, load=ld, mse=m, argmax_mse=am, mse_ungated=0.5, collapsed=c, success=ok)
               for s, (a, ld, m, am, c, ok) in enumerate(((-2.0, 0.9, 0.01, 0.03, True, True),
                                                          (1.0, 0.2, 0.02, 0.04, False, False),
                                                          (3.0, 0.7, 0.30, 0.05, True, True)))]
    records += [_kool("gating", seed=s, params={"a": 0.0}, load=0.5, mse=0.1, argmax_mse=0.1, mse_ungated=0.1,
                      collapsed=False, success=False) for s in range(2)]
    diag = _row(_table(diagnostics_markdown(records, ["reinforce", "gating"]), "configuration"), "`reinforce`")
    assert (diag["runs"], diag["median abs(a)"], diag["median minority load"]) == ("3", "2.00", "0.20")
    assert (diag["median MSE"], diag["median argmax MSE"], diag["collapsed"]) == ("0.0200", "0.0400", "2")
    col = _row(_table(collapse_markdown(records, ["reinforce", "gating"]), "configuration"), "`reinforce`")
    assert col["τ=1"] == "2/3" and col["all"] == "2/3"
    assert collapse_note(records).startswith("measured: 2 of 2 collapsed reinforce runs and 0 of 0 collapsed gating")


def test_kool_toy_gradient_table_is_the_median_over_seeds_and_the_largest_se() -> None:
    from routelab.experiments.kool_toy.report import gradients_markdown

    keys = ("cos_skip_all", "ratio_skip_all", "cos_skip_router", "ratio_skip_router", "cos_iw_all", "ratio_iw_all")
    rows = [{"tau": 1.0, **{k: v for k in keys}, "cos_skip_all_se": se, "ratio_iw_all_se": se / 2}
            for v, se in ((0.1, 0.01), (0.2, 0.03), (0.9, 0.02))]
    row = _row(_table(gradients_markdown(rows), "τ"), "1")
    assert row["seeds"] == "3" and row["Sample Skip: cosine"] == "0.200" and row["largest MC s.e."] == "0.030"


def test_kool_toy_chunk_walls_keep_seconds_and_success_cells_name_failed_runs() -> None:
    from routelab.experiments.kit.store import failed_record
    from routelab.experiments.kool_toy import claims as cl
    from routelab.experiments.kool_toy.report import _chunk_walls, results_csv, success_markdown

    walls = _chunk_walls([{"chunk": "c", "chunk_wall_s": 5.0}, {"chunk": "old", "chunk_wall_s": 7.5}],
                         [{"chunk": "c", "wall_s": 90.0, "runs": 4, "routelab": "0.1"}])
    assert walls["c"][:2] == (90.0, 4) and walls["old"][0] == 7.5  # seconds, as recorded
    # a chunk without a chunks.jsonl entry counts its own records (review s43: its runs cell said 0)
    assert _chunk_walls([{"chunk": "old", "chunk_wall_s": 7.5}] * 3, [])["old"][:2] == (7.5, 3)
    records = [_kool(seed=s, mse=0.001, argmax_mse=0.001) for s in range(2)]
    records.append(failed_record(_kool(seed=2), "diverged"))
    cell = _row(_table(success_markdown(cl.success_table(records), "reinforce"), "method"), "Sample")["τ=1"]
    assert cell.endswith("2/3 (1 failed)")
    csv_rows = results_csv([_kool(tokens_per_expert=[30, 70])]).splitlines()
    row = dict(zip(csv_rows[0].split(","), csv_rows[1].split(",")))
    assert (row["tokens_expert0"], row["tokens_expert1"]) == ("30", "70")


# ----------------------------------------------------------------------------- mae/report.py


def _mae_run(variant, seed, lr, loss, *, seconds=120.0, dev=None, dim=8) -> dict:
    dev = loss if dev is None else dev
    return {"variant": variant, "seed": seed, "gate_lr": lr, "dim": dim, "test_loss": loss, "test_ppl": math.exp(loss),
            "dev_loss": dev, "dev_ppl": math.exp(dev), "experts": 7, "mode": "base" if variant == "BASE" else "bcd",
            "params": 1000, "gate_params": 10, "steps": {"g": 3, "f": 6, "base": 0, "joint": 0},
            "seconds": seconds, "curve": [{"step": 1, "train_loss": loss + 0.2, "dev_loss": dev + 0.1},
                                          {"step": 2, "train_loss": loss + 0.1, "dev_loss": dev}]}


def _mae_an(variant, seed, lr, *, uniform_ppl, single, mixture, collapsed=False) -> dict:
    return {"name": "model", "variant": variant, "seed": seed, "gate_lr": lr,
            "entropy": {"mean": 1.9, "uniform": math.log(8), "per_layer": [1.9]}, "shares": [[12.5] * 8],
            "top1": {"single": "top", "single_ppl": single, "mixture_ppl": mixture},
            "uniform_gates": {"test_ppl": uniform_ppl}, "collapse": {"top_mass": [0.3], "collapsed": collapsed}}


def test_mae_report_tables_print_each_seeds_run_at_the_chosen_gate_lr(tmp_path: Path) -> None:
    from routelab.experiments.mae.report import write_report

    e = math.exp
    # runs (and analyses) at another gate lr come first: a lookup that ignored the gate lr would find them
    runs = [_mae_run("MAE-7", 0, 30.0, 1.5, dev=2.5, seconds=600.0),  # the other gate lr: a candidate only
            _mae_run("MAE-7", 1, 30.0, 1.5, seconds=6000.0),  # an earlier invocation's lr: not used
            _mae_run("BASE", 0, None, 2.0, seconds=60.0), _mae_run("BASE", 1, None, 2.2, seconds=180.0),
            _mae_run("UNI-MAE-7", 0, None, 2.3), _mae_run("UNI-MAE-7", 1, None, 2.6),
            _mae_run("MAE-7", 0, 1.0, 1.9, dev=1.95), _mae_run("MAE-7", 1, 1.0, 2.1)]
    analyses = [_mae_an("MAE-7", 0, 30.0, uniform_ppl=e(1.6), single=5.0, mixture=4.0, collapsed=True),
                _mae_an("MAE-7", 1, 30.0, uniform_ppl=e(1.6), single=5.0, mixture=4.0, collapsed=True),
                _mae_an("MAE-7", 0, 1.0, uniform_ppl=e(2.1), single=8.0, mixture=7.0),
                _mae_an("MAE-7", 1, 1.0, uniform_ppl=e(2.3), single=9.0, mixture=8.5)]
    ft = [{"method": m, "fraction": f, "best_dev_loss": 2.0, "test_loss_at_best": 2.0, "best_step": 1,
           "updated_params": 5, "windows": 10, "curve": [{"step": 1, "dev_loss": 2.0}], "seconds": 30.0}
          for m, f in (("FTALL", 1.0), ("FTG", 0.5), ("NOFT", 0.0), ("FTALL", 0.5))]
    sched = SimpleNamespace(epochs=1, batches_per_epoch=6, batch=4, lr=1e-3, warmup=1, clip_norm=1.0,
                            g_every_steps=2, g_phase=1)
    s = SimpleNamespace(seeds=(0, 1), dim=8, quick=False, variants=("BASE", "MAE-7", "UNI-MAE-7"), schedule=sched,
                        train_limit=0, layers=1, heads=8, ffn=8, gate_hidden=4, gate_context=2, seq=6,
                        multi_seed=("BASE", "MAE-7", "UNI-MAE-7"), collapse=0.5, pmi_min_count=1, ft_lr=1e-3,
                        scale_dims=())
    windows = {k: torch.zeros(n, 1) for k, n in (("train", 40), ("dev", 5), ("test", 5), ("nt_train", 10),
                                                  ("nt_dev", 3), ("nt_test", 3))}
    corpus = SimpleNamespace(vocab=20, windows=windows)
    text = write_report(tmp_path, s, corpus, runs, analyses, None, ft, 1.0, 90.0).read_text()
    scores = _table(text, "variant", "gate lr")
    mae7 = _row(scores, "MAE-7")
    assert (mae7["gate lr"], mae7["seed 0"], mae7["seed 1"]) == ("1", f"{e(1.9):.2f}", f"{e(2.1):.2f}")
    assert mae7["mean ± s.e."] == f"{(e(1.9) + e(2.1)) / 2:.2f} ± {(e(2.1) - e(1.9)) / 2:.2f}"
    base = _row(scores, "BASE")
    assert base["time per run"] == "2.0 min"  # (60 + 180) s / 2
    # run time: the runs used (the candidates of the gate lr included, not the earlier invocation's run) plus
    # fine-tuning, in minutes
    used_s = 60 + 180 + 4 * 120 + 600 + 4 * 30
    assert "also records 1 runs at a gate lr that an earlier invocation had selected" in text
    assert f"training and fine-tuning took {used_s / 60:.1f} min of recorded epochs" in text
    assert f"ran {90 / 60:.1f} min" in text
    lrs = _table(text, "gate lr", "G steps")
    assert _row(lrs, "1")["chosen"] == "**yes**" and _row(lrs, "30")["chosen"] == ""
    cost = _row(_table(text, "seed", "BASE"), "0")
    assert cost["expert cost"] == f"{100 * (e(0.1) - 1):+.2f}%" and cost["gate gain"] == f"{100 * (e(-0.2) - 1):+.2f}%"
    costs = [2.3 - 2.0, 2.6 - 2.2]  # UNI-MAE-7 - BASE per seed: the mean cost, not the largest
    assert f"is {100 * (e(sum(costs) / 2) - 1):+.2f}% on average over 2 seeds" in text
    top1 = _row(_table(text.split("## Only the top expert")[1], "model", "seed"), "MAE-7 (top)", "1")
    assert top1["increase"] == "+0.50"
    ft_rows = _table(text, "method", "data")
    assert [(r[0], r[1]) for r in ft_rows[1:]] == [("NOFT", "-"), ("FTG", "50%"), ("FTALL", "50%"), ("FTALL", "100%")]
    curves = _table(text, "epoch")
    assert curves[0][1:] == ["BASE train / dev", "MAE-7 train / dev", "UNI-MAE-7 train / dev"]
    assert curves[1][1:] == ["2.200 / 2.100", "2.100 / 2.050", "2.500 / 2.400"]  # epoch 1: each curve's first point
    assert curves[2][1:] == ["2.100 / 2.000", "2.000 / 1.950", "2.400 / 2.300"]


def test_mae_failed_report_prints_training_time_in_minutes(tmp_path: Path) -> None:
    from routelab.experiments.kit.store import failed_record
    from routelab.experiments.mae.report import write_failed_report

    runs = [_mae_run("BASE", 0, None, 2.0, seconds=150.0),
            failed_record({"variant": "MAE-7", "seed": 0, "gate_lr": 1.0}, "diverged")]
    text = write_failed_report(tmp_path, SimpleNamespace(quick=False), runs, 60.0).read_text()
    assert _row(_table(text, "variant", "seed"), "BASE")["training time"] == "2.5 min"


def test_kool_toy_report_counts_failed_runs_as_recorded_and_chunk_time_in_seconds() -> None:
    import routelab.experiments.kool_toy as kt
    from routelab.experiments.kit.store import failed_record
    from routelab.experiments.kool_toy.report import render_report

    settings = kt.Settings(configs=("reinforce",), methods=("sample",), taus=(1.0,), seeds=(0, 1, 2), steps=3,
                           workers=1)
    key = {"config": "reinforce", "method": "sample", "tau": 1.0, "steps": 3}
    records = [{**key, "seed": s, "mse": 0.01, "argmax_mse": 0.01, "mse_ungated": 0.01, "success": True,
                "load": 0.3, "params": {"a": 1.0}, "iw_mean": 1.0, "iw_max": 1.0, "chunk": "reinforce"}
               for s in (0, 1)]
    records.append(failed_record({**key, "seed": 2}, "diverged", 2))
    text = render_report(settings, records, marginals=None, errors=[], wall_s=1.0, n_planned=3,
                         chunks=[{"chunk": "reinforce", "wall_s": 90.0, "runs": 3, "routelab": "0.1"}])
    assert _row(_table(text, "configuration", "signal"), "`reinforce`")["runs recorded"] == "3"
    assert "training recorded in runs.jsonl: 90.0 s over 1 chunks" in text
    assert _row(_table(text, "chunk", "runs"), "`reinforce`")["wall s"] == "90.0"
