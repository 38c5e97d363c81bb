"""The one place where routelab keeps code out of ``torch.compile``'s tracing: :func:`eager`.

The balanced solvers (the exact balanced assignment, Gumbel-Matching, the Sinkhorn iteration
with its convergence test) are data-dependent loops over host-side decisions: Dynamo cannot
trace them (some crash it), and tracing them would gain nothing. Every routing rule calls them
through :func:`eager`, so a compiled model runs them as ordinary eager calls: one clean graph
break around each solve, and everything else of the layer compiled.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

__all__ = ["eager"]

F = TypeVar("F", bound=Callable[..., object])


def eager(fn: F) -> F:
    """``fn`` excluded from ``torch.compile`` tracing (``torch.compiler.disable``, recursively):
    it runs eagerly, with autograd, whether or not the caller is compiled.

    Through torch's lazy form of the same decorator where torch has it (``torch._disable_dynamo``,
    which torch uses for its own functions): Dynamo is imported at the first call, not when
    routelab is imported (``torch.compiler.disable`` imports it at once: about 2 s of the import of
    ``routelab`` on a CPU, for users who never compile).
    """
    lazy = getattr(torch, "_disable_dynamo", None)
    if lazy is None:  # (a torch without it)
        return torch.compiler.disable(fn, recursive=True)  # type: ignore[return-value]
    return lazy(fn, recursive=True)  # type: ignore[return-value]
