"""Benchmark of the n x k assignment algorithms (``routelab bench assignment``).

For every size ``(n, k)`` of a grid, on float32 scores ``torch.randn(n, k)`` from seeded
generators (a new instance for every timed call, the same instances for every method) and
capacity ``c = n / k``, it measures

* :func:`routelab.assignment.balanced_assignment`, the exact capacity-constrained maximiser;
* :func:`scipy.optimize.linear_sum_assignment` on the column-expanded ``n x (k*c) = n x n``
  float64 matrix (every expert's column repeated ``c`` times), i.e. the same problem posed as a
  general assignment problem, and whether both reach the same optimum;
* :func:`routelab.assignment.gumbel_matching` (``tau = 1``, with its conditionals);
* :func:`routelab.assignment.sinkhorn` of ``log_softmax`` of the scores (``tol = 1e-4``).

Every reported time is the median over the timed calls (one per instance) after two warm-up
calls (not among the timed ones; :func:`_time_paired`), all taken in the same run. The report is
markdown; it is written to ``out`` line by line while it is being measured, and returned whole.

**Batched section** (``--device cuda``; :func:`_batched_section`, which runs on any device). For each
``(b, n, k)`` of :data:`BATCH_SIZES` (``64 x 4096 x 64`` and ``64 x 256 x 16``), on batches of float32
``torch.randn(b, n, k)`` (batch ``r`` from seed ``r``, made on the CPU and moved to the device untimed),
one table with a row per method, each timed call solving a whole batch:

* routelab :func:`~routelab.assignment.balanced_assignment` on the ``[b, n, k]`` batch in one call,
  as a user calls it (``on_host=None``: on a GPU, batches of at most ``host_max_scores`` scores are
  solved on the host when the compiled CPU solver is there, :mod:`routelab.assignment._tuning`);
* the same call with ``on_host=False``: the PyTorch solver on the device (the evidence for that bound);
* routelab on one ``[n, k]`` instance at a time (a Python loop over the batch, ``on_host=None``);
* the BASE-layers auction :func:`routelab.bench.peers.fairseq_auction` instance by instance on the
  device (it is single-instance; one host sync per round);
* "host": the batch copied to the CPU, solved there in one batched call, the result copied back,
  all inside the timed call (not run on device cpu, where it would be the first row).

The methods alternate batch by batch after two warm-up calls each (:func:`_time_paired`; on CUDA
``torch.cuda.synchronize()`` before and after every timed call), at most :data:`BATCH_REPEATS`
batches (:data:`QUICK_BATCH_REPEATS` in quick mode) and fewer when the warm-ups show that they would
exceed the time budget. Columns: median ms per call (per batch), ms per instance, the ratio of the
row's median to routelab batched's, the host syncs of one call (:func:`count_host_syncs`, untimed:
of the whole batch for the batched and host rows, of instance 0 for the per-instance rows; "n/a
(CPU)" off CUDA), whether every result respects the capacity, and the objective: the routelab rows
must equal the batched call's float64 objective on every instance to relative :data:`OPTIMUM_RTOL`;
the auction's row gives its mean and largest relative gap ``(routelab - auction) / |routelab|``.
Under each table, the batched rows' host syncs by the line of routelab that made them
(:func:`host_sync_sites`), so that a count that differs between machines can be traced.

Entry point: :func:`run_benchmark`. The measuring itself is :func:`_benchmark`, which takes the
grid and the number of repeats as parameters (the tests run it on a tiny grid), and
:func:`_batched_section`, which takes the batch sizes (the tests run it on tiny sizes on CPU).
"""

from __future__ import annotations

import math
import os
import platform
import re
import statistics
import time
import traceback
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TextIO

import numpy as np
import scipy
import torch
from scipy.optimize import linear_sum_assignment

import routelab
from routelab.assignment import SOLVER_TUNING, balanced_assignment, gumbel_matching, sinkhorn

from ..machine import cpu_model as _cpu_model
from ..machine import load_average
from ._checks import check_device_and_threads
from .peers import fairseq_auction

__all__ = ["count_host_syncs", "host_sync_sites", "run_benchmark"]

#: The grid of the full benchmark: every n with every k.
FULL_NS: tuple[int, ...] = (256, 1024, 4096, 16384)
QUICK_NS: tuple[int, ...] = (256, 1024, 4096)
KS: tuple[int, ...] = (4, 16, 64)

#: Timed calls per measurement (after the warm-up calls), by n.
FULL_REPEATS: dict[int, int] = {256: 9, 1024: 9, 4096: 11, 16384: 5}
QUICK_REPEATS: dict[int, int] = {256: 5, 1024: 5, 4096: 3}

#: Time budget of one measurement: fewer timed calls (at least one) when the second warm-up call shows that
#: the requested number would take longer.
FULL_BUDGET_S = 20.0
QUICK_BUDGET_S = 3.0

#: scipy is skipped where one call is estimated to take longer than this ...
SCIPY_LIMIT_S = 60.0
#: ... and always from this n on (the n x n float64 matrix alone is 2 GiB at n = 16384).
SCIPY_NEVER_N = 16384

#: Relative tolerance of the "same optimum" check (objectives in float64).
OPTIMUM_RTOL = 1e-6

SINKHORN_TOL = 1e-4
SINKHORN_MAX_ITER = 1000
GUMBEL_TAU = 1.0

#: The batched section (on CUDA): ``(instances, n, k)`` of each of its tables.
BATCH_SIZES: tuple[tuple[int, int, int], ...] = ((64, 4096, 64), (64, 256, 16))
#: Timed batches per size of the batched section (after the warm-up calls), full and quick.
BATCH_REPEATS = 5
QUICK_BATCH_REPEATS = 3

DTYPE = torch.float32


# ---------------------------------------------------------------------------- data


@dataclass(frozen=True)
class Timing:
    """A measured time.

    Attributes:
        median_ms: median wall time of the timed calls, in milliseconds.
        runs: number of timed calls (the warm-up calls not counted).
    """

    median_ms: float
    runs: int


@dataclass
class Row:
    """Everything measured at one size ``(n, k)``.

    Attributes:
        n: tokens.
        k: experts (capacity ``n / k``).
        routelab: timing of :func:`balanced_assignment`.
        gumbel: timing of :func:`gumbel_matching`.
        sinkhorn: timing of :func:`sinkhorn` (of every call, converged or not).
        sinkhorn_error: ``None`` when sinkhorn converged, else its message's column error.
        scipy: timing of ``linear_sum_assignment``; ``None`` when skipped.
        scipy_skip: why scipy was skipped (``"est. 96 s"``), else ``None``.
        same_optimum: whether routelab's assignment is feasible and has scipy's objective;
            ``None`` when scipy was skipped.
        objectives: ``(routelab, scipy)`` objectives in float64, when scipy ran.
        requested: timed calls asked for per method (fewer are made when over the time budget).
    """

    n: int
    k: int
    routelab: Timing
    gumbel: Timing
    sinkhorn: Timing
    sinkhorn_error: str | None = None
    scipy: Timing | None = None
    scipy_skip: str | None = None
    same_optimum: bool | None = None
    objectives: tuple[float, float] | None = None
    requested: int = 0


class _Report:
    """Collects markdown lines and streams each to ``out`` (flushed) as it is added."""

    def __init__(self, out: TextIO | None) -> None:
        self.lines: list[str] = []
        self.out = out

    def emit(self, *lines: str) -> None:
        """Append ``lines`` to the report and write them to ``out``."""
        for line in lines:
            self.lines.append(line)
            if self.out is not None:
                print(line, file=self.out, flush=True)

    def text(self) -> str:
        """The report so far, newline-terminated."""
        return "\n".join(self.lines) + "\n"


# ---------------------------------------------------------------------------- timing


def _synchronize(device: str) -> None:
    """Wait for queued CUDA work (no-op on CPU)."""
    if device == "cuda":
        torch.cuda.synchronize()


def _time_calls(
    fn: Callable[[int], Any], *, repeats: int, budget_s: float, device: str
) -> tuple[Timing, list[Any]]:
    """Median wall time of ``fn(i)`` for instances ``i = 0, 1, ...`` after two warm-up calls.

    Timed call ``r`` solves instance ``r`` (a fresh random problem each time, so the median is over
    instances, not over one lucky or unlucky draw). The second warm-up call's duration (the first
    pays one-off costs) sets how many timed calls fit in ``budget_s``: at most ``repeats``, at
    least one.

    Returns:
        The :class:`Timing` and the results of the timed calls, in instance order.
    """
    timings, results = _time_paired({"fn": fn}, repeats=repeats, budget_s=budget_s, device=device)
    return timings["fn"], results["fn"]


def _time_paired(
    fns: Mapping[str, Callable[[int], Any]], *, repeats: int, budget_s: float, device: str
) -> tuple[dict[str, Timing], dict[str, list[Any]]]:
    """Like :func:`_time_calls` for several functions, timed alternately on every instance.

    Each function is warmed up twice on instance 0: a first call, untimed, pays one-off costs (in a
    fresh process, loading the compiled kernel made routelab's first call at n = 256 take 1.7 s on
    this project's CPU, the next 0.4 ms), then a second, timed one. Then, instance by instance,
    every function solves it in turn (the order rotating from one instance to the next). The speed
    of a shared machine drifts over seconds; alternating makes the drift hit every function alike,
    so the ratio of their medians is stable where separate blocks of timing would not be. The summed
    time of the second warm-up calls sets how many instances fit in ``budget_s`` (at most
    ``repeats``, at least one).

    Returns:
        ``(timings, results)``, both keyed like ``fns``; results in instance order.
    """
    names = list(fns)
    for name in names:  # the first calls: one-off costs, which would make the budget look spent
        fns[name](0)
    _synchronize(device)
    warmup_s = 0.0
    for name in names:
        _synchronize(device)
        start = time.perf_counter()
        fns[name](0)
        _synchronize(device)
        warmup_s += time.perf_counter() - start
    runs = max(1, min(repeats, int(budget_s / max(warmup_s, 1e-9))))
    times: dict[str, list[float]] = {name: [] for name in names}
    results: dict[str, list[Any]] = {name: [None] * runs for name in names}
    for i in range(runs):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            _synchronize(device)
            start = time.perf_counter()
            results[name][i] = fns[name](i)
            _synchronize(device)
            times[name].append(time.perf_counter() - start)
    timings = {name: Timing(median_ms=1e3 * statistics.median(times[name]), runs=runs) for name in names}
    return timings, results


# ---------------------------------------------------------------------------- checks


def _objective(scores64: np.ndarray, expert: np.ndarray) -> float:
    """``sum_i scores[i, expert[i]]`` in float64."""
    return float(scores64[np.arange(len(expert)), expert].sum())


def _is_feasible(expert: np.ndarray, k: int, capacity: int) -> bool:
    """Every token has an expert in ``[0, k)`` and no expert holds more than ``capacity``."""
    if expert.min() < 0 or expert.max() >= k:
        return False
    return bool((np.bincount(expert, minlength=k) <= capacity).all())


def _same_value(a: float, b: float) -> bool:
    """``a`` and ``b`` agree to relative :data:`OPTIMUM_RTOL`."""
    return math.isclose(a, b, rel_tol=OPTIMUM_RTOL, abs_tol=1e-12)


def _scipy_estimate_s(n: int, k: int, measured: Mapping[tuple[int, int], float]) -> float | None:
    """Estimated seconds of one scipy call at ``(n, k)`` from measured smaller sizes (``~n^3``).

    Uses the largest measured ``n0 < n`` at the same ``k`` (or, if none, at any ``k``, the
    slowest), scaled by ``(n / n0) ** 3``; ``None`` when nothing smaller was measured.
    """
    same_k = [(n0, t) for (n0, k0), t in measured.items() if k0 == k and n0 < n]
    pool = same_k or [(n0, t) for (n0, _), t in measured.items() if n0 < n]
    if not pool:
        return None
    n0 = max(n0 for n0, _ in pool)
    t0 = max(t for m, t in pool if m == n0)
    return t0 * (n / n0) ** 3


_SINKHORN_ERROR = re.compile(r"off by up to ([0-9.eE+\-]+)")


def _sinkhorn_or_error(log_p: torch.Tensor) -> torch.Tensor | str:
    """Run :func:`sinkhorn`; on non-convergence return its column error (as text) instead."""
    try:
        return sinkhorn(log_p, tol=SINKHORN_TOL, max_iter=SINKHORN_MAX_ITER)
    except ValueError as exc:
        if "did not converge" not in str(exc):
            raise
        match = _SINKHORN_ERROR.search(str(exc))
        return match.group(1) if match else "?"


# ---------------------------------------------------------------------------- measuring


def _measure(
    n: int,
    k: int,
    *,
    repeats: int,
    budget_s: float,
    device: str,
    seed: int,
    scipy_measured: dict[tuple[int, int], float],
    scipy_limit_s: float,
) -> Row:
    """Measure every method at one size ``(n, k)``; updates ``scipy_measured`` (seconds)."""
    capacity = n // k
    # Instance i: scores from seed + i (the same instances for every method and for scipy).
    cpu_scores = [
        torch.randn(n, k, generator=torch.Generator().manual_seed(seed + i), dtype=DTYPE) for i in range(repeats)
    ]
    scores = [x.to(device) for x in cpu_scores]
    kw: dict[str, Any] = {"repeats": repeats, "budget_s": budget_s, "device": device}
    estimate = _scipy_estimate_s(n, k, scipy_measured)
    if n >= SCIPY_NEVER_N:
        scipy_skip: str | None = f"n >= {SCIPY_NEVER_N}" + (f"; est. {estimate:.0f} s" if estimate is not None else "")
    elif estimate is not None and estimate > scipy_limit_s:
        scipy_skip = f"est. {estimate:.0f} s"
    else:
        scipy_skip = None

    # routelab and scipy alternate instance by instance (see _time_paired).
    timed: dict[str, Callable[[int], Any]] = {"routelab": lambda i: balanced_assignment(scores[i])}
    if scipy_skip is None:
        scores64 = [x.double().numpy() for x in cpu_scores]
        # n x (k*c): column j*c + r is expert j. Building it is not timed.
        expanded = [np.repeat(x, capacity, axis=1) for x in scores64]
        timed["scipy"] = lambda i: linear_sum_assignment(-expanded[i])
    timings, outputs = _time_paired(timed, **kw)
    routelab_t, experts = timings["routelab"], outputs["routelab"]

    gen = torch.Generator(device=device).manual_seed(seed + 1)
    gumbel_t, _ = _time_calls(lambda i: gumbel_matching(scores[i], tau=GUMBEL_TAU, generator=gen), **kw)

    log_p = [torch.log_softmax(x, dim=-1) for x in scores]
    sinkhorn_t, sks = _time_calls(lambda i: _sinkhorn_or_error(log_p[i]), **kw)
    sk = next((e for e in sks if isinstance(e, str)), None)

    row = Row(n=n, k=k, routelab=routelab_t, gumbel=gumbel_t, sinkhorn=sinkhorn_t,
              sinkhorn_error=sk, requested=repeats)
    if scipy_skip is not None:
        row.scipy_skip = scipy_skip
        return row
    scipy_t, solutions = timings["scipy"], outputs["scipy"]
    scipy_measured[(n, k)] = scipy_t.median_ms / 1e3
    row.scipy = scipy_t

    same = True
    for i, (rows_idx, cols_idx) in enumerate(solutions):
        scipy_expert = np.empty(n, dtype=np.int64)
        scipy_expert[rows_idx] = cols_idx // capacity
        ours = experts[i].cpu().numpy().astype(np.int64) if i < len(experts) else (
            balanced_assignment(scores[i]).cpu().numpy().astype(np.int64))
        objectives = (_objective(scores64[i], ours), _objective(scores64[i], scipy_expert))
        agrees = _is_feasible(ours, k, capacity) and _same_value(*objectives)
        if same:  # the objectives shown: the first instance that disagrees (else the last)
            row.objectives = objectives
        same = same and agrees
    row.same_optimum = same
    return row


# ---------------------------------------------------------------------------- rendering


TABLE_HEADER = (
    "| n | k | routelab ms | scipy ms | speed-up | same optimum | gumbel_matching ms | sinkhorn ms |",
    "|---:|---:|---:|---:|---:|:---:|---:|---:|",
)


def _ms(value: float) -> str:
    """Milliseconds with about three significant digits."""
    return f"{value:.2f}" if value < 10 else f"{value:.1f}" if value < 1000 else f"{value:.0f}"


def _sci(value: float) -> str:
    """``1e-4`` rather than ``0.0001``."""
    mantissa, exponent = f"{value:.0e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def _speedup(ratio: float) -> str:
    """``"123x"``, ``"4.5x"``, ``"0.82x"``, ``"0.000099x"`` (always parses as ``float(s[:-1])``)."""
    if ratio >= 10:
        return f"{ratio:.0f}x"
    if ratio >= 1:
        return f"{ratio:.1f}x"
    return np.format_float_positional(ratio, precision=2, unique=False, fractional=False, trim="-") + "x"


def _render_row(row: Row) -> str:
    """One markdown table row."""
    if row.scipy is not None:
        scipy_cell = _ms(row.scipy.median_ms)
        speedup = _speedup(row.scipy.median_ms / row.routelab.median_ms)
        same = "yes" if row.same_optimum else "no"
    else:
        scipy_cell, speedup, same = f"skipped ({row.scipy_skip})", "—", "—"
    sink = _ms(row.sinkhorn.median_ms)
    if row.sinkhorn_error is not None:
        sink += " (not converged)"
    cells = [str(row.n), str(row.k), _ms(row.routelab.median_ms), scipy_cell, speedup, same,
             _ms(row.gumbel.median_ms), sink]
    return "| " + " | ".join(cells) + " |"


def _growth_sentence(rows: Sequence[Row]) -> str:
    """How routelab's median time grows with n at fixed k, computed from ``rows``."""
    parts = []
    other_steps = False
    for k in sorted({r.k for r in rows}):
        col = sorted((r.n, r.routelab.median_ms) for r in rows if r.k == k)
        if len(col) < 2:
            continue
        steps = []
        for (n0, t0), (n1, t1) in zip(col, col[1:]):
            other_steps |= n1 != 4 * n0
            per4 = (t1 / t0) ** (math.log(4) / math.log(n1 / n0))  # normalised to a 4x step
            steps.append(f"{per4:.1f}x")
        logn = np.log([n for n, _ in col])
        logt = np.log([t for _, t in col])
        slope = float(np.polyfit(logn, logt, 1)[0])
        parts.append(f"k={k}: {', '.join(steps)} (fitted time ~ n^{slope:.2f})")
    if not parts:
        return "Growth in n: too few sizes per k to say."
    scaled = " (steps other than 4x in n are scaled to 4x: ratio^(log 4 / log step))" if other_steps else ""
    return (
        "Growth of routelab's median time per 4x n at fixed k, between consecutive sizes of the "
        f"grid{scaled}: " + "; ".join(parts) + "."
    )


def _notes(rows: Sequence[Row], *, device: str) -> list[str]:
    """The explanatory notes under the table, all derived from ``rows``."""
    lines = ["", _growth_sentence(rows), ""]
    where = "on CPU" if device == "cpu" else f"on {device} (scipy always on CPU)"
    lines += [
        "Notes:",
        "",
        f"- Times are wall-clock medians {where}, in ms, of the timed calls after two warm-up calls "
        "(the first pays one-off costs such as loading a compiled kernel; the second sizes the run to the time "
        "budget); every number above was measured in this run. routelab and scipy are "
        "timed alternately, instance by instance, so that drifts in the machine's speed affect "
        "both alike.",
        "- scipy: `linear_sum_assignment(-E)` where `E` is the `n x n` float64 matrix of the "
        "scores with each expert's column repeated `c = n/k` times: it solves the general `n x n` "
        "assignment problem in float64 (single-threaded), while `balanced_assignment` works on "
        "the `n x k` float32 scores. Building `E` is not timed. speed-up = scipy ms / routelab ms"
        + ("." if device == "cpu" else f" (scipy on CPU vs routelab on {device})."),
        f"- same optimum: routelab's assignment respects the capacity and its objective "
        f"`sum_i s[i, z_i]` (float64, from the float32 scores) equals scipy's to relative "
        f"{_sci(OPTIMUM_RTOL)}.",
        f"- scipy is skipped where one call is estimated to exceed {SCIPY_LIMIT_S:.0f} s "
        f"(measured time at the largest smaller n of the same k, times (n/n0)^3) and never run "
        f"for n >= {SCIPY_NEVER_N}.",
        f"- gumbel_matching: tau = {GUMBEL_TAU:g}, seeded generator; the time includes sampling "
        "the Gumbel noise, the solve and the conditionals.",
        *([] if device == "cpu" else [
            f"- routelab and gumbel_matching as a user calls them: on {device}, a problem of at most "
            f"{SOLVER_TUNING.host_max_scores:,} scores is solved on the host when the compiled "
            "CPU solver is available (`balanced_assignment(on_host=None)`), with its copies in the time."]),
        f"- sinkhorn: input `log_softmax` of the scores, default `col_sum = n/k`, "
        f"tol = {_sci(SINKHORN_TOL)} (not the default 1e-6, to keep the benchmark fast), "
        f"max_iter = {SINKHORN_MAX_ITER}.",
    ]
    failed = [r for r in rows if r.sinkhorn_error is not None]
    if failed:
        eps = torch.finfo(DTYPE).eps
        detail = "; ".join(
            f"n={r.n}, k={r.k}: column error {r.sinkhorn_error}, float32 eps * n/k = "
            f"{eps * r.n / r.k:.2g}" for r in failed
        )
        lines.append(
            f"- sinkhorn did not converge to tol = {_sci(SINKHORN_TOL)} within {SINKHORN_MAX_ITER} "
            f"sweeps at: {detail}. Its time there is that of the full {SINKHORN_MAX_ITER} sweeps "
            "(the call raises ValueError)."
        )
    reduced = [
        f"{name} at n={r.n}, k={r.k}: {t.runs}"
        for r in rows
        for name, t in (("routelab", r.routelab), ("scipy", r.scipy), ("gumbel_matching", r.gumbel),
                        ("sinkhorn", r.sinkhorn))
        if t is not None and t.runs < r.requested
    ]
    if reduced:
        lines.append("- Fewer timed calls than requested (time budget per measurement): "
                     + "; ".join(reduced) + ".")
    not_same = [r for r in rows if r.same_optimum is False]
    for r in not_same:
        ours, theirs = r.objectives or (float("nan"), float("nan"))
        lines.append(f"- n={r.n}, k={r.k}: objectives differ: routelab {ours:.9g}, scipy {theirs:.9g}.")
    return lines



# ---------------------------------------------------------------------------- driver


def _benchmark(
    grid: Iterable[tuple[int, int]],
    repeats: int | Mapping[int, int],
    *,
    device: str = "cpu",
    budget_s: float = FULL_BUDGET_S,
    scipy_limit_s: float = SCIPY_LIMIT_S,
    seed: int = 0,
    out: TextIO | None = None,
) -> str:
    """Measure every size of ``grid`` and return the markdown table with its notes.

    Args:
        grid: ``(n, k)`` sizes; ``k`` must divide ``n``. Measured in increasing ``n`` (so that
            scipy's time at large ``n`` can be estimated from the smaller ones).
        repeats: timed calls per measurement after the warm-up, a number or a map from ``n``.
        device: ``"cpu"`` or ``"cuda"`` for the routelab functions (scipy runs on CPU).
        budget_s: time budget of one measurement (see :func:`_time_calls`).
        scipy_limit_s: skip scipy where one call is estimated to take longer.
        seed: seed of the score generator (the same for every size).
        out: where to stream the table, row by row as measured.

    Returns:
        The markdown: table, growth sentence and notes.
    """
    report = _Report(out)
    report.emit(*TABLE_HEADER)
    rows: list[Row] = []
    scipy_measured: dict[tuple[int, int], float] = {}
    for n, k in sorted(set(grid)):
        if n % k:
            raise ValueError(f"grid size (n={n}, k={k}): k must divide n (capacity n/k)")
        r = repeats if isinstance(repeats, int) else repeats[n]
        row = _measure(n, k, repeats=r, budget_s=budget_s, device=device, seed=seed,
                       scipy_measured=scipy_measured, scipy_limit_s=scipy_limit_s)
        rows.append(row)
        report.emit(_render_row(row))
    report.emit(*_notes(rows, device=device))
    return report.text()


# ---------------------------------------------------------------------------- batched section


#: Host syncs are counted from the warnings of ``torch.cuda.set_sync_debug_mode("warn")``, whose
#: text is "called a synchronizing CUDA operation".
_SYNC_WARNING = "synchronizing CUDA operation"


def count_host_syncs(fn: Callable[[], Any], *, device: str | torch.device) -> int | None:
    """How many times one call of ``fn()`` makes the host wait for the GPU.

    On CUDA, ``fn`` runs once under ``torch.cuda.set_sync_debug_mode("warn")``; torch then warns
    at every synchronizing operation (``.item()``, ``bool()`` of a CUDA tensor, a copy to the
    host, a blocking copy from pageable host memory, ``nonzero`` and the like), and the warnings
    are caught and counted. The previous debug mode is restored afterwards, also when ``fn``
    raises. Pending GPU work is finished before counting (outside the count). Only syncs raised on
    the calling thread are seen. :func:`host_sync_sites` says where they are.

    Args:
        fn: the call to count, without arguments; its result is discarded.
        device: where ``fn`` runs: ``"cuda"`` (or a CUDA ``torch.device``) counts; for any other
            device ``fn`` is not called and the result is ``None``.

    Returns:
        The number of synchronizing operations, or ``None`` when ``device`` is not CUDA.

    Raises:
        ValueError: ``device`` is CUDA but CUDA is not available.
    """
    sites = host_sync_sites(fn, device=device)
    return None if sites is None else sum(sites.values())


def host_sync_sites(fn: Callable[[], Any], *, device: str | torch.device) -> dict[str, int] | None:
    """The synchronizing operations of one call of ``fn()`` by the line of routelab that made them.

    As :func:`count_host_syncs` (one call under ``torch.cuda.set_sync_debug_mode("warn")``), each
    sync counted under the innermost frame of routelab's own source on the Python stack when
    torch warned (``"routelab/assignment/_prices.py:212"``; ``"(outside routelab)"`` when there is
    none), most frequent first.

    Returns:
        ``{site: syncs}``, or ``None`` when ``device`` is not CUDA.

    Raises:
        ValueError: ``device`` is CUDA but CUDA is not available.
    """
    if torch.device(device).type != "cuda":
        return None
    if not torch.cuda.is_available():
        raise ValueError("count_host_syncs: device is CUDA but torch.cuda.is_available() is False")
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        return _sync_warning_sites(fn, _PACKAGE_DIR)
    finally:
        torch.cuda.set_sync_debug_mode(previous)


#: routelab's source directory, whose frames name a sync's site.
_PACKAGE_DIR = os.path.dirname(os.path.abspath(routelab.__file__))

#: The site of a sync made with no frame of routelab's on the stack.
OUTSIDE = "(outside routelab)"


def _sync_warning_sites(fn: Callable[[], Any], package_dir: str) -> dict[str, int]:
    """Run ``fn`` and count torch's sync warnings by the innermost stack frame under
    ``package_dir`` (named relative to its parent directory) at the moment each was raised;
    other warnings of ``fn`` are passed on, not swallowed."""
    sites: dict[str, int] = {}
    others: list[tuple[Any, ...]] = []
    root = os.path.dirname(package_dir)

    def record(message: Warning | str, category: type[Warning], filename: str, lineno: int, *_: Any) -> None:
        if _SYNC_WARNING not in str(message):
            others.append((message, category, filename, lineno))
            return
        site = OUTSIDE
        for frame in reversed(traceback.extract_stack()[:-1]):  # (not this function's own frame)
            path = os.path.abspath(frame.filename)
            if path.startswith(package_dir + os.sep):
                site = f"{os.path.relpath(path, root)}:{frame.lineno}"
                break
        sites[site] = sites.get(site, 0) + 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        fn()
    for message, category, filename, lineno in others:
        warnings.warn_explicit(message, category, filename, lineno)
    return dict(sorted(sites.items(), key=lambda item: (-item[1], item[0])))


@dataclass
class BatchedMethod:
    """One method of the batched section at one size.

    Attributes:
        name: the row's label (markdown).
        timing: median over the timed batches of one call that solves the whole batch; ``None``
            when not run (the host row on device cpu).
        host_syncs: synchronizing operations in one call (see :func:`count_host_syncs`): of the
            whole batch for the batched rows, of instance 0 alone for the per-instance rows;
            ``None`` off CUDA or when not run.
        sync_sites: those syncs by the line of routelab that made them (:func:`host_sync_sites`).
        per_instance_calls: whether the method is called once per instance (a Python loop).
        feasible: every returned assignment has shape ``[b, n]``, experts in ``[0, k)`` and at
            most ``n / k`` tokens per expert; ``None`` when not run.
        skipped: why the method was not run, else ``None``.
    """

    name: str
    timing: Timing | None = None
    host_syncs: int | None = None
    sync_sites: dict[str, int] | None = None
    per_instance_calls: bool = False
    feasible: bool | None = None
    skipped: str | None = None


@dataclass
class BatchedSize:
    """Everything the batched section measured at one size ``(b, n, k)``.

    Attributes:
        b, n, k: instances per batch, tokens, experts (capacity ``n / k``).
        methods: by key ``"batched"``, ``"device"``, ``"loop"``, ``"auction"``, ``"host"``.
        same_optimum: every exact routelab row (batched, device, loop, host when run) has, on every
            instance, the batched call's objective to relative :data:`OPTIMUM_RTOL`.
        auction_gap_mean: mean over the instances the auction solved feasibly of ``(opt - auction)
            / |opt|`` (``opt``: routelab batched's objective, float64); nan when there are none.
        auction_gap_max: the largest such gap.
        auction_above: instances where the auction's answer is feasible and its objective exceeds
            routelab's by more than relative :data:`OPTIMUM_RTOL` (0 unless routelab is not exact there).
        auction_infeasible: instances where the auction left an expert over capacity (left out
            of the gaps; possible on tied scores).
        instances: instances checked (``b`` times the timed batches).
        requested: timed batches asked for (fewer are timed when over the time budget).
    """

    b: int
    n: int
    k: int
    methods: dict[str, BatchedMethod] = field(default_factory=dict)
    same_optimum: bool = True
    auction_gap_mean: float = 0.0
    auction_gap_max: float = 0.0
    auction_above: int = 0
    auction_infeasible: int = 0
    instances: int = 0
    requested: int = 0


def _batch_objectives(scores: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
    """``[b]`` float64 objectives ``sum_i scores[j, i, expert[j, i]]`` of ``[b, n, k]`` CPU scores
    and ``[b, n]`` experts (the gathered float32 values are exact in float64)."""
    return scores.gather(-1, expert.long().unsqueeze(-1)).squeeze(-1).double().sum(-1)


def _batch_feasible(expert: torch.Tensor, b: int, n: int, k: int) -> bool:
    """``expert`` is ``[b, n]`` integer, in ``[0, k)``, and no expert holds more than ``n / k``
    tokens in any instance."""
    if tuple(expert.shape) != (b, n) or expert.dtype.is_floating_point or expert.dtype == torch.bool:
        return False
    expert = expert.long()
    if b * n == 0:
        return True
    if int(expert.min()) < 0 or int(expert.max()) >= k:
        return False
    counts = torch.zeros(b, k, dtype=torch.long).scatter_add_(1, expert, torch.ones_like(expert))
    return bool((counts <= n // k).all())


def _per_instance(solve: Callable[[torch.Tensor], torch.Tensor], scores: torch.Tensor) -> torch.Tensor:
    """``solve`` on every ``[n, k]`` instance of ``[b, n, k]`` ``scores`` in turn; ``[b, n]``."""
    return torch.stack([solve(scores[j]) for j in range(scores.shape[0])])


def _on_host(scores: torch.Tensor) -> torch.Tensor:
    """``[b, n, k]`` device scores copied to the CPU, solved there in one batched
    :func:`balanced_assignment` call, the ``[b, n]`` experts copied back to ``scores.device``."""
    return balanced_assignment(scores.cpu()).to(scores.device)


def _measure_batched(
    b: int, n: int, k: int, *, repeats: int, budget_s: float, device: str, seed: int = 0
) -> BatchedSize:
    """Time and check the batched section's methods on ``repeats`` batches ``[b, n, k]``.

    Batch ``r`` is float32 ``torch.randn(b, n, k)`` from seed ``seed + r``, made on the CPU and
    moved to ``device`` before timing. Every method solves every batch, alternating batch by batch
    (:func:`_time_paired`: two warm-up calls each, synchronised timing, at most ``repeats``
    batches and fewer when the second warm-ups show that they exceed ``budget_s``). The host syncs of
    one call are counted afterwards, untimed.

    Raises:
        ValueError: ``k`` does not divide ``n``, or a size is not positive.
    """
    if min(b, n, k) < 1 or n % k:
        raise ValueError(f"batched size (b={b}, n={n}, k={k}): all must be positive and k must divide n")
    cpu_batches = [
        torch.randn(b, n, k, generator=torch.Generator().manual_seed(seed + r), dtype=DTYPE) for r in range(repeats)
    ]
    batches = [x.to(device) for x in cpu_batches]
    size = BatchedSize(b=b, n=n, k=k, requested=repeats)
    methods = {
        "batched": BatchedMethod("routelab `balanced_assignment`, the batch in one call"),
        "device": BatchedMethod("routelab `balanced_assignment(on_host=False)`, the batch in one call on the device"),
        "loop": BatchedMethod("routelab `balanced_assignment`, one call per instance", per_instance_calls=True),
        "auction": BatchedMethod("BASE-layers auction (`fairseq_auction`), one call per instance",
                                 per_instance_calls=True),
        "host": BatchedMethod("host: copy to CPU, `balanced_assignment` batched there, copy back"),
    }
    fns: dict[str, Callable[[int], Any]] = {
        "batched": lambda r: balanced_assignment(batches[r]),
        "device": lambda r: balanced_assignment(batches[r], on_host=False),
        "loop": lambda r: _per_instance(balanced_assignment, batches[r]),
        "auction": lambda r: _per_instance(fairseq_auction, batches[r]),
    }
    if device == "cpu":
        methods["host"].skipped = "device is cpu: the same as the first row"
        methods["device"].skipped = "device is cpu: the same as the first row"
        del fns["device"]
    else:
        fns["host"] = lambda r: _on_host(batches[r])
    timings, results = _time_paired(fns, repeats=repeats, budget_s=budget_s, device=device)
    one = batches[0]
    counted: dict[str, Callable[[], Any]] = {
        "batched": lambda: balanced_assignment(one),
        "device": lambda: balanced_assignment(one, on_host=False),
        "loop": lambda: balanced_assignment(one[0]),
        "auction": lambda: fairseq_auction(one[0]),
        "host": lambda: _on_host(one),
    }
    for key in fns:
        methods[key].timing = timings[key]
        sites = host_sync_sites(counted[key], device=device)
        methods[key].sync_sites = sites
        methods[key].host_syncs = None if sites is None else sum(sites.values())
        methods[key].feasible = all(_batch_feasible(z.cpu(), b, n, k) for z in results[key])
    size.methods = methods

    gaps: list[float] = []
    for r, z_opt in enumerate(results["batched"]):
        opt = _batch_objectives(cpu_batches[r], z_opt.cpu())
        scale = opt.abs().clamp(min=1e-30)
        for key in ("device", "loop", "host"):
            if key in results:
                other = _batch_objectives(cpu_batches[r], results[key][r].cpu())
                size.same_optimum &= bool(((other - opt).abs() <= OPTIMUM_RTOL * scale + 1e-12).all())
        z_auction = results["auction"][r].cpu()
        auction = _batch_objectives(cpu_batches[r], z_auction)
        gap = (opt - auction) / scale
        # An instance the auction left over capacity can score above the optimum: its gap says
        # nothing about optimality (the method's feasible column reports it), so it is left out.
        ok = _instance_feasible(z_auction, k)
        gaps += gap[ok].tolist()
        size.auction_above += int(((gap < -OPTIMUM_RTOL) & ok).sum())
        size.auction_infeasible += int((~ok).sum())
    size.instances = len(results["batched"]) * b
    size.auction_gap_mean = statistics.fmean(gaps) if gaps else float("nan")
    size.auction_gap_max = max(gaps) if gaps else float("nan")
    return size


def _instance_feasible(expert: torch.Tensor, k: int) -> torch.Tensor:
    """``[b]`` bool: instance ``j`` of ``[b, n]`` experts (in ``[0, k)``) gives no expert more than ``n / k`` tokens."""
    b, n = expert.shape
    expert = expert.long()
    counts = torch.zeros(b, k, dtype=torch.long).scatter_add_(1, expert, torch.ones_like(expert))
    return (counts <= n // k).all(-1)


BATCHED_HEADER = (
    "| method | ms per call | ms per instance | ratio to batched | host syncs per call | feasible | objective |",
    "|---|---:|---:|---:|---:|:---:|---|",
)


def _ms_small(value: float) -> str:
    """Like :func:`_ms`, with three significant digits below 1 ms (per-instance GPU times)."""
    return f"{value:.3g}" if value < 1 else _ms(value)


def _render_batched(size: BatchedSize) -> list[str]:
    """The batched section's markdown table at one size (one row per method)."""
    base = size.methods["batched"].timing
    lines = list(BATCHED_HEADER)
    for key, m in size.methods.items():
        if m.timing is None or base is None:
            lines.append(f"| {m.name} | skipped ({m.skipped}) | — | — | — | — | — |")
            continue
        if m.host_syncs is None:
            syncs = "n/a (CPU)"
        else:
            syncs = f"{m.host_syncs} (instance 0 alone)" if m.per_instance_calls else str(m.host_syncs)
        if key == "batched":
            objective = "reference (exact)"
        elif key == "auction":
            objective = f"gap mean {size.auction_gap_mean:.2e}, max {size.auction_gap_max:.2e}"
        else:
            objective = "same" if size.same_optimum else "DIFFERS"
        cells = [m.name, _ms(m.timing.median_ms), _ms_small(m.timing.median_ms / size.b),
                 _speedup(m.timing.median_ms / base.median_ms), syncs, "yes" if m.feasible else "NO", objective]
        lines.append("| " + " | ".join(cells) + " |")
    sited = [m for key, m in size.methods.items() if key in SITED_METHODS and m.sync_sites]
    if sited:
        lines += ["", "Host syncs by the line of routelab that made them (one untimed call):", ""]
        for m in sited:
            shown = [f"`{site}` {count}" for site, count in list(m.sync_sites.items())[:SITES_SHOWN]]
            more = len(m.sync_sites) - SITES_SHOWN
            lines.append(f"- {m.name}: " + ", ".join(shown) + (f", and {more} more sites" if more > 0 else ""))
    return lines


#: The rows whose host syncs are listed by site under the table (the batched calls).
SITED_METHODS = ("batched", "device", "host")

#: Sites listed per row, most frequent first.
SITES_SHOWN = 12


def _batched_notes(sizes: Sequence[BatchedSize], *, device: str) -> list[str]:
    """The notes under the batched section's tables, derived from the measurements."""
    lines = [
        "",
        "Notes:",
        "",
        "- ms per call: median over the timed batches of one call that solves the whole batch (the per-instance rows "
        "loop over its instances inside the call), wall clock"
        + (", with `torch.cuda.synchronize()` before and after every timed call" if device == "cuda" else "")
        + "; two warm-up calls each (not timed in the results); the methods alternate batch by batch. "
        "ms per instance = ms per call / instances. ratio to batched = ms per call / routelab batched's ms per call "
        "(> 1: slower than it).",
        "- host syncs per call: synchronizing operations counted with `torch.cuda.set_sync_debug_mode(\"warn\")` "
        "over one untimed call: of the whole batch for the batched and host rows, of instance 0 alone for the "
        "per-instance rows (a batch makes that many calls; the auction's count is its number of rounds on that "
        "instance, as it tests `bool(have_bids.all())` every round)."
        if device == "cuda" else "- host syncs per call: only counted on CUDA (n/a on CPU).",
        f"- objective: float64 sums of the float32 scores at the chosen experts. The routelab rows must equal "
        f"the batched call's objective on every instance to relative {_sci(OPTIMUM_RTOL)} (ties may pick other "
        "experts); the auction's gap is (routelab - auction) / |routelab| over the checked instances it "
        "solved within capacity.",
        "- host: includes both copies and the CPU solve with the torch threads of the header."
        if device != "cpu" else "- host and on_host=False: not run, as on device cpu they are the first row.",
    ]
    if device != "cpu":
        lines.append(f"- batched and the per-instance rows call `balanced_assignment` as a user does (`on_host=None`): "
                     f"on {device}, a problem of at most {SOLVER_TUNING.host_max_scores:,} scores is copied to the "
                     "host and solved there when the compiled CPU solver is available; `on_host=False` keeps "
                     "every solve on the device.")
    for s in sizes:
        if not s.same_optimum:
            lines.append(f"- b={s.b}, n={s.n}, k={s.k}: the routelab rows' objectives DIFFER (an exactness bug).")
        if s.auction_above:
            lines.append(f"- b={s.b}, n={s.n}, k={s.k}: the auction beat routelab's objective on {s.auction_above} "
                         "instance(s) (routelab should be exact: a bug).")
        if s.auction_infeasible:
            lines.append(f"- b={s.b}, n={s.n}, k={s.k}: the auction left an expert over capacity on "
                         f"{s.auction_infeasible} of {s.instances} instances (left out of its gap).")
        reduced = [key for key, m in s.methods.items() if m.timing is not None and m.timing.runs < s.requested]
        if reduced:
            runs = s.methods["batched"].timing.runs if s.methods["batched"].timing else 0
            lines.append(f"- b={s.b}, n={s.n}, k={s.k}: {runs} timed batch(es) instead of {s.requested} (time budget).")
    return lines


def _batched_section(
    sizes: Iterable[tuple[int, int, int]],
    *,
    repeats: int,
    budget_s: float,
    device: str,
    seed: int = 0,
    out: TextIO | None = None,
) -> str:
    """The batched section: for every ``(b, n, k)`` a table of routelab batched, one instance at a
    time, the BASE auction instance by instance and (off CPU) solving on the host.

    Args:
        sizes: ``(instances, n, k)`` per table, ``k`` dividing ``n``; measured in the given order.
        repeats: timed batches per size after the warm-up (fewer when over ``budget_s``).
        budget_s: time budget of one size (see :func:`_time_paired`).
        device: ``"cpu"`` or ``"cuda"``: where the scores live and the solvers run.
        seed: batch ``r`` of a size is drawn from ``seed + r``.
        out: where to stream the markdown as it is measured.

    Returns:
        The markdown: a heading line and a table per size, then the notes.
    """
    report = _Report(out)
    measured: list[BatchedSize] = []
    for b, n, k in sizes:
        size = _measure_batched(b, n, k, repeats=repeats, budget_s=budget_s, device=device, seed=seed)
        measured.append(size)
        runs = size.methods["batched"].timing.runs if size.methods["batched"].timing else 0
        report.emit("", f"Batched on {device}: {b} instances of n={n}, k={k} (capacity {n // k}), float32 "
                    f"`torch.randn({b}, {n}, {k})`, {runs} timed batch(es), {size.instances} instances checked:", "")
        report.emit(*_render_batched(size))
    report.emit(*_batched_notes(measured, device=device))
    return report.text()


def _header(*, quick: bool, device: str) -> list[str]:
    """Markdown lines stating what runs where, all facts read at run time."""
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    lines = [
        f"**routelab assignment benchmark** ({'quick' if quick else 'full'} mode)",
        "",
        f"- CPU: {_cpu_model()} ({os.cpu_count()} logical CPUs)",
        f"- routelab {routelab.__version__}, torch {torch.__version__}, scipy {scipy.__version__}, "
        f"numpy {np.__version__}, Python {platform.python_version()}",
        f"- torch threads: {torch.get_num_threads()} (set for this run; scipy's "
        "linear_sum_assignment is single-threaded)",
        f"- device: {device}"
        + (f" ({torch.cuda.get_device_name()})" if device == "cuda" else "")
        + f"; dtype: {str(DTYPE).removeprefix('torch.')} (scipy: float64 on CPU)",
        f"- date: {stamp}; 1-minute load average at start: {load_average()}",
        "",
    ]
    return lines


def run_benchmark(
    *, quick: bool = False, threads: int = 1, device: str = "cpu", out: TextIO | None = None
) -> str:
    """Run the assignment benchmark and return its markdown report.

    Args:
        quick: the smaller grid (n up to 4096) with fewer repeats.
        threads: torch intra-op threads for the run (restored afterwards).
        device: ``"cpu"`` or ``"cuda"``; on CUDA the batched section (:func:`_batched_section` at
            :data:`BATCH_SIZES`) is added (scipy stays on CPU).
        out: stream to write the report to as it is measured (each line flushed).

    Returns:
        The markdown report: machine facts, the results table, notes, and on CUDA the batched
        section's tables and notes.

    Raises:
        ValueError: an unknown device, ``device="cuda"`` without CUDA, or ``threads < 1``.
    """
    check_device_and_threads(device, threads)

    ns = QUICK_NS if quick else FULL_NS
    repeats = QUICK_REPEATS if quick else FULL_REPEATS
    budget_s = QUICK_BUDGET_S if quick else FULL_BUDGET_S

    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        report = _Report(out)
        report.emit(*_header(quick=quick, device=device))
        report.emit(f"Sizes: n in {list(ns)}, k in {list(KS)}, capacity n/k, scores "
                    "`torch.randn(n, k)`, a new instance (seed 0, 1, ...) for each timed call, the same instances "
                    "for every method. Timed calls (instances) per size after two warm-up calls: "
                    + ", ".join(f"{r} at n={n}" for n, r in repeats.items()) + ".", "")
        text = report.text()
        text += _benchmark([(n, k) for n in ns for k in KS], repeats, device=device,
                           budget_s=budget_s, out=out)
        if device == "cuda":
            text += _batched_section(BATCH_SIZES, repeats=QUICK_BATCH_REPEATS if quick else BATCH_REPEATS,
                                     budget_s=budget_s, device=device, out=out)
        return text
    finally:
        torch.set_num_threads(previous_threads)
