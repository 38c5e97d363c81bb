"""Multi-gate mixture of experts for multi-task learning (Ma et al. 2018; Hazimeh et al. 2021,
Fig. 1 right) and the shared-bottom baseline (Caruana 1997).

::

    x [batch, ...] -> experts           -> E [batch, n, d]     (shared by all tasks)
    gate_t(x)      -> w_t [batch, n]                            (one gate per task, any MTLGate)
    y_t = tower_t( sum_i w_t[:, i] E[:, i] )   [batch, out_t]

Any gate of :mod:`routelab.gates` that follows the :class:`~routelab.gates.mtl_gate.MTLGate`
interface (DSelect-k, Top-k, softmax, Gumbel-softmax, the ablations) can be used per task.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from .._checks import check_finite, check_generator, check_positive_int, floating_input
from ..gates.mtl_gate import MTLGate

__all__ = ["MultiGateMoE", "SharedBottom", "StackedLinear"]


class StackedLinear(nn.Module):
    """n independent dense layers on the same input, in one batched matmul.

    ``[batch, in_dim]`` (shared input) or ``[batch, n, in_dim]`` (one input per expert) ->
    ``[batch, n, out_dim]``, then ``activation``. Initialised like ``nn.Linear`` (uniform
    ±1/sqrt(in_dim)) unless ``init_std`` is given (then normal with that std, biases too);
    ``dropout`` (default 0) is applied after the activation.

    Dtypes (routelab's module policy): any floating ``x`` is computed in the parameters' dtype
    and the output returned in ``x``'s dtype; a non-floating ``x`` is a ValueError.

    Args:
        num_experts: n. in_dim / out_dim: widths. activation: applied after (default none).
        generator: optional torch.Generator for the initialisation.
    """

    def __init__(self, num_experts: int, in_dim: int, out_dim: int, *,
                 activation: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 init_std: float | None = None, dropout: float = 0.0,
                 generator: torch.Generator | None = None) -> None:
        super().__init__()
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}.")
        self.dropout = nn.Dropout(dropout) if dropout > 0 else None
        for name, v in (("num_experts", num_experts), ("in_dim", in_dim), ("out_dim", out_dim)):
            check_positive_int(name, v)
        self.num_experts, self.in_dim, self.out_dim = num_experts, in_dim, out_dim
        check_generator(generator)
        if init_std is None:
            bound = 1.0 / math.sqrt(in_dim)
            w = (torch.rand((num_experts, in_dim, out_dim), generator=generator) * 2 - 1) * bound
            b = (torch.rand((num_experts, out_dim), generator=generator) * 2 - 1) * bound
        else:
            w = torch.randn((num_experts, in_dim, out_dim), generator=generator) * init_std
            b = torch.randn((num_experts, out_dim), generator=generator) * init_std
        self.weight = nn.Parameter(w)
        self.bias = nn.Parameter(b)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out_dtype = x.dtype if isinstance(x, torch.Tensor) else None
        x = floating_input(x, "x", self.weight.dtype)
        if x.dim() == 2:
            if x.shape[1] != self.in_dim:
                raise ValueError(f"x must be [batch, {self.in_dim}], got {tuple(x.shape)}.")
            y = torch.einsum("bi,nio->bno", x, self.weight)
        elif x.dim() == 3:
            if x.shape[1:] != (self.num_experts, self.in_dim):
                raise ValueError(f"x must be [batch, {self.num_experts}, {self.in_dim}], got {tuple(x.shape)}.")
            y = torch.einsum("bni,nio->bno", x, self.weight)
        else:
            raise ValueError(f"x must be [batch, in_dim] or [batch, n, in_dim], got {tuple(x.shape)}.")
        y = y + self.bias
        y = self.activation(y) if self.activation is not None else y
        y = self.dropout(y) if self.dropout is not None else y
        return y if y.dtype == out_dtype else y.to(out_dtype)


def _as_tower_list(towers: Sequence[nn.Module] | None, num_tasks: int) -> nn.ModuleList:
    if towers is None:
        return nn.ModuleList([nn.Identity() for _ in range(num_tasks)])
    towers = list(towers)
    if len(towers) != num_tasks:
        raise ValueError(f"towers must have one module per task ({num_tasks}), got {len(towers)}.")
    return nn.ModuleList(towers)


class MultiGateMoE(nn.Module):
    """Shared experts, one gate per task, task towers.

    Args:
        experts: either one module mapping ``x -> [batch, n, d]`` (e.g. :class:`StackedLinear`;
            it must have an int attribute ``num_experts``) or a sequence of n modules, each
            ``x -> [batch, d]``. With a sequence, experts that no task's gate weighs (all
            weights exactly 0 in the batch) are not evaluated: conditional computation once
            sparse gates have converged. Only where that changes no gradient: with gradients
            enabled, every gate must say its zeros have a zero gradient (``exact_zeros``:
            DSelect-k, top-k, softmax; not the straight-through Gumbel-softmax gate in training,
            nor a gate that does not say).
        gates: one gate per task (:class:`~routelab.gates.mtl_gate.MTLGate`), each with
            ``num_experts == n``.
        towers: one module per task mapping the mixture ``[batch, d]`` to the task output, or
            None for identity towers.
        check_finite: check a floating ``x`` for NaN/inf on every call (one host sync); the
            gates' own checks are theirs (``gate.check_finite``).

    ``forward(x, gate_x=None)`` returns a list with one tensor per task; the gates receive
    ``gate_x`` if given, else ``x.flatten(1)``. After a forward, :attr:`last_weights` holds the
    gates' weights (``[batch, n]`` per task) and :meth:`regularization` the sum of the gates'
    penalties.

    Dtypes (routelab's module policy): a floating ``x`` is cast to the experts' parameter dtype
    (the first floating parameter of ``experts``; none: ``x``'s own), experts, gates' mixture and
    towers compute in it, and every floating task output is returned in ``x``'s dtype. A
    non-floating ``x`` (token ids, say) goes to the experts unchanged. ``gate_x`` goes to the
    gates as given (each gate applies the policy itself). A floating ``x`` with NaN/inf entries
    is a ValueError (one host synchronisation per forward; ``check_finite=False`` drops the check,
    and each per-example gate has a ``check_finite`` attribute of its own); skipping unneeded
    experts of a sequence costs one more (which experts every gate left out).
    """

    def __init__(self, experts: nn.Module | Sequence[nn.Module], gates: Sequence[nn.Module],
                 towers: Sequence[nn.Module] | None = None, *, check_finite: bool = True) -> None:
        super().__init__()
        if not isinstance(check_finite, bool):
            raise TypeError(f"check_finite must be True or False, got {check_finite!r}")
        self.check_finite = check_finite
        if isinstance(experts, nn.Module) and not isinstance(experts, nn.ModuleList):
            n = getattr(experts, "num_experts", None)
            if not isinstance(n, int) or n < 1:
                raise ValueError(
                    "a single experts module must have an int attribute num_experts (and return "
                    "[batch, n, d]); pass a list of expert modules otherwise."
                )
            self.experts: nn.Module = experts
            self.stacked = True
        else:
            experts = list(experts)
            if not experts:
                raise ValueError("experts must not be empty.")
            n = len(experts)
            self.experts = nn.ModuleList(experts)
            self.stacked = False
        self.num_experts = n
        gates = list(gates)
        if not gates:
            raise ValueError("gates must have one gate per task (at least one).")
        for t, g in enumerate(gates):
            if getattr(g, "num_experts", None) != n:
                raise ValueError(
                    f"gate {t} weighs {getattr(g, 'num_experts', None)} experts, but there are {n}; "
                    "build every gate with num_experts = the number of experts."
                )
        self.gates = nn.ModuleList(gates)
        self.num_tasks = len(gates)
        self.towers = _as_tower_list(towers, self.num_tasks)
        self.last_weights: list[torch.Tensor] = []

    def _gate_weights(self, gx: torch.Tensor) -> tuple[list[torch.Tensor], list[tuple[MTLGate, torch.Tensor]]]:
        """Every gate's weights ``[batch, n]``, and the rows that routelab's static gates leave to
        be checked for NaN/inf (:meth:`~routelab.gates.MTLGate.unchecked_rows`), so that the layer
        reads them in one host sync instead of one per gate."""
        weights: list[torch.Tensor] = []
        unchecked: list[tuple[MTLGate, torch.Tensor]] = []
        for g in self.gates:
            if isinstance(g, MTLGate) and type(g).forward is MTLGate.forward:
                out = g.gate(gx)
                rows = g.unchecked_rows(out.scores)
                if rows is not None:
                    unchecked.append((g, rows))
                g.remember(out)
                weights.append(out.scores)
            else:
                weights.append(g(gx))
        return weights, unchecked

    def expert_outputs(self, x: torch.Tensor, needed: torch.Tensor | list[bool] | None = None) -> torch.Tensor:
        """``[batch, n, d]``; with a list of experts, rows of unneeded experts are zeros (``needed``:
        ``[n]`` bool, or the list of it already read)."""
        if self.stacked:
            return self.experts(x)
        outs: list[torch.Tensor | None] = []
        ref: torch.Tensor | None = None
        if needed is None:
            use = [True] * len(self.experts)
        else:
            use = needed if isinstance(needed, list) else needed.tolist()  # one host sync for all experts
        for i, e in enumerate(self.experts):
            if not use[i]:
                outs.append(None)
                continue
            o = e(x)
            ref = o
            outs.append(o)
        if ref is None:  # no gate weighs any expert (e.g. DSelect-k codes all on unused codes):
            with torch.no_grad():  # one expert, run only for the output's shape, dtype and device
                ref = self.experts[0](x)
        zero = torch.zeros_like(ref)
        return torch.stack([zero if o is None else o for o in outs], dim=1)

    def _compute_dtype(self) -> torch.dtype | None:
        """The dtype the experts compute in: that of their first floating parameter (None if none)."""
        for p in self.experts.parameters():
            if p.is_floating_point():
                return p.dtype
        return None

    def forward(self, x: torch.Tensor, gate_x: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Task outputs, a list of ``[batch, out_t]`` tensors."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor [batch, ...], got {type(x).__name__}")
        out_dtype = x.dtype if x.is_floating_point() else None
        compute = self._compute_dtype()
        if out_dtype is not None and compute is not None and compute != out_dtype:
            x = x.to(compute)
        if out_dtype is not None and self.check_finite:  # (after the cast: 1e300 in float64 is inf in float32)
            check_finite(x, "x", "the input contains NaN/inf (or a magnitude the experts' dtype cannot hold); fix "
                                 "the previous layer or the data")
        if gate_x is not None:
            if not isinstance(gate_x, torch.Tensor):
                raise TypeError(f"gate_x must be a torch.Tensor [batch, ...] or None, got {type(gate_x).__name__}")
            if gate_x.dim() == 0 or gate_x.shape[0] != x.shape[0]:
                raise ValueError(f"gate_x must have one row per example of x: x has {x.shape[0]}, gate_x has shape "
                                 f"{tuple(gate_x.shape)}")
        gx = x.flatten(1) if gate_x is None else gate_x
        weights, unchecked = self._gate_weights(gx)                  # T x [batch, n]
        needed = None
        # A list of experts skips those every gate weighs exactly 0, when that changes no gradient:
        # not under a straight-through gate (its zeros have a gradient), nor under a foreign gate.
        skippable = not torch.is_grad_enabled() or all(getattr(g, "exact_zeros", False) for g in self.gates)
        if not self.stacked and skippable:
            needed = torch.stack([(w.detach() != 0).any(dim=0) for w in weights]).any(dim=0)
        if unchecked:
            # The static gates' finite checks, read with the experts' flags: one host sync for all.
            finite = torch.stack([torch.isfinite(rows.detach()).all() for _, rows in unchecked])
            flags = (finite if needed is None else torch.cat([needed, finite])).tolist()
            if not all(flags[len(flags) - len(unchecked):]):
                for gate, rows in unchecked:
                    gate.check_rows(rows)  # (names the gate)
            needed = None if needed is None else flags[: self.num_experts]
        e = self.expert_outputs(x, needed)                           # [batch, n, d]
        if e.dim() != 3 or e.shape[1] != self.num_experts:
            raise ValueError(f"experts must produce [batch, {self.num_experts}, d], got {tuple(e.shape)}.")
        self.last_weights = [w.detach() for w in weights]
        outs = [tower(torch.einsum("bn,bnd->bd", w.to(e.dtype), e)) for w, tower in zip(weights, self.towers)]
        if out_dtype is None:
            return outs
        return [o.to(out_dtype) if o.is_floating_point() and o.dtype != out_dtype else o for o in outs]

    def regularization(self) -> torch.Tensor:
        """Sum of the gates' penalties from the last forward (scalar)."""
        return torch.stack([g.regularization().reshape(()) for g in self.gates]).sum()

    def on_step(self, step: int, total_steps: int) -> None:
        """Forward the schedule hook to every gate."""
        for g in self.gates:
            g.on_step(step, total_steps)

    def track(self, step: int) -> None:
        """Forward the bookkeeping hook to every gate."""
        for g in self.gates:
            g.track(step)

    def report(self) -> list[dict[str, Any]]:
        """Every gate's :meth:`~routelab.gates.mtl_gate.MTLGate.report`, by task."""
        return [g.report() for g in self.gates]


class SharedBottom(nn.Module):
    """Shared-bottom multi-task baseline: ``y_t = tower_t(bottom(x))``.

    Args:
        bottom: the shared module ``x -> [batch, d]``.
        towers: one module per task ``[batch, d] -> [batch, out_t]``.
    """

    def __init__(self, bottom: nn.Module, towers: Sequence[nn.Module]) -> None:
        super().__init__()
        towers = list(towers)
        if not towers:
            raise ValueError("towers must have one module per task (at least one).")
        self.bottom = bottom
        self.towers = nn.ModuleList(towers)
        self.num_tasks = len(towers)

    def forward(self, x: torch.Tensor, gate_x: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Task outputs, a list of ``[batch, out_t]`` tensors (``gate_x`` is ignored)."""
        h = self.bottom(x)
        return [t(h) for t in self.towers]

    def regularization(self) -> torch.Tensor:
        """No gate, no penalty: 0."""
        return torch.zeros(())

    def on_step(self, step: int, total_steps: int) -> None:
        """No schedule."""

    def track(self, step: int) -> None:
        """No bookkeeping."""

    def report(self) -> list[dict[str, Any]]:
        """No gates: an empty list."""
        return []
