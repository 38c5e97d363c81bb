"""The small interface every multi-task gate of routelab shares (DSelect-k and its baselines).

A gate is an ``nn.Module`` that maps a batch of inputs to expert weights. It follows routelab's
one gate protocol (:mod:`routelab.gates.protocol`, shared with the token routers)::

    out = gate.gate(x)             # GateOutput: out.scores [batch, num_experts] weights,
                                   # out.aux the gate's penalties; stores nothing on the gate

and keeps the stateful form its callers use::

    weights = gate(x)              # x [batch, input_dim] -> weights [batch, num_experts]
    loss = task_loss + gate.regularization()   # the gate's own penalties, from that forward
    gate.track(step)               # optional, after the optimizer step: convergence bookkeeping
    gate.report()                  # dict of plain numbers (experts selected, binary S(Z), ...)

``forward`` is ``gate(x)`` plus remembering that output (``aux``, the weights) for
``regularization()`` and ``report()``: the only state kept between calls.

* Static gates (``per_example=False``) ignore the values of ``x``: they use only its batch
  size (``x`` may also be an ``int`` batch size) and return the same weights for every row.
* ``regularization()`` returns the scalar sum of the penalties of the most recent forward
  call (entropy, the DSelect-k unused-code penalty, Gumbel sparsity ...), already multiplied by
  their coefficients; ``aux`` holds them by name. It is 0 (on the gate's device) when the gate
  has none.
* ``selected_experts(weights)`` counts the experts with nonzero weight per row: ``[batch]``.
* ``report()`` after a forward on an empty batch (``x`` of shape ``[0, input_dim]``): a static
  gate's selection does not depend on the batch, so it reports the weights of its parameters; a
  per-example gate has no example to report (``experts_selected`` ``[]``, its mean ``None``).
* Training state that is not a parameter (a gate's own noise generator, DSelect-k's
  ``binary_step``) is saved in ``state_dict()`` as the gate's ``_extra_state``, so that a run
  resumed from a checkpoint continues exactly as the uninterrupted one. A ``state_dict`` saved
  without it (by an older routelab) still loads, with ``strict=True`` too: the gate then keeps
  its current extra state.
* ``on_step(step, total_steps)`` lets gates with schedules (temperature annealing) update
  themselves; the default does nothing.
* Dtypes: a per-example gate casts any floating ``x`` to its parameters' dtype (integer ``x``
  is a ValueError, as are NaN/inf gate logits) and every gate returns its weights in ``x``'s
  dtype when ``x`` is a floating tensor (else in its parameters' dtype).

Every gate here is interchangeable inside :class:`routelab.layers.MultiGateMoE`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .._checks import (
    ArgumentTypeError,
    check_finite,
    check_flag,
    check_generator,
    check_k,
    check_nonneg,
    check_pos,
    check_positive_int,
    check_seed,
    checks_run,
    floating_input,
)
from .protocol import GateOutput, aux_sum

__all__ = ["MTLGate", "check_positive_int", "check_k", "check_nonneg", "check_pos", "uniform_init",
           "batch_size_of", "check_finite", "floating_input", "check_seed"]


# The validators every layer above uses live in routelab._checks (their one home); the gates'
# modules and older user code import them from here.

#: The ``state_dict`` key suffix of a module's ``get_extra_state()`` (``torch.nn.Module``'s
#: ``_EXTRA_STATE_KEY_SUFFIX``).
_EXTRA_STATE_KEY = "_extra_state"


def uniform_init(shape: tuple[int, ...], half_width: float,
                 generator: torch.Generator | None = None) -> torch.Tensor:
    """Uniform in ``[-half_width, half_width)`` (Keras ``RandomUniform``), drawn from ``generator``."""
    check_generator(generator)
    return (torch.rand(shape, generator=generator) * 2.0 - 1.0) * half_width


def batch_size_of(x: torch.Tensor | int) -> int:
    """The batch size of ``x`` (``[batch, ...]`` tensor) or ``x`` itself if it is an int."""
    if isinstance(x, int) and not isinstance(x, bool):
        if x < 1:
            raise ValueError(f"batch size must be >= 1, got {x}.")
        return x
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        if not isinstance(x, torch.Tensor):
            raise ArgumentTypeError("x must be a tensor [batch, input_dim] (or an int batch size for a static gate), "
                                    f"got {type(x).__name__}; convert it with torch.as_tensor(x).")
        raise ValueError(f"x must be a tensor [batch, input_dim] (or an int batch size for a static gate), got "
                         f"shape {tuple(x.shape)}.")
    return int(x.shape[0])


class MTLGate(nn.Module):
    """Base class of the multi-task gates: shared bookkeeping, see the module docstring.

    Args:
        num_experts: n, the number of experts the gate weighs (>= 1).
        per_example: whether the weights depend on the input (then ``input_dim`` is needed);
            True or False (anything else, e.g. the string ``"False"``, is a TypeError).
        input_dim: p, the width of ``x`` for per-example gates.
    """

    #: Whether every weight that is exactly 0 also has a zero gradient (DSelect-k's smooth step, top-k's
    #: masked softmax), so that a layer may skip the experts every gate weighs 0 without changing any
    #: gradient. A straight-through gate (Gumbel-softmax in training) says False.
    exact_zeros: bool = True

    #: Whether the gate checks for NaN/inf on every call (one host sync): a per-example gate its
    #: scores, a static gate its weights (from its parameters).
    #: Set it to False on a gate (``gate.check_finite = False``) to drop the check, e.g. for a step
    #: without host syncs on a GPU.
    check_finite: bool = True

    def __init__(self, num_experts: int, *, per_example: bool = False,
                 input_dim: int | None = None) -> None:
        super().__init__()
        self.num_experts = check_positive_int("num_experts", num_experts)
        self.per_example = check_flag("per_example", per_example)
        if self.per_example:
            if input_dim is None:
                raise ValueError("input_dim is required when per_example=True (the width of x).")
            self.input_dim: int | None = check_positive_int("input_dim", input_dim)
        else:
            self.input_dim = None if input_dim is None else check_positive_int("input_dim", input_dim)
        self.aux: dict[str, torch.Tensor] = {}
        self._last_weights: torch.Tensor | None = None

    # -- input checks -------------------------------------------------------------------------
    def _check_x(self, x: torch.Tensor | int) -> int:
        """Validate ``x`` and return the batch size."""
        b = batch_size_of(x)
        if self.per_example:
            if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != self.input_dim:
                shape = tuple(x.shape) if isinstance(x, torch.Tensor) else x
                raise ValueError(
                    f"x must have shape [batch, {self.input_dim}] for this per-example gate, "
                    f"got {shape}."
                )
        return b

    # -- the gate protocol ---------------------------------------------------------------------
    def gate(self, x: torch.Tensor | int) -> GateOutput:  # pragma: no cover - abstract
        """Weights ``[batch, n]`` (in ``x``'s dtype when ``x`` is a floating tensor) and the
        penalties of this call, as a :class:`~routelab.gates.protocol.GateOutput`; stores nothing."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor | int) -> torch.Tensor:
        """Expert weights ``[batch, n]``: :meth:`gate`, remembered for :meth:`regularization` and
        :meth:`report` (:meth:`remember`)."""
        out = self.gate(x)
        rows = self.unchecked_rows(out.scores)
        if rows is not None:
            self.check_rows(rows)
        self.remember(out)
        return out.scores

    def unchecked_rows(self, weights: torch.Tensor) -> torch.Tensor | None:
        """The rows of :meth:`gate`'s ``weights`` that :meth:`forward` checks for NaN/inf (one host
        sync; a layer of several gates may read them together, :meth:`check_rows` then names the
        gate): the first row of a static gate's (its rows are all alike, from its parameters), None
        for a per-example gate (it checks its scores in :meth:`gate`), with ``check_finite`` off, or
        for an empty batch."""
        if self.per_example or not self.check_finite or not weights.shape[0] or not checks_run():
            return None  # (checks_run: not while torch.compile traces, as every value check)
        return weights[:1]

    def check_rows(self, rows: torch.Tensor) -> None:
        """ValueError naming the gate unless :meth:`unchecked_rows`' ``rows`` are finite."""
        check_finite(rows, f"{type(self).__name__} weights",
                     "the gate's parameters are not finite (the training diverged); lower the learning rate")

    def remember(self, out: GateOutput) -> None:
        """Keep ``out`` (its penalties and detached weights) for :meth:`regularization` and
        :meth:`report`; what :meth:`forward` does after :meth:`gate`."""
        self.aux = out.aux
        self._last_weights = out.scores.detach()

    def __getstate__(self) -> dict:
        """The gate's state for ``copy.deepcopy`` and pickling, with the last penalties detached (a
        graph's tensors cannot be deep-copied: an EMA or best-model snapshot of a model after a
        training step would fail)."""
        state = dict(super().__getstate__())
        state["aux"] = {name: value.detach() for name, value in state.get("aux", {}).items()}
        return state

    def _output(self, weights: torch.Tensor, x: torch.Tensor | int) -> torch.Tensor:
        """``weights`` in ``x``'s dtype when ``x`` is a floating tensor (the dtype policy).

        A cast to a narrower dtype rounds tiny weights to exactly 0 (6e-9 in float32 is 0 in
        float16) that keep their gradient; for a gate whose zeros have none (``exact_zeros``) such
        a zero is detached, so that a layer that skips the experts every gate weighs 0 loses no
        gradient (it would lose up to 15 % of one, measured in float16)."""
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != weights.dtype:
            out = weights.to(x.dtype)
            if self.exact_zeros and out.requires_grad:
                out = torch.where(out == 0, out.detach(), out)
            return out
        return weights

    def _device(self) -> torch.device:
        """Where the gate computes: its last weights' device, else its parameters'."""
        if self._last_weights is not None:
            return self._last_weights.device
        p = next(self.parameters(), None)
        return p.device if p is not None else torch.device("cpu")

    # -- the shared interface -----------------------------------------------------------------
    def regularization(self) -> torch.Tensor:
        """Scalar sum of the penalties of the last forward call (0, on the gate's device, if none)."""
        return aux_sum(self.aux, self._device())

    @staticmethod
    def selected_experts(weights: torch.Tensor) -> torch.Tensor:
        """Number of experts with nonzero weight per row: ``[batch, n] -> [batch]`` (float)."""
        return (weights != 0).sum(dim=-1).to(torch.float32)

    def on_step(self, step: int, total_steps: int) -> None:  # noqa: B027 - optional hook
        """Schedule hook called before training step ``step`` of ``total_steps`` (default: none)."""

    def track(self, step: int) -> None:  # noqa: B027 - optional hook
        """Bookkeeping hook called after training step ``step`` (default: none)."""

    def report(self) -> dict[str, Any]:
        """Plain-number summary of the last forward: experts selected per example and mean.

        Nothing before the first forward. After a forward on an empty batch a static gate reports
        the selection of its parameters (:meth:`_parameter_weights`; it is the same for every
        batch) and a per-example gate reports no examples: ``experts_selected`` ``[]`` and
        ``experts_selected_mean`` ``None``.
        """
        out: dict[str, Any] = {}
        if self._last_weights is None:
            return out
        w = self._report_weights()
        if w is None:  # a per-example gate after an empty batch: no example to report
            out["experts_selected_mean"] = None
            out["experts_selected"] = []
            return out
        sel = self.selected_experts(w)
        out["experts_selected_mean"] = float(sel.mean())
        out["experts_selected"] = sel.tolist() if self.per_example else float(sel[0])
        return out

    def _report_weights(self) -> torch.Tensor | None:
        """The weights :meth:`report` describes: the last forward's ``[batch, n]`` (detached); after
        an empty batch, a static gate's ``[1, n]`` from its parameters and a per-example gate's
        ``None``. ``None`` before the first forward."""
        w = self._last_weights
        if w is None or w.shape[0] > 0:
            return w
        return None if self.per_example else self._parameter_weights()

    def _parameter_weights(self) -> torch.Tensor:
        """A static gate's weights ``[1, n]`` from its parameters alone (no gradient, nothing stored):
        the row every example of a forward gets. A stochastic gate overrides it (it must not draw)."""
        with torch.no_grad():
            return self.gate(1).scores.detach()

    # -- state_dict: training state outside the parameters ---------------------------------------
    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, local_metadata: dict[str, Any],
                              strict: bool, missing_keys: list[str], unexpected_keys: list[str],
                              error_msgs: list[str]) -> None:
        """As ``nn.Module``'s, except that a ``state_dict`` without this gate's ``_extra_state`` (saved
        by a routelab that did not store it) is no missing key under ``strict=True``: the gate keeps
        its current extra state (its noise stream, ``binary_step``)."""
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        key = prefix + _EXTRA_STATE_KEY
        if key not in state_dict and key in missing_keys:
            missing_keys.remove(key)
