"""Sec. 4.2 of Hazimeh et al. (2021): Multi-MNIST and Multi-Fashion (36×36 overlays, two tasks).

Task 1: the class of the top-left item; task 2: the bottom-right item (data:
:func:`routelab.data.make_overlays`). Models as App. D.2: a multi-gate MoE with 8 CNN experts
(conv 5×5, 10 filters, ReLU, max-pool; conv 5×5, 20 filters, ReLU, max-pool; one ReLU dense
layer of 50 units), towers of 3 dense layers (50, 50 ReLU, 10), one gate per task (static
gates, per-example gates on the flattened image); shared bottom = one such CNN. The 8 expert
CNNs run as one grouped convolution.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from routelab.data import DataUnavailable, make_overlays
from routelab.layers import MultiGateMoE, SharedBottom, StackedLinear

from ..kit.claims import (
    HOLDS,
    INCONCLUSIVE,
    NOT_HOLD,
    NOT_MEASURED,
    PARTLY,
    Claim,
    claims_markdown,
    single_seed,
    write_claims_json,
)
from ..kit.divergence import train_or_fail
from ..kit.experiment import Experiment
from ..kit.failed_runs import add_failures_to_report
from ..kit.provenance import CommitStamp, software_line
from ..kit.stats import beyond_spread, mean_se, paired_difference, spread_note
from ..kit.store import (
    append_jsonl_atomic,
    atomic_write_text,
    completed_keys,
    is_failed,
    read_jsonl,
    settings_key,
    split_failed,
)
from ..kit.tables import md_table
from . import common
from .common import (
    GATE_LABELS,
    Timer,
    binary_step_percent,
    experts_per_run,
    log,
    make_gate,
    steps_per_epoch,
    write_csv,
)
from .common import (
    MTL_MODELS as MODELS,
)
from .mtl_train import experts_selected, train_mtl

__all__ = ["EXPERIMENT", "MultiMnistSettings", "FULL", "QUICK", "run_multimnist", "CNNExperts"]

DATASETS = ("multi_mnist", "multi_fashion")
EXPERTS = 8
IMG = 36 * 36

# Table 2 of the paper: accuracy 1, accuracy 2 (%, with s.e.), experts selected.
PAPER_TABLE2 = {
    "multi_mnist": {
        "dselect_static": ("92.56 ± 0.03", "90.98 ± 0.04", "1.7"), "topk_static": ("91.93 ± 0.06", "90.03 ± 0.08", "4"),
        "gumbel_static": ("92.3 ± 0.05", "90.63 ± 0.05", "1.8"),
        "dselect_per_example": ("92.42 ± 0.03", "90.7 ± 0.03", "1.5"),
        "topk_per_example": ("92.27 ± 0.03", "90.45 ± 0.03", "4"), "softmax": ("92.61 ± 0.03", "91.0 ± 0.03", "8"),
        "shared_bottom": ("91.3 ± 0.04", "89.47 ± 0.04", "—")},
    "multi_fashion": {
        "dselect_static": ("83.78 ± 0.05", "83.34 ± 0.05", "1.8"), "topk_static": ("83.44 ± 0.07", "82.66 ± 0.08", "4"),
        "gumbel_static": ("83.66 ± 0.07", "83.28 ± 0.05", "1.5"),
        "dselect_per_example": ("83.69 ± 0.04", "83.13 ± 0.04", "1.5"),
        "topk_per_example": ("83.66 ± 0.04", "83.15 ± 0.04", "4"), "softmax": ("83.48 ± 0.04", "82.81 ± 0.04", "8"),
        "shared_bottom": ("82.05 ± 0.05", "81.37 ± 0.06", "—")},
}


@dataclass(frozen=True)
class MultiMnistSettings:
    """Sweep size and fixed hyperparameters."""

    reps: int
    epochs: int
    n_train: int
    n_test: int
    batch: int = 128
    lr: float = 1e-3
    k: int = 2
    gamma: float = 1.0
    entropy_reg: float = 0.1
    gumbel_reg: float = 1e-3
    quick: bool = False


FULL = MultiMnistSettings(reps=2, epochs=2, n_train=8_000, n_test=2_000)
QUICK = MultiMnistSettings(reps=1, epochs=1, n_train=512, n_test=500, quick=True)


class CNNExperts(nn.Module):
    """n CNNs of App. D.2 as grouped convolutions: ``[B, 1, 36, 36] -> [B, n, 50]``."""

    def __init__(self, num_experts: int, generator: torch.Generator) -> None:
        super().__init__()
        n = self.num_experts = num_experts
        torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=generator)))
        self.conv1 = nn.Conv2d(1, 10 * n, 5)
        self.conv2 = nn.Conv2d(10 * n, 20 * n, 5, groups=n)
        self.dense = StackedLinear(n, 20 * 6 * 6, 50, activation=torch.relu, generator=generator)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.max_pool2d(torch.relu(self.conv1(x)), 2)          # [B, 10n, 16, 16]
        h = nn.functional.max_pool2d(torch.relu(self.conv2(h)), 2)          # [B, 20n, 6, 6]
        return self.dense(h.view(x.shape[0], self.num_experts, 20 * 36))    # [B, n, 50]


class _OneCNN(nn.Module):
    """The shared-bottom CNN: ``[B, 1, 36, 36] -> [B, 50]``."""

    def __init__(self, generator: torch.Generator) -> None:
        super().__init__()
        self.cnn = CNNExperts(1, generator)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.cnn(x)[:, 0]


def _tower() -> nn.Module:
    return nn.Sequential(nn.Linear(50, 50), nn.ReLU(), nn.Linear(50, 50), nn.ReLU(), nn.Linear(50, 10))


def build_model(kind: str, s: MultiMnistSettings, seed: int) -> nn.Module:
    """The App. D.2 model for ``kind`` (a gate name or ``shared_bottom``)."""
    g = torch.Generator().manual_seed(90_000 + seed)
    torch.manual_seed(91_000 + seed)
    if kind == "shared_bottom":
        return SharedBottom(_OneCNN(g), [_tower() for _ in range(2)])
    gates = [make_gate(kind, EXPERTS, k=s.k, input_dim=IMG, seed=seed * 10 + t, gamma=s.gamma,
                       entropy_reg=s.entropy_reg, gumbel_reg=s.gumbel_reg,
                       entropy_reduction="mean") for t in range(2)]  # batch-averaged entropy, as committed
    return MultiGateMoE(CNNExperts(EXPERTS, g), gates, [_tower() for _ in range(2)])


def _data(name: str, seed: int, s: MultiMnistSettings) -> tuple[torch.Tensor, ...]:
    from routelab.data import load_fashion_mnist, load_mnist

    splits = load_mnist() if name == "multi_mnist" else load_fashion_mnist()
    g = torch.Generator().manual_seed(100_000 + seed)
    x_tr, y_tr = make_overlays(splits.train_x, splits.train_y, s.n_train, g)
    x_te, y_te = make_overlays(splits.test_x, splits.test_y, s.n_test, g)
    return x_tr, y_tr, x_te, y_te


def _loss(out: list[torch.Tensor], y: torch.Tensor) -> torch.Tensor:
    return sum(nn.functional.cross_entropy(o, y[:, t]) for t, o in enumerate(out))


def run_multimnist(out_dir: Path, s: MultiMnistSettings) -> Path:
    """Run (or resume) both data sets; write report.md and results.csv.

    A run that diverges is recorded as failed and listed in the report. Raises
    ``DataUnavailable`` when neither data set is installed and no run is recorded yet.
    """
    torch.set_num_threads(1)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "runs.jsonl"
    timer = Timer()
    missing: list[str] = []
    key = settings_key(s)  # a run's record is reused only under the same settings (quick and full apart)
    done = completed_keys(path, ("dataset", "model", "seed", "settings"))
    stamp = CommitStamp("dselect-multimnist")  # the commit on every record, a warning when resuming another's
    recorded = [r for r in read_jsonl(path) if r.get("settings") == key]
    for seed in range(s.reps):
        for name in DATASETS:
            data = None
            for kind in MODELS:
                if (name, kind, seed, key) in done:
                    continue
                if data is None:
                    try:
                        data = _data(name, seed, s)
                    except DataUnavailable as err:
                        missing.append(f"{name}: {err}")
                        break
                stamp.before_training(recorded)
                t = Timer()
                model = build_model(kind, s, seed)

                def train(model=model, name=name, kind=kind, seed=seed, t=t, data=data) -> dict[str, Any]:
                    x_tr, y_tr, x_te, y_te = data
                    info = train_mtl(model, model, _loss, x_tr, y_tr, epochs=s.epochs, batch=s.batch, lr=s.lr,
                                     generator=torch.Generator().manual_seed(110_000 + seed))
                    with torch.no_grad():
                        outs = [model(x_te[i:i + 500]) for i in range(0, s.n_test, 500)]
                    acc = [float((torch.cat([o[tk] for o in outs]).argmax(1) == y_te[:, tk]).float().mean())
                           for tk in range(2)]
                    sel = experts_selected(model, model, [x_te[i:i + 500] for i in range(0, s.n_test, 500)])
                    return {"dataset": name, "model": kind, "seed": seed, "acc1": acc[0], "acc2": acc[1],
                            "experts": sel, **info, "wall_s": t()}

                label = f"dselect-multimnist rep {seed + 1}/{s.reps} {name} {kind}"
                rec = train_or_fail(train, {"dataset": name, "model": kind, "seed": seed},
                                    on_fail=lambda why, label=label: log(f"{label}: FAILED, {why}"))
                append_jsonl_atomic(path, stamp({**rec, "settings": key}))
                if not is_failed(rec):
                    log(f"{label}: acc {rec['acc1']:.3f}/{rec['acc2']:.3f} experts {rec['experts']} "
                        f"{rec['wall_s']:.0f}s")
    everything = read_jsonl(path)
    records = [r for r in everything if r["settings"] == key and r["seed"] < s.reps]
    if missing and not records:  # no data set installed, nothing recorded: the experiment is skipped
        raise DataUnavailable("; ".join(sorted(set(missing))))
    ok, failed = split_failed(records)
    report = write_report(out_dir, ok, s, timer(), sorted(set(missing)))
    if len(everything) > len(records):
        atomic_write_text(report, report.read_text(encoding="utf-8").rstrip("\n") + (
            f"\n\n- runs.jsonl also holds {len(everything) - len(records)} record(s) of other settings or "
            "repetitions (e.g. a quick run's), not used here.\n"))
    return add_failures_to_report(report, failed, len(records), ("dataset", "model", "seed"))


def write_report(out_dir: Path, records: list[dict[str, Any]], s: MultiMnistSettings, wall: float,
                 missing: list[str]) -> Path:
    """Table 2 style tables (routelab next to the paper) and claims."""
    cols = ("dataset", "model", "seed", "acc1", "acc2", "experts", "binary_step", "steps", "wall_s")
    write_csv(out_dir / "results.csv", records, cols)

    def sel(name: str, kind: str) -> list[dict[str, Any]]:
        return [r for r in records if r["dataset"] == name and r["model"] == kind]

    lines = [
        "# DSelect-k on Multi-MNIST and Multi-Fashion (Hazimeh et al. 2021, Sec. 4.2, Table 2)",
        "",
        f"""**{f'QUICK form ({s.n_train} training images, {s.epochs} epoch(s)): a check that the pipeline runs; '
                  'too short to judge the claims (their verdicts read *not measured*).' if s.quick
               else 'Full run (CPU, scaled down to the budget; see Setup).'}**""",
        "",
        "- Wall time of the last invocation (runs already recorded are not re-run): "
        f"{wall:.0f} s (training recorded in runs.jsonl: "
        f"{sum(r['wall_s'] for r in records):.0f} s over {len(records)} runs).",
        f"- {software_line(torch.get_num_threads(), runs=records)}, CPU.",
    ]
    for m in missing:
        lines += [f"- **Data unavailable:** {m}"]
    lines += [
        "",
        "## Setup",
        "",
        "- Data: overlays of two random images (top-left shifted by 4 px, bottom-right by 4 px, 36×36, "
        f"pixel-wise max) from the MNIST / Fashion-MNIST training images ({s.n_train} training examples) "
        f"and test images ({s.n_test} test examples). **Scaled down** from the paper's 100,000 / 20,000 / 20,000; "
        "no validation set, no tuning.",
        "- Model as App. D.2: 8 CNN experts (conv5×5×10, pool, conv5×5×20, pool, one dense ReLU layer of 50), towers "
        "50-50-10; shared bottom = one such CNN with the same towers.",
        f"- Training: Adam lr {s.lr}, batch {s.batch}, {s.epochs} epochs (paper: tuned, 25–100 epochs). "
        f"Fixed: k = {s.k}, γ = {s.gamma}, DSelect-k entropy λ = {s.entropy_reg} "
        f"(per-example gate: averaged over the batch), Gumbel-softmax λ = {s.gumbel_reg} (fixed: the paper picks "
        "the best Gumbel-softmax solution with at most 4 expected nonzeros, App. D.2; no such constraint here); "
        "per-example gates see the flattened image.",
        (f"- {s.reps} repetitions (new overlays and initialisation; paper: 100); mean ± standard error." if s.reps > 1
         else "- **One repetition only** (paper: 100): on the shared 2-core CPU one run of an 8-expert model took "
              "minutes, so there are no standard errors; differences of a few points are within run-to-run noise."),
        "",
    ]
    claims = []
    for name in DATASETS:
        title = "Multi-MNIST" if name == "multi_mnist" else "Multi-Fashion"
        rows = []
        for kind in MODELS:
            rs = sel(name, kind)
            p1, p2, pe = PAPER_TABLE2[name][kind]
            rows.append([GATE_LABELS[kind], len(rs), mean_se(r["acc1"] for r in rs).fmt(2, 100),
                         mean_se(r["acc2"] for r in rs).fmt(2, 100),
                         mean_se(experts_per_run(rs)).fmt(2), p1, p2, pe])
        lines += [f"## {title}", "", md_table(["model", "reps", "accuracy 1 (%)", "accuracy 2 (%)", "experts",
                                                "paper acc 1", "paper acc 2", "paper experts"], rows), ""]
        if not any(sel(name, k) for k in MODELS):
            continue

        def avg(kind: str) -> float:
            return mean_se((r["acc1"] + r["acc2"]) / 2 for r in sel(name, kind)).mean

        needed = ("dselect_static", "topk_static", "gumbel_static", "shared_bottom")
        if any(avg(k) != avg(k) for k in needed):  # nan: some model has no runs
            claims.append(Claim(text=f"{title}: claims", criterion="needs runs of every model",
                                measured="some models not run", verdict=NOT_MEASURED))
            continue

        def by_seed(kind: str) -> dict[int, float]:
            return {r["seed"]: (r["acc1"] + r["acc2"]) / 2 for r in sel(name, kind)}

        def verdict(a: str, b: str) -> tuple[str, str]:
            """("a beats b" verdict, the paired evidence in words). The models of a repetition share its data
            (the same overlays), so a and b are compared by repetition: the mean of the per-repetition
            differences of the mean accuracy, against its 95 % Student-t interval (a paired t-test at 5 %).
            Above it: holds; below it: does not hold; within it: inconclusive (a tie at this seed spread).
            With one repetition the sign decides (labelled by :func:`single_seed`)."""
            d = paired_difference(by_seed(a), by_seed(b))
            side = beyond_spread(d)
            if side is None:
                return NOT_MEASURED, "no repetition measured both"
            evidence = (f"{GATE_LABELS[a]} − {GATE_LABELS[b]} per repetition: "
                        + ", ".join(f"{100 * (by_seed(a)[k] - by_seed(b)[k]):+.2f}"
                                    for k in sorted(by_seed(a).keys() & by_seed(b).keys()))
                        + f" pts, mean {100 * d.mean:+.2f} pts, "
                        + spread_note(d, 100, 3, "repetitions", label="95 % t bound (pts)"))
            if side > 0:
                return HOLDS, evidence
            if side < 0:
                return NOT_HOLD, evidence
            return f"{INCONCLUSIVE} (within the 95 % t interval of the paired difference)", evidence

        paired_rule = ("; paired by repetition (the models of a repetition share its data): the mean of the "
                       "per-repetition differences beyond its 95 % Student-t interval (t(0.975, n − 1) s.e. over n "
                       "repetitions, a paired t-test at 5 %), above it: holds, below it: does not hold, within it: "
                       "inconclusive")

        statics = ("dselect_static", "topk_static", "gumbel_static")
        best_static = max(statics, key=avg)
        runner_up = max((k for k in statics if k != "dselect_static"), key=avg)
        best, best_evidence = verdict("dselect_static", runner_up)
        claims.append(Claim(
            text=f"{title}: static DSelect-k has the best mean accuracy of the static gates.",
            criterion="mean accuracy (of the two tasks) of DSelect-k (static) against the best other static gate "
                      "by mean" + paired_rule,
            measured=f"best static: {GATE_LABELS[best_static]} ({100 * avg(best_static):.2f} %; DSelect-k "
                     f"{100 * avg('dselect_static'):.2f} %, Top-k {100 * avg('topk_static'):.2f} %, Gumbel "
                     f"{100 * avg('gumbel_static'):.2f} %); {best_evidence}",
            verdict=best))
        beats, beats_evidence = verdict("dselect_static", "shared_bottom")
        claims.append(Claim(text=f"{title}: DSelect-k (static) beats the shared bottom.",
                            criterion="mean accuracy (of the two tasks) of DSelect-k (static) against the shared "
                                      "bottom" + paired_rule,
                            measured=f"{100 * avg('dselect_static'):.2f} % vs {100 * avg('shared_bottom'):.2f} %; "
                                     f"{beats_evidence}",
                            verdict=beats))
        e = experts_per_run(sel(name, "dselect_static"))
        me = sum(e) / len(e) if e else float("nan")
        claims.append(Claim(text=f"{title}: DSelect-k (static) uses fewer experts than Top-k (paper: 1.7–1.8 vs 4).",
                            criterion=f"mean experts < k = {s.k} (Top-k uses exactly k here): holds; = k: partly",
                            measured=f"{me:.2f}", verdict=HOLDS if me < s.k else (PARTLY if me == s.k else NOT_HOLD)))
    claims = _too_short_to_judge(single_seed(claims, s.reps), s)  # one repetition: the sign decides, labelled
    bin_rows = []
    for name in DATASETS:
        for kind in ("dselect_static", "dselect_per_example"):
            rs = sel(name, kind)
            if rs:
                fr = binary_step_percent(rs)
                bin_rows.append([name, GATE_LABELS[kind], f"{len(fr)}/{len(rs)}", mean_se(fr).fmt(1),
                                 rs[0]["steps"]])
    if bin_rows:
        lines += ["## DSelect-k convergence (Table C.4): runs whose S(Z) became binary, and when", "",
                  md_table(["data", "gate", "binary", "% of steps until binary", "training steps"], bin_rows), "",
                  "Paper (Table C.4, after tuning and 25–100 epochs): 42.33 % (Multi-MNIST) and 80.02 % "
                  "(Multi-Fashion) of the steps. A static DSelect-k gate that is not binary yet weighs all 8 "
                  "experts, which is why its 'experts' column reads 8.", ""]
    if claims:
        lines += ["## Claims", "", claims_markdown(claims), ""]
    lines += ["Paper's k was tuned in {2, 4} (Top-k used 4); here k = 2 for every sparse gate, so 'experts' of Top-k "
              "is 2 by construction.", ""]
    write_claims_json(out_dir, claims, experiment="dselect-multimnist", paper=common.PAPER, quick=s.quick)
    return atomic_write_text(out_dir / "report.md", "\n".join(lines))


def _too_short_to_judge(claims: list[Claim], s: MultiMnistSettings) -> list[Claim]:
    """A quick form that trains fewer steps than the full run judges nothing: its claims are *not measured*.

    One full-length run of an 8-expert model takes about 40 s on one core of this project's 2-core
    machine, and the claims compare means against their standard errors (two repetitions at least),
    so a quick form at the full run's length does not fit ``make run``'s budget; the quick form is
    a check that the pipeline runs, and its numbers are shown, not judged.
    """
    steps, full_steps = (x.epochs * steps_per_epoch(x.n_train, x.batch) for x in (s, FULL))
    if not s.quick or steps >= full_steps:
        return claims
    why = f"{NOT_MEASURED} (quick form: {steps} of the full run's {full_steps} training steps)"
    return [replace(c, verdict=why) for c in claims]


EXPERIMENT = Experiment(
    "dselect-multimnist",
    "Hazimeh et al. 2021 Sec. 4.2: Multi-MNIST and Multi-Fashion (Table 2)",
    run_multimnist,
    FULL,
    QUICK,
    quick_seconds=38,  # measured 2026-11-25 on this project's 2-core machine
)
"""The registered experiment (``routelab reproduce dselect-multimnist``)."""
