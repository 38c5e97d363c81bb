"""The one description of an MoE layer: :class:`MoEConfig` (in the manner of MegaBlocks' ``Arguments``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from .._checks import ArgumentTypeError, check_capacity_factor, check_flag, check_positive_int
from ..routers import Router, check_router_arguments, make_router
from ..routing import DROP_POLICIES
from .experts import resolve_activation

__all__ = ["DISPATCH_MODES", "MoEConfig"]

#: How the layer lays out the tokens for its experts (see :class:`~routelab.layers.MoE`).
DISPATCH_MODES: tuple[str, ...] = ("auto", "grouped", "buffers")


@dataclass(frozen=True)
class MoEConfig:
    """Everything that defines an MoE layer except its parameters, validated once.

    :class:`~routelab.layers.MoE`, :class:`~routelab.parallel.ExpertParallelMoE` and the
    benchmarks are built from it (``MoE.from_config(config)``, or the layers' keyword
    constructors, which make one); ``layer.config`` describes a built layer.

    Attributes:
        d_model: token width.
        d_hidden: hidden width of each expert.
        num_experts: ``E``.
        router: a name in :data:`routelab.routers.ROUTERS` (aliases accepted) or a
            :class:`~routelab.routers.Router` instance built for ``d_model`` and ``num_experts``.
        capacity_factor: ``> 0``, or ``None`` for dropless routing.
        k: experts per token for routers that take it (with a router name only).
        router_kwargs: options of the router's constructor (with a router name only).
        drop_policy: one of :data:`routelab.routing.DROP_POLICIES`.
        importance_weighting: combine with ``gate * weight`` instead of ``gate``.
        activation: expert activation, a name in :data:`routelab.layers.experts.ACTIVATIONS`, a gated
            name in :data:`routelab.layers.experts.GATED_ACTIVATIONS` (``"swiglu"``: gated SiLU) or a
            callable.
        bias: expert biases.
        gated: gated (GLU) :class:`~routelab.layers.StackedExperts` (also implied by a gated name).
        experts: the user's experts module instead of :class:`~routelab.layers.StackedExperts`
            (any ``nn.Module`` mapping buffers ``[E, C, d_model] -> [E, C, d_model]``; see
            :class:`~routelab.layers.MoE`); ``d_hidden``, ``activation``, ``bias`` and ``gated`` then
            describe nothing the layer builds.
        eval_capacity_factor: the capacity factor in ``eval()`` mode, ``> 0``, or ``None`` (the
            default) for dropless inference: at eval no token is dropped, so a token's output
            does not depend on its batch-mates through capacity.
        check_finite: whether the router checks its scores for NaN/inf (one host sync per call,
            skipped while ``torch.compile`` traces); ``None`` (the default) keeps the router's
            own setting (``True`` for a router built by name). ``False`` also skips the
            capacity step's check of the router's expert indices (its host sync), so that a
            layer with ``False`` and grouped dispatch (or a set capacity factor) runs its forward
            without a host synchronisation.
        dispatch: one of :data:`DISPATCH_MODES`: ``"grouped"`` sorts the kept pairs by expert and
            runs grouped matmuls (``torch._grouped_mm``; no padding, no host sync even dropless;
            the stacked experts only, where grouped matmuls run on the device and dtype),
            ``"buffers"`` gathers them into ``[E, C, d_model]`` buffers (any experts module),
            ``"auto"`` (the default) picks buffers where a capacity factor of at most 1 makes
            them pad nothing (``E * C <= tokens * k``), else grouped where it can run and the
            router proposes exactly ``k`` experts per token (top-k, Switch, BASE, Sinkhorn,
            Gumbel-Matching), else buffers (batchwise gating's ``E`` masked slots;
            :meth:`routelab.layers.MoE.uses_grouped`).

    Raises:
        ValueError: naming the field, for a non-positive width or expert count, an unknown
            activation or router name, ``k``/``router_kwargs`` with a router instance, a router
            instance of other sizes, a bad capacity factor or drop policy.
    """

    d_model: int
    d_hidden: int
    num_experts: int
    router: str | Router = "topk"
    capacity_factor: float | None = 1.0
    k: int | None = None
    router_kwargs: Mapping[str, Any] | None = None
    drop_policy: str = "position"
    importance_weighting: bool = False
    activation: str | Callable[[Tensor], Tensor] = "gelu"
    bias: bool = True
    gated: bool = False
    experts: nn.Module | None = None
    eval_capacity_factor: float | None = None
    check_finite: bool | None = None
    dispatch: str = "auto"

    def __post_init__(self) -> None:
        for name in ("d_model", "d_hidden", "num_experts"):
            check_positive_int(name, getattr(self, name))
        _, gated = resolve_activation(self.activation, self.gated)
        object.__setattr__(self, "gated", gated)
        if self.experts is not None and not isinstance(self.experts, nn.Module):
            raise ValueError(f"experts must be an nn.Module mapping [E, C, d_model] -> [E, C, d_model] (or None for "
                             f"StackedExperts), got {type(self.experts).__name__}")
        if isinstance(self.router, Router):
            if self.k is not None or self.router_kwargs:
                raise ValueError("pass k and router_kwargs only with a router name; configure a Router instance "
                                 "directly")
            if self.router.d_model != self.d_model or self.router.num_experts != self.num_experts:
                raise ValueError(
                    f"router was built for d_model={self.router.d_model}, num_experts={self.router.num_experts} but "
                    f"the layer has d_model={self.d_model}, num_experts={self.num_experts}"
                )
        elif isinstance(self.router, str):
            if self.router_kwargs is not None and not isinstance(self.router_kwargs, Mapping):
                raise ValueError(f"router_kwargs must be a dict of router options, got "
                                 f"{type(self.router_kwargs).__name__}")
            # the options and k the router takes (a replace(router=...) may carry those of another)
            check_router_arguments(self.router, self.num_experts, self.k, dict(self.router_kwargs or {}))
            if self.k is not None:
                object.__setattr__(self, "k", int(self.k))  # (a NumPy integer is kept as a Python int)
        else:
            raise ValueError(f"router must be a router name or a Router instance, got {type(self.router).__name__}")
        check_capacity_factor(self.capacity_factor)
        try:
            check_capacity_factor(self.eval_capacity_factor)
        except ValueError as err:
            raise ValueError(str(err).replace("capacity_factor", "eval_capacity_factor", 1)) from None
        if self.check_finite is not None:  # a Python or NumPy bool, as every flag (check_flag)
            if not isinstance(self.check_finite, (bool, np.bool_)):
                raise ArgumentTypeError(f"check_finite must be True, False or None, got {self.check_finite!r}")
            object.__setattr__(self, "check_finite", bool(self.check_finite))
        if self.dispatch not in DISPATCH_MODES:
            raise ValueError(f"dispatch must be one of {', '.join(DISPATCH_MODES)}, got {self.dispatch!r}")
        if self.dispatch == "grouped" and self.experts is not None and not _groups(self.experts):
            raise ValueError(f"dispatch='grouped' needs experts with the grouped form (experts(rows, offsets=, "
                             f"expert_of_row=) and grouped_supported(device), as routelab's StackedExperts); "
                             f"{type(self.experts).__name__} runs on buffers: use dispatch='buffers' or 'auto'")
        if self.drop_policy not in DROP_POLICIES:
            raise ValueError(f"drop_policy must be one of {', '.join(DROP_POLICIES)}, got {self.drop_policy!r}")
        object.__setattr__(self, "importance_weighting", check_flag("importance_weighting", self.importance_weighting))
        object.__setattr__(self, "bias", check_flag("bias", self.bias))

    def build_router(self, device: torch.device | str | None = None) -> Router:
        """The router: the instance itself, or a new one built by name (on ``device``), with
        ``check_finite`` applied when it is not ``None``."""
        if isinstance(self.router, Router):
            router = self.router
        else:
            router = make_router(self.router, self.d_model, self.num_experts, k=self.k,
                                 **dict(self.router_kwargs or {}))
            router = router if device is None else router.to(device)
        if self.check_finite is not None:
            router.check_finite = self.check_finite
        return router

    def layer_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``MoE(**config.layer_kwargs())`` (the fields, not copied)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def replace(self, **changes: Any) -> MoEConfig:
        """A copy with ``changes`` (validated again). A router instance given for a config with a
        router name drops its ``k`` and ``router_kwargs`` (they configure routers built by name),
        unless they are given too. Another router name keeps them: a ValueError names an option or
        ``k`` the new router does not take (give ``router_kwargs=`` / ``k=`` with it)."""
        if isinstance(changes.get("router"), Router):
            changes.setdefault("k", None)
            changes.setdefault("router_kwargs", None)
        try:
            return dataclasses.replace(self, **changes)
        except ValueError as err:
            kept = [name for name in ("k", "router_kwargs") if name not in changes and getattr(self, name)]
            if isinstance(changes.get("router"), str) and kept:
                raise ValueError(f"{err} (replace(router={changes['router']!r}) keeps this config's "
                                 f"{' and '.join(kept)}: pass {', '.join(f'{n}=' for n in kept)} with it)") from None
            raise


def _groups(experts: nn.Module) -> bool:
    """Whether an experts module has the grouped form of the experts protocol (it says where it
    can run it: ``grouped_supported(device)``)."""
    return callable(getattr(experts, "grouped_supported", None))
