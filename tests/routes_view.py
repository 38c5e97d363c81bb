"""A test helper shared by the estimator tests: a one-slot :class:`routelab.Routes` read per token.

``sample_routes`` returns the layout of every router, ``[..., n, 1]`` (one slot per token); the
estimator tests compare its fields with per-token oracles of shape ``[..., n]``. (Importable from
every test directory: pytest puts ``tests/``, the directory of the root ``conftest.py``, on
``sys.path``.)
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from routelab import Routes


class PerToken(NamedTuple):
    """The per-slot fields of a one-slot record read per token, each ``[..., n]``."""

    expert: torch.Tensor
    gate: torch.Tensor
    keep: torch.Tensor
    weight: torch.Tensor
    log_prob: torch.Tensor


def per_token(routes: Routes) -> PerToken:
    """The fields of ``routes`` (one slot per token, ``[..., n, 1]``) as ``[..., n]`` tensors."""
    assert routes.num_slots == 1, routes
    return PerToken(*(getattr(routes, name)[..., 0] for name in PerToken._fields))
