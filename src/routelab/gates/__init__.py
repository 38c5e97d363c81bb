"""Gates: modules and functions that turn inputs into expert scores or weights.

A gate only produces scores/weights, under one protocol shared with the token routers
(:class:`GateOutput`, :mod:`routelab.gates.protocol`); turning scores into a
:class:`routelab.Routes` decision under capacity is the routing rules' job
(:mod:`routelab.routing.rules`, called by :mod:`routelab.routers`).
"""

from routelab.gates.batchwise import batchwise_mask, batchwise_threshold_loss, threshold_mask
from routelab.gates.dselect import DSelectK, dselect_weights, selector_outputs
from routelab.gates.mtl_baselines import (
    GumbelSoftmaxGate,
    SoftmaxGate,
    SoftmaxSelectorGate,
    TopKGate,
    ablation_annealing,
    ablation_entropy,
    keep_top_k,
)
from routelab.gates.mtl_gate import MTLGate
from routelab.gates.protocol import GateOutput
from routelab.gates.smooth_step import smooth_step

# Each gate family lives in its own module; add its public names here.
__all__: list[str] = ["batchwise_mask", "batchwise_threshold_loss", "threshold_mask"]
__all__ += [
    "DSelectK", "dselect_weights", "selector_outputs", "smooth_step", "MTLGate", "GateOutput",
    "SoftmaxGate", "TopKGate", "GumbelSoftmaxGate", "SoftmaxSelectorGate",
    "ablation_annealing", "ablation_entropy", "keep_top_k",
]
