"""The small interface every multi-task gate of routelab shares (DSelect-k and its baselines).

A gate is an ``nn.Module`` that maps a batch of inputs to expert weights::

    weights = gate(x)              # x [batch, input_dim] -> weights [batch, num_experts]
    loss = task_loss + gate.regularization()   # the gate's own penalties, from that forward
    gate.track(step)               # optional, after the optimizer step: convergence bookkeeping
    gate.report()                  # dict of plain numbers (experts selected, binary S(Z), ...)

* Static gates (``per_example=False``) ignore the values of ``x``: they use only its batch
  size (``x`` may also be an ``int`` batch size) and return the same weights for every row.
* ``regularization()`` returns the scalar sum of the penalties of the most recent forward
  call (entropy, the DSelect-k unused-code penalty, Gumbel sparsity ...), already multiplied by
  their coefficients; ``aux`` holds them by name. It is 0 when the gate has none.
* ``selected_experts(weights)`` counts the experts with nonzero weight per row: ``[batch]``.
* ``on_step(step, total_steps)`` lets gates with schedules (temperature annealing) update
  themselves; the default does nothing.
* Dtypes: a per-example gate casts any floating ``x`` to its parameters' dtype (integer ``x``
  is a ValueError, as are NaN/inf gate logits) and every gate returns its weights in ``x``'s
  dtype when ``x`` is a floating tensor (else in its parameters' dtype).

Every gate here is interchangeable inside :class:`routelab.layers.MultiGateMoE`.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from routelab.assignment._checks import check_generator

__all__ = ["MTLGate", "check_positive_int", "check_k", "check_nonneg", "check_pos", "uniform_init",
           "batch_size_of", "check_finite", "floating_input", "check_seed"]


# -- validators shared by every layer above this one (gates, routers, estimators, layers) -------
# (the generator check is assignment._checks.check_generator, the lowest layer's)
def check_finite(tensors: torch.Tensor | Sequence[torch.Tensor], what: str, fix: str) -> None:
    """ValueError ``"{what} are not finite (NaN or inf): {fix}"`` unless every entry is finite.

    One reduction per tensor and a single host synchronisation for all of them together: the
    only sync such a check adds to a forward pass (it is a graph break under ``torch.compile``,
    like any data-dependent check). Empty tensors pass.
    """
    if isinstance(tensors, torch.Tensor):
        tensors = (tensors,)
    flags = [torch.isfinite(t).all() for t in tensors if t.numel()]
    if not flags:
        return
    ok = flags[0] if len(flags) == 1 else torch.stack(flags).all()
    if not bool(ok):
        raise ValueError(f"{what} are not finite (NaN or inf): {fix}")


def floating_input(x: torch.Tensor, name: str, dtype: torch.dtype) -> torch.Tensor:
    """``x`` cast to the module's compute ``dtype``; ValueError (naming ``name``) unless ``x`` is floating.

    The dtype policy of routelab's modules: any floating input (float16, bfloat16, float32,
    float64) is accepted and computed in the dtype of the module's parameters; the module returns
    its output in the input's dtype. Integer, bool and complex inputs are rejected.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise ValueError(
            f"{name} must be a floating tensor (float16, bfloat16, float32 or float64), got {x.dtype}; "
            f"convert it with {name}.float()"
        )
    return x if x.dtype == dtype else x.to(dtype)


def check_positive_int(name: str, value: Any) -> int:
    """Return ``value`` if it is an int >= 1, else raise a ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
    return value


def check_seed(seed: Any, name: str = "seed") -> int:
    """``seed`` as an int for ``torch.Generator.manual_seed``: an integer (Python, numpy or a
    0-dim integer tensor; not a bool) in ``[0, 2**64)``, else a ValueError naming ``name``."""
    try:
        value = None if isinstance(seed, bool) else operator.index(seed)
    except TypeError:
        value = None
    if value is None or not 0 <= value < 2**64:
        raise ValueError(f"{name} must be an integer in [0, 2**64), got {seed!r}")
    return value


def check_k(k: Any, num_experts: int) -> int:
    """Return ``k`` if it is an int with 1 <= k <= num_experts, else raise a ValueError."""
    check_positive_int("k", k)
    if k > num_experts:
        raise ValueError(f"k = {k} must be <= num_experts = {num_experts} (select at most n).")
    return k


def check_nonneg(name: str, v: Any) -> float:
    """Return ``v`` as a float if it is a finite number >= 0, else raise a ValueError naming ``name``."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {v!r}.")
    return float(v)


def check_pos(name: str, v: Any) -> float:
    """Return ``v`` as a float if it is a finite number > 0, else raise a ValueError naming ``name``."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {v!r}.")
    return float(v)


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
        raise ValueError(
            "x must be a tensor [batch, input_dim] (or an int batch size for a static gate), "
            f"got {type(x).__name__}{'' if not isinstance(x, torch.Tensor) else tuple(x.shape)}."
        )
    return int(x.shape[0])


class MTLGate(nn.Module):
    """Base class of the multi-task gates: shared bookkeeping, see the module docstring.

    Args:
        num_experts: n, the number of experts the gate weighs (>= 1).
        per_example: whether the weights depend on the input (then ``input_dim`` is needed).
        input_dim: p, the width of ``x`` for per-example gates.
    """

    def __init__(self, num_experts: int, *, per_example: bool = False,
                 input_dim: int | None = None) -> None:
        super().__init__()
        self.num_experts = check_positive_int("num_experts", num_experts)
        self.per_example = bool(per_example)
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

    # -- the shared interface -----------------------------------------------------------------
    def regularization(self) -> torch.Tensor:
        """Scalar sum of the penalties of the last forward call (0 if none)."""
        if not self.aux:
            return torch.zeros(())
        return torch.stack([v.reshape(()) for v in self.aux.values()]).sum()

    @staticmethod
    def selected_experts(weights: torch.Tensor) -> torch.Tensor:
        """Number of experts with nonzero weight per row: ``[batch, n] -> [batch]`` (float)."""
        return (weights != 0).sum(dim=-1).to(torch.float32)

    def on_step(self, step: int, total_steps: int) -> None:  # noqa: B027 - optional hook
        """Schedule hook called before training step ``step`` of ``total_steps`` (default: none)."""

    def track(self, step: int) -> None:  # noqa: B027 - optional hook
        """Bookkeeping hook called after training step ``step`` (default: none)."""

    def report(self) -> dict[str, Any]:
        """Plain-number summary of the last forward: experts selected per example and mean."""
        out: dict[str, Any] = {}
        if self._last_weights is not None:
            sel = self.selected_experts(self._last_weights.detach())
            out["experts_selected_mean"] = float(sel.mean())
            out["experts_selected"] = sel.tolist() if self.per_example else float(sel[0])
        return out

    def _remember(self, weights: torch.Tensor, x: torch.Tensor | int | None = None) -> torch.Tensor:
        """Keep ``weights`` for :meth:`report`; return them in ``x``'s dtype when ``x`` is a floating tensor."""
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != weights.dtype:
            weights = weights.to(x.dtype)
        self._last_weights = weights.detach()
        return weights
