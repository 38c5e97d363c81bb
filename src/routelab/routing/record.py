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
forward under ``no_grad``, so its records carry no gradient, nor do the ``routes.aux`` a layer
returns there: use the non-reentrant form, or return the losses' sum from the checkpointed
function as an output of its own (:func:`aux_loss` warns when it finds such records in a
training step).

Layers that did not run: a model whose routelab layers do not all run in every step (one MoE per
task, LayerDrop, an encoder skipped) keeps, in a layer that did not run, the record of the step in
which it last ran. :func:`aux_loss` leaves those out: a backward pass through one of its results
marks the records it summed as *consumed* by that pass, and a later call sums only the records not
yet consumed, if there are any (the layers that ran since; the consumed ones are then detached,
releasing their graphs), else those consumed by the latest backward pass (the step just taken: for
logging after ``backward()``, or a second backward after ``retain_graph=True``). Limits: a step in
which no routelab layer runs sums the previous step's records; under ``torch.compile`` of a step
that includes ``aux_loss`` nothing is marked (the hook is not traced); one backward over several
micro-batches that ran different layers sums a layer's record once per call (sum the ``routes.aux``
each call returns there).
"""

from __future__ import annotations

import warnings
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
    #: the number of the backward pass through an :func:`aux_loss` result that consumed the record, or None
    _routelab_consumed: int | None = None
    #: the record was made in training mode with gradients off (reentrant activation checkpointing)
    _routelab_blind: bool = False

    def record_routing(self, aux: Mapping[str, Tensor], stats: Mapping[str, Tensor]) -> None:
        """Remember ``aux`` (weighted auxiliary losses, kept differentiable) and ``stats`` (detached).

        Inside a backward pass (activation checkpointing's recomputation) a record that the backward
        consumed stays consumed: the recomputation of a step's losses is not a new step.

        Args:
            aux: named scalar losses, already multiplied by their coefficients.
            stats: named diagnostics (e.g. ``tokens_per_expert [E]``, ``dropped_fraction``, ``load_cv``).
        """
        recomputing = not torch.compiler.is_compiling() and in_backward()
        if recomputing and self._routelab_record is not None:
            # Activation checkpointing's recomputation of a forward already recorded: its values are
            # that forward's, and it must not replace the record in place. With two forwards before
            # one backward the recomputations run in reverse, so replacing left the *first* call's
            # routing in aux_loss / routing_stats after backward (a review found it), or an eval
            # forward's record between forward and backward replaced by a training call's.
            return
        aux = dict(aux)
        consumed = None
        if self._routelab_consumed is not None and recomputing:
            consumed = self._routelab_consumed  # the recomputation of the step the backward consumed
        # (a statistic without a graph is kept as it is: a detached alias is one operator more per value)
        stats = {name: value.detach() if value.requires_grad else value for name, value in stats.items()}
        object.__setattr__(self, "_routelab_record", (aux, stats))
        object.__setattr__(self, "_routelab_consumed", consumed)
        # a training forward without gradient (reentrant checkpointing): its losses train nothing
        object.__setattr__(self, "_routelab_blind", bool(getattr(self, "training", False))
                           and not torch.is_grad_enabled())

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
        object.__setattr__(self, "_routelab_consumed", None)

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


def _current_records(model: nn.Module) -> list[tuple[RoutingRecord, tuple]]:
    """The ``(module, record)`` pairs of ``model`` that :func:`aux_loss` sums: the records no backward
    has consumed, if any (the consumed ones, stale, are detached), else those consumed by the latest
    backward pass (see the module docstring)."""
    recorded = [(module, module._routelab_record) for module in model.modules()
                if isinstance(module, RoutingRecord) and module._routelab_record is not None]
    fresh = [(module, record) for module, record in recorded if module._routelab_consumed is None]
    if fresh:
        for module, (aux, stats) in recorded:
            if module._routelab_consumed is not None and any(v.requires_grad for v in aux.values()):
                object.__setattr__(module, "_routelab_record",
                                   ({name: value.detach() for name, value in aux.items()}, stats))
        return fresh
    latest = max((module._routelab_consumed for module, _ in recorded), default=None)
    return [(module, record) for module, record in recorded if module._routelab_consumed == latest]


def _warn_without_gradient(records: list[tuple[RoutingRecord, tuple]]) -> None:
    """Warn when, with gradients on, a module recorded its losses in training mode under ``no_grad``
    (reentrant activation checkpointing runs the forward so), where they train nothing."""
    if not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return
    blind = [type(module).__name__ for module, (aux, _) in records
             if module._routelab_blind and aux and any(p.requires_grad for p in module.parameters())]
    if blind:
        warnings.warn(f"routelab.aux_loss: {len(blind)} routing module(s) ({blind[0]}, ...) in training mode recorded "
                      "their auxiliary losses without gradient (their forward ran under torch.no_grad: reentrant "
                      "activation checkpointing, or a training-mode forward without gradients), so those losses "
                      "train nothing; with checkpointing, use "
                      "torch.utils.checkpoint.checkpoint(..., use_reentrant=False) (transformers: "
                      "gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False}))",
                      stacklevel=3)


def aux_loss(model: nn.Module) -> Tensor:
    """The sum of the weighted auxiliary losses of the last forward of every routelab module in ``model``.

    A module that did not run since the last backward pass through an ``aux_loss`` result (one MoE
    per task, LayerDrop) is left out: its record is the earlier step's (module docstring). After
    ``backward()``, before the next forward, the call returns the step's losses again (for logging).

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

    Warns:
        UserWarning: a module in training mode recorded its losses without gradient (reentrant
        activation checkpointing), while gradients are on.
    """
    _check_model(model)
    records = _current_records(model)
    _warn_without_gradient(records)
    total: Tensor | None = None
    for _, (aux, _) in records:
        for value in aux.values():
            value = value.sum() if value.dim() else value
            total = value if total is None else total + value
    if total is None:
        return torch.zeros((), device=_device_of(model))
    if total.requires_grad and not torch.compiler.is_compiling():
        total.register_hook(_consume(records))
    return total


def _consume(records: list[tuple[RoutingRecord, tuple]]):
    """The gradient hook of an :func:`aux_loss` result: the backward pass through it consumes the
    records it summed (those still in place: a module may have recorded again since), marked with
    the pass's number (autograd's graph task id: one per ``backward()`` or ``autograd.grad`` call,
    increasing), so that every result summed into one loss marks its records alike."""

    def hook(grad: Tensor) -> None:
        number = max(torch._C._current_graph_task_id(), 0)  # (a hook runs inside a pass: never -1)
        for module, record in records:
            if module._routelab_record is record:
                object.__setattr__(module, "_routelab_consumed", number)

    return hook


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
