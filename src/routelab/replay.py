"""Activation checkpointing replays the forward's noise: :class:`NoiseReplay`.

``torch.utils.checkpoint`` (and transformers' ``gradient_checkpointing_enable``) discards a
segment's activations and *recomputes* the segment during the backward pass. It saves and
restores torch's global CPU/CUDA random state around the recomputation (``preserve_rng_state``),
but not the state of a :class:`torch.Generator` the model holds: a stochastic router drawing from
its own generator would draw *new* noise in the recomputation, route differently, and the
gradients would be silently wrong.

:class:`NoiseReplay` closes that gap in one place, for every stochastic draw of routelab (noisy
top-k's noise, Gumbel-Matching's samples, the random drop policy). Around each draw:

* in a forward pass (outside autograd's backward), it records the generator's state before the
  draw, on a short stack (the most recent ``depth`` forward draws);
* in a recomputation (the same code run again *inside* the backward pass, which is where
  checkpointing recomputes, re-entrant or not), it takes the most recent record not yet replayed
  by this backward pass, sets the generator to it for the draw, and afterwards puts the generator
  back where it was, so the recomputation draws exactly the forward's noise and leaves the
  generator's stream untouched.

Records are replayed last-in first-out within one backward pass (autograd's graph task), the
order in which backward recomputes the checkpointed segments of a forward (the last segment
first). A replay does not consume its record: a second backward pass through the same graph
(``retain_graph=True``: a gradient penalty, per-loss gradient norms) starts again from the most
recent record and replays the same noise. The next forward starts a new round of records.

Without a generator (``None``: torch's global generator) nothing is recorded: torch's checkpoint
restores the global state itself. Under ``torch.compile`` nothing is recorded either (a
generator's state cannot be traced; compiled stochastic routers should use the global generator).

Limits: a record is matched by order, not by identity. Between a checkpointed forward and its
backward, do not run the same stochastic module again in training mode (another forward would
push a newer record that the recomputation would then replay); one module used several times
inside the same checkpointed segment is not supported either.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ._checks import check_generator, check_positive_int

__all__ = ["NoiseReplay", "in_backward"]


def in_backward() -> bool:
    """Whether autograd is running a backward pass on this thread (where checkpointing recomputes)."""
    return torch._C._current_graph_task_id() != -1


class NoiseReplay:
    """Records a generator's state at each forward draw and replays it when checkpointing recomputes.

    Args:
        depth: forward draws remembered (older records are forgotten): at least the number of
            checkpointed uses of the module between one forward and its backward.
    """

    #: (class defaults: a replay pickled before they existed)
    _task: int | None = None
    _unreplayed: int = 0

    def __init__(self, depth: int = 64) -> None:
        self.depth = check_positive_int("depth", depth)
        self._states: deque[torch.Tensor] = deque(maxlen=self.depth)
        # The backward pass (graph task id) replaying, and how many records it has not replayed yet
        # (the next replay takes the record just below that count).
        self._task: int | None = None
        self._unreplayed = 0

    def __len__(self) -> int:
        return len(self._states)

    def clear(self) -> None:
        """Forget every record."""
        self._states.clear()
        self._task, self._unreplayed = None, 0

    @contextmanager
    def draw(self, generator: torch.Generator | None) -> Iterator[None]:
        """Context of one stochastic draw from ``generator`` (see the module docstring).

        Raises:
            TypeError: ``generator`` is not a ``torch.Generator`` or ``None``.
            RuntimeError: a recomputation with no record to replay (the module's forward ran
                outside this mechanism, e.g. before its generator was set).
        """
        check_generator(generator)
        if generator is None or torch.compiler.is_compiling():
            yield
            return
        if not in_backward():
            self._states.append(generator.get_state())
            self._task = None  # a new forward: the next backward pass replays from the newest record
            yield
            return
        task = torch._C._current_graph_task_id()
        if task != self._task:  # the first recomputation of this backward pass
            self._task, self._unreplayed = task, len(self._states)
        if self._unreplayed == 0:
            raise RuntimeError(
                "a stochastic routelab module is being recomputed by activation checkpointing but has no recorded "
                "forward noise to replay; set its generator before the checkpointed forward"
            )
        self._unreplayed -= 1
        current = generator.get_state()
        generator.set_state(self._states[self._unreplayed])
        try:
            yield
        finally:
            generator.set_state(current)
