"""The one gate protocol of routelab, shared by the token routers and the multi-task gates.

Every gate module has ``gate(x) -> GateOutput``: the expert scores (a router's logits, a
multi-task gate's mixture weights) and the gate's own auxiliary losses, computed from ``x`` and
the parameters alone. ``gate`` stores nothing on the module: calling it twice gives two
independent outputs. What happens next is the caller's: a router hands the scores to its routing
rule (:mod:`routelab.routing.rules`), a multi-gate MoE mixes the experts with the weights.

The older stateful API of the multi-task gates (``weights = gate(x)``, then
``gate.regularization()`` and ``gate.report()`` about that call) is ``forward``: ``gate(x)`` plus
remembering its output for those two methods, the one thing kept between calls, and only
because the caller asked for it by using them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = ["GateOutput"]


@dataclass
class GateOutput:
    """What a gate returns.

    Attributes:
        scores: ``[batch, experts]`` (a router: its logits, or features ``[tokens, F]``; a
            multi-task gate: its mixture weights).
        aux: named auxiliary losses, already multiplied by their coefficients (entropy, the
            DSelect-k unused-code penalty, Gumbel sparsity, ...), each a scalar tensor.
        stats: named diagnostics that are not losses (detached tensors).
    """

    scores: Tensor
    aux: dict[str, Tensor] = field(default_factory=dict)
    stats: dict[str, Tensor] = field(default_factory=dict)

    def regularization(self) -> Tensor:
        """The scalar sum of :attr:`aux`: a zero on the scores' device when there is none."""
        return aux_sum(self.aux, self.scores.device)


def aux_sum(aux: dict[str, Tensor], device: torch.device | None = None) -> Tensor:
    """Scalar sum of named losses (``0`` on ``device``, in float32, when there is none)."""
    if not aux:
        return torch.zeros((), device=device)
    return torch.stack([v.reshape(()) for v in aux.values()]).sum()
