"""Reproductions of Hazimeh et al. (2021), DSelect-k, on routelab's gates and MultiGateMoE.

* ``dselect-recovery`` — App. C.2.2 expert recovery (:mod:`.recovery`);
* ``dselect-synthetic`` — App. C.1 synthetic multi-task data, 16–128 tasks (:mod:`.synthetic`);
* ``dselect-movielens`` — Sec. 4.1 on MovieLens-100k (:mod:`.movielens`);
* ``dselect-multimnist`` — Sec. 4.2 Multi-MNIST and Multi-Fashion (:mod:`.multimnist`).

Each writes ``report.md`` (the paper's numbers next to routelab's), figures and per-run results
under its out_dir; results are appended one JSON line per finished run, so a rerun resumes.
The modules are imported lazily so that ``routelab list`` stays fast.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from routelab.experiments import FunctionExperiment

__all__ = ["EXPERIMENTS"]


def _lazy(module: str, fn: str):
    def run(out_dir: Path, quick: bool) -> Path:
        mod = importlib.import_module(f"routelab.experiments.dselect.{module}")
        return getattr(mod, fn)(Path(out_dir), quick)

    return run


EXPERIMENTS = (
    FunctionExperiment("dselect-recovery",
                       "Hazimeh et al. 2021 App. C.2.2: expert recovery by DSelect-k vs Top-k (Fig. 2, C.7-C.8)",
                       _lazy("recovery", "run_recovery")),
    FunctionExperiment("dselect-synthetic",
                       "Hazimeh et al. 2021 App. C.1: synthetic multi-task MoE, 16-128 tasks, MSE and Jaccard (Fig. C.5)",
                       _lazy("synthetic", "run_synthetic")),
    FunctionExperiment("dselect-movielens",
                       "Hazimeh et al. 2021 Sec. 4.1: MovieLens (100k here) watch + rating tasks (Table 1, C.5)",
                       _lazy("movielens", "run_movielens")),
    FunctionExperiment("dselect-multimnist",
                       "Hazimeh et al. 2021 Sec. 4.2: Multi-MNIST and Multi-Fashion (Table 2)",
                       _lazy("multimnist", "run_multimnist")),
)
