"""Benchmark of the exact balanced b-matching against exact peers on the same instances.

For every size ``(n, E, k)`` (balanced quotas: every expert ``floor``/``ceil`` of ``k n / E``
pairs) or ``(n, E, k, f)`` (a capacity ``ceil(f k n / E)``, no lower bound) and every seed, float32
scores are solved by

* :func:`routelab.assignment.balanced_b_matching` (``k`` distinct experts per token);
* OR-Tools' ``SimpleMinCostFlow`` (a cost-scaling push-relabel algorithm, on the flow graph source ->
  token -> expert -> sink, integer costs ``round(-s * 2^24 / max|s|)``; building the graph is timed), when
  OR-Tools is installed (the ``bench`` extra), else reported as missing;
* :func:`scipy.optimize.linprog` (``method="highs"``) on the ``n E``-variable LP relaxation
  (totally unimodular, so its optimum is the integer optimum), and
* :func:`scipy.optimize.milp` (HiGHS branch and cut) on the same binary program,

the peers in float64 on the same scores. The scores are ``torch.randn(n, E)``; the capacity rows
add a common expert bias ``linspace(2, 0, E)`` (popular experts), so that the capacity binds
some experts and not others, the case that a balanced instance does not exercise. Reported: the
median wall time of each over the seeds (after one untimed warm-up call of routelab's solver; milp
only up to ``MILP_MAX_PAIRS`` variables), each peer's median over routelab's (> 1: routelab is
faster), and whether routelab's objective equals every peer's optimum within ``1e-6`` relative to
the scores' spread times ``k n`` (OR-Tools': within its cost rounding). The report opens with the
machine, the versions (routelab, torch, numpy, scipy, OR-Tools, ...), the threads, the date and the
load, as the other benchmark reports (:func:`routelab.bench.peers._header`). Run it with
``routelab bench b-matching [--quick]``.
"""

from __future__ import annotations

import argparse
import importlib
import math
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO

import numpy as np
import scipy.sparse as sp
import torch
from scipy.optimize import Bounds, LinearConstraint, linprog, milp

from .._checks import positive_int_arg
from ..assignment import balanced_b_matching
from ..assignment.b_matching import b_matching_quotas
from ..machine import load_average
from ._checks import check_device_and_threads
from .peers import _header

__all__ = ["ortools_b_matching", "run_b_matching_benchmark", "scipy_b_matching"]

#: ``(n, E, k)``: balanced quotas; ``(n, E, k, f)``: a capacity ``ceil(f k n / E)``, popular experts.
Size = tuple[int, int, int] | tuple[int, int, int, float]

FULL_SIZES: tuple[Size, ...] = ((1024, 16, 2), (4096, 64, 2), (4096, 64, 4), (16384, 64, 2),
                                (4096, 64, 2, 1.25), (4096, 64, 8, 1.1), (2048, 64, 16, 1.1))
QUICK_SIZES: tuple[Size, ...] = ((1024, 16, 2), (4096, 64, 2), (4096, 64, 2, 1.25))
#: milp is skipped above this many binary variables ``n E`` (6 s at 16k variables on 2 CPU cores).
MILP_MAX_PAIRS = 20_000
#: OR-Tools' integer costs: ``round(-s * ORTOOLS_SCALE / max|s|)``.
ORTOOLS_SCALE = 2.0**24


def _capacity(n: int, E: int, k: int, factor: float | None) -> int | None:
    """The capacity of a size: ``ceil(factor k n / E)``, or None (balanced quotas)."""
    return None if factor is None else math.ceil(factor * k * n / E)


def _instance(size: Size, seed: int) -> tuple[torch.Tensor, int, int | None]:
    """``(scores [n, E] float32, k, capacity)`` of ``size``'s instance ``seed``."""
    n, E, k = size[:3]
    factor = size[3] if len(size) == 4 else None
    scores = torch.randn(n, E, generator=torch.Generator().manual_seed(seed))
    if factor is not None:  # popular experts: the capacity binds some of them
        scores = scores + torch.linspace(2.0, 0.0, E)
    return scores, k, _capacity(n, E, k, factor)


def scipy_b_matching(scores: np.ndarray, k: int, method: str, capacity: int | None = None) -> tuple[float, float]:
    """Solve the b-matching of ``[n, E]`` float64 ``scores`` with scipy's HiGHS.

    Args:
        scores: ``[n, E]`` finite scores.
        k: experts per token.
        method: ``"linprog"`` (the LP relaxation) or ``"milp"`` (the binary program).
        capacity: every expert's load at most ``capacity`` (None: balanced quotas, as
            :func:`~routelab.assignment.balanced_b_matching`).

    Returns:
        ``(objective, seconds)``: the optimal total score and the solver's wall time.
    """
    n, E = scores.shape
    N = n * E
    pairs = np.arange(N)
    per_token = sp.csr_matrix((np.ones(N), (np.repeat(np.arange(n), E), pairs)), shape=(n, N))
    per_expert = sp.csr_matrix((np.ones(N), (np.tile(np.arange(E), n), pairs)), shape=(E, N))
    lo, hi = b_matching_quotas(n, E, k, capacity)
    cost = -scores.ravel()
    start = time.perf_counter()
    if method == "linprog":
        res = linprog(cost, A_ub=sp.vstack([per_expert, -per_expert]), b_ub=np.r_[np.full(E, hi), np.full(E, -lo)],
                      A_eq=per_token, b_eq=np.full(n, k), bounds=(0, 1), method="highs")
    elif method == "milp":
        res = milp(cost, constraints=[LinearConstraint(per_token, k, k), LinearConstraint(per_expert, lo, hi)],
                   integrality=np.ones(N), bounds=Bounds(0, 1))
    else:
        raise ValueError(f"method must be 'linprog' or 'milp', got {method!r}")
    seconds = time.perf_counter() - start
    if res.status != 0:
        raise RuntimeError(f"scipy {method} failed: {res.message}")
    return -float(res.fun), seconds


def _ortools_flow() -> Any:
    """OR-Tools' min-cost flow module, or None when OR-Tools is not installed."""
    try:
        return importlib.import_module("ortools.graph.python.min_cost_flow")
    except ImportError:
        return None


def ortools_b_matching(scores: np.ndarray, k: int, capacity: int | None = None) -> tuple[float, float]:
    """Solve the b-matching of ``[n, E]`` float64 ``scores`` with OR-Tools' min-cost flow.

    The flow graph: every token supplies ``k`` units, one per arc token -> expert (capacity 1,
    integer cost ``round(-s * ORTOOLS_SCALE / max|s|)``); every expert keeps its lower quota
    ``lo`` (a demand) and passes up to ``hi - lo`` more to the sink, which takes the rest.

    Returns:
        ``(objective, seconds)``: the total *float* score of OR-Tools' b-matching (optimal for the
        rounded costs: within ``k n max|s| / ORTOOLS_SCALE`` of the optimum) and its wall time,
        building the graph included.

    Raises:
        ImportError: OR-Tools is not installed (``pip install ortools``, or the ``bench`` extra).
    """
    mcf = _ortools_flow()
    if mcf is None:
        raise ImportError("OR-Tools is not installed: pip install ortools (or routelab's `bench` extra)")
    n, E = scores.shape
    lo, hi = b_matching_quotas(n, E, k, capacity)
    cost = np.rint(-scores * (ORTOOLS_SCALE / max(float(np.abs(scores).max()), 1e-30))).astype(np.int64)
    start = time.perf_counter()
    flow = mcf.SimpleMinCostFlow()
    tails = np.repeat(np.arange(n), E)
    heads = n + np.tile(np.arange(E), n)
    arcs = flow.add_arcs_with_capacity_and_unit_cost(tails, heads, np.ones(n * E, dtype=np.int64), cost.ravel())
    sink = n + E
    flow.add_arcs_with_capacity_and_unit_cost(np.arange(n, n + E), np.full(E, sink),
                                              np.full(E, hi - lo, dtype=np.int64), np.zeros(E, dtype=np.int64))
    supplies = np.concatenate([np.full(n, k, dtype=np.int64), np.full(E, -lo, dtype=np.int64),
                               np.array([-(k * n - E * lo)], dtype=np.int64)])
    flow.set_nodes_supplies(np.arange(n + E + 1), supplies)
    if flow.solve() != flow.OPTIMAL:
        raise RuntimeError("OR-Tools min-cost flow did not solve")
    used = flow.flows(arcs) > 0
    seconds = time.perf_counter() - start
    return float(scores.ravel()[used].sum()), seconds


def run_b_matching_benchmark(
    sizes: Sequence[Size] = FULL_SIZES, seeds: int = 5, out: TextIO | None = None,
    threads: int | None = 1,
) -> str:
    """Time routelab and its peers (OR-Tools, scipy linprog and milp) on the same instances; a markdown table.

    Args:
        sizes: ``(n, E, k)`` (balanced) or ``(n, E, k, f)`` (capacity ``ceil(f k n / E)``) tuples.
        seeds: instances per size (each timed once per method).
        out: where to stream the lines as they are measured (``None``: nowhere).
        threads: torch intra-op threads while measuring (default 1, like HiGHS's default
            single-threaded solve; ``None``: leave torch's setting), restored afterwards.

    Returns:
        The markdown report.

    Raises:
        ValueError: a size that is not ``(n, E, k[, f])``, ``seeds < 1`` or ``threads < 1``.
    """
    for size in sizes:
        if len(size) not in (3, 4):
            raise ValueError(f"sizes: every size is (n, E, k) or (n, E, k, capacity_factor), got {size!r}")
    if isinstance(seeds, bool) or not isinstance(seeds, int) or seeds < 1:
        raise ValueError(f"seeds must be an integer >= 1 (instances per size), got {seeds!r}")
    if threads is not None:
        check_device_and_threads("cpu", threads)
    old = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _measure(sizes, seeds, out)
    finally:
        torch.set_num_threads(old)


def _speedup(peer: Sequence[float], ours: Sequence[float]) -> str:
    """``median(peer) / median(ours)`` as ``"12.3x"`` (> 1: routelab is faster; below 1 with two
    significant digits, ``"0.052x"``), ``"—"`` when the peer was skipped."""
    if not peer or not ours:
        return "—"
    ratio = statistics.median(peer) / max(statistics.median(ours), 1e-12)
    if ratio < 1:  # (0.996 at two digits would read "1x")
        return f"{ratio:.2g}x" if ratio < 0.995 else f"{ratio:.3f}x"
    return f"{ratio:.1f}x"


PEERS: tuple[str, ...] = ("OR-Tools", "linprog", "milp")


def _measure(sizes: Sequence[Size], seeds: int, out: TextIO | None) -> str:
    """:func:`run_b_matching_benchmark` under the chosen thread count."""
    lines: list[str] = []

    def emit(line: str) -> None:
        lines.append(line)
        if out is not None:
            print(line, file=out, flush=True)

    has_ortools = _ortools_flow() is not None
    for line in _header("routelab balanced b-matching vs OR-Tools and HiGHS", torch.get_num_threads()):
        emit(line)
    if not has_ortools:  # (the header ends with an empty line)
        emit("OR-Tools is not installed (pip install ortools, or the `bench` extra): its column is empty.")
        emit("")
    emit("| n | E | k | capacity | routelab ms | OR-Tools min-cost flow ms | scipy linprog (HiGHS) ms "
         "| scipy milp (HiGHS) ms | OR-Tools / routelab | linprog / routelab | milp / routelab | same optimum |")
    emit("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|")
    for size in sizes:
        n, E, k = size[:3]
        capacity = _capacity(n, E, k, size[3] if len(size) == 4 else None)
        times: dict[str, list[float]] = {"routelab": [], **{p: [] for p in PEERS}}
        same = True
        for seed in range(seeds):
            scores, k, capacity = _instance(size, seed)
            if seed == 0:
                balanced_b_matching(scores, k, capacity)  # warm-up: scratch memory, lazy imports
            start = time.perf_counter()
            experts = balanced_b_matching(scores, k, capacity)
            times["routelab"].append(time.perf_counter() - start)
            s64 = scores.double().numpy()
            ours = float(np.take_along_axis(s64, experts.numpy(), axis=-1).sum())
            tol = 1e-6 * float((s64.max(-1) - s64.min(-1)).max()) * k * n
            if has_ortools:
                theirs, seconds = ortools_b_matching(s64, k, capacity)
                times["OR-Tools"].append(seconds)
                rounding = k * n * float(np.abs(s64).max()) / ORTOOLS_SCALE
                same &= abs(theirs - ours) <= tol + rounding  # optimal for its rounded costs
            for method in ("linprog", "milp"):
                if method == "milp" and n * E > MILP_MAX_PAIRS:
                    continue
                best, seconds = scipy_b_matching(s64, k, method, capacity)
                times[method].append(seconds)
                same &= abs(ours - best) <= tol
        med = {name: f"{1e3 * statistics.median(ts):.1f}" if ts else "skipped" for name, ts in times.items()}
        if not has_ortools:
            med["OR-Tools"] = "missing"
        ratio = {name: _speedup(times[name], times["routelab"]) for name in PEERS}
        emit(f"| {n} | {E} | {k} | {'balanced' if capacity is None else capacity} | {med['routelab']} | "
             f"{med['OR-Tools']} | {med['linprog']} | {med['milp']} | {ratio['OR-Tools']} | {ratio['linprog']} | "
             f"{ratio['milp']} | {'yes' if same else 'NO'} |")
    emit("")
    emit(f"Median over {seeds} instances per size; load average at the end: {load_average()}. Balanced rows: "
         "`torch.randn(n, E)`, every expert floor/ceil of k n / E pairs; capacity rows: `torch.randn(n, E) + "
         "linspace(2, 0, E)` (popular experts), loads at most the capacity.")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m routelab.bench.b_matching [--quick] [--seeds N]`` (also ``routelab bench b-matching``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="three sizes")
    parser.add_argument("--seeds", type=positive_int_arg, default=5, help="instances per size")
    parser.add_argument("--threads", type=positive_int_arg, default=1, help="torch threads (default 1)")
    args = parser.parse_args(argv)
    run_b_matching_benchmark(QUICK_SIZES if args.quick else FULL_SIZES, args.seeds, out=sys.stdout,
                             threads=args.threads)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
