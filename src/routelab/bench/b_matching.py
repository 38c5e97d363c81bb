"""Benchmark of the exact balanced b-matching against scipy's HiGHS on the same instances.

For every size ``(n, E, k)`` and every seed, float32 scores ``torch.randn(n, E)`` are solved by

* :func:`routelab.assignment.balanced_b_matching` (``k`` distinct experts per token, every expert
  ``floor``/``ceil`` of ``k n / E`` pairs);
* :func:`scipy.optimize.linprog` (``method="highs"``) on the ``n E``-variable LP relaxation
  (totally unimodular, so its optimum is the integer optimum), and
* :func:`scipy.optimize.milp` (HiGHS branch and cut) on the same binary program,

both in float64 on the same scores. Reported: the median wall time of each over the seeds (after
one untimed warm-up call of routelab's solver; milp only up to ``MILP_MAX_PAIRS`` variables), each
peer's median over routelab's (> 1: routelab is faster), and whether routelab's objective equals
scipy's within ``1e-6`` relative to the scores' spread times ``k n``. Run it with
``python -m routelab.bench.b_matching [--quick]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from typing import TextIO

import numpy as np
import scipy.sparse as sp
import torch
from scipy.optimize import Bounds, LinearConstraint, linprog, milp

from ..assignment import balanced_b_matching
from ..machine import cpu_model, load_average

__all__ = ["run_b_matching_benchmark", "scipy_b_matching"]

FULL_SIZES: tuple[tuple[int, int, int], ...] = ((1024, 16, 2), (4096, 64, 2), (4096, 64, 4), (16384, 64, 2))
QUICK_SIZES: tuple[tuple[int, int, int], ...] = ((1024, 16, 2), (4096, 64, 2))
#: milp is skipped above this many binary variables ``n E`` (6 s at 16k variables on 2 CPU cores).
MILP_MAX_PAIRS = 20_000


def scipy_b_matching(scores: np.ndarray, k: int, method: str) -> tuple[float, float]:
    """Solve the b-matching of ``[n, E]`` float64 ``scores`` with scipy's HiGHS.

    Args:
        scores: ``[n, E]`` finite scores.
        k: experts per token.
        method: ``"linprog"`` (the LP relaxation) or ``"milp"`` (the binary program).

    Returns:
        ``(objective, seconds)``: the optimal total score and the solver's wall time.
    """
    n, E = scores.shape
    N = n * E
    pairs = np.arange(N)
    per_token = sp.csr_matrix((np.ones(N), (np.repeat(np.arange(n), E), pairs)), shape=(n, N))
    per_expert = sp.csr_matrix((np.ones(N), (np.tile(np.arange(E), n), pairs)), shape=(E, N))
    lo, hi = k * n // E, -(-k * n // E)
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


def run_b_matching_benchmark(
    sizes: Sequence[tuple[int, int, int]] = FULL_SIZES, seeds: int = 5, out: TextIO | None = None,
    threads: int | None = 1,
) -> str:
    """Time routelab and scipy (linprog, milp) on the same instances; a markdown table.

    Args:
        sizes: ``(n, E, k)`` triples.
        seeds: instances per size (each timed once per method).
        out: where to stream the lines as they are measured (``None``: nowhere).
        threads: torch intra-op threads while measuring (default 1, like HiGHS's default
            single-threaded solve; ``None``: leave torch's setting), restored afterwards.

    Returns:
        The markdown report.
    """
    old = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _measure(sizes, seeds, out)
    finally:
        torch.set_num_threads(old)


def _speedup(peer: Sequence[float], ours: Sequence[float]) -> str:
    """``median(peer) / median(ours)`` as ``"12.3x"`` (> 1: routelab is faster), ``"—"`` when the peer was skipped."""
    if not peer or not ours:
        return "—"
    return f"{statistics.median(peer) / max(statistics.median(ours), 1e-12):.1f}x"


def _measure(sizes: Sequence[tuple[int, int, int]], seeds: int, out: TextIO | None) -> str:
    """:func:`run_b_matching_benchmark` under the chosen thread count."""
    lines: list[str] = []

    def emit(line: str) -> None:
        lines.append(line)
        if out is not None:
            print(line, file=out, flush=True)

    emit(f"CPU: {cpu_model()}; torch threads: {torch.get_num_threads()}; load average at start: {load_average()}")
    emit("")
    emit("| n | E | k | routelab ms | scipy linprog (HiGHS) ms | scipy milp (HiGHS) ms | linprog / routelab "
         "| milp / routelab | same optimum |")
    emit("|---:|---:|---:|---:|---:|---:|---:|---:|:---:|")
    for n, E, k in sizes:
        times: dict[str, list[float]] = {"routelab": [], "linprog": [], "milp": []}
        same = True
        for seed in range(seeds):
            scores = torch.randn(n, E, generator=torch.Generator().manual_seed(seed))
            if seed == 0:
                balanced_b_matching(scores, k)  # warm-up: scratch memory, lazy imports
            start = time.perf_counter()
            experts = balanced_b_matching(scores, k)
            times["routelab"].append(time.perf_counter() - start)
            s64 = scores.double().numpy()
            ours = float(np.take_along_axis(s64, experts.numpy(), axis=-1).sum())
            spread = float((s64.max(-1) - s64.min(-1)).max())
            for method in ("linprog", "milp"):
                if method == "milp" and n * E > MILP_MAX_PAIRS:
                    continue
                best, seconds = scipy_b_matching(s64, k, method)
                times[method].append(seconds)
                same &= abs(ours - best) <= 1e-6 * spread * k * n
        med = {name: f"{1e3 * statistics.median(ts):.1f}" if ts else "skipped" for name, ts in times.items()}
        ratio = {name: _speedup(times[name], times["routelab"]) for name in ("linprog", "milp")}
        emit(f"| {n} | {E} | {k} | {med['routelab']} | {med['linprog']} | {med['milp']} | {ratio['linprog']} | "
             f"{ratio['milp']} | {'yes' if same else 'NO'} |")
    emit("")
    emit(f"Median over {seeds} instances per size; load average at the end: {load_average()}.")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m routelab.bench.b_matching [--quick] [--seeds N]``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two sizes")
    parser.add_argument("--seeds", type=int, default=5, help="instances per size")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = parser.parse_args(argv)
    run_b_matching_benchmark(QUICK_SIZES if args.quick else FULL_SIZES, args.seeds, out=sys.stdout,
                             threads=args.threads)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
