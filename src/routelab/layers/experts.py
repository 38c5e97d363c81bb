"""Feed-forward experts as stacked weight tensors, applied with batched matmuls."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._checks import check_positive_int, floating_input

__all__ = ["ACTIVATIONS", "StackedExperts"]

#: Activation functions accepted by name.
ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "gelu": F.gelu,
    "relu": F.relu,
    "silu": F.silu,
    "tanh": torch.tanh,
}


class StackedExperts(nn.Module):
    """``E`` two-layer feed-forward networks ``x -> act(x W1_e + b1_e) W2_e + b2_e``.

    The weights of all experts are stacked (``w1 [E, d_model, d_hidden]``, ``w2 [E, d_hidden,
    d_model]``) so one batched matmul runs every expert on its own buffer of tokens. Each expert
    is initialised like ``nn.Linear`` (uniform in ``±1/sqrt(fan_in)``).

    Args:
        d_model: input and output width.
        d_hidden: hidden width.
        num_experts: ``E``.
        activation: a name in :data:`ACTIVATIONS` or a callable.
        bias: whether the two layers have biases.
    """

    def __init__(
        self,
        d_model: int,
        d_hidden: int,
        num_experts: int,
        *,
        activation: str | Callable[[Tensor], Tensor] = "gelu",
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        for name, value in (("d_model", d_model), ("d_hidden", d_hidden), ("num_experts", num_experts)):
            check_positive_int(name, value)
        if isinstance(activation, str):
            if activation not in ACTIVATIONS:
                raise ValueError(f"unknown activation {activation!r}; choose one of {', '.join(ACTIVATIONS)} or pass a callable")
            self.activation = ACTIVATIONS[activation]
        elif callable(activation):
            self.activation = activation
        else:
            raise ValueError(f"activation must be a name or a callable, got {type(activation).__name__}")
        self.d_model, self.d_hidden, self.num_experts = d_model, d_hidden, num_experts
        factory = {"device": device, "dtype": dtype}
        self.w1 = nn.Parameter(torch.empty(num_experts, d_model, d_hidden, **factory))
        self.w2 = nn.Parameter(torch.empty(num_experts, d_hidden, d_model, **factory))
        self.b1 = nn.Parameter(torch.empty(num_experts, 1, d_hidden, **factory)) if bias else None
        self.b2 = nn.Parameter(torch.empty(num_experts, 1, d_model, **factory)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.Linear``'s default initialisation, expert by expert."""
        for w, b, fan_in in ((self.w1, self.b1, self.d_model), (self.w2, self.b2, self.d_hidden)):
            bound = 1.0 / math.sqrt(fan_in)
            nn.init.uniform_(w, -bound, bound)
            if b is not None:
                nn.init.uniform_(b, -bound, bound)

    def forward(self, buffers: Tensor) -> Tensor:
        """Run expert ``e`` on ``buffers[e]``.

        Args:
            buffers: ``[E, C, d_model]``, any floating dtype: computed in the parameters' dtype
                and returned in ``buffers``' dtype (the dtype policy of routelab's modules).

        Returns:
            ``[E, C, d_model]``.

        Raises:
            TypeError, ValueError: ``buffers`` is not a floating ``[E, C, d_model]`` tensor.
        """
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
        if self.b2 is not None:
            return torch.baddbmm(self.b2, h, self.w2)
        return torch.bmm(h, self.w2)

    def expert(self, e: int, x: Tensor) -> Tensor:
        """Expert ``e`` alone on ``x [tokens, d_model]`` (for references and tests)."""
        h = x @ self.w1[e]
        if self.b1 is not None:
            h = h + self.b1[e, 0]
        y = self.activation(h) @ self.w2[e]
        if self.b2 is not None:
            y = y + self.b2[e, 0]
        return y

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, d_model={self.d_model}, d_hidden={self.d_hidden}, bias={self.b1 is not None}"
