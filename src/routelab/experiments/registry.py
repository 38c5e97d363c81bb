"""The registered experiments: what ``routelab reproduce`` and ``routelab list`` know by name.

The built-in experiments are listed here, explicitly, in the order in which ``routelab list``
shows them and ``routelab reproduce`` runs them. Each experiment package defines its
``EXPERIMENT`` (a :class:`~routelab.experiments.kit.experiment.Experiment`) from the kit and
imports nothing from this module, so the imports go one way only: kit <- experiment packages <-
this registry <- ``routelab.cli``.

To add an experiment, write a package ``routelab.experiments.NAME`` that defines ``EXPERIMENT``
(see :mod:`routelab.experiments`), import it here and add it to :data:`BUILTIN`. Other code
(tests, a user's own experiments) adds to :data:`REGISTRY` with :func:`register`.
"""

from __future__ import annotations

from .dselect.movielens import EXPERIMENT as DSELECT_MOVIELENS
from .dselect.multimnist import EXPERIMENT as DSELECT_MULTIMNIST
from .dselect.recovery import EXPERIMENT as DSELECT_RECOVERY
from .dselect.synthetic import EXPERIMENT as DSELECT_SYNTHETIC
from .kit.experiment import Experiment
from .kool_toy import EXPERIMENT as KOOL_TOY
from .lm_routers import EXPERIMENT as LM_ROUTERS
from .mae import EXPERIMENT as MAE
from .moe_routers import EXPERIMENT as MOE_ROUTERS

__all__ = ["BUILTIN", "REGISTRY", "register"]

BUILTIN: tuple[Experiment, ...] = (
    KOOL_TOY, DSELECT_RECOVERY, DSELECT_SYNTHETIC, DSELECT_MOVIELENS, DSELECT_MULTIMNIST, MAE, MOE_ROUTERS,
    LM_ROUTERS,
)
"""routelab's own experiments, in listing order."""

REGISTRY: dict[str, Experiment] = {}
"""All registered experiments, by name, in registration order (the built-in ones first)."""


def register(exp: Experiment) -> Experiment:
    """Add ``exp`` to :data:`REGISTRY` and return it (so it can be used inline).

    Raises:
        TypeError: if ``exp`` is not an :class:`~routelab.experiments.kit.experiment.Experiment`.
        ValueError: if the name is empty, contains whitespace, or is already registered, or
            ``quick_seconds`` is not a finite number >= 0.
    """
    if not isinstance(exp, Experiment):
        raise TypeError(
            f"register() needs an Experiment(name, description, sweep, full, quick_settings) "
            f"(routelab.experiments.kit.experiment), got {type(exp).__name__}."
        )
    name = exp.name
    if not isinstance(name, str) or not name or any(c.isspace() for c in name):
        raise ValueError(f"experiment name must be a non-empty string without whitespace, got {name!r}.")
    cost = exp.quick_seconds
    if isinstance(cost, bool) or not isinstance(cost, int | float) or not cost >= 0 or cost == float("inf"):
        raise ValueError(f"quick_seconds of {name!r} must be a finite number >= 0 (CPU seconds of its quick form; "
                         f"0 if not known), got {cost!r}.")
    if name in REGISTRY:
        raise ValueError(f"an experiment named {name!r} is already registered; pick another name.")
    REGISTRY[name] = exp
    return exp


for _exp in BUILTIN:
    register(_exp)
