"""The report of ``dselect-recovery`` (App. C.2.2): tuning rule, tables, claims, figure, CSV.

Tuning follows the paper: per model (gate, output unit, selector init) the setting (lr, entropy,
epochs) with the lowest mean validation loss, for DSelect-k only among settings whose S(Z) became
binary in every repetition ("we disregard any λ whose corresponding solution does not have a
binary S(Z)"); a DSelect-k run counts towards recovery only if its S(Z) is binary.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..kit.claims import HOLDS, NOT_HOLD, PARTLY, Claim, claims_markdown, write_claims_json
from ..kit.provenance import software_line
from ..kit.stats import mean_se
from ..kit.store import atomic_write_text
from ..kit.tables import md_table
from . import common
from .common import GATE_LABELS, write_csv

__all__ = ["write_report", "best_settings", "counted", "TRAINABLE"]

Setting = tuple[float, float, int]           # (lr, entropy_reg, epochs)
Model = tuple[str, str, str | None]          # (gate, unit, init)

TRAINABLE = ("fresh", "generator")
"""The output units of the paper's setting ("fed into a single logistic unit", trained)."""

UNIT_LABELS = {"fresh": "trained, fresh start", "generator": "trained, started at the generating unit",
               "frozen": "frozen generating unit (earlier setting)"}
INIT_LABELS = {"official": "paper's init", "distinct": "distinct-expert init (routelab option, not the paper)",
               None: "—"}

CSV_COLUMNS = ("gate", "unit", "init", "lr", "entropy_reg", "epochs", "seed", "recovered", "mistakes", "distinct",
               "mass_on_true", "val_loss", "val_acc", "train_loss", "support_changes", "support_changes_second_half",
               "binary", "binary_step", "steps", "wall_s")


def counted(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The runs whose recovery counts: every Top-k run, DSelect-k runs with a binary S(Z)."""
    return [r for r in records if r["gate"] != "dselect_static" or r["binary"]]


def _groups(records: Sequence[dict[str, Any]]) -> dict[Model, dict[Setting, list[dict[str, Any]]]]:
    out: dict[Model, dict[Setting, list[dict[str, Any]]]] = {}
    for r in records:
        out.setdefault((r["gate"], r["unit"], r["init"]), {}).setdefault(
            (r["lr"], r["entropy_reg"], r["epochs"]), []).append(r)
    return out


def best_settings(records: Sequence[dict[str, Any]]) -> dict[Model, tuple[Setting, str]]:
    """Per model, the chosen setting and the rule that chose it ("binary in every run", or the
    fallbacks "binary in most runs" / "no setting binary" when no setting qualifies)."""
    out: dict[Model, tuple[Setting, str]] = {}
    for model, settings in _groups(records).items():
        cands, rule = settings, "lowest validation loss"
        if model[0] == "dselect_static":
            every = {k: g for k, g in settings.items() if all(r["binary"] for r in g)}
            most = {k: g for k, g in settings.items() if sum(bool(r["binary"]) for r in g) * 2 > len(g)}
            cands, rule = ((every, "binary S(Z) in every run") if every else
                           (most, "binary S(Z) in most runs (no setting binary in every run)") if most else
                           (settings, "no setting with a binary S(Z) in most runs"))
        best = min(cands, key=lambda k: (mean_se(r["val_loss"] for r in cands[k]).mean, k))
        out[model] = (best, rule)
    return out


def _stat(values: Sequence[float], digits: int) -> str:
    return mean_se(values).fmt(digits) if values else "—"


def _row_stats(g: Sequence[dict[str, Any]]) -> dict[str, Any]:
    c = counted(g)
    dsel = g[0]["gate"] == "dselect_static"
    return {
        "n": len(g), "counted": len(c),
        "binary": f"{sum(bool(r['binary']) for r in g)}/{len(g)}" if dsel else "—",
        "recovered": [r["recovered"] for r in c], "all4": sum(r["recovered"] == 4 for r in c),
        "mistakes": [r["mistakes"] for r in c],
        "distinct": [r["distinct"] for r in c] if dsel else [],
        "val_acc": [r["val_acc"] for r in g], "val_loss": [r["val_loss"] for r in g],
        "train_loss": [r["train_loss"] for r in g],
        "late": [r["support_changes_second_half"] for r in g],
    }


def _figure(out_dir: Path, records: Sequence[dict[str, Any]], best: dict[Model, tuple[Setting, str]]) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(g, u) for u in TRAINABLE for g in ("topk_static", "dselect_static")
              if (g, u, "official" if g == "dselect_static" else None) in best]
    if not panels:
        return []
    fig, axes = plt.subplots(len(panels) // 2 + len(panels) % 2, 2, figsize=(11, 3.6 * ((len(panels) + 1) // 2)),
                             squeeze=False, sharey=True)
    for ax, (gate, unit) in zip(axes.flat, panels, strict=False):
        init = "official" if gate == "dselect_static" else None
        (lr, er, ep), _ = best[(gate, unit, init)]
        rec = next((r for r in records if (r["gate"], r["unit"], r["init"], r["lr"], r["entropy_reg"]) ==
                    (gate, unit, init, lr, er) and r.get("traj")), None)
        if rec is None:
            continue
        traj = torch.tensor(rec["traj"])
        steps = torch.arange(traj.shape[0]) * rec["traj_every"]
        keep = steps < ep * rec["steps"] // rec["epochs"]          # the chosen number of epochs
        for e in range(traj.shape[1]):
            is_true = e in rec["true"]
            ax.plot(steps[keep], traj[keep, e], lw=1.6 if is_true else 0.8, ls="-" if is_true else "--",
                    label=f"expert {e}{' (true)' if is_true else ''}")
        ax.set_title(f"{GATE_LABELS[gate]}, unit {unit}, lr={lr}" + (f", λ={er}" if gate == "dselect_static" else "")
                     + f", {ep} ep.", fontsize=9)
        ax.set_xlabel("training step")
    axes[0, 0].set_ylabel("expert weight")
    axes[0, -1].legend(fontsize=6, ncol=2)
    fig.suptitle("Expert weights during training, repetition 0, chosen settings (solid: the 4 true experts)")
    fig.tight_layout()
    fig.savefig(out_dir / "fig_expert_weights.png", dpi=110)
    plt.close(fig)
    return ["fig_expert_weights.png"]


def _ident_lines(idents: Sequence[dict[str, Any]], n_train: int) -> list[str]:
    if not idents:
        return ["(not run in this invocation)", ""]
    n_sets = idents[0]["n_sets"]
    rows = []
    for name, label in (("frozen", "frozen generating unit (the earlier setting)"),
                        ("fitted", "unit fitted to each set (the paper's trainable unit)")):
        got = [r for r in idents if r.get(f"{name}_rank") is not None]
        if not got:
            continue
        ranks = [r[f"{name}_rank"] for r in got]
        rows.append([label, len(got), f"{statistics.median(ranks):g}", f"{min(ranks)}–{max(ranks)}",
                     f"{sum(x == 1 for x in ranks)}/{len(got)}",
                     _stat([r[f"{name}_true_loss"] for r in got], 3), _stat([r[f"{name}_best_loss"] for r in got], 3),
                     _stat([r[f"{name}_best_true_count"] for r in got], 2)])
    return [
        f"For each repetition, every one of the {n_sets} sets of 4 of the 16 experts is scored by the training "
        f"loss (binary cross-entropy on the {n_train} training points) of the gate that puts weight 1/4 on each "
        "member. "
        "*Rank* = 1 + the number of sets with a strictly lower loss than the true set. With the frozen unit the "
        "score is the loss as is; with a trainable unit the unit (4 weights + bias) is fitted to each set "
        "(damped Newton, a ridge of 1e-4·|w|²/2 only to keep the optimum finite: the true set's mixture is "
        "linearly separable, so its loss has infimum 0).",
        "",
        md_table(["output unit", "reps", "median rank of the true set", "range", "true set ranked 1st",
                  "true set's loss", "best set's loss", "true experts in the best set"], rows),
        "",
    ]


def write_report(out_dir: Path, records: list[dict[str, Any]], s: Any, wall: float,
                 idents: Sequence[dict[str, Any]] = (), unused: int = 0) -> Path:
    """Tables, claims, figure and CSV from the recorded (finished) runs and identifiability records."""
    best = best_settings(records)
    figs = _figure(out_dir, records, best)
    write_csv(out_dir / "results.csv", records, CSV_COLUMNS)
    groups = _groups(records)
    rows = []
    for model in sorted(groups, key=lambda m: (m[1], m[0], str(m[2]))):
        gate, unit, init = model
        for setting in sorted(groups[model]):
            st = _row_stats(groups[model][setting])
            lr, er, ep = setting
            rows.append([GATE_LABELS[gate], unit, init or "—", lr, er if gate == "dselect_static" else "—", ep,
                         st["n"], st["binary"], _stat(st["recovered"], 2), f"{st['all4']}/{st['counted']}",
                         _stat(st["mistakes"], 2), _stat(st["distinct"], 2), _stat(st["val_acc"], 3),
                         _stat(st["val_loss"], 3), _stat(st["late"], 1),
                         "**chosen**" if best[model][0] == setting else ""])
    head_rows, head = [], {}
    for model in sorted(best, key=lambda m: (m[1] != "fresh", m[1] != "generator", m[0], str(m[2]))):
        setting, rule = best[model]
        g = groups[model][setting]
        st = _row_stats(g)
        head[model] = st
        gate, unit, init = model
        lr, er, ep = setting
        rows_h = [GATE_LABELS[gate], UNIT_LABELS[unit], INIT_LABELS[init],
                  f"lr {lr}" + (f", λ {er}" if gate == "dselect_static" else "") + f", {ep} epochs", rule,
                  st["binary"], _stat(st["recovered"], 2), f"{st['all4']}/{st['counted']}", _stat(st["mistakes"], 2),
                  _stat(st["distinct"], 2), _stat(st["val_acc"], 3), _stat(st["late"], 1)]
        head_rows.append(rows_h)
    n_runs = len(records)
    per_rep: dict[int, float] = {}
    for r in records:  # wall_s = the batched repetition's time until that run's evaluation
        per_rep[r["seed"]] = max(per_rep.get(r["seed"], 0.0), r["wall_s"])
    train_s = sum(per_rep.values())
    lines = [
        "# DSelect-k expert recovery (Hazimeh et al. 2021, App. C.2.2, Fig. C.7–C.8)",
        "",
        ("**QUICK form: fewer repetitions; its verdicts are labelled quick and are indicative only.**" if s.quick
         else "**Full run.**"),
        "",
        f"- Wall time of the last invocation (runs already recorded are not re-run): {wall:.0f} s; {n_runs} finished "
        f"runs. All settings of a repetition train together as one batched model (independent rows); recorded "
        f"training wall time {train_s:.0f} s over {len(per_rep)} repetitions, identifiability check "
        f"{sum(r['wall_s'] for r in idents):.0f} s.",
        f"- {software_line(torch.get_num_threads(), runs=records)}, CPU.",
        "",
        "## Setup",
        "",
        f"- Data per repetition: x ~ N(0, I_10), {s.n_train} training + {s.n_val} validation points; a random static "
        "MoE of 4 experts (ReLU dense, 4 units; weights N(0, 1/10), biases N(0, 0.01)) is averaged and fed to one "
        "logistic unit (weights N(0, 1); bias = minus the median logit, so both labels are equally frequent: the paper "
        "does not give the bias, and with bias 0 the nonnegative ReLU outputs made 9 of the first 20 problems ≥ 99 % "
        "one label, 3 of them a single label); label = 1[logit > 0].",
        "- Model: 16 frozen experts, 4 of them exact copies of the generating ones at random positions; a static gate "
        "with k = 4 (DSelect-k, γ = "
        f"{s.gamma}, or Top-k); the mixture goes through one logistic unit, **trained with the gate** (the paper: "
        "\"the final result is fed into a single logistic unit\"), started fresh (Glorot-uniform weights, zero bias) "
        "or at the generating unit. The frozen generating unit (routelab's earlier setting) is run as a reference.",
        f"- Adam (β = (0.9, 0.999)), batch {s.batch}, binary cross-entropy (+ DSelect-k's entropy regularizer λ·Σ_i "
        "h(r(S(z_i)))). Grid: lr in "
        f"{list(s.lrs)}, λ in {list(s.entropy_regs)}, epochs in {list(s.eval_epochs)} (a run of fewer epochs is the "
        "longer run evaluated at that epoch: same data order, no schedule). Paper: lr in {1e-1, ..., 1e-5}.",
        f"- Selector initialisations: {', '.join(INIT_LABELS[i] for i in s.inits)}. The paper's (official code): "
        "every code logit uniform in ±γ/100, so the 4 selectors start alike. The distinct-expert init starts "
        "selector i at ±γ/4 per bit toward its own expert c_i (4 different random experts), S(z) inside (0, 1).",
        f"- {s.reps} repetitions (new data, experts and initialisation; seeds 0..{s.reps - 1}).",
        "- Tuning (the paper's rule): per model, the setting with the lowest mean validation loss; for DSelect-k only "
        "among settings whose S(Z) became binary in every run. *Recovered* = true experts with nonzero final "
        "weight, counted only over runs with a binary S(Z) for DSelect-k (all runs for Top-k); *mistakes* = selected "
        "experts that are not true; *distinct* = how many different experts the 4 selectors pick (argmax of each "
        "selector); *support changes (2nd half)* = steps in the second half of training at which the set of experts "
        "with nonzero weight changed (Top-k's 'jumps').",
        "",
        "## Identifiability: does the training loss prefer the true experts?",
        "",
        *_ident_lines(idents, s.n_train),
        "## Chosen settings",
        "",
        md_table(["gate", "output unit", "selector init", "chosen setting", "rule", "binary S(Z)", "recovered (of 4)",
                  "all 4 recovered", "mistakes", "distinct picks", "val accuracy", "support changes (2nd half)"],
                 head_rows),
        "",
    ]
    claims = _claims(head, best, s.quick)
    if claims:
        lines += ["## Claims" + (" (QUICK verdicts)" if s.quick else ""), "",
                  "Judged on the paper's setting: trainable output unit (both starts), the paper's selector init, "
                  "the chosen settings.", "", claims_markdown(claims), ""]
    lines += _findings(head, idents, records)
    for f in figs:
        lines += [f"![{f}]({f})", ""]
    lines += [
        "## Every setting",
        "",
        md_table(["gate", "unit", "init", "lr", "entropy", "epochs", "runs", "binary S(Z)", "recovered (of 4)",
                  "all 4", "mistakes", "distinct picks", "val accuracy", "val loss", "support changes (2nd half)", ""],
                 rows),
        "",
        "Per-run results: `results.csv`; raw records (weights, selector picks, output unit, weight trajectories "
        "of repetition 0): `runs.jsonl`; identifiability per repetition: `identifiability.jsonl`."
        + (f" `runs.jsonl` also holds {unused} runs outside this grid, not used here." if unused else ""),
        "",
    ]
    write_claims_json(out_dir, claims, experiment="dselect-recovery", paper=common.PAPER, quick=s.quick)
    return atomic_write_text(out_dir / "report.md", "\n".join(lines))


def _findings(head: dict[Model, dict[str, Any]], idents: Sequence[dict[str, Any]],
              records: Sequence[dict[str, Any]]) -> list[str]:
    """Measured comparisons beside the claims: identifiability, the two selector inits, the units."""

    def m(v: Sequence[float]) -> str:
        return f"{sum(v) / len(v):.2f}" if v else "—"

    out = []
    for name, label in (("frozen", "the frozen generating unit"), ("fitted", "a unit fitted to each set")):
        ranks = [r[f"{name}_rank"] for r in idents if r.get(f"{name}_rank") is not None]
        if ranks:
            out.append(f"- Identifiability with {label}: the true set ranks 1st in {sum(x == 1 for x in ranks)}/"
                       f"{len(ranks)} repetitions (median rank {statistics.median(ranks):g} of "
                       f"{idents[0]['n_sets']}).")
    for unit in ("fresh", "generator", "frozen"):
        t, d, dd = (head.get(("topk_static", unit, None)), head.get(("dselect_static", unit, "official")),
                    head.get(("dselect_static", unit, "distinct")))
        if t is None or d is None:
            continue
        text = (f"- Output unit {UNIT_LABELS[unit]}: Top-k recovers {m(t['recovered'])} of 4 "
                f"({t['all4']}/{t['counted']} runs all 4); DSelect-k with the paper's init {m(d['recovered'])} "
                f"({d['all4']}/{d['counted']} binary runs all 4; binary {d['binary']}; its 4 selectors pick "
                f"{m(d['distinct'])} distinct experts)")
        if dd is not None:
            text += (f"; with the distinct-expert init (routelab option) {m(dd['recovered'])} ({dd['all4']}/"
                     f"{dd['counted']}; binary {dd['binary']}; {m(dd['distinct'])} distinct)")
        out.append(text + ".")
    return (["## Findings", "", *out, *_best_any_setting(records), ""]) if out else []


def _best_any_setting(records: Sequence[dict[str, Any]]) -> list[str]:
    """Robustness of the tuning rule: DSelect-k's (paper's init) highest mean recovery over every
    setting whose S(Z) became binary in at least half the runs, per trainable unit."""
    out = []
    for unit in TRAINABLE:
        settings = _groups(records).get(("dselect_static", unit, "official"), {})
        scored = [(sum(r["recovered"] for r in counted(g)) / len(counted(g)), k, len(counted(g)), len(g))
                  for k, g in settings.items() if counted(g) and len(counted(g)) * 2 >= len(g)]
        if scored:
            rec, (lr, er, ep), nb, n = max(scored)
            out.append(f"- Whatever the tuning: DSelect-k (paper's init, unit {unit}) recovers at most {rec:.2f} "
                       f"of 4 on average in any setting binary in at least half its runs (lr {lr}, λ {er}, {ep} "
                       f"epochs; {nb}/{n} runs binary).")
    return out


def _claims(head: dict[Model, dict[str, Any]], best: dict[Model, tuple[Setting, str]], quick: bool) -> list[Claim]:
    """The paper's three claims, each judged on both trainable units (paper's init)."""
    units = [u for u in TRAINABLE if ("dselect_static", u, "official") in head and ("topk_static", u, None) in head]
    if not units:
        return []
    tag = " (quick)" if quick else ""

    def m(v: Sequence[float]) -> float:
        return sum(v) / len(v) if v else float("nan")

    d = {u: head[("dselect_static", u, "official")] for u in units}
    t = {u: head[("topk_static", u, None)] for u in units}
    full = {u: m(d[u]["recovered"]) >= 3.5 and d[u]["all4"] * 2 >= max(d[u]["counted"], 1) for u in units}
    more = {u: m(d[u]["recovered"]) > m(t[u]["recovered"]) for u in units}
    v1 = HOLDS if all(full.values()) else PARTLY if any(full.values()) or all(more.values()) else NOT_HOLD
    few = {u: m(t[u]["recovered"]) <= 2.0 for u in units}
    v2 = HOLDS if all(few.values()) else PARTLY if any(few.values()) else NOT_HOLD
    osc = {u: m(t[u]["late"]) >= 5 and m(d[u]["late"]) <= 1 for u in units}
    v3 = HOLDS if all(osc.values()) else PARTLY if any(osc.values()) else NOT_HOLD

    def dsel_text(u: str) -> str:
        top = f"Top-k {m(t[u]['recovered']):.2f}"
        if not d[u]["counted"]:
            return f"no run with a binary S(Z) ({top})"
        return (f"{m(d[u]['recovered']):.2f} of 4 (all 4 in {d[u]['all4']}/{d[u]['counted']} binary runs; "
                f"{m(d[u]['distinct']):.2f} distinct picks; {top})")

    def per_unit(f: Any) -> str:
        return "; ".join(f"{u}: {f(u)}" for u in units)

    return [
        Claim(text="DSelect-k recovers all 4 true experts (App. C.2.2: 4 of 4).",
              criterion="per trainable unit: mean recovered ≥ 3.5 and all 4 in ≥ half the counted runs; holds if "
                        "for both units, partly if for one, or if DSelect-k recovers more than Top-k for both",
              measured=per_unit(dsel_text),
              verdict=v1 + tag),
        Claim(text="Top-k recovers few true experts (App. C.2.2: 1 of 4, 3 mistakes).",
              criterion="per trainable unit: mean recovered ≤ 2; holds if for both units, partly if for one",
              measured=per_unit(lambda u: f"{m(t[u]['recovered']):.2f} of 4, mistakes {m(t[u]['mistakes']):.2f}"),
              verdict=v2 + tag),
        Claim(text="Top-k's weights oscillate during training, DSelect-k's change smoothly (Fig. C.7–C.8).",
              criterion="per trainable unit: mean support changes in the 2nd half of training Top-k ≥ 5 and "
                        "DSelect-k ≤ 1; holds if for both units, partly if for one",
              measured=per_unit(lambda u: f"Top-k {m(t[u]['late']):.1f}, DSelect-k {m(d[u]['late']):.1f}"),
              verdict=v3 + tag),
    ]
