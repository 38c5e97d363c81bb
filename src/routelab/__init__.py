"""routelab: routing in mixtures of experts, in one PyTorch library.

Layers (each depends only on the ones above it):

0. ``routelab._checks`` — every argument check, once; :class:`routelab.Routes`, the one shared
   record every routing method returns.
1. :mod:`routelab.assignment` — pure tensor algorithms (Sinkhorn, balanced assignment,
   Gumbel-Matching with its conditionals).
2. :mod:`routelab.gates` — modules and functions turning inputs into expert scores or weights
   (DSelect-k and its baselines, App. F batchwise gating).
3. :mod:`routelab.routing` / :mod:`routelab.estimators` — scores to :class:`Routes` under capacity
   (capacity, the eq. 3 skip correction, drop policies, the Switch balance loss, dispatch plans)
   and the training signals (sampling estimators with importance weights, REINFORCE, gating);
   :mod:`routelab.routers` — the routers (score tokens, then apply a routing rule).
4. :mod:`routelab.layers` — the MoE layer, multi-gate MoE, mixture of attentive experts and its
   trainer; :mod:`routelab.parallel` beside it (expert parallelism over ``torch.distributed``).
5. :mod:`routelab.integrations` — adapters to other libraries' models (transformers:
   :func:`routelab.integrations.hf.patch_moe`).
6. :mod:`routelab.experiments` — reproduced experiments.
7. :mod:`routelab.cli` — the ``routelab`` command.

:func:`aux_loss` and :func:`routing_stats` (from :mod:`routelab.routing.record`) read what
every routelab module of a model routed in its last forward; :func:`patch_moe` (from
:mod:`routelab.integrations.hf`, imported on first use) puts a routelab router into a transformers
model.
"""

from typing import Any

from routelab.routes import Routes
from routelab.routing.record import aux_loss, routing_stats

__version__ = "0.1.0"

__all__ = ["Routes", "__version__", "aux_loss", "patch_moe", "routing_stats"]


def __getattr__(name: str) -> Any:
    """``routelab.patch_moe``: :func:`routelab.integrations.hf.patch_moe`, imported on first use
    (``import routelab`` stays light)."""
    if name == "patch_moe":
        from routelab.integrations.hf import patch_moe

        return patch_moe
    raise AttributeError(f"module 'routelab' has no attribute {name!r}")
