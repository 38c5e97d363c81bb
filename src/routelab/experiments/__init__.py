"""The registry of reproduced experiments.

Each experiment is an object with a ``name``, a one-line ``description`` and a
``run(out_dir, quick)`` method that writes its results under ``out_dir`` and returns the path
of its markdown report. ``routelab reproduce`` runs them and aggregates their reports.

To add one, write a module in this package that builds the experiment and calls
:func:`register`, then import that module at the bottom of this file so that the registry is
filled when :mod:`routelab.experiments` is imported. Use :mod:`routelab.experiments.runner`
for resumable results (one JSON line per finished run) and atomic report writes, and
:mod:`routelab.experiments.failures` so that a run that diverges is recorded as failed (with its
reason) instead of stopping the sweep. ``run`` raises :class:`routelab.data.DataUnavailable`
when its data is not installed; ``routelab reproduce`` then reports the experiment as skipped
and goes on with the others.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

__all__ = ["REGISTRY", "Experiment", "FunctionExperiment", "SweepExperiment", "register"]


@runtime_checkable
class Experiment(Protocol):
    """What ``routelab reproduce`` needs from an experiment.

    Attributes:
        name: unique short identifier, used on the command line (``routelab reproduce NAME``).
        description: one line saying what is reproduced (paper, table or figure).
    """

    name: str
    description: str

    def run(self, out_dir: Path, quick: bool) -> Path:
        """Run the experiment, writing everything under ``out_dir``.

        Args:
            out_dir: a directory reserved for this experiment (created by the caller). Runs
                already recorded there are skipped, so an interrupted call resumes.
            quick: if ``True``, a reduced version (fewer seeds, smaller sizes) that finishes
                in minutes on a 2-core CPU; the report must say it is the quick form.

        Returns:
            Path to the experiment's markdown report (normally ``out_dir / "report.md"``).
            Links inside it (plots) should be relative to ``out_dir``.
        """
        ...


@dataclass(frozen=True)
class FunctionExperiment:
    """An :class:`Experiment` built from a plain function ``fn(out_dir, quick) -> Path``."""

    name: str
    description: str
    fn: Callable[[Path, bool], Path]

    def run(self, out_dir: Path, quick: bool) -> Path:
        """Call ``fn(out_dir, quick)``; see :meth:`Experiment.run`."""
        return self.fn(out_dir, quick)


@dataclass(frozen=True)
class SweepExperiment:
    """An :class:`Experiment` whose full and quick forms are two settings of one sweep function.

    Attributes:
        name, description: as in :class:`Experiment`.
        sweep: ``sweep(out_dir, settings) -> report path``; runs (or resumes) the sweep.
        full, quick_settings: the settings of ``run(out_dir, quick=False)`` and ``quick=True``
            (tests replace them with tiny ones through :func:`dataclasses.replace`).
    """

    name: str
    description: str
    sweep: Callable[[Path, Any], Path]
    full: Any
    quick_settings: Any

    def run(self, out_dir: Path, quick: bool) -> Path:
        """``sweep(out_dir, quick_settings if quick else full)``; see :meth:`Experiment.run`."""
        return self.sweep(Path(out_dir), self.quick_settings if quick else self.full)


REGISTRY: dict[str, Experiment] = {}
"""All registered experiments, by name, in registration order."""


def register(exp: Experiment) -> Experiment:
    """Add ``exp`` to :data:`REGISTRY` and return it (so it can be used inline).

    Raises:
        TypeError: if ``exp`` lacks ``name``, ``description`` or ``run``.
        ValueError: if the name is empty, contains whitespace, or is already registered.
    """
    if not isinstance(exp, Experiment):
        raise TypeError(
            f"register() needs an object with .name, .description and .run(out_dir, quick), "
            f"got {type(exp).__name__}; wrap a function with FunctionExperiment(name, "
            f"description, fn)."
        )
    name = exp.name
    if not isinstance(name, str) or not name or any(c.isspace() for c in name):
        raise ValueError(
            f"experiment name must be a non-empty string without whitespace, got {name!r}."
        )
    if name in REGISTRY:
        raise ValueError(
            f"an experiment named {name!r} is already registered; pick another name."
        )
    REGISTRY[name] = exp
    return exp

# Registered experiments (imported last: they call register() above).
from . import kool_toy as _kool_toy  # noqa: E402

register(_kool_toy.EXPERIMENT)
from . import dselect as _dselect  # noqa: E402

for _exp in _dselect.EXPERIMENTS:
    register(_exp)
from . import mae as _mae  # noqa: E402

register(_mae.EXPERIMENT)
from . import moe_routers as _moe_routers  # noqa: E402

register(_moe_routers.EXPERIMENT)
