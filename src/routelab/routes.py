"""The one record every routing method returns.

A routing method decides, for every token, which expert(s) see it (``expert``), with what
combine weight (``gate``), whether capacity let it through (``keep``), with what importance
weight (``weight``) and under what router log-probability (``log_prob``). Because every method
returns the same :class:`Routes`, every layer accepts every method.

All per-slot tensors share one shape ``[..., tokens, slots]``: optional leading batch
dimensions, then tokens, then slots (``slots = k`` for top-k, ``1`` for sampling). Every router
and layer uses that layout, and so do the samplers of :mod:`routelab.estimators`
(:func:`~routelab.estimators.sample_routes` returns ``slots = 1``).

The property that makes a stochastic method *unbiased*: for any table ``h``,
``E[sum_i keep_i * weight_i * h(i, expert_i)] = sum_i sum_j p_ij * h_ij`` with ``p`` the
router's distribution.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = ["Routes"]

# The per-slot tensor fields, in declaration order.
_SLOT_FIELDS: tuple[str, ...] = ("expert", "gate", "keep", "weight", "log_prob")
_FLOAT_FIELDS: tuple[str, ...] = ("gate", "weight", "log_prob")


@dataclass(eq=False)
class Routes:
    """A routing decision for a batch of tokens.

    Shapes: every per-slot tensor is ``[..., tokens, slots]`` (leading batch dims allowed).

    Attributes:
        expert: ``LongTensor [..., tokens, slots]`` — the expert chosen for each slot.
        gate: ``Tensor [..., tokens, slots]`` — combine weight, differentiable where the
            method is.
        keep: ``BoolTensor [..., tokens, slots]`` — ``False`` where capacity dropped the slot.
        weight: ``Tensor [..., tokens, slots]`` — importance weight, detached; ``1`` where the
            method has none.
        log_prob: ``Tensor [..., tokens, slots]`` — ``log p(expert | token)`` under the
            router, for REINFORCE-style estimators.
        aux: named auxiliary losses (e.g. ``"balance"``, ``"importance"``, ``"load"``,
            ``"entropy"``, ``"threshold"``), each a tensor (usually a scalar).
        stats: named diagnostics that are not losses (e.g. tokens per expert, dropped
            fraction), each a tensor.

    Raises:
        TypeError: if a per-slot field is not a tensor, or ``aux``/``stats`` is not a dict of
            tensors.
        ValueError: if the per-slot tensors differ in shape or device, have fewer than two
            dimensions, or have the wrong dtype (``expert`` must be ``torch.long``, ``keep``
            ``torch.bool``, the others floating point).

    Example:
        >>> expert = torch.tensor([0, 2, 1, 2])            # [tokens]
        >>> routes = Routes.from_expert(expert)            # one slot per token
        >>> routes.expert.shape
        torch.Size([4, 1])
        >>> routes.tokens_per_expert(3)
        tensor([1, 1, 2])
    """

    expert: Tensor
    gate: Tensor
    keep: Tensor
    weight: Tensor
    log_prob: Tensor
    aux: dict[str, Tensor] = field(default_factory=dict)
    stats: dict[str, Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in _SLOT_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, Tensor):
                raise TypeError(
                    f"Routes.{name} must be a torch.Tensor of shape [..., tokens, slots], "
                    f"got {type(value).__name__}; wrap it with torch.as_tensor(...)."
                )

        shape = self.expert.shape
        if self.expert.dim() < 2:
            raise ValueError(
                f"Routes.expert must have shape [..., tokens, slots] (at least 2 dims), got "
                f"shape {tuple(shape)}; add a slot dim with expert.unsqueeze(-1) or build the "
                f"record with Routes.from_expert(expert)."
            )
        for name in _SLOT_FIELDS[1:]:
            other = getattr(self, name)
            if other.shape != shape:
                raise ValueError(
                    f"Routes.{name} has shape {tuple(other.shape)} but Routes.expert has shape "
                    f"{tuple(shape)}; all of expert, gate, keep, weight, log_prob must share "
                    f"one shape [..., tokens, slots] (expand or reshape {name} to match)."
                )
            if other.device != self.expert.device:
                raise ValueError(
                    f"Routes.{name} is on {other.device} but Routes.expert is on "
                    f"{self.expert.device}; move it with {name}.to(expert.device)."
                )

        if self.expert.dtype != torch.long:
            raise ValueError(
                f"Routes.expert must have dtype torch.long, got {self.expert.dtype}; "
                f"convert it with expert.long()."
            )
        if self.keep.dtype != torch.bool:
            raise ValueError(
                f"Routes.keep must have dtype torch.bool, got {self.keep.dtype}; "
                f"convert it with keep.bool() (or build it from a comparison)."
            )
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if not value.is_floating_point():
                raise ValueError(
                    f"Routes.{name} must be a floating-point tensor, got {value.dtype}; "
                    f"convert it with {name}.float()."
                )

        for name in ("aux", "stats"):
            mapping = getattr(self, name)
            if not isinstance(mapping, dict):
                raise TypeError(
                    f"Routes.{name} must be a dict[str, Tensor], got {type(mapping).__name__}."
                )
            for key, value in mapping.items():
                if not isinstance(value, Tensor):
                    raise TypeError(
                        f"Routes.{name}[{key!r}] must be a torch.Tensor, got "
                        f"{type(value).__name__}; wrap it with torch.as_tensor(...)."
                    )

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_expert(
        cls,
        expert: Tensor,
        *,
        gate: Tensor | None = None,
        keep: Tensor | None = None,
        weight: Tensor | None = None,
        log_prob: Tensor | None = None,
        add_slot_dim: bool = True,
    ) -> Routes:
        """Build a :class:`Routes` from chosen experts, filling the other fields with defaults.

        Defaults: ``gate = 1``, ``keep = True``, ``weight = 1``, ``log_prob = 0``. Floating
        defaults take ``gate``'s dtype when ``gate`` is given, else the default dtype; all
        defaults live on ``expert``'s device.

        Args:
            expert: integer tensor ``[..., tokens]`` (one slot per token; a slot dim is
                added), or ``[..., tokens, slots]`` when ``add_slot_dim=False``. Any integer
                dtype is accepted and converted to ``torch.long``.
            gate, keep, weight, log_prob: optional tensors with the same shape as ``expert``
                (as passed); they receive the same slot dim.
            add_slot_dim: if ``True`` (default) ``expert`` is ``[..., tokens]`` and the
                result has ``slots = 1``; if ``False`` ``expert`` already is
                ``[..., tokens, slots]``.

        Returns:
            Routes with tensors of shape ``[..., tokens, 1]`` (or ``[..., tokens, slots]``).

        Raises:
            ValueError: if ``expert`` is not an integer tensor, or has too few dims.
        """
        if not isinstance(expert, Tensor):
            raise TypeError(
                f"expert must be a torch.Tensor, got {type(expert).__name__}; "
                f"wrap it with torch.as_tensor(...)."
            )
        if expert.is_floating_point() or expert.is_complex() or expert.dtype == torch.bool:
            raise ValueError(
                f"expert must be an integer tensor of expert indices, got dtype {expert.dtype}; "
                f"pass indices (e.g. scores.argmax(-1)), not scores or masks."
            )
        min_dims = 1 if add_slot_dim else 2
        if expert.dim() < min_dims:
            wanted = "[..., tokens]" if add_slot_dim else "[..., tokens, slots]"
            raise ValueError(
                f"expert must have shape {wanted}, got shape {tuple(expert.shape)}."
            )

        def lift(t: Tensor) -> Tensor:
            return t.unsqueeze(-1) if add_slot_dim else t

        expert = expert.long()
        float_dtype = gate.dtype if gate is not None else torch.get_default_dtype()
        device = expert.device
        if gate is None:
            gate = torch.ones(expert.shape, dtype=float_dtype, device=device)
        if keep is None:
            keep = torch.ones(expert.shape, dtype=torch.bool, device=device)
        if weight is None:
            weight = torch.ones(expert.shape, dtype=float_dtype, device=device)
        if log_prob is None:
            log_prob = torch.zeros(expert.shape, dtype=float_dtype, device=device)
        return cls(
            expert=lift(expert),
            gate=lift(gate),
            keep=lift(keep),
            weight=lift(weight),
            log_prob=lift(log_prob),
        )

    # ------------------------------------------------------------------ properties

    @property
    def num_slots(self) -> int:
        """Number of slots per token (``k`` for top-k, ``1`` for sampling)."""
        return self.expert.shape[-1]

    @property
    def num_tokens(self) -> int:
        """Number of tokens (the second-to-last dim)."""
        return self.expert.shape[-2]

    @property
    def batch_shape(self) -> torch.Size:
        """The leading batch dims ``[...]`` (empty for a plain ``[tokens, slots]`` record)."""
        return self.expert.shape[:-2]

    # ------------------------------------------------------------------ diagnostics

    def tokens_per_expert(self, num_experts: int) -> Tensor:
        """Count the kept slots routed to each expert.

        Args:
            num_experts: number of experts ``E``; every kept ``expert`` index must lie in
                ``[0, E)``.

        Returns:
            ``LongTensor [..., num_experts]``: for each leading batch index, how many kept
            (token, slot) pairs chose each expert. Dropped slots (``keep == False``) are not
            counted, whatever their ``expert`` value.

        Raises:
            ValueError: if ``num_experts < 1`` or a kept slot's expert is out of range.
        """
        if num_experts < 1:
            raise ValueError(f"num_experts must be >= 1, got {num_experts}.")
        batch_shape = self.batch_shape
        rows = math.prod(batch_shape)
        slots_per_row = self.num_tokens * self.num_slots
        flat_expert = self.expert.reshape(rows, slots_per_row)
        flat_keep = self.keep.reshape(rows, slots_per_row)

        kept = flat_expert[flat_keep]
        if kept.numel() and (int(kept.min()) < 0 or int(kept.max()) >= num_experts):
            raise ValueError(
                f"kept expert indices must lie in [0, {num_experts}), found values in "
                f"[{int(kept.min())}, {int(kept.max())}]; pass the right num_experts or mark "
                f"those slots keep=False."
            )

        index = flat_expert.masked_fill(~flat_keep, 0)
        counts = torch.zeros(rows, num_experts, dtype=torch.long, device=self.expert.device)
        counts.scatter_add_(1, index, flat_keep.long())
        return counts.reshape(*batch_shape, num_experts)

    def dropped_fraction(self) -> Tensor:
        """Fraction of (token, slot) pairs dropped by capacity (``keep == False``).

        Returns:
            ``float32 Tensor [...]`` (a scalar for a plain ``[tokens, slots]`` record), in
            ``[0, 1]``; ``0`` when there are no slots at all.
        """
        total = self.num_tokens * self.num_slots
        dropped = (~self.keep).sum(dim=(-2, -1)).to(torch.float32)
        return dropped / max(total, 1)

    # ------------------------------------------------------------------ movement

    def to(self, device: torch.device | str) -> Routes:
        """Return a copy with every tensor (per-slot fields, ``aux``, ``stats``) on ``device``.

        Dtypes are unchanged and autograd history is kept (``Tensor.to`` is differentiable).
        """
        moved = {name: getattr(self, name).to(device) for name in _SLOT_FIELDS}
        return Routes(
            **moved,
            aux={k: v.to(device) for k, v in self.aux.items()},
            stats={k: v.to(device) for k, v in self.stats.items()},
        )

    def __repr__(self) -> str:
        return (
            f"Routes(batch_shape={tuple(self.batch_shape)}, tokens={self.num_tokens}, "
            f"slots={self.num_slots}, device={self.expert.device}, "
            f"dtype={self.gate.dtype}, aux={sorted(self.aux)}, stats={sorted(self.stats)})"
        )
