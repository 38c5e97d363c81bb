"""Auxiliary load-balancing losses of routers (unweighted; routers multiply by coefficients).

Defined in :mod:`routelab.routing.losses`, their one home; kept importable from here.
"""

from __future__ import annotations

from ..routing.losses import cv_squared, noisy_topk_load, switch_balance

__all__ = ["cv_squared", "noisy_topk_load", "switch_balance"]
