"""The balanced-assignment solver's tuning, in one place.

Nothing here changes *what* the solver returns (the cycle cancelling that ends every solve is
exact whatever these are); they decide how much of the work the fast warm start does and how the
work is laid out for the CPU. Each value was measured on this project's machine (2 CPU cores,
float32, n = 256 ... 16384, k = 4 ... 64); the comments say what it bought. A test or a benchmark
that wants another setting passes ``dataclasses.replace(TUNING, ...)`` to the function that reads
it, rather than patching module globals.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SolverTuning", "TUNING"]


@dataclass(frozen=True)
class SolverTuning:
    """Tuning constants of :mod:`routelab.assignment` (defaults: :data:`TUNING`).

    **Price schedule** (:mod:`._prices`): temperatures relative to the spread (standard deviation)
    of the scores, one Newton step each, from ``first_temperature`` down by ``cooling`` per level
    until below ``final_temperature_n / n``. The more tokens, the closer their score differences,
    and the colder the prices must be to place nearly all of them (each cancelling round left to
    the exact phase costs more than a few extra steps on the active set). From ``large_n`` tokens
    on, the centred column means already start the prices close enough to skip the hottest level
    (measured: fewer full steps, no more cancelling rounds at n = 4096 and 16384; about even at
    2048; at n = 256 it costs ~3 extra rounds).

    **Newton steps**: ``steps_per_level`` steps per level on average (with 2, 4 of 15 instances
    at n = 4096, k = 64 ran out of steps and needed 3-5 cancelling rounds; with 3, 40 instances
    needed at most 1). A step moves no price by more than ``step_limit`` temperatures; a clipped
    step is repeated at the same temperature, up to ``level_steps`` steps per temperature.

    **Active set**: with ``active_set``, a token is frozen when its best expert leads every
    other one by ``freeze_gap`` temperatures, and treated as saturated while that lead stays above
    ``saturated_gap`` temperatures of the current step; freezing is skipped when it would leave
    more than ``max_active`` of the rows. Rows frozen by a shrink (at a colder level) need the
    larger lead ``shrink_gap`` (the prices then still move by several of the new, smaller
    temperatures per step). A colder level shrinks the active set only when it has more than
    ``shrink_min`` rows (a step on a few hundred rows costs little more than the shrink itself).

    **Layout**: softmax entries more than ``clamp_nats`` below their row's maximum are clamped
    (they change nothing, but as denormal numbers they slow the CPU several-fold); up to
    ``small_gram`` rows the Hessian's saturated rows are masked rather than selected; reductions
    over at most ``small_k`` experts are done slice by slice (:mod:`._ops`); Bellman-Ford looks
    for predecessor cycles every ``check_every`` sweeps (a look costs about two sweeps).

    **Where a GPU's problems are solved**: scores on a CUDA device with at most
    ``host_max_scores`` entries in all (batch x tokens x experts) are copied to the host and
    solved by the compiled CPU solver, when it is available (numba, ``ROUTELAB_PURE_TORCH``
    unset). The PyTorch path on the GPU makes about a hundred host synchronisations per call
    whatever the size, the host round trip two. Measured on an H200 machine (16-core Xeon host,
    float32 ``randn``, docs/bench-assignment-gpu.md): 64 x 256 x 16 (2^18 scores) took 20.6 ms on
    the GPU and 3.6 ms through the host; 64 x 4096 x 64 (2^24) 72 ms on the GPU and 211 ms through
    the host; one instance of 256 x 16 ... 16384 x 64 took 5.9-15.6 ms on the GPU. A power law
    through the two batched sizes puts the crossover near 3.4M scores; ``2^21`` stays below it.
    """

    first_temperature: float = 0.3
    large_n: int = 4096
    cooling: float = 5.0
    final_temperature_n: float = 0.4
    steps_per_level: int = 3
    step_limit: float = 4.0
    level_steps: int = 3
    active_set: bool = True
    freeze_gap: float = 30.0
    shrink_gap: float = 50.0
    saturated_gap: float = 20.0
    max_active: float = 0.6
    shrink_min: int = 256
    clamp_nats: float = 40.0
    small_gram: int = 1024
    small_k: int = 8
    check_every: int = 3
    host_max_scores: int = 2**21


#: The tuning every solver call uses unless it is given another.
TUNING = SolverTuning()
