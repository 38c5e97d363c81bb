"""What the last forward of every routelab module routed: its weighted auxiliary losses and statistics.

A routelab module (:class:`routelab.layers.MoE`, a Hugging Face sparse MoE block patched by
:func:`routelab.integrations.hf.patch_moe`) records, at the end of each forward, the auxiliary
losses of its router (already multiplied by their coefficients) and its routing statistics, with
:meth:`RoutingRecord.record_routing`. :func:`aux_loss` sums the losses of every such module in a
model and :func:`routing_stats` collects the statistics, so that a training loop needs no
per-layer plumbing (and a model whose blocks return only hidden states, as transformers' blocks
do, can still train its routers)::

    loss = task_loss + routelab.aux_loss(model)

Memory: each module keeps only its *last* forward's record, released when the next forward starts
(:meth:`RoutingRecord.forget_routing`), so at most one forward's auxiliary-loss graph is kept
alive (the statistics are detached); under ``torch.no_grad`` the losses carry no graph at all.
Releasing it *before* the next forward builds its graph matters on GPUs: a record kept until the
end of the next forward would keep the router's ``AccumulateGrad`` nodes alive from one step to the
next, on the stream of the very first step, and a training step captured in a CUDA graph (on its
own stream) would then fail in backward ("operation would make the legacy stream depend on a
capturing blocking stream"). Activation checkpointing: with non-reentrant
checkpointing (``torch.utils.checkpoint(..., use_reentrant=False)``, transformers' default for
``gradient_checkpointing_enable()``) the recorded losses carry their gradients as without it; the
recomputation in backward replaces the record with equal values where it runs that far, and
leaves it in place where it stops earlier. Reentrant checkpointing runs the
forward under ``no_grad``, so its records carry no gradient: use the non-reentrant form.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn

from ..replay import in_backward

__all__ = ["RoutingRecord", "aux_loss", "routing_stats"]


class RoutingRecord:
    """Mixin for ``nn.Module``\\ s that route tokens: remembers the last forward's aux losses and stats.

    Subclasses call :meth:`record_routing` once per forward. :func:`aux_loss` and
    :func:`routing_stats` find every module with this mixin in a model.
    """

    _routelab_record: tuple[dict[str, Tensor], dict[str, Tensor]] | None = None

    def record_routing(self, aux: Mapping[str, Tensor], stats: Mapping[str, Tensor]) -> None:
        """Remember ``aux`` (weighted auxiliary losses, kept differentiable) and ``stats`` (detached).

        Args:
            aux: named scalar losses, already multiplied by their coefficients.
            stats: named diagnostics (e.g. ``tokens_per_expert [E]``, ``dropped_fraction``, ``load_cv``).
        """
        object.__setattr__(self, "_routelab_record",
                           (dict(aux), {name: value.detach() for name, value in stats.items()}))

    def forget_routing(self) -> None:
        """Drop the last forward's record (and with it the graph of its losses, unless the caller
        holds them). Called at the start of each forward, before it builds its own graph, so that
        no autograd node lives on from one step to the next (see the module docstring).

        Not inside a backward pass: there a forward is activation checkpointing's recomputation,
        which may stop before it records (non-reentrant checkpointing stops once it has rebuilt
        the tensors it needs), and the record of the step must outlive its backward."""
        if not torch.compiler.is_compiling() and in_backward():
            return
        object.__setattr__(self, "_routelab_record", None)

    def __getstate__(self) -> dict:
        """The module's state for ``copy.deepcopy`` and pickling, with the record's losses detached
        (a graph's tensors cannot be deep-copied: an EMA or best-model snapshot after a training
        step would fail)."""
        state = dict(super().__getstate__())  # type: ignore[misc]
        record = state.get("_routelab_record")
        if record is not None:
            aux, stats = record
            state["_routelab_record"] = ({name: value.detach() for name, value in aux.items()}, stats)
        return state

    @property
    def last_aux(self) -> dict[str, Tensor]:
        """The weighted auxiliary losses of the last forward (empty before the first)."""
        return dict(self._routelab_record[0]) if self._routelab_record is not None else {}

    @property
    def last_stats(self) -> dict[str, Tensor]:
        """The routing statistics of the last forward (empty before the first)."""
        return dict(self._routelab_record[1]) if self._routelab_record is not None else {}


def _check_model(model: nn.Module) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")


def _device_of(model: nn.Module) -> torch.device:
    for tensor in model.parameters():
        return tensor.device
    for tensor in model.buffers():
        return tensor.device
    return torch.device("cpu")


def aux_loss(model: nn.Module) -> Tensor:
    """The sum of the weighted auxiliary losses of the last forward of every routelab module in ``model``.

    Args:
        model: any module; its submodules (``model`` included) that record routing
            (:class:`RoutingRecord`: routelab MoE layers, patched transformers blocks) contribute.

    Returns:
        A scalar tensor, differentiable through the routers (a float32 zero on the model's device
        when no module has recorded a loss, e.g. before the first forward). A module called
        several times in one forward (weight sharing) contributes its last call only: sum the
        ``routes.aux`` each call returns instead.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
    """
    _check_model(model)
    total: Tensor | None = None
    for module in model.modules():
        if isinstance(module, RoutingRecord):
            for value in module.last_aux.values():
                value = value.sum() if value.dim() else value
                total = value if total is None else total + value
    if total is None:
        return torch.zeros((), device=_device_of(model))
    return total


def routing_stats(model: nn.Module) -> dict[str, dict[str, Tensor]]:
    """Per routelab module of ``model``, the statistics of its last forward.

    Args:
        model: any module.

    Returns:
        ``{module name: stats}`` in module order (``""`` names ``model`` itself), for every module
        that has recorded a forward. ``stats`` holds at least ``tokens_per_expert [E]`` (kept
        (token, expert) pairs per expert), ``dropped_fraction`` (of the proposed pairs, by
        capacity), ``load_cv`` (coefficient of variation of ``tokens_per_expert``),
        ``tokens_dropped`` (fraction of tokens with no expert) and ``capacity``; detached tensors.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
    """
    _check_model(model)
    return {name: module.last_stats for name, module in model.named_modules()
            if isinstance(module, RoutingRecord) and module._routelab_record is not None}
