"""Gradient clipping and loss scaling across the ranks of an expert-parallel model.

With :class:`~routelab.parallel.ExpertParallelMoE` each rank holds a different shard of the
experts but the same router (and the same other, replicated, parameters once their gradients
are reduced). ``torch.nn.utils.clip_grad_norm_`` on one rank sees only that rank's shard, so
every rank computes its own norm, scales the replicated gradients by its own factor, and the
router replicas drift apart; ``torch.amp.GradScaler`` likewise skips a step on the rank whose
shard overflowed and applies it on the others. The helpers here make both decisions global:

* :func:`clip_grad_norm_` — the norm of the whole model's gradient (every expert counted once,
  the replicated parameters counted once), the same on every rank, and the same clipping;
* :func:`all_reduce_found_inf` — a GradScaler's inf/NaN finding of any rank made every rank's.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .comm import comm_device

__all__ = ["all_reduce_found_inf", "clip_grad_norm_"]


def _split(parameters_or_model: nn.Module | Tensor | Iterable[Tensor],
           sharded_parameters: Iterable[Tensor] | None,
           process_group: dist.ProcessGroup | None) -> tuple[list[Tensor], set[int], bool, dist.ProcessGroup | None]:
    """``(parameters, ids of the sharded ones, whether the norm needs a collective, group)``."""
    from .moe import ExpertParallelMoE

    if isinstance(parameters_or_model, nn.Module):
        if sharded_parameters is not None:
            raise ValueError("sharded_parameters is for a list of parameters: with a model, its ExpertParallelMoE "
                             "layers say which parameters are sharded; drop sharded_parameters=")
        layers = [m for m in parameters_or_model.modules() if isinstance(m, ExpertParallelMoE)]
        params = list(parameters_or_model.parameters())
        sharded = {id(p) for layer in layers for p in layer.expert_parameters()}
        if process_group is None and layers:
            groups = {id(layer.process_group): layer.process_group for layer in layers}
            if len(groups) > 1:
                raise ValueError("the model's ExpertParallelMoE layers shard their experts over different process "
                                 "groups: pass process_group= (the group over which the experts of the parameters "
                                 "to clip are spread)")
            process_group = next(iter(groups.values()))
        return params, sharded, bool(layers), process_group
    params = [parameters_or_model] if isinstance(parameters_or_model, Tensor) else list(parameters_or_model)
    if sharded_parameters is None:
        raise ValueError(
            "clip_grad_norm_ was given parameters without saying which are sharded over the ranks: pass the model "
            "(its ExpertParallelMoE layers say it), or sharded_parameters= (e.g. the layers' expert_parameters(); "
            "an empty list if none is)")
    sharded = {id(p) for p in sharded_parameters}
    return params, sharded, True, process_group


def clip_grad_norm_(parameters_or_model: nn.Module | Tensor | Iterable[Tensor], max_norm: float,
                    norm_type: float = 2.0, process_group: dist.ProcessGroup | None = None, *,
                    sharded_parameters: Iterable[Tensor] | None = None, error_if_nonfinite: bool = False,
                    foreach: bool | None = None) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for a model with expert-sharded parameters: the norm of
    the whole model's gradient, identical on every rank, and the same clipping on every rank.

    The norm is that of the single-process model's gradient: the expert-sharded parameters'
    ``|g|_p^p`` are summed over ``process_group`` (each rank holds other experts), the
    replicated ones (the routers and everything else, the same on every rank once their
    gradients are reduced: call :meth:`~routelab.parallel.ExpertParallelMoE.reduce_replicated_grads`
    and any data-parallel reduction first) are counted once. Then every gradient is scaled by
    ``min(1, max_norm / (total + 1e-6))`` (``torch.nn.utils.clip_grads_with_norm_``), so the
    router replicas stay identical. A collective: every rank of the group must call it.

    Args:
        parameters_or_model: the model (``nn.Module``, e.g. the ``DistributedDataParallel``
            wrapper): its :class:`~routelab.parallel.ExpertParallelMoE` layers'
            ``expert_parameters()`` are the sharded ones, every other parameter is replicated.
            Or parameters (a tensor or an iterable of them) with ``sharded_parameters``.
        max_norm: the largest norm allowed.
        norm_type: ``p > 0`` of the p-norm, or ``inf`` (the maximum over every rank).
        process_group: the group the experts are sharded over; ``None``: that of the model's
            layers (they must share one), else the default group.
        sharded_parameters: with parameters (not a model): those of them that are sharded
            over the ranks (e.g. ``layer.expert_parameters()`` of every layer; ``[]`` if none).
        error_if_nonfinite: raise RuntimeError (on every rank) if the total norm is NaN or inf.
        foreach: as in ``torch.nn.utils.clip_grad_norm_``.

    Returns:
        The total norm before clipping, a 0-dim float tensor, the same on every rank: NaN (or
        inf) if any rank's gradients hold NaN (inf), so ``if not torch.isfinite(norm)`` skips a
        step on every rank alike. A model without an ``ExpertParallelMoE`` gives torch's norm
        (no collective).

    Raises:
        ValueError: a non-positive ``norm_type``; parameters without ``sharded_parameters``;
            layers over different groups without ``process_group``.
        RuntimeError: no initialised process group where one is needed; ``error_if_nonfinite``.
    """
    p = float(norm_type)
    if not (p > 0):
        raise ValueError(f"norm_type must be > 0 or inf, got {norm_type!r}")
    params, sharded, collective, group = _split(parameters_or_model, sharded_parameters, process_group)
    rep = [q.grad for q in params if q.grad is not None and id(q) not in sharded]
    shard = [q.grad for q in params if q.grad is not None and id(q) in sharded]
    grads = rep + shard
    out_device = grads[0].device if grads else torch.device("cpu")
    out_dtype = grads[0].dtype if grads and grads[0].is_floating_point() else torch.float32
    if collective and not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("clip_grad_norm_ of expert-sharded parameters needs the initialised process group "
                           "(every rank calls it): call routelab.parallel.init_distributed() first")
    dev = comm_device(group) if collective else out_device

    def local_norm(tensors: list[Tensor]) -> Tensor:
        if not tensors:
            return torch.zeros((), dtype=torch.float64, device=dev)
        return torch.nn.utils.get_total_norm(tensors, p, foreach=foreach).to(dev, torch.float64)

    rep_norm, shard_norm = local_norm(rep), local_norm(shard)
    if collective:
        # [shard part, any NaN, any inf], the non-finite values carried by the flags alone (a NaN
        # would not survive a MAX reduction everywhere): one collective.
        finite = torch.isfinite(shard_norm)
        part = shard_norm if math.isinf(p) else shard_norm.pow(p)
        buf = torch.stack([torch.where(finite, part, torch.zeros_like(part)),
                           torch.isnan(shard_norm).double(), torch.isinf(shard_norm).double()])
        dist.all_reduce(buf, op=dist.ReduceOp.MAX if math.isinf(p) else dist.ReduceOp.SUM, group=group)
        part, any_nan, any_inf = buf.unbind()
        if math.isinf(p):
            total = torch.maximum(rep_norm, part)
        else:
            total = (rep_norm.pow(p) + part).pow(1.0 / p)
        total = torch.where(any_inf > 0, torch.full_like(total, math.inf), total)
        total = torch.where(any_nan > 0, torch.full_like(total, math.nan), total)
        total = torch.where(torch.isnan(rep_norm), rep_norm, total)  # NaN wins over inf, as in torch
    else:
        total = rep_norm
    total = total.to(out_device, out_dtype)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients (over every rank) is "
                           f"{float(total)}, so they cannot be clipped; set error_if_nonfinite=False to clip anyway")
    if grads:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=foreach)
    return total


def all_reduce_found_inf(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer,
                         process_group: dist.ProcessGroup | None = None) -> bool:
    """Make a ``torch.amp.GradScaler``'s inf/NaN finding global: every rank skips the step if any
    rank's (expert-sharded) gradients overflowed.

    ``scaler.unscale_(optimizer)`` checks only this rank's gradients, so the rank whose experts
    overflowed skips the step and lowers its scale while the others step: the replicated router
    drifts and the scales diverge. Call this after ``scaler.unscale_(optimizer)`` (and after
    :func:`clip_grad_norm_`, if any) and before ``scaler.step(optimizer)``; it all-reduces the
    finding (a collective: every rank calls it) and writes it back into the scaler's record for
    ``optimizer``, which ``scaler.step`` and ``scaler.update`` read::

        scaler.scale(loss).backward()
        moe.reduce_replicated_grads()
        scaler.unscale_(opt)
        clip_grad_norm_(model, 1.0)                 # optional
        all_reduce_found_inf(scaler, opt)
        scaler.step(opt)
        scaler.update()

    It reads the scaler's per-optimizer state (``GradScaler._per_optimizer_states``, private to
    torch): if a torch version lacks it, the error says so; the alternative is to skip the step
    on every rank when :func:`clip_grad_norm_` (which is global) returns a non-finite norm.

    Args:
        scaler: the ``torch.amp.GradScaler`` (one per rank, the same settings everywhere).
        optimizer: the optimizer passed to ``scaler.unscale_``.
        process_group: the ranks whose findings are combined (``None``: the default group; the
            group the experts are sharded over, or any group containing it).

    Returns:
        Whether any rank found an inf or NaN (then every rank's ``scaler.step`` skips the step).
        A disabled scaler returns ``False`` without a collective (it is disabled on every rank).

    Raises:
        RuntimeError: ``scaler.unscale_(optimizer)`` was not called first in this step, or the
            scaler's state is not where this torch version should keep it.
    """
    if not scaler.is_enabled():
        return False
    states = getattr(scaler, "_per_optimizer_states", None)
    if not isinstance(states, dict):
        raise RuntimeError(
            f"this torch's GradScaler ({torch.__version__}) keeps no _per_optimizer_states, where "
            "all_reduce_found_inf writes the global finding: skip the step on every rank instead when the global "
            "norm of routelab.parallel.clip_grad_norm_ (called after scaler.unscale_) is not finite")
    state = states.get(id(optimizer))
    stage = getattr(state.get("stage"), "name", None) if isinstance(state, dict) else None
    found = state.get("found_inf_per_device") if isinstance(state, dict) else None
    if stage != "UNSCALED" or not isinstance(found, dict):
        raise RuntimeError("all_reduce_found_inf(scaler, optimizer) combines what scaler.unscale_(optimizer) found: "
                           "call scaler.unscale_(optimizer) first in this step (and scaler.step(optimizer) after it)")
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("all_reduce_found_inf needs the initialised process group (every rank calls it): call "
                           "routelab.parallel.init_distributed() first")
    dev = comm_device(process_group)
    flag = torch.zeros((), dtype=torch.float32, device=dev)
    for value in found.values():
        flag = torch.maximum(flag, (value.detach().to(dev, torch.float32) > 0).float().reshape(()))
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=process_group)
    for value in found.values():
        value.copy_(flag.to(value.device, value.dtype).reshape(value.shape))
    return bool(flag > 0)
