"""Failed runs: a training run that diverges is recorded, not raised.

A run whose loss or parameters become non-finite (NaN or +-inf) cannot recover; before this
module, the next forward pass raised (e.g. ``sample_routes`` or ``MoE`` rejecting NaN scores)
and took the whole sweep down with it. Every experiment's training loop uses the helpers here
instead, so the policy is the same everywhere:

* the loop calls :func:`check_finite` on the step's loss (and, where cheap, the parameters),
  and runs the step inside :func:`diverged_on_error`, which turns an exception raised because
  the parameters already went non-finite into :class:`RunDiverged`;
* the sweep calls :func:`train_or_fail`, which returns the run's record, or a *failed record*
  (:func:`failed_record`: the run's key fields plus ``status: "failed"``, ``reason`` and
  ``failed_step``) that is appended to ``runs.jsonl`` like any other (a rerun does not retry
  it: training is deterministic; delete its line, or rerun with ``--fresh``, to retry);
* the report splits the records (:func:`split_failed`), computes its statistics on the runs
  that finished, and says how many failed and why (:func:`failures_markdown`).

Batched experiments (kool-toy trains many runs as one model) find the failing rows with
:func:`nonfinite_rows` and take them out of the batch themselves; the reasons read the same.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

__all__ = [
    "FAILED",
    "RunDiverged",
    "add_failures_to_report",
    "check_finite",
    "diverged_on_error",
    "divergence_reason",
    "failed_record",
    "failures_markdown",
    "is_failed",
    "nonfinite_rows",
    "split_failed",
    "train_or_fail",
    "with_failures_section",
]

FAILED = "failed"
"""The ``status`` of a failed run's record (records of finished runs carry no ``status``)."""

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


# ----------------------------------------------------------------------------- records


def failed_record(key: Mapping[str, Any], reason: str, step: int | None = None) -> dict[str, Any]:
    """The record of a failed run: its key fields, ``status: "failed"``, ``reason``, ``failed_step``."""
    return {**key, "status": FAILED, "reason": reason, "failed_step": step}


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


def is_failed(record: Mapping[str, Any]) -> bool:
    """Whether ``record`` is a failed run's record."""
    return record.get("status") == FAILED


def split_failed(records: Iterable[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(finished, failed)`` records, each in the original order."""
    done, failed = [], []
    for r in records:
        (failed if is_failed(r) else done).append(r)
    return done, failed


def failures_markdown(failed: Sequence[Mapping[str, Any]], total: int, fields: Sequence[str],
                      *, heading: str = "## Failed runs", limit: int = 30) -> str:
    """A report section on the failed runs: how many, which, and why ("" when none failed).

    Args:
        failed: the failed records.
        total: the number of runs recorded (finished + failed), for "F of N".
        fields: the key fields that name a run (e.g. ``("gate", "lr", "seed")``).
        heading: the section heading.
        limit: list at most this many runs one by one (the reasons are always counted).
    """
    if not failed:
        return ""
    lines = [heading, "",
             f"**{len(failed)} of {total} runs failed** (their loss or parameters became non-finite). "
             "They are left out of every average, median and figure; where a table counts successes per "
             "seed, a failed run counts as a seed without success and is marked *failed*. A rerun does not "
             "retry them (training is deterministic); delete their lines from the results file, or rerun "
             "with `--fresh`, to retry them.", ""]
    kinds = Counter(str(r.get("reason", "")).split(":", 1)[-1].strip().split(" (then:")[0] for r in failed)
    if len(kinds) > 1:
        lines += ["Reasons (without the step):", ""]
        lines += [f"- {n} x {k}" for k, n in kinds.most_common()]
        lines.append("")
    for r in list(failed)[:limit]:
        name = ", ".join(f"{f}={r.get(f)}" for f in fields)
        lines.append(f"- {name}: {r.get('reason', 'no reason recorded')}")
    if len(failed) > limit:
        lines.append(f"- ... and {len(failed) - limit} more (see the results file).")
    lines.append("")
    return "\n".join(lines)


def with_failures_section(text: str, failed: Sequence[Mapping[str, Any]], total: int,
                          fields: Sequence[str]) -> str:
    """``text`` (a report) with :func:`failures_markdown` inserted before its first ``## `` section
    (appended when it has none); ``text`` unchanged when nothing failed."""
    section = failures_markdown(failed, total, fields)
    if not section:
        return text
    lines = text.split("\n")
    at = next((i for i, line in enumerate(lines) if line.startswith("## ")), len(lines))
    return "\n".join(lines[:at] + section.split("\n") + lines[at:])


def add_failures_to_report(report: Path, failed: Sequence[Mapping[str, Any]], total: int,
                           fields: Sequence[str]) -> Path:
    """Rewrite the report file ``report`` with the failed-runs section (see :func:`with_failures_section`)."""
    if failed:
        from .runner import atomic_write_text  # local: runner imports nothing from here

        atomic_write_text(report, with_failures_section(report.read_text(encoding="utf-8"), failed, total, fields))
    return report
