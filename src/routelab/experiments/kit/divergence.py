"""Diverged runs: a training run whose loss or parameters become non-finite is recorded, not raised.

A run whose loss or parameters become non-finite (NaN or +-inf) cannot recover; left alone, the
next forward pass raises (e.g. ``sample_routes`` or ``MoE`` rejecting NaN scores) and takes the
whole sweep down with it. Every experiment's training loop uses the helpers here instead, so the
policy is the same everywhere:

* the loop calls :func:`check_finite` on the step's loss (and, where cheap, the parameters),
  and runs the step inside :func:`diverged_on_error`, which turns an exception raised because
  the parameters already went non-finite into :class:`RunDiverged`;
* the sweep calls :func:`train_or_fail`, which returns the run's record, or its failed record
  (:func:`routelab.experiments.kit.store.failed_record`), appended to ``runs.jsonl`` like any
  other;
* the report computes its statistics on the runs that finished and says how many failed and why
  (:mod:`routelab.experiments.kit.failed_runs`).

Batched experiments (kool-toy trains many runs as one model) find the failing rows with
:func:`nonfinite_rows` and take them out of the batch themselves; the reasons read the same.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from .store import failed_record

__all__ = [
    "RunDiverged",
    "check_finite",
    "diverged_on_error",
    "divergence_reason",
    "nonfinite_rows",
    "train_or_fail",
]

Params = nn.Module | Mapping[str, Tensor] | Iterable[tuple[str, Tensor]]


class RunDiverged(FloatingPointError):
    """A training run's loss or parameters became non-finite.

    Not a ``ValueError``: nothing about the call was wrong, and the library's ``ValueError``
    handlers must not swallow it.

    Attributes:
        reason: one line saying what became non-finite and when.
        step: the training step at which it was seen (``None`` if unknown).
    """

    def __init__(self, reason: str, step: int | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.step = step


def _named(params: Params | None) -> list[tuple[str, Tensor]]:
    if params is None:
        return []
    if isinstance(params, nn.Module):
        return list(params.named_parameters())
    if isinstance(params, Mapping):
        return list(params.items())
    return list(params)


def _nonfinite_params(params: Params | None) -> list[str]:
    """Names of the tensors in ``params`` holding a NaN or an infinity."""
    bad = []
    with torch.no_grad():
        for name, p in _named(params):
            if p.is_floating_point() or p.is_complex():
                if not bool(torch.isfinite(p).all()):
                    bad.append(name)
    return bad


def _value(loss: Tensor | float) -> float:
    return float(loss.detach()) if isinstance(loss, Tensor) else float(loss)


def divergence_reason(step: int | None, *, loss: float | None = None, params: Sequence[str] = (),
                      label: str = "parameter(s) ") -> str:
    """The one-line reason of a failed run: which values became non-finite, at which step.

    Args:
        step: the training step (0-based, as the loop counts) or ``None``.
        loss: the non-finite loss value, if the loss is what diverged.
        params: names of the parameters that hold non-finite values.
        label: what ``params`` are, put before their names.
    """
    at = "" if step is None else f" at step {step}"
    parts = []
    if loss is not None:
        parts.append(f"the training loss became {loss}")
    if params:
        shown = ", ".join(params[:6]) + (f" and {len(params) - 6} more" if len(params) > 6 else "")
        parts.append(f"{label}{shown} became non-finite")
    if not parts:
        parts.append("non-finite values appeared")
    return f"diverged{at}: " + "; ".join(parts)


def check_finite(step: int | None = None, *, loss: Tensor | float | None = None,
                 params: Params | None = None) -> None:
    """Raise :class:`RunDiverged` if ``loss`` or any tensor of ``params`` is not finite.

    The loss check reads one number (cheap enough for every step); the parameter check reads
    every parameter, so loops call it at the end of training or every few steps.

    Args:
        step: the current training step, for the reason.
        loss: the step's scalar loss.
        params: a module (its named parameters), a ``{name: tensor}`` mapping or
            ``(name, tensor)`` pairs.
    """
    value = None
    if loss is not None:
        v = _value(loss)
        if not math.isfinite(v):
            value = v
    bad = _nonfinite_params(params) if params is not None else []
    if value is not None or bad:
        raise RunDiverged(divergence_reason(step, loss=value, params=bad), step)


@contextmanager
def diverged_on_error(params: Params, step: int | None = None) -> Iterator[None]:
    """Run a training step; an exception raised while ``params`` are non-finite becomes :class:`RunDiverged`.

    A NaN parameter usually surfaces as an exception inside the library (a layer or a routing
    rule rejecting NaN scores: a ``ValueError``) rather than as a NaN loss. On the normal path
    this costs nothing; only when the block raises are the parameters inspected. An exception
    raised with finite parameters is a real error and propagates unchanged.
    """
    try:
        yield
    except (ValueError, RuntimeError, FloatingPointError) as err:
        if isinstance(err, RunDiverged):
            raise
        bad = _nonfinite_params(params)
        if not bad:
            raise
        raise RunDiverged(
            divergence_reason(step, params=bad) + f" (then: {type(err).__name__}: {_first_line(err)})", step
        ) from err


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return (text[0] if text else "")[:200]


def nonfinite_rows(step: int | None, *, loss: Tensor | None = None,
                   params: Mapping[str, Tensor] | None = None,
                   rows: Tensor | None = None, label: str = "parameter(s) ") -> dict[int, str]:
    """The runs of a batched model that diverged, with their reasons.

    Args:
        step: the training step, for the reasons.
        loss: ``[R]`` per-run loss.
        params: ``{name: [R, ...]}`` per-run parameters (the run dimension first).
        rows: optional bool ``[R]``: only these runs are checked (e.g. those still training).
        label: what ``params`` are, for the reasons (see :func:`divergence_reason`).

    Returns:
        ``{run index: reason}`` for every checked run with a non-finite loss or parameter;
        empty (after one fused check and one host sync) when every run is finite.
    """
    tensors = [t.detach() for t in ([loss] if loss is not None else []) + list((params or {}).values())]
    if not tensors:
        return {}
    R = tensors[0].shape[0]
    # Fast path (every step of a healthy batch): a sum is finite only if every term is.
    total = tensors[0].reshape(R, -1).sum(-1)
    for t in tensors[1:]:
        total = total + t.reshape(R, -1).sum(-1)
    if bool(torch.isfinite(total).all()):
        return {}
    ok = torch.ones(R, dtype=torch.bool, device=tensors[0].device)
    for t in tensors:
        ok &= torch.isfinite(t.reshape(R, -1)).all(-1)
    if rows is not None:
        ok |= ~rows
    if bool(ok.all()):  # only the sum overflowed, or only retired runs are non-finite
        return {}
    out = {}
    for i in torch.nonzero(~ok).flatten().tolist():
        value = None
        if loss is not None and not bool(torch.isfinite(loss[i])):
            value = float(loss[i])
        names = [n for n, p in (params or {}).items() if not bool(torch.isfinite(p[i].detach()).all())]
        out[i] = divergence_reason(step, loss=value, params=names, label=label)
    return out


# ----------------------------------------------------------------------------- sweeps


def train_or_fail(train: Callable[[], dict[str, Any]], key: Mapping[str, Any],
                  on_fail: Callable[[str], None] | None = None) -> dict[str, Any]:
    """``train()``'s record, or the failed record of ``key`` if the run diverged.

    Args:
        train: trains one run and returns its record; raises :class:`RunDiverged` if it diverges.
        key: the fields that identify the run (those the sweep resumes on), copied into the
            failed record so that a rerun sees the run as done.
        on_fail: called with the reason (e.g. to print a progress line).
    """
    try:
        return train()
    except RunDiverged as err:
        if on_fail is not None:
            on_fail(err.reason)
        return failed_record(key, err.reason, err.step)
