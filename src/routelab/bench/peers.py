"""routelab against the strongest peers, in the same run (``routelab bench assignment|sinkhorn --peers``).

**Assignment.** For every ``(n, k)`` of the grid, on float32 ``torch.randn(n, k)`` instances (seeds
0, 1, ...; capacity ``n / k``), one call of every method per instance, the methods in rotating
order instance by instance (a shared machine's drift hits all alike), after one untimed warm-up:

* routelab :func:`~routelab.assignment.balanced_assignment` (exact);
* POT ``ot.emd`` (network simplex, exact) on the float64 cost ``-scores`` with marginals
  ``1`` (tokens) and ``n / k`` (experts);
* OR-Tools ``SimpleMinCostFlow`` (exact on integers): ``n * k`` token-to-expert arcs with costs
  ``round(-scores * 2^24 / max|scores|)`` (float32's resolution); building the graph is timed
  (it is the solver's input format);
* scipy ``linear_sum_assignment`` on the ``n x n`` column-expanded float64 matrix (building it is
  not timed), skipped where too slow (said so);
* the fairseq BASE-layers auction (approximate), reimplemented in PyTorch from its description:
  :func:`fairseq_auction`.

Each method's time is the median over instances; a peer's *ratio* is the median over instances
of ``peer time / routelab time`` (the number the targets are judged by); its *gap* the largest
relative optimality gap ``(best - its objective) / |best|`` over the instances (``best``: the
largest objective of any method; exact methods show 0 up to rounding). A peer that is not
installed is reported as missing.

**Sinkhorn.** routelab :func:`~routelab.assignment.sinkhorn` of ``log_softmax(scores / T)`` against
POT's ``ot.sinkhorn`` (``method="sinkhorn"``, the scaling domain, and ``"sinkhorn_log"``) with
``M = -log_p``, ``reg = 1`` and the same marginals, in float32 and float64, at equal accuracy:
routelab stops at the tolerance (checked every sweep), and POT runs, on each instance, exactly the
sweeps routelab needed there (``numItermax``, ``stopThr = 0``), so both end with the same iterate
up to rounding (the report checks the column errors). POT's own stopping rule is tested only every
10 sweeps (it runs at least 11), so POT with ``stopThr = tol`` ends more accurate after more work:
it is shown for information, not judged. routelab returns ``log q`` and POT the plan ``q``: each is
timed returning its own output.
"""

from __future__ import annotations

import importlib
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TextIO

import numpy as np
import scipy
import torch
from scipy.optimize import linear_sum_assignment

import routelab
from routelab.assignment import balanced_assignment, compiled_phases, sinkhorn

from ..machine import cpu_model, load_average
from ._checks import check_device_and_threads

__all__ = ["fairseq_auction", "run_assignment_peers", "run_sinkhorn_peers"]

FULL_NS: tuple[int, ...] = (256, 1024, 4096, 16384)
QUICK_NS: tuple[int, ...] = (256, 1024)
KS: tuple[int, ...] = (4, 16, 64)
FULL_REPEATS: dict[int, int] = {256: 15, 1024: 11, 4096: 9, 16384: 5}
QUICK_REPEATS: dict[int, int] = {256: 5, 1024: 3, 4096: 3, 16384: 1}
#: scipy is skipped from this n on (its n x n problem takes seconds per call at n = 4096 ...
SCIPY_MAX_N = 4096
#: ... and ~1 minute at n = 16384), and where one call is estimated to take longer than this.
SCIPY_LIMIT_S = 3.0
#: The batched per-sequence row: this many instances of (n, k) in one call.
BATCH: tuple[int, int, int] = (64, 256, 16)
BATCH_REPEATS = 9
#: The per-phase breakdown and the memory bound are measured at this size.
PHASE_SIZE: tuple[int, int] = (4096, 64)
#: An exact peer's objective may differ from the best by this (relative) before it counts as a gap.
EXACT_RTOL = 1e-6

SINKHORN_SIZES: tuple[tuple[int, int], ...] = ((256, 16), (1024, 16), (4096, 64), (16384, 64))
QUICK_SINKHORN_SIZES: tuple[tuple[int, int], ...] = ((256, 16), (1024, 16))
SINKHORN_TEMPERATURES: tuple[float, ...] = (1.0, 0.1)
SINKHORN_TOL = 1e-6
SINKHORN_MAX_ITER = 10000


# ---------------------------------------------------------------------------- the auction peer


def fairseq_auction(scores: torch.Tensor, *, max_iterations: int = 100) -> torch.Tensor:
    """The BASE-layers auction as fairseq runs it (``libbase`` ``balanced_assignment``), in PyTorch.

    Written from its description: ``eps = (max - min) / 50``, floored at ``1e-4``; in every round
    each expert bids for its top ``c + 1`` tokens by value (score minus the token's price),
    offering the lead of each of its top ``c`` over its ``(c + 1)``-th plus ``eps``; after the first
    round an expert also bids ``eps`` to keep last round's winnings; every token goes to its
    highest bidder and its price rises by that bid. For ``max_iterations`` rounds the tokens an
    expert won are pushed to the top of its next ranking; after that (the greedy finish) they keep
    their true value. It stops once every token received a bid. Approximate: it does not certify
    optimality. With one expert (``k = 1``, capacity ``n``) every token goes to expert 0, the only
    assignment (there is no ``(c + 1)``-th token to bid against).

    Args:
        scores: ``[n, k]`` scores, ``k`` dividing ``n``.

    Returns:
        ``[n]`` long expert per token.
    """
    n, k = scores.shape
    if k == 1:
        return torch.zeros(n, dtype=torch.long, device=scores.device)
    c = n // k
    w2j = scores.detach().t().contiguous()  # [k, n]
    eps = ((w2j.max() - w2j.min()) / 50).clamp(min=1e-4)
    value = w2j.clone()
    max_value = w2j.max()
    cost = w2j.new_zeros(1, n)
    jobs = torch.arange(n, device=scores.device)
    bid_indices = None
    counter = 0
    while True:
        top_values, top_index = value.topk(c + 1, dim=1)
        increments = top_values[:, :c] - top_values[:, c:] + eps
        bids = torch.zeros_like(w2j).scatter_(1, top_index[:, :c], increments)
        if 0 < counter < max_iterations and bid_indices is not None:
            bids.view(-1)[bid_indices] = eps
        high_bids, high_bidders = bids.max(dim=0)
        have_bids = high_bids > 0
        if bool(have_bids.all()):
            return high_bidders
        cost += high_bids
        value = w2j - cost
        bid_indices = (high_bidders * n + jobs)[have_bids]
        if counter < max_iterations:
            value.view(-1)[bid_indices] = max_value
        else:
            value.view(-1)[bid_indices] = w2j.view(-1)[bid_indices]
        counter += 1
        if counter > 100 * n:  # it always ends; this only bounds a surprise
            raise RuntimeError("fairseq_auction did not end")


# ---------------------------------------------------------------------------- peers


@dataclass
class Peer:
    """A method to time: ``prepare(scores) -> input`` (not timed), ``solve(input) -> experts``."""

    name: str
    exact: bool
    prepare: Callable[[torch.Tensor], Any]
    solve: Callable[[Any], np.ndarray]
    note: str = ""


def _module(name: str) -> Any | None:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _pot_peer(ot: Any) -> Peer:
    def prepare(s: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        n, k = s.shape
        return np.ones(n), np.full(k, n / k), np.ascontiguousarray(-s.double().numpy())

    def solve(x: tuple[np.ndarray, np.ndarray, np.ndarray]) -> np.ndarray:
        return ot.emd(*x).argmax(1)

    return Peer("POT ot.emd", True, prepare, solve)


def _ortools_peer(mcf: Any) -> Peer:
    def prepare(s: torch.Tensor) -> tuple[np.ndarray, int, int]:
        scale = 2.0**24 / max(float(s.abs().max()), 1e-30)
        return np.rint(-s.double().numpy() * scale).astype(np.int64), s.shape[0], s.shape[1]

    def solve(x: tuple[np.ndarray, int, int]) -> np.ndarray:
        cost, n, k = x
        flow = mcf.SimpleMinCostFlow()
        tails = np.repeat(np.arange(n), k)
        heads = n + np.tile(np.arange(k), n)
        arcs = flow.add_arcs_with_capacity_and_unit_cost(tails, heads, np.ones(n * k, dtype=np.int64), cost.ravel())
        flow.set_nodes_supplies(np.arange(n + k), np.concatenate([np.ones(n, dtype=np.int64),
                                                                  np.full(k, -(n // k), dtype=np.int64)]))
        if flow.solve() != flow.OPTIMAL:
            raise RuntimeError("OR-Tools min-cost flow did not solve")
        used = flow.flows(arcs) > 0
        z = np.full(n, -1, dtype=np.int64)
        z[tails[used]] = heads[used] - n
        return z

    return Peer("OR-Tools min-cost flow", True, prepare, solve,
                "integer costs round(-s * 2^24 / max|s|); building the graph is timed")


def _scipy_peer() -> Peer:
    def prepare(s: torch.Tensor) -> tuple[np.ndarray, int]:
        c = s.shape[0] // s.shape[1]
        return np.repeat(-s.double().numpy(), c, axis=1), c

    def solve(x: tuple[np.ndarray, int]) -> np.ndarray:
        rows, cols = linear_sum_assignment(x[0])
        z = np.empty(len(rows), dtype=np.int64)
        z[rows] = cols // x[1]
        return z

    return Peer("scipy LSA", True, prepare, solve, "n x n column-expanded float64 matrix (not timed to build)")


def peers() -> tuple[list[Peer], list[str]]:
    """The available peers and the names of the missing ones (with the install hint)."""
    found = [_scipy_peer()]
    missing = []
    ot = _module("ot")
    if ot is not None:
        found.insert(0, _pot_peer(ot))
    else:
        missing.append("POT ot.emd (`pip install pot`, or the `bench` extra)")
    mcf = _module("ortools.graph.python.min_cost_flow")
    if mcf is not None:
        found.insert(1 if ot is not None else 0, _ortools_peer(mcf))
    else:
        missing.append("OR-Tools min-cost flow (`pip install ortools`, or the `bench` extra)")
    found.append(Peer("fairseq auction", False, lambda s: s,
                      lambda s: fairseq_auction(s).numpy(), "PyTorch reimplementation, approximate"))
    return found, missing


# ---------------------------------------------------------------------------- timing


def _paired(fns: Mapping[str, Callable[[int], Any]], runs: int) -> tuple[dict[str, list[float]], dict[str, list[Any]]]:
    """Per-instance seconds and results of every function, alternating instance by instance."""
    names = list(fns)
    for name in names:
        fns[name](0)  # warm-up (compilation, caches, scratch memory)
    times: dict[str, list[float]] = {name: [] for name in names}
    results: dict[str, list[Any]] = {name: [] for name in names}
    for i in range(runs):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            out = fns[name](i)
            times[name].append(time.perf_counter() - start)
            results[name].append(out)
    return times, results


def _median_ms(seconds: Sequence[float]) -> float:
    return 1e3 * statistics.median(seconds)


def _ratio(peer: Sequence[float], ours: Sequence[float]) -> float:
    """Median over instances of ``peer / ours``."""
    return statistics.median(p / max(o, 1e-12) for p, o in zip(peer, ours))


def _ms(value: float) -> str:
    if value < 1:
        return f"{value:.3f}"
    return f"{value:.2f}" if value < 10 else f"{value:.1f}" if value < 1000 else f"{value:.0f}"


def _x(ratio: float) -> str:
    """A ratio as ``"12.3x"``; below 1 with two significant digits (``"0.86x"``: never a "1.0x" that
    is really below 1 beside a target "NOT met"); from 100 on without decimals."""
    if ratio < 1:  # (0.996 at two digits would read "1x")
        return f"{ratio:.2g}x" if ratio < 0.995 else f"{ratio:.3f}x"
    return f"{ratio:.1f}x" if ratio < 100 else f"{ratio:.0f}x"


def _gap(g: float) -> str:
    return "0" if g <= EXACT_RTOL else f"{g:.1e}"


@dataclass
class Cell:
    """One peer at one size: median ms, median ratio, largest gap, feasibility; or why skipped."""

    ms: float = math.nan
    ratio: float = math.nan
    gap: float = 0.0
    feasible: bool = True
    skipped: str = ""


@dataclass
class SizeResult:
    n: int
    k: int
    routelab_ms: float
    cells: dict[str, Cell] = field(default_factory=dict)


def _objective(s64: np.ndarray, z: np.ndarray) -> float:
    return float(s64[np.arange(len(z)), z].sum())


def _feasible(z: np.ndarray, n: int, k: int) -> bool:
    return len(z) == n and z.min() >= 0 and z.max() < k and bool((np.bincount(z, minlength=k) <= n // k).all())


def _measure_size(n: int, k: int, runs: int, peer_list: list[Peer], scipy_est: dict[int, float]) -> SizeResult:
    scores = [torch.randn(n, k, generator=torch.Generator().manual_seed(i)) for i in range(runs)]
    fns: dict[str, Callable[[int], Any]] = {"routelab": lambda i: balanced_assignment(scores[i]).numpy()}
    skipped: dict[str, str] = {}
    for p in peer_list:
        if p.name == "scipy LSA":
            est = scipy_est.get(k, 0.0) * (n / scipy_est.get(-k, n)) ** 3 if k in scipy_est else 0.0
            if n > SCIPY_MAX_N or est > SCIPY_LIMIT_S:
                skipped[p.name] = f"skipped (n > {SCIPY_MAX_N})" if n > SCIPY_MAX_N else f"skipped (est. {est:.0f} s)"
                continue
        inputs = [p.prepare(x) for x in scores]
        fns[p.name] = lambda i, p=p, inputs=inputs: p.solve(inputs[i])
    times, results = _paired(fns, runs)
    res = SizeResult(n, k, _median_ms(times["routelab"]))
    s64 = [x.double().numpy() for x in scores]
    # The best objective among the feasible answers only: an answer over capacity can score higher
    # than the optimum, and would otherwise make every exact method look suboptimal.
    best = [max((_objective(s64[i], results[name][i]) for name in fns
                 if _feasible(np.asarray(results[name][i], dtype=np.int64), n, k)), default=float("nan"))
            for i in range(runs)]
    for name in fns:
        if name == "routelab":
            continue
        cell = Cell(ms=_median_ms(times[name]), ratio=_ratio(times[name], times["routelab"]))
        for i in range(runs):
            z = np.asarray(results[name][i], dtype=np.int64)
            cell.feasible &= _feasible(z, n, k)
            cell.gap = max(cell.gap, (best[i] - _objective(s64[i], z)) / max(abs(best[i]), 1e-30))
        res.cells[name] = cell
        if name == "scipy LSA":
            scipy_est[k], scipy_est[-k] = cell.ms / 1e3, n
    ours_gap = max((best[i] - _objective(s64[i], results["routelab"][i])) / max(abs(best[i]), 1e-30)
                   for i in range(runs))
    ours_ok = all(_feasible(np.asarray(results["routelab"][i]), n, k) for i in range(runs))
    res.cells["routelab"] = Cell(ms=res.routelab_ms, ratio=1.0, gap=ours_gap, feasible=ours_ok)
    for name, why in skipped.items():
        res.cells[name] = Cell(skipped=why)
    return res


# ---------------------------------------------------------------------------- the report


def _header(title: str, threads: int) -> list[str]:
    versions = [f"routelab {routelab.__version__}", f"torch {torch.__version__}", f"numpy {np.__version__}",
                f"scipy {scipy.__version__}"]
    for mod, label in (("ot", "POT"), ("ortools", "OR-Tools"), ("numba", "numba")):
        m = _module(mod)
        versions.append(f"{label} {getattr(m, '__version__', '?')}" if m is not None else f"{label} missing")
    return [
        f"**{title}**",
        "",
        f"- CPU: {cpu_model()} ({os.cpu_count()} logical CPUs); CPU only",
        f"- {', '.join(versions)}, Python {platform.python_version()}",
        f"- torch threads: {threads}; OMP/MKL/OpenBLAS threads as set in the environment "
        f"(OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')})",
        f"- date: {datetime.now(UTC).strftime('%Y-%m-%d %H:%M:%S UTC')}; 1-minute load average at start: "
        f"{load_average()}",
        "",
    ]


def _phase_breakdown(n: int, k: int, runs: int = 9) -> list[str]:
    """Where the time goes at ``(n, k)``: the compiled kernel stopped after each phase, and one
    pass over the scores (the memory bound)."""
    phases = ("normalise", "auction", "cycles")
    if not compiled_phases(torch.randn(1, 8, 4), "cycles"):
        return ["", f"Per-phase breakdown at n={n}, k={k}: the compiled kernel is not in use (numba missing or "
                "switched off), so the PyTorch path was timed above."]
    scores = [torch.randn(1, n, k, generator=torch.Generator().manual_seed(100 + i)) for i in range(runs)]
    fns: dict[str, Callable[[int], Any]] = {
        f"to {phase}": (lambda i, phase=phase: compiled_phases(scores[i], phase)) for phase in phases
    }
    fns["whole call"] = lambda i: balanced_assignment(scores[i])
    fns["one pass (amax)"] = lambda i: scores[i].amax()
    times, _ = _paired(fns, runs)
    ms = {name: _median_ms(t) for name, t in times.items()}
    cum = [ms["to normalise"], ms["to auction"], ms["to cycles"]]
    parts = [("normalise (checks, row shift, 2^-e scale)", cum[0]),
             ("auction start", max(cum[1] - cum[0], 0.0)),
             ("cycle cancelling (exact)", max(cum[2] - cum[1], 0.0)),
             ("Python wrapper, validation, result tensors", max(ms["whole call"] - cum[2], 0.0))]
    one_pass = ms["one pass (amax)"]
    lines = ["", f"Per-phase breakdown at n={n}, k={k} (float32, one instance, medians of {runs}; the compiled "
             "kernel stopped after each phase, differences of medians):", "",
             "| phase | ms | share |", "|---|---:|---:|"]
    total = ms["whole call"]
    for name, t in parts:
        lines.append(f"| {name} | {_ms(t)} | {100 * t / max(total, 1e-12):.0f}% |")
    lines.append(f"| whole `balanced_assignment` call | {_ms(total)} | 100% |")
    mb = n * k * 4 / 2**20
    lines += ["", f"Memory bound: one pass over the {n} x {k} float32 scores ({mb:.1f} MiB; `scores.amax()`) takes "
              f"{_ms(one_pass)} ms; the whole call is {total / max(one_pass, 1e-12):.0f}x that "
              f"(the normalisation pass alone {cum[0] / max(one_pass, 1e-12):.1f}x)."]
    return lines


def _batched(peer_list: list[Peer], fastest: str, runs: int) -> list[str]:
    b, n, k = BATCH
    peer = next(p for p in peer_list if p.name == fastest)
    batches = [torch.randn(b, n, k, generator=torch.Generator().manual_seed(1000 + r)) for r in range(runs)]
    inputs = [[peer.prepare(x) for x in batch] for batch in batches]
    fns = {"routelab": lambda r: balanced_assignment(batches[r]).numpy(),
           fastest: lambda r: [peer.solve(x) for x in inputs[r]]}
    times, results = _paired(fns, runs)
    same = True
    for r in range(runs):
        s64 = batches[r].double().numpy()
        for i in range(b):
            ours, theirs = results["routelab"][r][i], np.asarray(results[fastest][r][i], dtype=np.int64)
            same &= _feasible(ours, n, k) and math.isclose(_objective(s64[i], ours), _objective(s64[i], theirs),
                                                            rel_tol=EXACT_RTOL)
    ratio = _ratio(times[fastest], times["routelab"])
    return ["", f"Batched per-sequence routing: {b} instances of n={n}, k={k} in one `balanced_assignment` call "
            f"against {b} calls of the fastest exact peer at that size ({fastest}), alternately, {runs} batches:", "",
            "| method | ms per batch of 64 | ratio | same optimum |", "|---|---:|---:|:---:|",
            f"| routelab, one call | {_ms(_median_ms(times['routelab']))} | 1x | — |",
            f"| {fastest}, {b} calls | {_ms(_median_ms(times[fastest]))} | {_x(ratio)} | {'yes' if same else 'no'} |",
            "", f"Target (>= 10x): {'met' if ratio >= 10 else 'NOT met'} ({_x(ratio)})."]

class _Lines:
    """The markdown lines of a report, each also printed to ``out`` as it is added (a long benchmark
    shows its table row by row)."""

    def __init__(self, out: TextIO | None) -> None:
        self.lines: list[str] = []
        self.out = out

    def __call__(self, *new: str) -> None:
        for line in new:
            self.lines.append(line)
            if self.out is not None:
                print(line, file=self.out, flush=True)

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


@contextmanager
def _torch_threads(threads: int) -> Iterator[None]:
    """torch's intra-op threads set to ``threads`` inside the block, restored after it."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def run_assignment_peers(*, quick: bool = False, threads: int = 1, out: TextIO | None = None) -> str:
    """The assignment peer table (markdown), streamed to ``out`` line by line."""
    check_device_and_threads("cpu", threads)
    emit = _Lines(out)
    with _torch_threads(threads):
        peer_list, missing = peers()
        ns = QUICK_NS if quick else FULL_NS
        repeats = QUICK_REPEATS if quick else FULL_REPEATS
        emit(*_header(f"routelab balanced assignment vs peers ({'quick' if quick else 'full'})", threads))
        emit("Float32 `torch.randn(n, k)` (instance i from seed i), capacity n/k, every method once per instance in "
             "rotating order after one warm-up; instances per size: "
             + ", ".join(f"{repeats[n]} at n={n}" for n in ns) + ". Cells: median ms, then the median over "
             "instances of (peer time / routelab time), then the largest relative optimality gap.")
        if missing:
            emit("", "Missing peers (not installed): " + "; ".join(missing) + ".")
        emit("", "| n | k | routelab ms | " + " | ".join(p.name + (" (exact)" if p.exact else " (approx.)")
                                                     for p in peer_list) + " |",
             "|---:|---:|---:|" + "---:|" * len(peer_list))
        results: list[SizeResult] = []
        scipy_est: dict[int, float] = {}
        for n in ns:
            for k in KS:
                r = _measure_size(n, k, repeats[n], peer_list, scipy_est)
                results.append(r)
                cells = []
                for p in peer_list:
                    c = r.cells[p.name]
                    if c.skipped:
                        cells.append(c.skipped)
                        continue
                    text = f"{_ms(c.ms)} ({_x(c.ratio)}), gap {_gap(c.gap)}"
                    cells.append(text + ("" if c.feasible else ", INFEASIBLE"))
                ours = r.cells["routelab"]
                flag = "" if ours.gap <= EXACT_RTOL and ours.feasible else f" (gap {ours.gap:.1e}!)"
                emit(f"| {n} | {k} | {_ms(r.routelab_ms)}{flag} | " + " | ".join(cells) + " |")
        emit(*_verdicts(results, peer_list))
        fastest = _fastest_exact(results, peer_list, BATCH[1], BATCH[2])
        if fastest is not None:
            emit(*_batched(peer_list, fastest, 3 if quick else BATCH_REPEATS))
        n, k = PHASE_SIZE
        emit(*_phase_breakdown(n, k, 3 if quick else 9))
        emit("", f"1-minute load average at the end: {load_average()}.")
        return emit.text()


def _fastest_exact(results: list[SizeResult], peer_list: list[Peer], n: int, k: int) -> str | None:
    """The exact peer with the smallest median at ``(n, k)`` (or at the smallest measured size)."""
    pool = [r for r in results if (r.n, r.k) == (n, k)] or results[:1]
    if not pool:
        return None
    cells = {p.name: pool[0].cells[p.name] for p in peer_list if p.exact and not pool[0].cells[p.name].skipped}
    return min(cells, key=lambda name: cells[name].ms) if cells else None


def _verdicts(results: list[SizeResult], peer_list: list[Peer]) -> list[str]:
    """The targets of the issue, each judged from the measured ratios."""
    lines = ["", "Targets (ratios: medians over instances of peer time / routelab time; > 1: routelab is faster):", ""]
    exact_ok = all(r.cells["routelab"].gap <= EXACT_RTOL and r.cells["routelab"].feasible for r in results)
    lines.append(f"- exact on every instance (objective equal to the best of all methods to {EXACT_RTOL:g} relative, "
                 f"capacity respected): {'met' if exact_ok else 'NOT met'}")
    worst: tuple[float, str] | None = None
    for r in results:
        for p in peer_list:
            c = r.cells[p.name]
            if p.exact and not c.skipped and (worst is None or c.ratio < worst[0]):
                worst = (c.ratio, f"{p.name} at n={r.n}, k={r.k}")
    if worst is not None:
        lines.append(f"- faster than every exact peer at every size: {'met' if worst[0] > 1 else 'NOT met'} "
                     f"(smallest ratio {_x(worst[0])}, {worst[1]})")
    pot = [r.cells["POT ot.emd"] for r in results if (r.n, r.k) == PHASE_SIZE and "POT ot.emd" in r.cells]
    if pot:
        lines.append(f"- at least 5x POT at n={PHASE_SIZE[0]}, k={PHASE_SIZE[1]}: "
                     f"{'met' if pot[0].ratio >= 5 else 'NOT met'} ({_x(pot[0].ratio)})")
    auction = [(r.cells["fairseq auction"].ratio, r.n, r.k) for r in results if "fairseq auction" in r.cells]
    if auction:
        low = min(auction)
        lines.append(f"- faster than the fairseq auction at every size: {'met' if low[0] > 1 else 'NOT met'} "
                     f"(smallest ratio {_x(low[0])} at n={low[1]}, k={low[2]})")
    skipped = sorted({f"n={r.n}" for r in results for c in r.cells.values() if c.skipped})
    if skipped:
        lines.append(f"- scipy LSA skipped at {', '.join(skipped)} (its n x n problem grows as n^3; "
                     f"skipped where a call is estimated above {SCIPY_LIMIT_S:g} s or n > {SCIPY_MAX_N}).")
    lines.append("- OR-Tools: " + next(p.note for p in peer_list if p.name.startswith("OR-Tools"))
                 if any(p.name.startswith("OR-Tools") for p in peer_list) else "- OR-Tools: missing")
    return lines


# ---------------------------------------------------------------------------- sinkhorn

#: POT's methods timed at equal accuracy (each for exactly the sweeps routelab needed), by column ...
POT_SAME_SWEEPS: dict[str, str] = {"POT sinkhorn": "sinkhorn", "POT sinkhorn_log": "sinkhorn_log"}
#: ... and POT's scaling method with its own stopping rule (``stopThr = tol``), for information only.
POT_OWN_RULE = "POT sinkhorn, stopThr = tol"


@dataclass
class SinkhornCell:
    """routelab's sinkhorn and POT's at one ``(dtype, T, n, k)``, over ``runs`` instances.

    Attributes:
        tol: the tolerance routelab met (:func:`sinkhorn_tolerance`).
        sweeps: the sweeps routelab needed on each instance (the ``numItermax`` POT got there).
        ms: median ms by method (``"routelab"``, the keys of :data:`POT_SAME_SWEEPS`, :data:`POT_OWN_RULE`).
        ratio: by POT method, the median over instances of POT time / routelab time.
        err: by method, the largest absolute column error of the results (``inf``: a non-finite plan).
        err_ratio: by POT method, the largest over instances of its column error / routelab's on the
            same instance (about 1 at equal accuracy; far above 1 where POT stopped short of it).
    """

    dtype: torch.dtype
    T: float
    n: int
    k: int
    tol: float
    sweeps: list[int]
    ms: dict[str, float] = field(default_factory=dict)
    ratio: dict[str, float] = field(default_factory=dict)
    err: dict[str, float] = field(default_factory=dict)
    err_ratio: dict[str, float] = field(default_factory=dict)


def run_sinkhorn_peers(*, quick: bool = False, threads: int = 1, out: TextIO | None = None) -> str:
    """routelab's sinkhorn against POT's ``ot.sinkhorn`` (plain and log) at equal accuracy, markdown.

    On every instance POT runs exactly as many sweeps as routelab needed to meet the tolerance
    (:func:`_routelab_sweeps`, untimed), so both end with the same iterate up to rounding; the
    target is judged from those ratios. POT with its own stopping rule is shown for information.
    """
    check_device_and_threads("cpu", threads)
    emit = _Lines(out)
    with _torch_threads(threads):
        ot = _module("ot")
        runs = 3 if quick else 7
        emit(*_header(f"routelab sinkhorn vs POT ({'quick' if quick else 'full'})", threads))
        emit(f"Input `log_p = log_softmax(randn(n, k) / T)` (instance i from seed i); row sums 1, column sums n/k. "
             f"routelab stops at tolerance {SINKHORN_TOL:g} on the largest absolute column error (checked every "
             "sweep), floored at 4 eps sqrt(n) max(1, n/k) where the dtype cannot resolve it (float32; routelab's "
             f"own floor), numItermax/max_iter {SINKHORN_MAX_ITER}. POT gets `M = -log_p`, `reg = 1` (its kernel "
             "`exp(-M/reg)` is then `p`: the same iteration) and is compared **at equal accuracy**: on each "
             "instance it runs exactly the sweeps routelab needed there (`numItermax` = that count, `stopThr = 0`; "
             "the count is found beforehand, untimed, as the smallest `max_iter` with which routelab converges), "
             "so both end with the same iterate up to rounding (the error columns show it). POT's own stopping "
             "rule (`stopThr = tol` on the 2-norm of the column error) is tested only every 10 sweeps: it runs "
             "at least 11 sweeps where routelab needs fewer and ends more accurate, so that last column does "
             f"not count for the target. {runs} instances per cell, methods alternating; cells: median ms "
             "(median over instances of POT time / routelab time), and the largest column error of the results.")
        if ot is None:
            emit("", "POT is missing (`pip install pot`, or the `bench` extra): routelab alone is timed.")
        emit("", "| dtype | T | n | k | routelab sweeps | routelab ms | POT sinkhorn (scaling), same sweeps "
             "| POT sinkhorn_log, same sweeps | POT sinkhorn (scaling), stopThr = tol (information) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        sizes = QUICK_SINKHORN_SIZES if quick else SINKHORN_SIZES
        judged: list[SinkhornCell] = []
        for dtype in (torch.float32, torch.float64):
            for T in SINKHORN_TEMPERATURES:
                for n, k in sizes:
                    cell = _sinkhorn_cell(ot, dtype, T, n, k, runs)
                    emit(_sinkhorn_row(cell))
                    if T >= 1.0:
                        judged.append(cell)
        emit(*_sinkhorn_verdict(judged))
        emit("", f"1-minute load average at the end: {load_average()}.")
        return emit.text()


def _col_error(q: np.ndarray, n: int, k: int) -> float:
    return float(np.abs(q.sum(0) - n / k).max()) if np.isfinite(q).all() else math.inf


def _routelab_sweeps(log_p: torch.Tensor, tol: float, max_iter: int = SINKHORN_MAX_ITER) -> int:
    """The fewest sweeps routelab's :func:`~routelab.assignment.sinkhorn` needs on ``log_p [n, k]``
    at ``tol``: the smallest ``max_iter`` with which it converges (doubling, then bisection).

    With up to ``2 * NEWTON_AFTER`` (32) sweeps, and on every instance whose sweeps stay in the
    scaling domain, this is the count of plain Sinkhorn sweeps, POT's ``numItermax`` for the same
    iterate. Where routelab finishes by Newton's method (sharp ``p``, many sweeps) it is fewer, and
    POT stopped there ends less accurate: the error ratio of the report shows it.

    Raises:
        ValueError: routelab does not converge within ``max_iter`` sweeps.
    """

    def converges(m: int) -> bool:
        try:
            sinkhorn(log_p, tol=tol, max_iter=m)
        except ValueError:
            return False
        return True

    hi = 1
    while not converges(hi):
        if hi >= max_iter:
            raise ValueError(f"routelab's sinkhorn does not converge within max_iter={max_iter} sweeps at tol={tol:g}")
        hi = min(2 * hi, max_iter)
    lo = hi // 2  # it does not converge within lo sweeps (lo = 0: no sweep at all)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if converges(mid):
            hi = mid
        else:
            lo = mid
    return hi


def _sinkhorn_cell(ot: Any, dtype: torch.dtype, T: float, n: int, k: int, runs: int) -> SinkhornCell:
    """Time routelab and POT (``ot``; ``None``: routelab alone) on ``runs`` instances of ``(n, k)``."""
    log_p = [torch.log_softmax(torch.randn(n, k, generator=torch.Generator().manual_seed(i), dtype=dtype) / T, -1)
             for i in range(runs)]
    tol = sinkhorn_tolerance(dtype, n, k)
    sweeps = [_routelab_sweeps(x, tol) for x in log_p]
    cell = SinkhornCell(dtype, T, n, k, tol, sweeps)
    fns: dict[str, Callable[[int], Any]] = {
        "routelab": lambda i: sinkhorn(log_p[i], tol=tol, max_iter=SINKHORN_MAX_ITER)}  # log q (exp not timed)
    if ot is not None:
        npdt = np.float32 if dtype == torch.float32 else np.float64
        a, b = np.ones(n, dtype=npdt), np.full(k, n / k, dtype=npdt)
        M = [(-x).numpy() for x in log_p]
        for name, method in POT_SAME_SWEEPS.items():
            fns[name] = lambda i, method=method: _pot_sinkhorn(ot, a, b, M[i], method, stop_thr=0.0,
                                                               max_iter=sweeps[i])
        fns[POT_OWN_RULE] = lambda i: _pot_sinkhorn(ot, a, b, M[i], "sinkhorn", stop_thr=tol,
                                                    max_iter=SINKHORN_MAX_ITER)
    times, results = _paired(fns, runs)
    errors = {name: [_col_error(q.double().exp().numpy() if name == "routelab" else q, n, k) for q in qs]
              for name, qs in results.items()}
    for name in fns:
        cell.ms[name] = _median_ms(times[name])
        cell.err[name] = max(errors[name])
        if name != "routelab":
            cell.ratio[name] = _ratio(times[name], times["routelab"])
            cell.err_ratio[name] = max(e / max(o, 1e-300) for e, o in zip(errors[name], errors["routelab"]))
    return cell


def _sinkhorn_row(cell: SinkhornCell) -> str:
    """The markdown row of a :class:`SinkhornCell`."""
    low, high = min(cell.sweeps), max(cell.sweeps)
    cells = [str(cell.dtype).removeprefix("torch."), f"{cell.T:g}", str(cell.n), str(cell.k),
             str(low) if low == high else f"{low}-{high}",
             f"{_ms(cell.ms['routelab'])}, err {cell.err['routelab']:.0e}"]
    for name in (*POT_SAME_SWEEPS, POT_OWN_RULE):
        cells.append(f"{_ms(cell.ms[name])} ({_x(cell.ratio[name])}), err {cell.err[name]:.0e}"
                     if name in cell.ms else "missing")
    return "| " + " | ".join(cells) + " |"


def _sinkhorn_verdict(judged: Sequence[SinkhornCell]) -> list[str]:
    """The target, judged from the equal-accuracy ratios at T = 1, and the accuracy check behind them."""
    worst: list[tuple[float, str]] = []
    worst_err: list[tuple[float, str]] = []
    pot_tol = max((c.err[name] / c.tol for c in judged for name in POT_SAME_SWEEPS if name in c.err), default=None)
    ours_tol = max((c.err["routelab"] / c.tol for c in judged), default=None)
    for cell in judged:
        where = f"{str(cell.dtype).removeprefix('torch.')}, n={cell.n}, k={cell.k}"
        for name in POT_SAME_SWEEPS:
            if name in cell.ratio and math.isfinite(cell.err[name]):
                worst.append((cell.ratio[name], f"{name} at {where}"))
                worst_err.append((cell.err_ratio[name], f"{name} at {where}"))
    if not worst or pot_tol is None or ours_tol is None:
        return []
    low, high_err = min(worst), max(worst_err)
    return ["", "Target (at least as fast as POT's fastest at equal accuracy and the same dtype, judged at T = 1 from "
            "the same-sweeps columns; T = 0.1 is shown for information: its rows span up to ~80 nats, the edge of "
            "routelab's float32 scaling domain, so some instances take the log domain or a Newton finish there): "
            + f"{'met' if low[0] >= 1 else 'NOT met'} (smallest ratio {_x(low[0])}, {low[1]}).",
            "", "Equal accuracy, checked at T = 1: after routelab's sweeps, POT's largest column error is "
            f"{pot_tol:.2f}x the tolerance (routelab's: {ours_tol:.2f}x), and at most {high_err[0]:.2g}x routelab's "
            f"on the same instance ({high_err[1]}; 1: the same iterate, as in float64; in float32 the errors near "
            "the tolerance's floor are rounding, POT summing in float32 where routelab's compiled sweeps sum in "
            "float64)."]


def sinkhorn_tolerance(dtype: torch.dtype, n: int, k: int) -> float:
    """:data:`SINKHORN_TOL`, floored where the dtype cannot resolve it: routelab's own floor
    ``4 eps sqrt(n) max(1, n/k)`` (float32 at n = 4096, k = 64: 2e-3), given to both solvers."""
    return max(SINKHORN_TOL, 4 * torch.finfo(dtype).eps * n**0.5 * max(1.0, n / k))


def _pot_sinkhorn(ot: Any, a: np.ndarray, b: np.ndarray, M: np.ndarray, method: str, *, stop_thr: float,
                  max_iter: int) -> np.ndarray:
    """POT's ``ot.sinkhorn(a, b, M, reg=1, method=method)`` with ``stopThr=stop_thr`` and
    ``numItermax=max_iter`` (``stop_thr=0``: exactly ``max_iter`` sweeps); the ``[n, k]`` plan."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # POT warns on non-convergence / overflow; the error column says it
        return ot.sinkhorn(a, b, M, 1.0, method=method, stopThr=stop_thr, numItermax=max_iter)
