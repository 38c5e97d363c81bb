"""The assignment algorithms' input checks: routelab's one set of validators, :mod:`routelab._checks`.

Kept so that the modules of this package can import them as ``from ._checks import ...``; every
rule is defined once, in :mod:`routelab._checks`.
"""

from __future__ import annotations

from .._checks import check_generator, check_k, check_score_matrix, check_tau, resolve_capacity

__all__ = ["check_generator", "check_k", "check_score_matrix", "check_tau", "resolve_capacity"]
