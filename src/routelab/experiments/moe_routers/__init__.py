"""MoE routers on MNIST: ``routelab reproduce moe-routers [--quick] [--out DIR]``.

A small MoE classifier (tokens = images, one residual MoE layer of 8 experts) is trained on
real MNIST with every router of :mod:`routelab.routers`, each through ``MoE(..., router=name)``,
over a few seeds. Measured per router: test accuracy, the coefficient of variation of the expert
load, the fraction of (token, expert) pairs dropped by the capacity and of images left with no
expert, at training and at test; for batchwise gating (Shazeer et al. 2017, App. F) the
accuracy with the batchwise mask at inference (over batches of several sizes) against the
learned threshold mask with batch size 1, and how often the two masks agree. The report checks
the papers' claims on balance (App. F eq. 18-20; Kool et al. 2021 Sec. 2.2-2.3 and Sec. 4).

Layout: :mod:`.model` (data, model, one run, evaluation), :mod:`.report` (CSV, figures,
report.md), here the registered ``EXPERIMENT`` and :func:`run_sweep` (one JSON line per
finished (router, seed) run in ``DIR/runs.jsonl``; a rerun skips recorded runs).
"""

from __future__ import annotations

from pathlib import Path

from ..kit.claims import write_claims_json
from ..kit.experiment import Experiment
from ..kit.failed_runs import with_failures_section
from ..kit.router_sweep import recorded_runs, train_router_seeds
from ..kit.store import atomic_write_text
from .model import ROUTER_SPECS, MnistMoE, RouterSpec, Settings, evaluate, prepare_data, train_run
from .report import claims, draw_figures, render_report, results_csv

__all__ = ["FULL", "QUICK", "ROUTER_SPECS", "MnistMoE", "EXPERIMENT", "RouterSpec", "Settings", "evaluate",
           "run_sweep", "train_run", "write_outputs"]

#: The full sweep (~10 min on one unloaded core of the 2-core AMD EPYC machine).
FULL = Settings()
#: The quick form run by ``make run``: the routers the claims compare, trained exactly as the full run's
#: seed 0 (all 60k images, 3 epochs: shorter training drops more pairs under top-1 and moves the
#: Sinkhorn-vs-Switch verdict), evaluated on fewer test images. About 1.5 minutes on an unloaded core.
QUICK = Settings(routers=("switch", "batchwise", "base", "sinkhorn", "gumbel_matching"), seeds=(0,),
                 test_images=2000, batch1_images=200, batchwise_eval_batches=(200, 8), quick=True)


def _settings_key(settings: Settings) -> dict:
    """The settings that change a run's result (records of other settings are not reused)."""
    return {"epochs": settings.epochs, "train_images": settings.train_images, "test_images": settings.test_images,
            "batch_size": settings.batch_size, "d_model": settings.d_model, "d_hidden": settings.d_hidden,
            "num_experts": settings.num_experts, "capacity_factor": settings.capacity_factor, "lr": settings.lr,
            "batch1_images": settings.batch1_images,
            "batchwise_eval_batches": list(settings.batchwise_eval_batches)}


def run_sweep(out_dir: Path, settings: Settings, *, figures: bool = True, progress: bool = True) -> Path:
    """Train every (router, seed) run not yet in ``out_dir/runs.jsonl``, then write the outputs.

    Args:
        out_dir: where runs.jsonl, results.csv, the figures and report.md go.
        settings: the sweep.
        figures: draw the PNGs (tests switch them off).
        progress: print one line per epoch and per finished run.

    Returns:
        ``out_dir / "report.md"``.
    """
    settings.validate()
    done = train_router_seeds(
        "moe-routers", out_dir, key=_settings_key(settings), routers=settings.routers, seeds=settings.seeds,
        threads=settings.threads, load_data=lambda: prepare_data(settings),
        train=lambda router, seed, data, say: train_run(settings.spec(router), seed, settings, data, progress=say),
        summary=lambda r: (f"test acc {r['test']['acc']:.4f}, train load CV {r['train']['load_cv']:.3f}, "
                           f"{r['train_s']:.0f} s train + {r['eval_s']:.0f} s eval"),
        progress=progress)
    return write_outputs(out_dir, settings, wall_s=done.wall_s, figures=figures, resumed=done.resumed)


def write_outputs(out_dir: Path, settings: Settings, *, wall_s: float | None = None, figures: bool = True,
                  resumed: int = 0) -> Path:
    """Write results.csv, the figures and report.md from the records of ``settings`` in runs.jsonl.

    Failed runs (diverged) are left out of the CSV, the figures and the statistics, and listed
    with their reasons in the report."""
    key = _settings_key(settings)
    runs = recorded_runs(out_dir, key=key, routers=settings.routers, seeds=settings.seeds)
    records, failed, total, invocations = runs.ok, runs.failed, runs.total, runs.invocations
    atomic_write_text(out_dir / "results.csv", results_csv(records))
    figure_files = draw_figures(out_dir, records, settings) if figures else []
    text = render_report(settings, records, wall_s=wall_s, figures=figure_files, resumed=resumed,
                         invocations=invocations)
    text = with_failures_section(text, failed, total, ("router", "seed"))
    write_claims_json(out_dir, claims(records, settings), experiment="moe-routers",
                      paper="Shazeer et al. 2017; Kool et al. 2021", quick=settings.quick)
    return atomic_write_text(out_dir / "report.md", text)


EXPERIMENT = Experiment(
    "moe-routers",
    ("MoE routers on MNIST: accuracy, load balance and dropped tokens of every routelab router; "
     "batchwise vs threshold masks at inference (Shazeer et al. 2017, App. F)."
    ),
    run_sweep,
    FULL,
    QUICK,
    quick_seconds=26,  # measured 2026-11-25 on this project's 2-core machine
)
"""The registered experiment (``routelab reproduce moe-routers``)."""
