"""The :class:`Experiment` record: what ``routelab reproduce`` runs.

An experiment is its settings (a full and a quick form) and one run function
``run(out_dir, settings) -> report path`` that trains whatever ``out_dir`` does not record yet
and writes the report (its package's report function). It is listed in
:mod:`routelab.experiments.registry`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Experiment"]


@dataclass(frozen=True)
class Experiment:
    """One reproduced experiment.

    Attributes:
        name: unique short identifier, used on the command line (``routelab reproduce NAME``);
            no whitespace.
        description: one line saying what is reproduced (paper, table or figure).
        sweep: ``sweep(out_dir, settings) -> report path``: runs (or resumes) the experiment at
            ``settings``, writing everything under ``out_dir``, and returns the path of its
            markdown report (normally ``out_dir / "report.md"``; links inside it relative to
            ``out_dir``). Runs already recorded in ``out_dir`` are not run again. Raises
            :class:`routelab.data.DataUnavailable` when its data is not installed.
        full: the settings of the full reproduction.
        quick_settings: the settings of the quick form (``--quick``): fewer seeds, smaller sizes,
            minutes on a 2-core CPU; the report must say it is the quick form.
        quick_seconds: about how many CPU seconds the quick form takes on this project's 2-core
            machine (0: not known). ``routelab reproduce --quick --jobs N`` starts the costliest
            first, so that no long experiment is left running alone at the end.
    """

    name: str
    description: str
    sweep: Callable[[Path, Any], Path]
    full: Any
    quick_settings: Any
    quick_seconds: float = 0.0

    def run(self, out_dir: Path, quick: bool) -> Path:
        """``sweep(out_dir, quick_settings if quick else full)``; returns the report's path."""
        return self.sweep(Path(out_dir), self.quick_settings if quick else self.full)
