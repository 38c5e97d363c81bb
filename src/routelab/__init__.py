"""routelab: routing in mixtures of experts, in one PyTorch library.

Layers (a module imports only lower ranks; ``tests/test_import_layers.py`` enforces the order, the
README's Layout section tells what each holds):

0. ``routelab._checks`` (every argument check, once), :mod:`routelab.routes` (:class:`Routes`, the
   one record every routing method returns), ``routelab.machine``, ``routelab._float32_out``.
1. :mod:`routelab.assignment` — pure tensor algorithms (Sinkhorn, balanced assignment and
   b-matching, Gumbel-Matching with its conditionals); :mod:`routelab.replay` (noise replayed
   under activation checkpointing).
2. :mod:`routelab.gates` — inputs to expert scores or weights (DSelect-k and its baselines, App. F
   batchwise gating).
3. :mod:`routelab.routing` — scores to :class:`Routes` under capacity (capacity, the eq. 3 skip
   correction, drop policies, the Switch balance loss, dispatch plans).
4. :mod:`routelab.estimators` — the training signals (sampling estimators with importance weights,
   REINFORCE, gating).
5. :mod:`routelab.routers` — the routers (score tokens, then apply a routing rule).
6. :mod:`routelab.layers` — the MoE layer, multi-gate MoE, mixture of attentive experts and its
   trainer.
7. :mod:`routelab.parallel` — expert parallelism over ``torch.distributed``.
8. :mod:`routelab.integrations` — adapters to other libraries' models (transformers:
   :func:`routelab.integrations.hf.patch_moe`).
9. :mod:`routelab.data` — data that ships inside packages.
10. :mod:`routelab.bench`, :mod:`routelab.experiments` — benchmarks and reproduced experiments.
11. :mod:`routelab.cli` — the ``routelab`` command.

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
