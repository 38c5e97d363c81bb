"""The figures of the toy experiment (Fig. 2a-c, Fig. 3 of the paper, balance losses, importance
weights, Sinkhorn vs Gumbel-Matching marginals), drawn with matplotlib's object API (no pyplot
state, no display needed)."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch

from ...estimators import METHODS
from .claims import METHOD_LABELS
from .model import SUCCESS_MSE, make_data, true_function

__all__ = ["FIGURES", "draw_figures"]

YLIM = (3e-3, 3.0)  # MSE axis of every panel (values outside are clipped at the frame)

#: file name of every figure in the output directory
FIGURES = {
    "data": "fig2a_data.png",
    "reinforce": "fig2b_reinforce.png",
    "gating": "fig2c_gating.png",
    "appendix": "fig3_appendix.png",
    "balance": "fig_balance.png",
    "iw": "fig_importance_weights.png",
    "marginals": "fig_marginals.png",
    "curves": "fig_training_curves.png",
}


_STYLE = {
    "sample": ("tab:blue", "-", "o"),
    "sample_skip": ("tab:orange", "-", "s"),
    "sample_skip_iw": ("tab:green", "-", "^"),
    "gumbel_matching": ("tab:red", "--", "v"),
    "gumbel_matching_iw": ("tab:purple", "--", "D"),
    "gumbel_matching_sh": ("tab:brown", "--", "P"),
}


def _figure(nrows: int = 1, ncols: int = 1, size: tuple[float, float] = (5.0, 3.6)):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(size[0] * ncols, size[1] * nrows), constrained_layout=True)
    axes = fig.subplots(nrows, ncols, squeeze=False)
    return fig, axes


def plot_data(path, seed: int = 0) -> None:
    """Fig. 2(a): the data of one seed and the true function."""
    fig, axes = _figure()
    ax = axes[0][0]
    x, y = make_data(seed)
    ax.scatter(x.numpy(), y.numpy(), s=12, color="tab:blue", label=f"data (seed {seed}, n={len(x)})")
    # two pieces, so that no line is drawn across the jump at x = 0.5
    left = torch.linspace(-1.0, 0.5, 201)[:-1]
    right = torch.linspace(0.5, 1.0, 101)
    ax.plot(left.numpy(), true_function(left).numpy(), color="black", lw=1.5, label="true function")
    ax.plot(right.numpy(), true_function(right).numpy(), color="black", lw=1.5)
    ax.set_xlabel("x")
    ax.set_ylabel("y")
    ax.set_title("Toy data (Fig. 2a)")
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=110)


def _panel(ax, records: Sequence[Mapping], config: str, title: str, legend: bool = True) -> None:
    by: dict[tuple[str, float], list[float]] = defaultdict(list)
    for r in records:
        if r["config"] == config:
            by[(r["method"], float(r["tau"]))].append(float(r["mse"]))
    methods = [m for m in METHODS if any(k[0] == m for k in by)]
    for m in methods:
        taus = sorted(t for mm, t in by if mm == m)
        vals = [np.array(by[(m, t)]) for t in taus]
        med = [np.nanmedian(v) for v in vals]
        lo = [np.nanpercentile(v, 25) for v in vals]
        hi = [np.nanpercentile(v, 75) for v in vals]
        color, ls, marker = _STYLE[m]
        ax.plot(taus, med, color=color, ls=ls, marker=marker, ms=4, label=METHOD_LABELS[m])
        ax.fill_between(taus, lo, hi, color=color, alpha=0.12)
    ax.axhline(SUCCESS_MSE, color="black", ls="--", lw=1)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("temperature τ")
    ax.set_ylabel("final MSE")
    ax.set_ylim(*YLIM)
    ax.set_title(title, fontsize=9)
    if not methods:
        ax.text(0.5, 0.5, "not run", ha="center", va="center", transform=ax.transAxes)
    elif legend:
        ax.legend(fontsize=7)


def plot_config(path, records: Sequence[Mapping], config: str, title: str) -> None:
    """Fig. 2(b)/(c): final MSE vs tau, median over seeds with the inter-quartile band."""
    fig, axes = _figure()
    _panel(axes[0][0], records, config, title)
    fig.savefig(path, dpi=110)


def plot_grid(path, records: Sequence[Mapping], grid: Sequence[Sequence[tuple[str, str]]], suptitle: str) -> None:
    """A grid of MSE-vs-tau panels, ``grid[row][col] = (config, title)``."""
    nrows, ncols = len(grid), max(len(r) for r in grid)
    fig, axes = _figure(nrows, ncols, size=(4.2, 3.3))
    for i, row in enumerate(grid):
        for j in range(ncols):
            if j < len(row):
                _panel(axes[i][j], records, row[j][0], row[j][1], legend=(i == 0 and j == 0))
            else:
                axes[i][j].axis("off")
    fig.suptitle(suptitle)
    fig.savefig(path, dpi=110)


def plot_importance_weights(path, records: Sequence[Mapping], config: str = "reinforce") -> None:
    """Median (over seeds) of the largest importance weight seen in training, vs tau."""
    fig, axes = _figure()
    ax = axes[0][0]
    by: dict[tuple[str, float], list[float]] = defaultdict(list)
    for r in records:
        if r["config"] == config:
            by[(r["method"], float(r["tau"]))].append(float(r["iw_max"]))
    for m in METHODS:
        taus = sorted(t for mm, t in by if mm == m)
        if not taus:
            continue
        color, ls, marker = _STYLE[m]
        ax.plot(taus, [np.median(by[(m, t)]) for t in taus], color=color, ls=ls, marker=marker, ms=4,
                label=METHOD_LABELS[m])
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("temperature τ")
    ax.set_ylabel("largest importance weight in training")
    ax.set_title(f"Importance weights ({config}), median over seeds", fontsize=9)
    ax.legend(fontsize=7)
    fig.savefig(path, dpi=110)


def plot_curves(path, records: Sequence[Mapping], configs: Sequence[tuple[str, str]]) -> None:
    """Fraction of runs with MSE < 0.02 during training, per method (all temperatures pooled).

    Each run's ``mse_curve`` is ``[(step, mse), ...]``; the fraction at a step is over the runs that
    recorded that step (runs of different lengths or evaluation intervals pool where they meet)."""
    fig, axes = _figure(1, len(configs), size=(4.6, 3.4))
    for ax, (config, title) in zip(axes[0], configs):
        for m in METHODS:
            curves = [r["mse_curve"] for r in records
                      if r["config"] == config and r["method"] == m and r.get("mse_curve")]
            if not curves:
                continue
            at_step: dict[int, list[bool]] = {}
            for curve in curves:
                for step, mse in curve:
                    at_step.setdefault(step, []).append(mse < SUCCESS_MSE)
            steps = sorted(at_step)
            frac = [np.mean(at_step[step]) for step in steps]
            color, ls, marker = _STYLE[m]
            ax.plot(steps, frac, color=color, ls=ls, marker=marker, ms=3, label=METHOD_LABELS[m])
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("training step")
        ax.set_ylabel("fraction of runs with MSE < 0.02")
        ax.set_title(f"{title} (all τ)", fontsize=9)
    for ax in axes[0]:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
            break
    fig.savefig(path, dpi=110)


def plot_marginals(path, marginals: Sequence[Mapping]) -> None:
    """Sinkhorn vs Gumbel-Matching marginals: |difference| against n."""
    fig, axes = _figure()
    ax = axes[0][0]
    ns = [r["n"] for r in marginals]
    ax.errorbar(ns, [r["max_abs_diff"] for r in marginals], yerr=[r["se_of_max"] for r in marginals],
                marker="o", capsize=3, label="max |GM − Sinkhorn|")
    ax.errorbar(ns, [r["mean_abs_diff"] for r in marginals],
                yerr=[r["mean_se"] / math.sqrt(max(1, r["n"] * r["matrices"])) for r in marginals],
                marker="s", capsize=3, label="mean |GM − Sinkhorn|")
    ax.plot(ns, [r["mean_abs_diff_unbalanced"] for r in marginals], marker="^", ls=":", color="gray",
            label="mean |GM − softmax| (no balancing)")
    ax.plot(ns, [r["noise_floor"] for r in marginals], ls="--", color="black", lw=1,
            label="Monte Carlo noise floor of the mean")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("n (tokens), k = 2, capacity n/2")
    ax.set_ylabel("absolute difference of marginals")
    ax.set_title("Sinkhorn vs Gumbel-Matching marginals (Sec. 2.3)", fontsize=9)
    ax.legend(fontsize=7)
    fig.savefig(path, dpi=110)


def draw_figures(out_dir: Path, records: Sequence[Mapping], marginals: Sequence[Mapping] | None) -> None:
    """Draw every figure of :data:`FIGURES` into ``out_dir`` (the marginals one only if given)."""
    plot_data(out_dir / FIGURES["data"])
    plot_config(out_dir / FIGURES["reinforce"], records, "reinforce", "REINFORCE, no balance loss (Fig. 2b)")
    plot_config(out_dir / FIGURES["gating"], records, "gating", "Differentiable gating, balance loss 0.01 (Fig. 2c)")
    plot_grid(out_dir / FIGURES["appendix"], records, [
        [("reinforce", "REINFORCE"), ("reinforce_sinkhorn", "REINFORCE + Sinkhorn"),
         ("reinforce_no_iw", "REINFORCE, no IW")],
        [("gating", "gating (0.01)"), ("gating_sinkhorn", "gating (0.01) + Sinkhorn"),
         ("gating_no_iw", "gating (0.01), no IW")],
    ], "Fig. 3: REINFORCE (top) and gating (bottom); plain / Sinkhorn / no importance weights")
    plot_grid(out_dir / FIGURES["balance"], records, [
        [("gating_balance0", "gating, balance 0"), ("gating", "gating, balance 0.01"),
         ("gating_balance0.03", "gating, balance 0.03")],
        [("gating_balance0.1", "gating, balance 0.1"), ("reinforce", "REINFORCE, balance 0"),
         ("reinforce_balance0.1", "REINFORCE, balance 0.1")],
    ], "Balance-loss weights")
    plot_importance_weights(out_dir / FIGURES["iw"], records)
    if marginals:
        plot_marginals(out_dir / FIGURES["marginals"], marginals)
    if any(r.get("mse_curve") for r in records):
        plot_curves(out_dir / FIGURES["curves"], records,
                    [("reinforce", "REINFORCE"), ("gating", "gating (0.01)"), ("gating_sinkhorn", "gating + Sinkhorn")])
