"""Feed-forward experts as stacked weight tensors, applied with batched matmuls."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._checks import check_flag, check_positive_int, floating_input
from ._grouped import grouped_mm, grouped_mm_unsupported_reason

__all__ = ["ACTIVATIONS", "GATED_ACTIVATIONS", "StackedExperts"]

#: Activation functions accepted by name.
ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "gelu": F.gelu,
    "relu": F.relu,
    "silu": F.silu,
    "tanh": torch.tanh,
}

#: Gated (GLU) experts by name: ``"swiglu"`` is ``gated=True`` with SiLU, and so on.
GATED_ACTIVATIONS: dict[str, str] = {
    "swiglu": "silu",
    "geglu": "gelu",
    "reglu": "relu",
}


def resolve_activation(activation: str | Callable[[Tensor], Tensor], gated: bool) -> tuple[Callable[[Tensor], Tensor],
                                                                                             bool]:
    """``(activation function, gated)`` for an activation name, a gated name or a callable.

    Raises:
        ValueError: an unknown name or a non-callable, naming ``activation``.
        TypeError: ``gated`` not True or False.
    """
    gated = check_flag("gated", gated)
    if isinstance(activation, str):
        if activation in GATED_ACTIVATIONS:
            return ACTIVATIONS[GATED_ACTIVATIONS[activation]], True
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}; choose one of "
                             f"{', '.join([*ACTIVATIONS, *GATED_ACTIVATIONS])} or pass a callable")
        return ACTIVATIONS[activation], gated
    if callable(activation):
        return activation, gated
    raise ValueError(f"activation must be a name or a callable, got {type(activation).__name__}")


class StackedExperts(nn.Module):
    """``E`` feed-forward networks ``x -> act(x W1_e + b1_e) W2_e + b2_e``, or gated (GLU) ones.

    The weights of all experts are stacked (``w1 [E, d_model, d_hidden]``, ``w2 [E, d_hidden,
    d_model]``) so one batched matmul runs every expert on its own buffer of tokens. Each expert
    is initialised like ``nn.Linear`` (uniform in ``±1/sqrt(fan_in)``).

    Gated experts (``gated=True``, or ``activation="swiglu"`` / ``"geglu"`` / ``"reglu"``) have a
    third stacked weight ``w3 [E, d_model, d_hidden]`` and compute ``y = (act(x W1_e + b1_e) *
    (x W3_e + b3_e)) W2_e + b2_e`` (Shazeer 2020, "GLU variants"; SwiGLU with SiLU, as the experts
    of Mixtral, Qwen-MoE and OLMoE). :meth:`from_hf_fused` loads transformers' fused layout.

    This module follows the experts protocol of :class:`~routelab.layers.MoE`: buffers
    ``[E, C, d_model] -> [E, C, d_model]``; and its grouped form, ``experts(rows, offsets=...,
    expert_of_row=...)`` on rows sorted by expert (:meth:`forward_grouped`: ``torch._grouped_mm``,
    no padding), where :meth:`grouped_supported` says the device and dtype allow it.

    Args:
        d_model: input and output width.
        d_hidden: hidden width.
        num_experts: ``E``.
        activation: a name in :data:`ACTIVATIONS`, a gated name in :data:`GATED_ACTIVATIONS`, or a
            callable.
        bias: whether the layers have biases.
        gated: gated (GLU) experts with ``activation`` on the gate branch.
    """

    def __init__(
        self,
        d_model: int,
        d_hidden: int,
        num_experts: int,
        *,
        activation: str | Callable[[Tensor], Tensor] = "gelu",
        bias: bool = True,
        gated: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        for name, value in (("d_model", d_model), ("d_hidden", d_hidden), ("num_experts", num_experts)):
            check_positive_int(name, value)
        self.activation, self.gated = resolve_activation(activation, gated)
        self.d_model, self.d_hidden, self.num_experts = d_model, d_hidden, num_experts
        factory = {"device": device, "dtype": dtype}
        self.w1 = nn.Parameter(torch.empty(num_experts, d_model, d_hidden, **factory))
        self.w2 = nn.Parameter(torch.empty(num_experts, d_hidden, d_model, **factory))
        self.b1 = nn.Parameter(torch.empty(num_experts, 1, d_hidden, **factory)) if bias else None
        self.b2 = nn.Parameter(torch.empty(num_experts, 1, d_model, **factory)) if bias else None
        self.w3 = nn.Parameter(torch.empty(num_experts, d_model, d_hidden, **factory)) if self.gated else None
        self.b3 = nn.Parameter(torch.empty(num_experts, 1, d_hidden, **factory)) if self.gated and bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.Linear``'s default initialisation, expert by expert."""
        layers = [(self.w1, self.b1, self.d_model), (self.w2, self.b2, self.d_hidden)]
        if self.w3 is not None:
            layers.append((self.w3, self.b3, self.d_model))
        for w, b, fan_in in layers:
            bound = 1.0 / math.sqrt(fan_in)
            nn.init.uniform_(w, -bound, bound)
            if b is not None:
                nn.init.uniform_(b, -bound, bound)

    @classmethod
    def from_hf_fused(cls, gate_up_proj: Tensor, down_proj: Tensor, *, activation: str | Callable[[Tensor], Tensor]
                      = "silu") -> StackedExperts:
        """Gated experts with the weights of transformers' fused experts layout (copied).

        transformers (Mixtral, Qwen-MoE, OLMoE, ...) runs expert ``e`` as ``gate, up =
        (x @ gate_up_proj[e].T).chunk(2)``, ``y = (act(gate) * up) @ down_proj[e].T``; the result
        computes the same function with ``w1 = gate_up_proj[:, :I].mT``, ``w3 = gate_up_proj[:,
        I:].mT``, ``w2 = down_proj.mT`` and no biases.

        Args:
            gate_up_proj: ``[E, 2I, d_model]`` (e.g. ``block.experts.gate_up_proj``).
            down_proj: ``[E, d_model, I]``.
            activation: the gate branch's activation (transformers' ``hidden_act``; ``"silu"``).

        Returns:
            ``StackedExperts(d_model, I, E, activation=activation, bias=False, gated=True)`` on the
            weights' device and dtype, its parameters new tensors (not views of the inputs).

        Raises:
            ValueError: tensors that are not of those shapes, naming the argument.
        """
        for name, value in (("gate_up_proj", gate_up_proj), ("down_proj", down_proj)):
            if not isinstance(value, Tensor) or value.dim() != 3 or not value.is_floating_point():
                raise ValueError(f"{name} must be a floating tensor of 3 dimensions, got "
                                 f"{tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__}")
        E, two_i, d = gate_up_proj.shape
        if two_i % 2 or two_i == 0 or E == 0 or d == 0:
            raise ValueError(f"gate_up_proj must have shape [E, 2I, d_model] with I >= 1, got "
                             f"{tuple(gate_up_proj.shape)}")
        hidden = two_i // 2
        if tuple(down_proj.shape) != (E, d, hidden):
            raise ValueError(f"down_proj must have shape [E={E}, d_model={d}, I={hidden}] to match gate_up_proj "
                             f"{tuple(gate_up_proj.shape)}, got {tuple(down_proj.shape)}")
        if isinstance(activation, str) and activation in GATED_ACTIVATIONS:
            raise ValueError(f"activation is the gate branch's function (e.g. 'silu' for SwiGLU), got {activation!r}")
        out = cls(d, hidden, E, activation=activation, bias=False, gated=True, device=gate_up_proj.device,
                  dtype=gate_up_proj.dtype)
        with torch.no_grad():
            out.w1.copy_(gate_up_proj[:, :hidden].transpose(1, 2))
            out.w3.copy_(gate_up_proj[:, hidden:].transpose(1, 2))
            out.w2.copy_(down_proj.transpose(1, 2).to(out.w2.dtype))
        return out

    def forward(self, buffers: Tensor, offsets: Tensor | None = None, expert_of_row: Tensor | None = None) -> Tensor:
        """Run expert ``e`` on ``buffers[e]``, or on its rows of an expert-sorted matrix.

        Args:
            buffers: ``[E, C, d_model]``, any floating dtype: computed in the parameters' dtype
                and returned in ``buffers``' dtype (the dtype policy of routelab's modules).
                With ``offsets``: rows ``[R, d_model]`` sorted by expert (:meth:`forward_grouped`).
            offsets, expert_of_row: the grouped layout (see :meth:`forward_grouped`); ``None``:
                buffers.

        Returns:
            ``[E, C, d_model]`` (``[R, d_model]`` grouped).

        Raises:
            TypeError, ValueError: ``buffers`` is not a floating ``[E, C, d_model]`` tensor (rows
                ``[R, d_model]`` grouped), or only one of ``offsets`` and ``expert_of_row`` given.
        """
        if offsets is not None or expert_of_row is not None:
            if offsets is None or expert_of_row is None:
                raise ValueError("pass offsets and expert_of_row together (the grouped layout), or neither")
            return self.forward_grouped(buffers, offsets, expert_of_row)
        x = floating_input(buffers, "buffers", self.w1.dtype)
        if x.dim() != 3 or x.shape[0] != self.num_experts or x.shape[2] != self.d_model:
            raise ValueError(f"buffers must have shape [num_experts={self.num_experts}, capacity, "
                             f"d_model={self.d_model}], got {tuple(x.shape)}")
        y = self._run(x)
        return y if y.dtype == buffers.dtype else y.to(buffers.dtype)

    def _run(self, buffers: Tensor) -> Tensor:
        if self.b1 is not None:
            h = torch.baddbmm(self.b1, buffers, self.w1)
        else:
            h = torch.bmm(buffers, self.w1)
        h = self.activation(h)
        if self.w3 is not None:
            h = h * (torch.baddbmm(self.b3, buffers, self.w3) if self.b3 is not None else torch.bmm(buffers, self.w3))
        if self.b2 is not None:
            return torch.baddbmm(self.b2, h, self.w2)
        return torch.bmm(h, self.w2)

    def grouped_supported(self, device: torch.device) -> bool:
        """Whether :meth:`forward_grouped` can run on ``device`` in the parameters' dtype (grouped
        matmuls exist there, accept the dtype, ``d_model`` and ``d_hidden`` are multiples of 16
        bytes and the weights start 16-byte aligned; see
        :func:`routelab.layers._grouped.grouped_mm_supported`)."""
        return self.grouped_unsupported_reason(device) is None

    def grouped_unsupported_reason(self, device: torch.device) -> str | None:
        """Why :meth:`forward_grouped` cannot run on ``device`` (``None``: it can), for error messages."""
        weights = [w for w in (self.w1, self.w2, self.w3) if w is not None]
        return grouped_mm_unsupported_reason(torch.device(device), self.w1.dtype, (self.d_model, self.d_hidden),
                                             weights)

    def forward_grouped(self, rows: Tensor, offsets: Tensor, expert_of_row: Tensor) -> Tensor:
        """Run expert ``e`` on its rows of an expert-sorted matrix (grouped matmuls).

        Args:
            rows: ``[R, d_model]``; expert ``e``'s rows are ``offsets[e-1] <= r < offsets[e]``
                (:class:`routelab.routing.GroupedPlan` lays them out), rows from ``offsets[-1]``
                on belong to no expert. Computed in the parameters' dtype, returned in ``rows``'.
            offsets: ``IntTensor [E]`` (int32), cumulative rows per expert.
            expert_of_row: ``LongTensor [R]``, the expert of each row, ``E`` past ``offsets[-1]``
                (indexes the biases).

        Returns:
            ``[R, d_model]``; the rows of no expert are unspecified (never read by the layer;
            their gradients go nowhere).
        """
        x = floating_input(rows, "rows", self.w1.dtype)
        if x.dim() != 2 or x.shape[1] != self.d_model:
            raise ValueError(f"rows must have shape [R, d_model={self.d_model}], got {tuple(x.shape)}")

        def linear(inputs: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
            out = grouped_mm(inputs, w, offsets)
            if b is None:
                return out
            # One extra zero bias row for the rows of no expert: what they read, and where their
            # (unspecified) gradients go, is a row that is thrown away. An embedding lookup, not
            # an index: its backward sums the rows of each expert by a segment reduction, where
            # an index's backward (index_put with accumulate) serialises the rows of one expert
            # on CUDA.
            return out + F.embedding(expert_of_row, F.pad(b[:, 0], (0, 0, 0, 1)))

        h = self.activation(linear(x, self.w1, self.b1))
        if self.w3 is not None:
            h = h * linear(x, self.w3, self.b3)
        y = linear(h, self.w2, self.b2)
        return y if y.dtype == rows.dtype else y.to(rows.dtype)

    def expert(self, e: int, x: Tensor) -> Tensor:
        """Expert ``e`` alone on ``x [tokens, d_model]`` (for references and tests): computed in the
        parameters' dtype and returned in ``x``'s, as :meth:`forward`."""
        dtype = x.dtype if isinstance(x, Tensor) else None
        x = floating_input(x, "x", self.w1.dtype)
        h = x @ self.w1[e]
        if self.b1 is not None:
            h = h + self.b1[e, 0]
        h = self.activation(h)
        if self.w3 is not None:
            h = h * (x @ self.w3[e] + (self.b3[e, 0] if self.b3 is not None else 0))
        y = h @ self.w2[e]
        if self.b2 is not None:
            y = y + self.b2[e, 0]
        return y if y.dtype == dtype else y.to(dtype)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, d_model={self.d_model}, d_hidden={self.d_hidden}, "
                f"bias={self.b1 is not None}, gated={self.gated}")
