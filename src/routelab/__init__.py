"""routelab: routing in mixtures of experts, in one PyTorch library.

Layers (each depends only on the ones above it):

1. :mod:`routelab.assignment` — pure tensor algorithms (sinkhorn, balanced assignment,
   Gumbel matching).
2. ``routelab.gates`` — modules producing expert scores (planned).
3. ``routelab.routing`` / ``routelab.estimators`` — scores to :class:`Routes` under capacity,
   and the training signal (planned).
4. ``routelab.layers`` — MoE layers and trainers (planned).
5. :mod:`routelab.experiments` — reproduced experiments on one small runner.
6. :mod:`routelab.cli` — the ``routelab`` command.

The one shared type is :class:`routelab.Routes`.
"""

from routelab.routes import Routes

__version__ = "0.1.0"

__all__ = ["Routes", "__version__"]
