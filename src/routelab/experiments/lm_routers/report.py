"""results.csv, the figures, the claims and report.md of the lm-routers experiment, from the run records.

Every comparison of two routers is *paired by seed* (the same seed gives both the same initial
weights and the same batches): the difference ``d_s`` per seed, its mean and standard error. A claim
that one router is better holds when the mean difference lies beyond the 95 % Student-t interval
(``t(0.975, n - 1)`` standard errors for n seeds: a paired t-test at 5 %); "as well as" holds when the
difference is within that interval or in its favour. With one seed there is no
spread to judge against: those claims are *not measured* (the measured text says what the sign alone
would say); the exact-balance claim needs no spread and is judged.
"""

from __future__ import annotations

import csv
import io
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from ...machine import cpu_model
from ..kit.claims import HOLDS, INCONCLUSIVE, NOT_HOLD, NOT_MEASURED, PARTLY, Claim, claims_markdown, count_verdicts
from ..kit.data_stamp import data_label
from ..kit.plots import pyplot, router_bars, save_figure
from ..kit.provenance import software_line
from ..kit.router_sweep import figures_markdown, invocations_markdown, missing_runs_markdown
from ..kit.stats import Stat, beyond_spread, mean_se, spread_bound, spread_note
from ..kit.tables import csv_cell, md_table
from .model import ROUTER_SPECS, Settings

__all__ = ["FIGURES", "claims", "draw_figures", "observations", "paired", "render_report", "results_csv",
           "summary"]

Record = Mapping[str, Any]


# ----------------------------------------------------------------------------- per-run summaries


def _mean(xs: Sequence[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return sum(vals) / len(vals) if vals else None


def summary(record: Record) -> dict[str, Any]:
    """The scalar results of one run: final perplexities, the last logging window's balance (mean over
    layers), the time shares and the throughput."""
    last = record["curve"][-1]
    layers = last["layers"]
    return {
        "router": record["router"], "seed": record["seed"],
        "test_ppl": record["test_ppl"], "test_loss": math.log(record["test_ppl"]),
        "val_ppl": record["final_val_ppl"], "val_loss": math.log(record["final_val_ppl"]),
        "proposed_cv": _mean([layer["proposed_cv"] for layer in layers]),
        "kept_cv": _mean([layer["load_cv"] for layer in layers]),
        "dropped": _mean([layer["dropped"] for layer in layers]),
        "tokens_dropped": _mean([layer["tokens_dropped"] for layer in layers]),
        "aux": sum(last["aux"].values()) if last["aux"] else 0.0,
        "routing_of_moe": record["time_share"]["routing_of_moe"],
        "routing_of_layer": record["time_share"]["routing_of_layer"],
        "tokens_per_s": record["tokens_per_s"], "train_s": record["train_s"],
        "val_ppl_batchwise_mask": record.get("val_ppl_batchwise_mask"),
    }


def _stat(records: Sequence[Record], router: str, field: str) -> Stat:
    return mean_se([summary(r)[field] for r in records if r["router"] == router])


def _routers(records: Sequence[Record], settings: Settings) -> list[str]:
    return [r for r in settings.routers if any(rec["router"] == r for rec in records)]


# ----------------------------------------------------------------------------- csv


CSV_FIELDS: tuple[str, ...] = (
    "router", "seed", "test_ppl", "val_ppl", "proposed_cv", "kept_cv", "dropped", "tokens_dropped", "aux",
    "routing_of_moe", "routing_of_layer", "tokens_per_s", "train_s", "val_ppl_batchwise_mask",
)


def results_csv(records: Sequence[Record], settings: Settings) -> str:
    """One row per run (the curves stay in runs.jsonl); balance columns are the last logging window's,
    means over the layers, then one column per layer."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    per_layer = [f"layer{i}.{f}" for i in range(settings.layers) for f in ("proposed_cv", "load_cv", "dropped")]
    w.writerow([*CSV_FIELDS, *per_layer])
    for r in records:
        s = summary(r)
        layers = r["curve"][-1]["layers"]
        w.writerow([csv_cell(s[f]) for f in CSV_FIELDS]
                   + [csv_cell(layers[i][f]) for i in range(settings.layers) for f in ("proposed_cv", "load_cv",
                                                                                        "dropped")])
    return buf.getvalue()


# ----------------------------------------------------------------------------- paired comparisons


def paired(records: Sequence[Record], a: str, b: str, value: Callable[[Record], float | None]) -> Stat:
    """Mean ± s.e. over the seeds both ``a`` and ``b`` ran of ``value(run of a) - value(run of b)``."""
    by = {(r["router"], r["seed"]): r for r in records}
    seeds = sorted({s for (name, s) in by if name == a} & {s for (name, s) in by if name == b})
    diffs = []
    for s in seeds:
        va, vb = value(by[(a, s)]), value(by[(b, s)])
        if va is not None and vb is not None:
            diffs.append(va - vb)
    return mean_se(diffs)


def _diff(stat: Stat, digits: int = 4, one_sided: bool = False) -> str:
    """``stat``'s mean with the bound its claim judges it by: the two-sided 95 % one, or (``one_sided``,
    the "not worse" claims of :func:`_as_good`) the one-sided 5 % one."""
    if stat.n == 0:
        return "no seed finished for both"
    if stat.se is None:
        return f"{stat.mean:+.{digits}f} (one seed)"
    note = (spread_note(stat, digits=digits, confidence=ONE_SIDED, label="one-sided 5 % t bound") if one_sided
            else spread_note(stat, digits=digits))
    return f"{stat.mean:+.{digits}f} ({note})"


#: A "not worse" claim is refuted by one direction only: A significantly worse than B in a one-sided
#: t-test at 5 % (the upper end of the two-sided 90 % interval, t(0.95, n - 1) s.e.).
ONE_SIDED = 0.90
AS_GOOD_RULE = ("holds: A's loss is not above B's (mean paired difference <= 0); inconclusive: above, but not "
                "significantly (one-sided t-test at 5 %: within t(0.95, n − 1) s.e. over n seeds); does not hold: "
                "significantly above")


def _worse(d: Stat) -> tuple[bool, bool]:
    """``(worse, significantly)`` for the paired difference ``d`` of A's loss minus B's: A's mean loss
    above B's, and beyond the one-sided 5 % bound (:data:`ONE_SIDED`)."""
    return d.mean > 0, d.mean > spread_bound(d, confidence=ONE_SIDED)


def _as_good(d: Stat) -> str:
    """Verdict of "A is as good as B" from the paired difference ``d`` of A's loss minus B's
    (:data:`AS_GOOD_RULE`; not measured when no seed finished for both). Failing to show A worse is
    not evidence that it is as good: a positive difference that is not significant reads partly."""
    if d.n == 0:
        return NOT_MEASURED
    worse, significantly = _worse(d)
    if not worse:
        return HOLDS
    return f"{INCONCLUSIVE} (worse, not significantly)" if not significantly else NOT_HOLD


def _better(sides: Sequence[int | None]) -> str:
    """Verdict of a "better" claim from the sides of its parts' paired differences (:func:`beyond_spread`,
    +1: better beyond the 95 % t interval, -1: worse beyond it, 0: within it), symmetric in the two
    directions: holds: every part better; partly: some better; does not hold: none better and some worse;
    inconclusive: every part within its spread (a lead and an equal deficit read the same)."""
    if any(side is None for side in sides):
        return NOT_MEASURED
    if all(side > 0 for side in sides):
        return HOLDS
    if any(side > 0 for side in sides):
        return PARTLY
    if any(side < 0 for side in sides):
        return NOT_HOLD
    return f"{INCONCLUSIVE} (within the seed spread)"


def _checkpoints(records: Sequence[Record], fractions: Sequence[float]) -> list[int]:
    """The logged steps closest to ``fractions`` of training (distinct, in order)."""
    steps = [p["step"] for p in records[0]["curve"]] if records else []
    out: list[int] = []
    for f in fractions:
        target = f * steps[-1]
        best = min(steps[1:], key=lambda s: abs(s - target))
        if best not in out:
            out.append(best)
    return out


def _val_loss_at(record: Record, step: int) -> float | None:
    """Validation loss at the logged step closest to ``step``."""
    curve = record["curve"]
    best = min(curve, key=lambda p: abs(p["step"] - step))
    return best["val_loss"]


def _val_loss_at_time(record: Record, seconds: float) -> float | None:
    """Validation loss at ``seconds`` of training, linearly interpolated between logged points
    (``None`` beyond the run's end)."""
    curve = record["curve"]
    for p, q in zip(curve, curve[1:]):
        if p["train_s"] <= seconds <= q["train_s"]:
            f = (seconds - p["train_s"]) / max(q["train_s"] - p["train_s"], 1e-12)
            return p["val_loss"] + f * (q["val_loss"] - p["val_loss"])
    return None


def _test_loss(r: Record) -> float:
    return math.log(r["test_ppl"])


def claims(records: Sequence[Record], settings: Settings) -> list[Claim]:
    """The claims of the literature checked on ``records`` (criteria stated with each)."""
    have = {r["router"] for r in records}
    note = " One seed: indicative." if len(settings.seeds) < 2 else ""
    # With several seeds planned, a comparison that failed runs left with fewer than two shared seeds has no
    # spread to judge against: not measured (with one seed planned, the guard at the end says so for all).
    multi = len(settings.seeds) >= 2
    rule_better = ("paired by seed (same initial weights and batches); 'lower' means the mean difference "
                   "lies beyond its 95 % Student-t interval (t(0.975, n − 1) standard errors over n seeds)")
    out: list[Claim] = []

    def missing(cid: str, text: str, paper: str, need: Sequence[str]) -> Claim:
        return Claim(id=cid, text=text, paper=paper, criterion="—",
                     measured=f"not run: {', '.join(n for n in need if n not in have)}", verdict=NOT_MEASURED)

    def as_good_as(cid: str, text: str, paper: str, a: str, b: str, criterion: str) -> None:
        """A claim that router ``a``'s test loss is not above ``b``'s beyond the paired spread."""
        if {a, b} <= have:
            d = paired(records, a, b, _test_loss)
            out.append(Claim(id=cid, text=text, paper=paper, criterion=criterion + note,
                             measured=f"test loss {a} − {b}: {_diff(d, one_sided=True)}",
                             verdict=NOT_MEASURED if multi and d.n < 2 else _as_good(d)))
        else:
            out.append(missing(cid, text, paper, (a, b)))

    # 1. BASE without aux loss matches top-k with its balance loss.
    text = ("A balanced assignment (BASE) matches the perplexity of top-k routing trained with a balancing loss, "
            "without any auxiliary loss.")
    paper = "Lewis et al. 2021 (BASE layers), Sec. 5"
    if {"base", "top1_switch", "top2"} <= have:
        parts, verdicts, spread = [], [], []
        for other in ("top1_switch", "top2"):
            d = paired(records, "base", other, _test_loss)
            spread.append(d.n >= 2)
            verdicts.append(_as_good(d))
            parts.append(f"test loss base − {other}: {_diff(d, one_sided=True)}")
        aux = _stat(records, "base", "aux").mean
        outcomes = [v.split(" (")[0] for v in verdicts]
        if all(v == HOLDS for v in outcomes):
            verdict = HOLDS
        elif all(v == NOT_HOLD for v in outcomes):
            verdict = NOT_HOLD
        elif all(v == INCONCLUSIVE for v in outcomes):
            verdict = f"{INCONCLUSIVE} (above both, not significantly)"
        else:
            verdict = PARTLY
        if multi and not all(spread):  # failed runs left fewer than two shared seeds
            verdict = NOT_MEASURED
        out.append(Claim(id="base-matches-topk", text=text, paper=paper,
                         criterion="BASE's test loss (nats/char) against that of top-1+Switch loss and of top-2, "
                                   "paired by seed (BASE has no aux loss: reported). holds: not above either; does "
                                   "not hold: significantly above both (one-sided t-test at 5 %: beyond "
                                   "t(0.95, n − 1) s.e. over n seeds); inconclusive: above both, not "
                                   "significantly; partly: anything between." + note,
                         measured="; ".join(parts) + f"; BASE aux loss {aux:g}", verdict=verdict))
    else:
        out.append(missing("base-matches-topk", text, paper, ("base", "top1_switch", "top2")))

    # 2. batchwise / expert-choice converges faster than top-2 at equal compute.
    text = ("Balanced batchwise (expert-choice style) routing converges faster than top-2 token choice at equal "
            "compute.")
    paper = ("Shazeer et al. 2017 App. F (strictly balanced gating); the convergence claim is Zhou et al. 2022's for "
             "expert-choice routing (later work, not cited by the four papers)")
    if {"batchwise", "top2"} <= have:
        checks = _checkpoints(records, (0.25, 0.5))
        parts, sides, spread = [], [], []
        for step in checks:
            d = paired(records, "top2", "batchwise", lambda r, s=step: _val_loss_at(r, s))
            spread.append(d.n >= 2)
            sides.append(beyond_spread(d))
            parts.append(f"step {step}: val loss top2 − batchwise {_diff(d)}")
        verdict = _better(sides)
        if multi and not (spread and all(spread)):
            verdict = NOT_MEASURED
        out.append(Claim(id="batchwise-converges-faster", text=text, paper=paper,
                         criterion="at the evaluations closest to a quarter and to half of training (steps "
                                   f"{', '.join(map(str, checks))}), the validation loss of batchwise is lower than "
                                   "top-2's, " + rule_better + ". holds: at each; partly: at some; does not hold: at "
                                   "none, and higher beyond the spread at some; inconclusive: within the spread at "
                                   "each." + note,
                         measured="; ".join(parts), verdict=verdict))
    else:
        out.append(missing("batchwise-converges-faster", text, paper, ("batchwise", "top2")))

    # 3. the noisy gate's load loss evens the load.
    text = "The load (and importance) loss of noisy top-k gating evens the load over the experts."
    paper = "Shazeer et al. 2017, Sec. 4 and App. A"
    if {"noisy_top2", "noisy_top2_noloss"} <= have:
        d = paired(records, "noisy_top2_noloss", "noisy_top2", lambda r: summary(r)["proposed_cv"])
        dd = paired(records, "noisy_top2_noloss", "noisy_top2", lambda r: summary(r)["dropped"])
        cv_with = _stat(records, "noisy_top2", "proposed_cv")
        cv_without = _stat(records, "noisy_top2_noloss", "proposed_cv")
        out.append(Claim(id="noisy-load-loss-evens-load", text=text, paper=paper,
                         criterion="against the same router with both loss coefficients 0, over the last logging "
                                   "window: (a) a lower proposed-load CV, (b) a lower dropped fraction, each "
                                   + rule_better + ". holds: both; partly: one; does not hold: neither, and one "
                                   "higher beyond the spread; inconclusive: both within the spread." + note,
                         measured=f"proposed-load CV with losses {cv_with.fmt(3)}, without {cv_without.fmt(3)}: "
                                  f"difference {_diff(d, 3)}; dropped fraction difference {_diff(dd, 4)}",
                         verdict=NOT_MEASURED if multi and min(d.n, dd.n) < 2 else
                         _better([beyond_spread(d), beyond_spread(dd)])))
    else:
        out.append(missing("noisy-load-loss-evens-load", text, paper, ("noisy_top2", "noisy_top2_noloss")))

    # 4. GM-IW trains as well as top-1 + Switch loss.
    as_good_as("gm-iw-as-good-as-switch",
               "Gumbel-Matching with importance weights (differentiable gating) trains as well as top-1 routing "
               "with the Switch balance loss.", "Kool et al. 2021, Sec. 3.1 and 4", "gm_iw", "top1_switch",
               "GM-IW's test loss against top-1+Switch's, paired by seed. " + AS_GOOD_RULE + ".")

    # 5. Switch (top-1) matches top-2 at equal compute.
    as_good_as("switch-matches-top2", "Top-1 (Switch) routing preserves the quality of top-2 routing.",
               "Fedus et al. 2022 (Switch Transformer), Sec. 2.1", "top1_switch", "top2",
               "at equal expert FLOPs per token (wide experts for top-1), top-1's test loss against top-2's, "
               "paired by seed. " + AS_GOOD_RULE + ".")

    # 6. exact balance of the balanced routers in training.
    text = "Balanced assignment routers give every expert the same number of tokens in every training batch."
    paper = "Lewis et al. 2021; Shazeer et al. 2017 App. F eq. 18; Kool et al. 2021 eq. 4"
    balanced = [r for r in ("base", "batchwise", "gm_iw") if r in have]
    if balanced:
        parts, oks = [], []
        for name in balanced:
            worst_cv = max(layer["load_cv"] for r in records if r["router"] == name for p in r["curve"][1:]
                           for layer in p["layers"])
            worst_drop = max(layer["dropped"] for r in records if r["router"] == name for p in r["curve"][1:]
                             for layer in p["layers"])
            oks.append(worst_cv <= 1e-9 and worst_drop <= 1e-9)
            parts.append(f"{name}: largest kept-load CV {worst_cv:.2g}, largest dropped fraction {worst_drop:.2g}")
        out.append(Claim(id="balanced-routers-exact", text=text, paper=paper,
                         criterion="over every training step of every seed and layer (window means), kept-load CV 0 "
                                   "and nothing dropped (an exact property, so no spread applies). holds: every "
                                   "balanced router; partly: some; does not hold: none.",
                         measured="; ".join(parts),
                         verdict=HOLDS if all(oks) else (PARTLY if any(oks) else NOT_HOLD)))

    # 7. learned thresholds replace the batchwise mask at inference.
    text = "The learned per-expert thresholds approximate the batchwise mask at inference."
    paper = "Shazeer et al. 2017, App. F eq. 19-20"
    bw = [r for r in records if r["router"] == "batchwise" and r.get("val_ppl_batchwise_mask")]
    if bw:
        diffs = mean_se([math.log(r["final_val_ppl"]) - math.log(r["val_ppl_batchwise_mask"]) for r in bw])
        out.append(Claim(id="thresholds-replace-batchwise-mask", text=text, paper=paper,
                         criterion="validation loss with the threshold mask (causal, any batch) against that "
                                   f"with the batchwise mask over evaluation batches of {settings.eval_batch} windows, "
                                   "paired by seed. " + AS_GOOD_RULE + "." + note,
                         measured=f"val loss threshold − batchwise mask: {_diff(diffs, one_sided=True)}",
                         verdict=NOT_MEASURED if multi and diffs.n < 2 else _as_good(diffs)))

    # 8. sparse beats dense at equal wall time.
    text = "At equal training time a sparse MoE (top-2) reaches a lower perplexity than the dense MoE."
    paper = "Shazeer et al. 2017, Sec. 1 and 5; Fedus et al. 2022, Sec. 2"
    if {"dense", "top2"} <= have:
        def at_equal_time(r: Record) -> float | None:
            # both runs at the shorter of their two training times (each interpolated on its own curve): a seed
            # where dense finished first is compared at dense's end, not left out (that left out exactly the
            # seeds that count against the claim; found by review)
            other = "top2" if r["router"] == "dense" else "dense"
            partner = next((x for x in records if x["router"] == other and x["seed"] == r["seed"]), None)
            if partner is None:
                return None
            return _val_loss_at_time(r, min(r["curve"][-1]["train_s"], partner["curve"][-1]["train_s"]))

        d = paired(records, "dense", "top2", at_equal_time)
        steps_d = paired(records, "dense", "top2", lambda r: r["curve"][-1]["val_loss"])
        out.append(Claim(id="sparse-beats-dense-per-time", text=text, paper=paper,
                         criterion="dense's and top-2's validation losses at the shorter of their two training "
                                   "times (each interpolated on its own curve): dense's above top-2's, "
                                   + rule_better.replace("lower", "above") + ": holds; below it beyond the "
                                   "spread: does not hold; within the spread: inconclusive. A wall-clock "
                                   "comparison: the machine's load moves it between identical runs (the other "
                                   "claims are deterministic)." + note,
                         measured=f"val loss dense − top-2 at equal training time: {_diff(d)}; at equal steps "
                                  f"(dense has {settings.experts}x the expert FLOPs): {_diff(steps_d)}",
                         verdict=NOT_MEASURED if (multi and d.n < 2) or d.n == 0 else _better([beyond_spread(d)])))
    if len(settings.seeds) < 2:  # every comparison is judged against the seed spread: none with one seed
        out = [c if c.id == "balanced-routers-exact" or c.verdict == NOT_MEASURED else
               replace(c, measured=f"{c.measured} [the sign alone would say: {c.verdict}]", verdict=NOT_MEASURED)
               for c in out]
    return out


# ----------------------------------------------------------------------------- figures


FIGURES: dict[str, str] = {
    "fig_ppl.png": "validation perplexity against training steps and against training seconds: seed mean (line) "
                   "and min-max over seeds (band)",
    "fig_load.png": "share of the (token, slot) pairs each router proposes to each expert of layer 0 over training "
                    "(first seed); the dashed line is the even share",
    "fig_balance.png": "proposed-load CV and dropped fraction over training, mean over layers and seeds",
    "fig_final.png": "test perplexity, load CV, routing share of the MoE time and throughput: mean ± s.e. over seeds",
}


def _color(i: int) -> Any:
    return pyplot().get_cmap("tab10")(i % 10)


def draw_figures(out_dir: Path, records: Sequence[Record], settings: Settings) -> list[str]:
    """Draw the PNGs into ``out_dir``; returns the file names drawn."""
    import numpy as np

    plt = pyplot()

    routers = _routers(records, settings)
    if not routers:
        return []
    drawn: list[str] = []

    # 1. perplexity curves with the seed spread.
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.6))
    for i, name in enumerate(routers):
        runs = [r for r in records if r["router"] == name]
        steps = [p["step"] for p in runs[0]["curve"]]
        ppl = np.array([[p["val_ppl"] for p in r["curve"]] for r in runs])
        secs = np.array([[p["train_s"] for p in r["curve"]] for r in runs]).mean(0)
        for ax, x in ((axes[0], steps), (axes[1], secs)):
            ax.plot(x[1:], ppl.mean(0)[1:], color=_color(i), label=name, lw=1.3)
            if len(runs) > 1:
                ax.fill_between(x[1:], ppl.min(0)[1:], ppl.max(0)[1:], color=_color(i), alpha=0.18)
    for ax, xl in ((axes[0], "training step"), (axes[1], "training seconds (mean over seeds)")):
        ax.set_xlabel(xl)
        ax.set_ylabel("validation perplexity (per character)")
        ax.set_yscale("log")
        ax.grid(alpha=0.3, which="both")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Validation perplexity (held-out books, dropless, causal eval), {len(settings.seeds)} seed(s)",
                 fontsize=10)
    save_figure(fig, out_dir, "fig_ppl.png", drawn)

    # 2. proposed load per expert over training, layer 0, first seed.
    cols = 3
    rows = math.ceil(len(routers) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.3 * cols, 2.8 * rows), squeeze=False, sharex=True)
    for ax, name in zip(axes.flat, routers):
        rec = next(r for r in records if r["router"] == name)
        pts = [p for p in rec["curve"] if p["layers"][0]["proposed_share"] is not None]
        if pts:
            share = np.array([p["layers"][0]["proposed_share"] for p in pts])
            for e in range(share.shape[1]):
                ax.plot([p["step"] for p in pts], share[:, e], lw=0.9)
            ax.axhline(1.0 / share.shape[1], color="k", ls="--", lw=0.8)
        ax.set_title(f"{name} ({share.shape[1] if pts else '?'} experts)", fontsize=9)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(routers):]:
        ax.axis("off")
    for ax in axes[-1]:
        ax.set_xlabel("training step")
    for ax in axes[:, 0]:
        ax.set_ylabel("share of pairs")
    fig.suptitle("Load per expert over training (layer 0, first seed): share of the proposed (token, slot) pairs",
                 fontsize=10)
    save_figure(fig, out_dir, "fig_load.png", drawn)

    # 3. balance over training.
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.2))
    for i, name in enumerate(routers):
        runs = [r for r in records if r["router"] == name]
        steps = [p["step"] for p in runs[0]["curve"]][1:]
        for ax, field in ((axes[0], "proposed_cv"), (axes[1], "dropped")):
            vals = np.array([[_mean([layer[field] for layer in p["layers"]]) or 0.0 for p in r["curve"][1:]]
                             for r in runs])
            ax.plot(steps, vals.mean(0), color=_color(i), label=name, lw=1.3)
    axes[0].set_ylabel("proposed-load CV")
    axes[1].set_ylabel("fraction of pairs dropped by the capacity")
    for ax in axes:
        ax.set_xlabel("training step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    save_figure(fig, out_dir, "fig_balance.png", drawn)

    # 4. final bars with error bars.
    fig, axes = plt.subplots(1, 4, figsize=(17, 3.8))
    panels = (("test_ppl", "test perplexity"), ("proposed_cv", "proposed-load CV (last window)"),
              ("routing_of_moe", "routing share of MoE forward time"), ("tokens_per_s", "training tokens / s"))
    for ax, (field, title) in zip(axes, panels):
        stats = [_stat(records, r, field) for r in routers]
        router_bars(ax, routers, [s.mean for s in stats], [s.se or 0.0 for s in stats], title,
                    color=[_color(i) for i in range(len(routers))], alpha=0.85, rotation=40)
        if field == "test_ppl":
            lo = min(s.mean for s in stats)
            hi = max(s.mean for s in stats)
            ax.set_ylim(lo - 0.3 * (hi - lo + 1e-3), hi + 0.3 * (hi - lo + 1e-3))
    save_figure(fig, out_dir, "fig_final.png", drawn)
    return drawn


# ----------------------------------------------------------------------------- report


def observations(records: Sequence[Record], settings: Settings) -> list[str]:
    """Sentences computed from the records (every number in them is measured)."""
    routers = _routers(records, settings)
    if not routers:
        return []
    ppl = {r: _stat(records, r, "test_ppl") for r in routers}
    speed = {r: _stat(records, r, "tokens_per_s") for r in routers}
    order = sorted(routers, key=lambda r: ppl[r].mean)
    out = ["- Test perplexity, best to worst: " + ", ".join(f"{r} {ppl[r].mean:.3f}" for r in order) + "."]
    fast = sorted(routers, key=lambda r: -speed[r].mean)
    out.append("- Training throughput, fastest to slowest (tokens/s): "
               + ", ".join(f"{r} {speed[r].mean:.0f}" for r in fast) + ".")
    share = {r: _stat(records, r, "routing_of_moe").mean for r in routers if r != "dense"}
    if share:
        lo, hi = min(share, key=share.get), max(share, key=share.get)
        out.append(f"- Routing takes {100 * share[lo]:.0f} % ({lo}) to {100 * share[hi]:.0f} % ({hi}) of the sparse "
                   f"MoE blocks' forward time: the experts are small here (d_model {settings.d_model}, units of width "
                   f"{settings.unit_hidden}), so this share would shrink as the experts grow.")
    return out


def render_report(settings: Settings, records: Sequence[Record], *, wall_s: float | None = None,
                  figures: Sequence[str] = (), resumed: int = 0, invocations: Sequence[Mapping[str, Any]] = ()) -> str:
    """The markdown report."""
    routers = _routers(records, settings)
    planned = len(settings.routers) * len(settings.seeds)
    cl = claims(records, settings)
    train_total = sum(r["train_s"] for r in records)
    threads = sorted({r.get("threads", settings.threads) for r in records})
    E, width = settings.experts, settings.unit_hidden
    L: list[str] = [
        "# Every router in one language model (routelab lm-routers)" + (" — quick form" if settings.quick else ""),
        "",
        f"**Summary:** {count_verdicts(cl)} (criteria below). Runs recorded: {len(records)} of {planned} planned.",
        "",
    ]
    if settings.quick:
        L += [f"*This is the quick form ({len(settings.seeds)} seed(s), a tiny model, {settings.steps} steps): its "
              "verdicts are judged against its own seed spread but describe a model far smaller and shorter-trained "
              "than the full run's, so some differ; the full run's report is docs/lm-routers/report.md.*", ""]
    if wall_s is not None:
        L.append(f"- Wall time of this invocation: {wall_s:.0f} s ({resumed} runs were already recorded); recorded "
                 f"training time {train_total:.0f} s in all.")
    L += invocations_markdown(invocations)
    device = settings.device if settings.device == "cpu" else f"{settings.device} (GPU)"
    L += [
        f"- Hardware: {cpu_model()} ({os.cpu_count()} logical CPUs), device {device}, "
        f"{', '.join(map(str, threads))} torch thread(s); other jobs may have shared the machine, so times and "
        "tokens/s are indicative (every router ran under the same conditions, one after the other).",
        f"- {software_line(runs=records)}.",
        "",
        "## Setup",
        "",
        "- Data: the World English Bible (Debian `sword-text-web`), characters; each of the 66 books is a "
        "document and goes whole to one split: book index mod 8 = 4 validation, = 0 test, else training. "
        f"Validation: {settings.eval_windows} evenly spaced windows of {settings.seq} characters; test: "
        f"{settings.test_windows} windows. Text of the runs: {data_label(records)}; resuming a directory whose runs "
        "trained on another text (another `pairs_fingerprint`) is refused.",
        f"- Model: transformers `MixtralForCausalLM`, {settings.layers} layers, d_model {settings.d_model}, "
        f"{settings.heads} heads, RMSNorm, rotary attention, SwiGLU experts; every MoE block patched with "
        "`routelab.integrations.hf.patch_moe(model, router, ...)`. Random init from the seed.",
        f"- Equal expert FLOPs per token: the experts are {2 * E} SwiGLU units of width {width}. The k = 2 routers "
        f"route two units per token; the k = 1 routers route one of {E} wide experts of width {2 * width}, wide expert "
        "j being units 2j and 2j+1 side by side (a SwiGLU is a sum over its hidden units, so it computes exactly "
        "their sum): the same parameters, the same initial values, the same expert multiply-adds per token. "
        f"Training capacity factor {settings.capacity_factor:g} for every sparse router (C = ceil(factor · tokens "
        "· k / experts): the same buffer FLOPs in both groups); the dense MoE runs every unit "
        f"({E}x the expert FLOPs).",
        f"- Training: AdamW (lr {settings.lr:g}, betas 0.9/0.95, weight decay {settings.weight_decay:g} on matrices), "
        f"{settings.warmup} warm-up steps then cosine to 10 %, gradient clipping {settings.clip:g}, "
        f"{settings.steps} steps of {settings.batch} windows x {settings.seq} characters "
        f"({settings.steps * settings.batch * settings.seq:,} characters); loss = cross-entropy + "
        "`routelab.aux_loss(model)` (each router's own weighted losses). A seed fixes the initial weights, the "
        "batches and the router noise, the same for every router.",
        f"- Evaluation: every {settings.eval_every} steps, `eval()`, dropless (`eval_capacity_factor=None`) and "
        "causal (every router is token-local at eval; tested in tests/experiments/test_lm_routers.py). The batch-"
        "level routers (batchwise, BASE, Sinkhorn, Gumbel-Matching) do see the whole batch, future characters "
        "included, while training.",
        "- Load: proposed load = (token, slot) pairs a router proposes to each expert before the capacity; CV = "
        "std / mean over the experts; kept-load CV after the capacity; dropped = pairs the capacity removed. "
        "Routing share = forward time of the patched gates (router, capacity, statistics) / forward time of the "
        "MoE blocks (hooks; backward not included).",
        "- Gumbel-Matching (GM-IW) runs with the router's defaults: sampling temperature 1 and no balance loss. "
        "That is not Kool et al.'s recipe for differentiable gating (Sec. 3.1: a load-balancing loss of weight "
        "0.01 or 0.03 and a low temperature; this project's kool-toy reproduction solves no cell without that "
        "loss), so claim 4 tests the router as configured here, not the paper's best setting.",
        "- Comparisons are paired by seed; mean ± standard error over seeds.",
        "",
        "Routers:",
        "",
    ]
    L.append(md_table(["name", "routelab router", "experts per token", "what"],
                      [[s.name, f"`{s.router}`", str(s.k) if s.k else f"all {2 * E}", s.note]
                       for s in ROUTER_SPECS if s.name in routers]))
    L += ["", "## Results", "",
          "Perplexity per character (test: held-out books after training; validation: the last evaluation), "
          "balance over the last logging window (mean over layers), speed:", ""]
    rows = []
    for r in routers:
        rows.append([r, _stat(records, r, "test_ppl").fmt(3), _stat(records, r, "val_ppl").fmt(3),
                     _stat(records, r, "proposed_cv").fmt(3), _stat(records, r, "kept_cv").fmt(3),
                     _stat(records, r, "dropped").fmt(2, scale=100), _stat(records, r, "aux").fmt(4),
                     _stat(records, r, "routing_of_moe").fmt(2, scale=100),
                     _stat(records, r, "routing_of_layer").fmt(2, scale=100),
                     _stat(records, r, "tokens_per_s").fmt(0), _stat(records, r, "train_s").fmt(0)])
    L.append(md_table(["router", "test ppl", "val ppl", "proposed-load CV", "kept-load CV", "dropped %",
                       "aux loss", "routing % of MoE time", "routing % of layer time", "tokens/s", "train s"],
                      rows, "---|" + "---:|" * 10))
    L += ["", "Per layer (last logging window, mean over seeds): proposed-load CV / dropped %:", ""]
    rows = []
    for r in routers:
        runs = [x for x in records if x["router"] == r]
        cells = []
        for i in range(settings.layers):
            cvs = mean_se([x["curve"][-1]["layers"][i]["proposed_cv"] for x in runs])
            drop = mean_se([x["curve"][-1]["layers"][i]["dropped"] for x in runs])
            cells.append(f"{cvs.mean:.3f} / {100 * drop.mean:.2f}")
        rows.append([r, *cells])
    L.append(md_table(["router", *(f"layer {i}" for i in range(settings.layers))], rows))
    obs = observations(records, settings)
    if obs:
        L += ["", "Observations (computed from the records):", "", *obs]
    bw = [x for x in records if x.get("val_ppl_batchwise_mask")]
    if bw:
        thr = mean_se([x["final_val_ppl"] for x in bw]).fmt(3)
        mask = mean_se([x["val_ppl_batchwise_mask"] for x in bw]).fmt(3)
        L += ["", f"Batchwise router at evaluation: validation perplexity with the learned thresholds (causal) {thr}, "
                  f"with the batchwise mask over batches of {settings.eval_batch} windows (not causal) {mask}."]
    L += ["", "## Claims", "",
          "Each verdict follows its stated criterion, computed by the code from the run records; comparisons are "
          "paired by seed and judged against the 95 % Student-t interval of the paired difference (t(0.975, n − 1) "
          "standard errors over n seeds: a paired t-test at the 5 % level)."
          + (" With one seed (quick form) a comparison has no spread to be judged against: it is not measured "
             "(its sign is shown)." if len(settings.seeds) < 2 else ""),
          ""]
    L.append(claims_markdown(cl))
    L += figures_markdown(figures, FIGURES)
    L += missing_runs_markdown(settings.routers, settings.seeds, records)
    L += ["", "Files: `runs.jsonl` (one JSON line per run, with its curves), `results.csv` (one row per run), "
              "`claims.json`"
              + (", `invocations.jsonl` (wall time and machine load of each invocation)" if invocations else "")
              + ".", ""]
    return "\n".join(L)
