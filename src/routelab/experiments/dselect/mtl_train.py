"""The training loop shared by the MovieLens and Multi-MNIST experiments.

A model maps ``x`` to a list of task outputs and has ``regularization()``, ``on_step``,
``track`` and ``report`` (:class:`~routelab.layers.MultiGateMoE` and
:class:`~routelab.layers.SharedBottom` both do).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from routelab.layers import MultiGateMoE

from ..kit.divergence import check_finite, diverged_on_error
from .common import minibatches, steps_per_epoch

__all__ = ["train_mtl", "experts_selected"]


def experts_selected(model: nn.Module, forward: Callable[[torch.Tensor], list[torch.Tensor]],
                     x_batches: Sequence[torch.Tensor]) -> list[float] | None:
    """Mean number of nonzero-weight experts per example, per task (None for shared bottom)."""
    if not isinstance(model, MultiGateMoE):
        return None
    tot = [0.0] * model.num_tasks
    n = 0
    with torch.no_grad():
        for xb in x_batches:
            forward(xb)
            for t, w in enumerate(model.last_weights):
                tot[t] += float((w != 0).sum())
            n += xb.shape[0]
    return [v / n for v in tot]


def train_mtl(model: nn.Module, forward: Callable[[torch.Tensor], list[torch.Tensor]],
              loss_fn: Callable[[list[torch.Tensor], torch.Tensor], torch.Tensor],
              x: torch.Tensor, y: torch.Tensor, *, epochs: int, batch: int, lr: float,
              generator: torch.Generator, log_every: int = 0,
              on_log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Adam on ``loss_fn(forward(xb), yb) + model.regularization()``; returns training info.

    ``forward`` maps a batch of x to the model's outputs (it may embed ids first).
    Records the first step at which every DSelect-k gate's S(Z) was binary, as reported by the
    gates (``binary_step``; for per-example gates: binary on that step's batch).

    Raises:
        RunDiverged: the loss or a parameter became non-finite (the sweep records the run as
            failed, see :func:`routelab.experiments.kit.divergence.train_or_fail`).
    """
    n = x.shape[0]
    if y.shape[0] != n:
        raise ValueError(f"x and y must have the same number of examples, got {n} and {y.shape[0]}.")
    if not 1 <= batch <= n:
        raise ValueError(f"batch must be in [1, {n}] (the number of training examples), got {batch}.")
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    total = epochs * steps_per_epoch(n, batch)
    model.train()
    for ep, step, idx in minibatches(n, batch, epochs, generator):
        model.on_step(step, total)
        opt.zero_grad()
        with diverged_on_error(model, step):
            loss = loss_fn(forward(x[idx]), y[idx]) + model.regularization()
        check_finite(step, loss=loss)
        loss.backward()
        opt.step()
        model.track(step)
        if log_every and on_log and step % log_every == 0:
            on_log(f"epoch {ep + 1} step {step}/{total} loss {float(loss):.4f}")
    check_finite(total - 1, params=model)
    model.eval()
    dselect = [r for r in model.report() if "binary" in r]     # the gates that report S(Z)
    steps = [r["binary_step"] for r in dselect]
    return {"steps": total,
            "binary_step": max(steps) if dselect and None not in steps else None,
            "binary_all": all(bool(r["binary"]) for r in dselect) if dselect else None}
