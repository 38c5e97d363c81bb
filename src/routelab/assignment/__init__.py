"""Pure balanced-assignment algorithms (layer 1 of routelab): no modules, no state.

* :func:`sinkhorn` — log-space Sinkhorn balancing of an n x k matrix (Kool et al. 2021, Sec. 2.3).
* :func:`balanced_assignment` — the exact capacity-constrained maximiser (eq. 4, App. D.2).
* :func:`balanced_b_matching` — its ``k``-experts-per-token generalisation (BASE with top-k):
  ``k`` distinct experts per token, every expert ``floor``/``ceil`` of ``k n / E`` pairs, exact.
* :func:`gumbel_matching` — n x k Gumbel-Matching samples with their conditionals (App. D.3-D.5).
* :func:`base_assignment` — the deterministic BASE-layers assignment, the ``tau -> 0`` limit.

Helpers for the layers above (public so that no package reaches into this one's private modules):
:func:`sinkhorn_balance` (the Sinkhorn iteration without validation, under a fixed budget),
:func:`rank_within_groups`, :func:`compiled_phases` (the compiled solver stopped after a phase, for
the benchmark's breakdown), :func:`uses_closed_form` (the one switch of the two-expert closed
forms), :data:`SOLVER_TUNING` (the solver's tuning constants, e.g. ``host_max_scores``, the
largest GPU problem solved on the host), and the last-dimension reductions :func:`amax`, :func:`argmax` and
:func:`log_softmax` (torch's, computed slice by slice when there are few experts: faster on CPU).

All functions are batched over leading dimensions (empty ones included), run on CPU and CUDA in
float32 and float64 (float16/bfloat16 input is computed in float32), are exact at any magnitude
(scores are row-shifted and scaled by a power of two first, :mod:`._normalise`) and draw
randomness only from an explicit ``torch.Generator``. On CPU the solvers keep a few
scratch tensors per thread between calls (page faults on fresh memory would otherwise cost more
than the arithmetic); :func:`clear_scratch` frees them.
"""

from ._compiled import compiled_phases
from ._groups import rank_within_groups
from ._ops import amax, argmax, log_softmax
from ._tuning import TUNING as SOLVER_TUNING
from ._two_experts import closed_form as uses_closed_form
from ._workspace import clear as clear_scratch
from .b_matching import balanced_b_matching
from .balanced import balanced_assignment
from .gumbel import GumbelMatching, base_assignment, gumbel_matching, sample_gumbel
from .sinkhorn import balance as sinkhorn_balance
from .sinkhorn import sinkhorn

__all__ = [
    "SOLVER_TUNING",
    "GumbelMatching",
    "amax",
    "argmax",
    "balanced_assignment",
    "balanced_b_matching",
    "base_assignment",
    "clear_scratch",
    "compiled_phases",
    "gumbel_matching",
    "log_softmax",
    "rank_within_groups",
    "sample_gumbel",
    "sinkhorn",
    "sinkhorn_balance",
    "uses_closed_form",
]
