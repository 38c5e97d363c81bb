"""Benchmark of the MoE layer (``routelab bench moe``): forward + backward throughput and memory.

For every ``(E, k)`` of a grid (``d_model``, ``d_hidden`` and the number of tokens fixed), one
:class:`routelab.layers.MoE` with the ``topk`` router (``capacity_factor`` 1, position drop
policy) is compared with two references that use **the same router and the same stacked
weights**, so that all three compute the same outputs (checked in the run):

* ``moe`` — the layer itself as configured (``dispatch="auto"``): route, capacity, dispatch in
  the layout ``auto`` picks (``[E, C, d]`` buffers and two batched matmuls where they pad
  nothing, i.e. capacity factor <= 1; else the kept pairs sorted by expert and two grouped
  matmuls, ``torch._grouped_mm``, where those run on the device and dtype), gather back and combine;
* ``other`` — the same layer in the other layout (``dispatch="grouped"`` where ``auto`` picked
  buffers and grouped matmuls run, else ``dispatch="buffers"``);
* ``naive`` — the loop of common reference implementations (e.g. the Mixtral sparse MoE block
  of ``transformers``): the same routes and capacity decision, then ``for e in range(E)``: the
  tokens of expert ``e`` by ``nonzero`` of a boolean mask, the expert as two ``addmm`` calls on
  its weights (views ``w1.unbind(0)[e]`` of the stacked weights, which behave like separate
  per-expert ``nn.Linear`` weights), the weighted output added back with ``index_add_``.
* ``dense`` — every expert on every token (``baddbmm`` over ``[E, tokens, d]``), combined with a
  ``[tokens, E]`` gate matrix that is zero outside the kept routes.

Measured per size and implementation, all in the same run:

* throughput: tokens / s of one forward + backward (``y.backward(grad)`` with a fixed random
  ``grad``), median over timed calls after one untimed warm-up; the implementations are timed
  round-robin (``moe, naive, dense, moe, ...``) so that a change of load on the machine hits
  all of them alike;
* the share of the layer's time that is not the experts, measured inside every timed call of
  the layer (so a change of load cannot skew it): hooks on ``moe.experts`` read the clock when
  its forward starts and ends, and tensor hooks when the gradient reaches its output (the
  experts' backward starts) and its input buffer (the experts' backward has finished; autograd
  runs the expert nodes in between, as they were created after dispatch and before combine).
  ``t_experts`` is the sum of the two spans (the two batched matmuls, biases and activation,
  forward and backward) and ``1 - t_experts / t_call`` the share spent in the router,
  capacity, dispatch and combine, forward and backward. On CUDA the marks are CUDA events (no
  synchronisation), read on the GPU's timeline after the call;
* peak memory of one forward + backward above the memory allocated before it (weights,
  inputs): ``torch.cuda.max_memory_allocated`` on CUDA; on CPU the same quantity from the
  allocation events of torch's CPU allocator recorded by ``torch.profiler``;
* the largest relative difference of ``y`` and of the input gradient between each reference
  and the layer.

A second table, when transformers is installed, compares the layer with **transformers' own
Mixtral sparse MoE block** (``MixtralSparseMoeBlock``) under each of its experts implementations
(the one transformers picks by default, ``grouped_mm`` and ``eager``; one block, its
implementation switched between calls) at the same sizes, timed round-robin in the same run: the
block with SwiGLU experts (``intermediate_size = d_hidden``), dropless, renormalised top-k, and the
routelab layer computing the same function (``router="topk"`` with ``renormalize=True``,
``capacity_factor=None``, experts ``StackedExperts.from_hf_fused`` of the block's weights, the
router weight copied, ``check_finite=False`` as the block checks nothing); outputs and input
gradients are checked equal (:func:`_benchmark_hf`).

Every size runs in float32 or bfloat16 (``BenchConfig.dtype``: weights, inputs and gradients; the
routers score in float32 in both). On CUDA the full run measures the grid :data:`GPU_FULL`
(``d_model`` 1024 to 4096, 8k to 64k tokens); a size that does not fit in the GPU's memory is
reported as such and the run goes on.

Entry point: :func:`run_benchmark`; the measuring is :func:`_benchmark`, parameterised by a
:class:`BenchConfig` (the tests run it on tiny sizes).
"""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import TextIO

import torch
from torch import Tensor

import routelab
from routelab.layers import MoE, MoEConfig, StackedExperts
from routelab.routing import apply_capacity

from ..machine import cpu_model as _cpu_model
from ..machine import load_average
from ._checks import check_device_and_threads

__all__ = ["FULL", "QUICK", "BenchConfig", "IMPLEMENTATIONS", "dense_forward", "naive_forward", "run_benchmark",
           "select_configs", "select_grid"]

#: The compared implementations, in timing order.
IMPLEMENTATIONS: tuple[str, ...] = ("moe", "other", "naive", "dense")

#: Relative tolerance of the "same outputs" check by dtype (different summation orders; bfloat16
#: keeps 8 bits of mantissa).
SAME_RTOL: dict[torch.dtype, float] = {torch.float32: 1e-4, torch.bfloat16: 3e-2}

#: The dtypes the benchmark runs in, by name (``--dtype``).
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}

#: Target of the issue: the layer within this factor of the time of the best grouped-GEMM peer.
PEER_TARGET = 1.2

#: Target of the issue: routing + dispatch + combine below this share of the layer's time.
OVERHEAD_TARGET = 0.10
#: Target of the issue: at least this speed-up over the naive loop at E = 64 on GPU.
SPEEDUP_TARGET = 2.0


@dataclass(frozen=True)
class BenchConfig:
    """The sizes and repeats of one benchmark run.

    Attributes:
        d_model, d_hidden: expert widths.
        tokens: tokens per batch (``n``).
        experts: the numbers of experts ``E`` measured.
        ks: the top-k values measured.
        repeats: timed calls per implementation after the warm-up.
        budget_s: at most about this many seconds of timed calls per implementation and size
            (fewer timed calls, at least one, when the warm-up shows the repeats do not fit).
        capacity_factor: the layer's capacity factor.
        dense_limit_gib: the dense reference is skipped where its ``[E, tokens, d_hidden]``
            activations (pre-activation and activation, float32) would exceed this many GiB.
        seed: seed of the inputs and of the weights.
        hf_peer: also compare with transformers' Mixtral sparse block (when transformers is installed).
        dtype: the dtype of weights, inputs and gradients (float32 or bfloat16).
    """

    d_model: int = 512
    d_hidden: int = 2048
    tokens: int = 8192
    experts: tuple[int, ...] = (8, 64)
    ks: tuple[int, ...] = (1, 2)
    repeats: int = 3
    budget_s: float = 30.0
    capacity_factor: float = 1.0
    dense_limit_gib: float = 4.0
    seed: int = 0
    hf_peer: bool = True
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if self.dtype not in SAME_RTOL:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype}")
        # the grid is experts x ks: a k above any E is refused here, before any size is measured
        if self.experts and self.ks and max(self.ks) > min(self.experts):
            raise ValueError(f"k={max(self.ks)} is larger than E={min(self.experts)} in the benchmark grid "
                             f"(experts={self.experts} x ks={self.ks}); every k must be at most every E")

    @property
    def same_rtol(self) -> float:
        """The tolerance of the "same outputs" check in this config's dtype."""
        return SAME_RTOL[self.dtype]

    def layer(self, num_experts: int, k: int) -> MoEConfig:
        """The measured layer at one size: ``topk`` router, position drop policy, GELU experts with biases."""
        return MoEConfig(self.d_model, self.d_hidden, num_experts, router="topk", k=k,
                         capacity_factor=self.capacity_factor)


#: The issue's sizes: E in {8, 64}, d_model 512, d_hidden 2048, 8192 tokens, top-1 and top-2.
FULL = BenchConfig()
#: Small sizes for a smoke run (seconds).
QUICK = BenchConfig(d_model=64, d_hidden=256, tokens=1024, experts=(8, 64), ks=(1, 2), repeats=3, budget_s=5.0)
#: The GPU grid of the issue: d_model 1024 to 4096, 8k to 64k tokens, E in {8, 64}, top-1 and top-2
#: (fp32 weights of the E = 64 SwiGLU block at d_model 4096: 13 GiB, as many for their gradients).
GPU_FULL: tuple[BenchConfig, ...] = (
    BenchConfig(d_model=1024, d_hidden=4096, tokens=8192, repeats=10, budget_s=10.0),
    BenchConfig(d_model=2048, d_hidden=4096, tokens=32768, repeats=10, budget_s=10.0),
    BenchConfig(d_model=4096, d_hidden=4096, tokens=65536, repeats=5, budget_s=10.0),
)
#: One GPU size for a smoke run.
GPU_QUICK = BenchConfig(d_model=1024, d_hidden=4096, tokens=8192, repeats=5, budget_s=5.0)


# ---------------------------------------------------------------------------- references


def _routes_after_capacity(moe: MoE, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The layer's routing decision on ``x [tokens, d_model]``: ``(expert, combine, keep)``,
    each ``[tokens, slots]``."""
    n = x.shape[0]
    capacity = moe.capacity(n)
    proposed = moe.router(x, capacity)
    decision = apply_capacity(proposed.expert, proposed.keep, capacity, moe.num_experts, policy=moe.drop_policy,
                              score=proposed.gate, generator=moe.generator)
    combine = proposed.gate
    if moe.importance_weighting:
        combine = combine * proposed.weight * decision.skip_weight.to(proposed.weight.dtype)
    return proposed.expert, combine, decision.keep


def naive_forward(moe: MoE, x: Tensor) -> Tensor:
    """The Mixtral-style reference: a Python loop over experts with boolean masks.

    Same router, capacity decision and weights as ``moe`` (so the same output), but every
    expert gathers its tokens with ``nonzero`` and runs as its own two ``addmm`` calls, and the
    weighted outputs are added back with ``index_add_``.

    Args:
        moe: the layer whose router and ``experts`` weights are used.
        x: ``[tokens, d_model]``.

    Returns:
        ``[tokens, d_model]``.
    """
    expert, combine, keep = _routes_after_capacity(moe, x)
    ex = moe.experts
    # One view per expert, as separate per-expert Linear weights would be: unbind's backward stacks
    # the experts' gradients once (indexing w1[e] inside the loop would instead allocate and
    # zero-fill a full [E, ...] gradient for every expert, a cost the reference designs do not have).
    w1, w2 = ex.w1.unbind(0), ex.w2.unbind(0)
    b1 = ex.b1[:, 0].unbind(0) if ex.b1 is not None else None
    b2 = ex.b2[:, 0].unbind(0) if ex.b2 is not None else None
    y = torch.zeros_like(x)
    for e in range(moe.num_experts):
        tok, slot = torch.nonzero((expert == e) & keep, as_tuple=True)
        if tok.numel() == 0:
            continue
        xe = x[tok]
        h = torch.addmm(b1[e], xe, w1[e]) if b1 is not None else xe @ w1[e]
        h = ex.activation(h)
        ye = torch.addmm(b2[e], h, w2[e]) if b2 is not None else h @ w2[e]
        y.index_add_(0, tok, ye * combine[tok, slot, None].to(ye.dtype))
    return y


def dense_forward(moe: MoE, x: Tensor) -> Tensor:
    """The dense reference: every expert on every token, combined with a masked gate.

    Args:
        moe: the layer whose router and weights are used.
        x: ``[tokens, d_model]``.

    Returns:
        ``[tokens, d_model]``: ``sum_e W[t, e] FFN_e(x_t)`` with ``W [tokens, E]`` the combine
        weights of the kept routes (zero elsewhere).
    """
    expert, combine, keep = _routes_after_capacity(moe, x)
    n, E = x.shape[0], moe.num_experts
    weights = torch.zeros(n, E, dtype=combine.dtype, device=x.device).scatter_add(
        1, expert, torch.where(keep, combine, torch.zeros_like(combine)))
    out = moe.experts(x.unsqueeze(0).expand(E, n, x.shape[-1]))  # [E, n, d]
    return torch.einsum("ne,end->nd", weights.to(out.dtype), out)


def _moe_forward(moe: MoE, x: Tensor) -> Tensor:
    return moe(x)[0]


def other_layout(moe: MoE, x: Tensor) -> str:
    """The layout ``moe`` (``dispatch="auto"``) does not pick on ``x [tokens, d_model]``:
    ``"grouped"`` where it picks buffers and grouped matmuls run, else ``"buffers"`` (the same
    layout when grouped matmuls do not run)."""
    slots = moe.router.slots
    if moe.uses_grouped(slots, x.device, num_tokens=x.shape[0]):
        return "buffers"
    return "grouped" if moe.uses_grouped(slots, x.device) else "buffers"


def _other_forward(moe: MoE, x: Tensor) -> Tensor:
    """The layer in :func:`other_layout` (its ``dispatch`` setting restored after the call)."""
    layout = other_layout(moe, x)
    dispatch, moe.dispatch = moe.dispatch, layout
    try:
        return moe(x)[0]
    finally:
        moe.dispatch = dispatch


FORWARDS: dict[str, Callable[[MoE, Tensor], Tensor]] = {
    "moe": _moe_forward,
    "other": _other_forward,
    "naive": naive_forward,
    "dense": dense_forward,
}


# ---------------------------------------------------------------------------- expert time


class ExpertTimer:
    """Time spent inside ``moe.experts`` (forward and backward) during one call of the layer.

    Module hooks mark the forward; tensor hooks on the experts' output (its gradient arrives:
    backward of the experts begins) and input buffer (its gradient is ready: the experts'
    backward nodes have run) mark the backward. Use as a context manager around exactly one
    forward + backward of the layer (the context's entry and exit mark the call); read
    :attr:`seconds` and :meth:`share` after it.

    On the CPU a mark reads the clock. On CUDA a mark records a CUDA event on the current stream:
    nothing synchronises, so the timed call runs as it would untimed (the host keeps running
    ahead of the device), and the spans are read on the device's timeline after the call. A span
    includes the device's idle time inside it (waiting for the host's launches), which therefore
    counts towards the part of the call where it happens.
    """

    def __init__(self, moe: MoE, device: str) -> None:
        self.moe, self.device = moe, device
        self.marks: dict[str, float | torch.cuda.Event] = {}
        self._handles: list = []

    def _now(self, key: str) -> None:
        if self.device == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks[key] = event
        else:
            self.marks[key] = time.perf_counter()

    def _pre(self, module: torch.nn.Module, args: tuple) -> None:
        buffer = args[0]
        if buffer.requires_grad:
            buffer.register_hook(lambda g: self._now("bwd_end"))
        self._now("fwd_start")

    def _post(self, module: torch.nn.Module, args: tuple, out: Tensor) -> None:
        self._now("fwd_end")
        if out.requires_grad:
            out.register_hook(lambda g: self._now("bwd_start"))

    def __enter__(self) -> ExpertTimer:
        self.marks = {}
        self._now("call_start")
        self._handles = [self.moe.experts.register_forward_pre_hook(self._pre),
                         self.moe.experts.register_forward_hook(self._post)]
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._now("call_end")

    def _span(self, start: str, end: str) -> float:
        a, b = self.marks[start], self.marks[end]
        if isinstance(a, float):
            return b - a
        b.synchronize()
        return a.elapsed_time(b) / 1e3

    @property
    def seconds(self) -> float:
        """Forward span + backward span of the experts, in seconds."""
        missing = {"fwd_start", "fwd_end", "bwd_start", "bwd_end"} - set(self.marks)
        if missing:
            raise RuntimeError(f"the experts' hooks did not fire ({sorted(missing)}): run a forward and a backward "
                               "of the layer, with an input that requires grad, inside the timer")
        return self._span("fwd_start", "fwd_end") + self._span("bwd_start", "bwd_end")

    def share(self) -> float:
        """``t_experts / t_call``: the experts' spans over the span of the whole call (from the
        context's entry to its exit), both on the same clock (the device's on CUDA)."""
        if "call_end" not in self.marks:
            raise RuntimeError("read the share after the timer's context has exited")
        return self.seconds / self._span("call_start", "call_end")


# ---------------------------------------------------------------------------- memory


class _PeakMemory:
    """Peak bytes allocated by torch during a block, above what was allocated when it started.

    CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``. CPU: the
    allocation and free events of torch's CPU allocator recorded by ``torch.profiler``
    (``profile_memory=True``), summed in time order; the same quantity as on CUDA (tensors'
    bytes, no allocator cache or kernel scratch space outside tensors). ``peak()`` is ``None``
    where the events cannot be read (a torch without the profiler's event tree).
    """

    def __init__(self, device: str) -> None:
        self.device = device
        self.start = 0
        self._prof: torch.profiler.profile | None = None
        self._peak: int | None = None

    def __enter__(self) -> _PeakMemory:
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.start = torch.cuda.memory_allocated()
        else:
            self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
            self._prof.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()
            self._peak = torch.cuda.max_memory_allocated() - self.start
        elif self._prof is not None:
            self._prof.__exit__(None, None, None)
            self._peak = _cpu_peak_from_profile(self._prof)
        return None

    def peak(self) -> int | None:
        """Peak bytes above the start (after the block)."""
        return self._peak


def _cpu_peak_from_profile(prof: torch.profiler.profile) -> int | None:
    """Largest running sum of the CPU allocation events (+size, -size on free) of a profile."""
    try:
        from torch._C._profiler import _EventType

        stack = list(prof.profiler.kineto_results.experimental_event_tree())
    except (ImportError, AttributeError):
        return None
    events = []
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            events.append((node.start_time_ns, node.extra_fields.alloc_size))
        stack.extend(node.children)
    events.sort()
    current = peak = 0
    for _, size in events:
        current += size
        peak = max(peak, current)
    return peak


# ---------------------------------------------------------------------------- measuring


@dataclass
class Row:
    """Everything measured at one size ``(E, k)``.

    Attributes:
        experts, k: the size.
        capacity: the layer's per-expert capacity ``C``.
        dropped: fraction of the (token, slot) pairs dropped by the capacity.
        ms: median ms of one forward + backward, by implementation (absent: skipped).
        runs: timed calls, by implementation (and ``"experts"``).
        expert_share: median over the timed calls of the layer of ``t_experts / t_call``
            (:class:`ExpertTimer`).
        peak_bytes: peak memory above the start, by implementation (``None``: not measurable).
        max_rel_diff: by reference, ``max(rel. diff of y, rel. diff of dL/dx)`` against the layer.
        skipped: why an implementation was not run, by implementation.
        layout: the layer's dispatch under ``"auto"`` (``"grouped"`` or ``"buffers"``).
        other_layout: the layout of the ``other`` reference (:func:`other_layout`).
        failed: why the size was not measured at all (e.g. out of GPU memory), else ``None``.
    """

    experts: int
    k: int
    layout: str = ""
    other_layout: str = ""
    failed: str | None = None
    capacity: int = 0
    dropped: float = 0.0
    ms: dict[str, float] = field(default_factory=dict)
    runs: dict[str, int] = field(default_factory=dict)
    expert_share: float | None = None
    peak_bytes: dict[str, int | None] = field(default_factory=dict)
    max_rel_diff: dict[str, float] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)

    @property
    def overhead(self) -> float | None:
        """``1 - t_experts / t_call``: the share of the layer's time outside the experts."""
        if self.expert_share is None:
            return None
        return 1.0 - self.expert_share


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _rel_diff(a: Tensor, b: Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def _out_of_memory(device: str) -> tuple[type[BaseException], ...]:
    """The exceptions that mean a size does not fit (caught per size, so the run goes on)."""
    return (torch.cuda.OutOfMemoryError,) if device == "cuda" else ()


def _measure(E: int, k: int, cfg: BenchConfig, device: str) -> Row:
    """Measure every implementation at one size (a :class:`Row` with ``failed`` set when it does
    not fit in the device's memory)."""
    try:
        return _measure_fitting(E, k, cfg, device)
    except _out_of_memory(device) as err:
        return Row(experts=E, k=k, failed=f"out of memory ({str(err).splitlines()[0][:120]})")
    finally:
        _free(device)  # the size's tensors died with its frame


def _free(device: str) -> None:
    """Return the cached blocks of a finished size to the device."""
    if device == "cuda":
        torch.cuda.empty_cache()


def _measure_fitting(E: int, k: int, cfg: BenchConfig, device: str) -> Row:
    gen = torch.Generator().manual_seed(cfg.seed)
    torch.manual_seed(cfg.seed)  # the layer's initialisation
    moe = MoE.from_config(cfg.layer(E, k)).to(device, cfg.dtype)
    moe.train()
    x = torch.randn(cfg.tokens, cfg.d_model, generator=gen).to(device, cfg.dtype).requires_grad_(True)
    grad_out = torch.randn(cfg.tokens, cfg.d_model, generator=gen).to(device, cfg.dtype)
    params = list(moe.parameters())
    row = Row(experts=E, k=k, layout="grouped" if moe.uses_grouped(k, x.device, num_tokens=cfg.tokens) else "buffers",
              other_layout=other_layout(moe, x))

    dense_gib = 2 * E * cfg.tokens * cfg.d_hidden * cfg.dtype.itemsize / 2**30
    impls = list(IMPLEMENTATIONS)
    if dense_gib > cfg.dense_limit_gib:
        impls.remove("dense")
        row.skipped["dense"] = (f"its [E, tokens, d_hidden] activations alone need {dense_gib:.0f} GiB "
                                f"(limit {cfg.dense_limit_gib:g} GiB)")

    def clear() -> None:
        x.grad = None
        for p in params:
            p.grad = None

    def step(name: str) -> Tensor:
        y = FORWARDS[name](moe, x)
        y.backward(grad_out)
        return y

    with torch.no_grad():
        _, routes = moe(x)
    row.capacity = int(routes.stats["capacity"])
    row.dropped = float(routes.stats["dropped_fraction"])

    # Warm-up, which also checks the outputs (y and dL/dx) against the layer.
    warm: dict[str, float] = {}
    reference: tuple[Tensor, Tensor] | None = None
    for name in impls:
        clear()
        _sync(device)
        t0 = time.perf_counter()
        y = step(name)
        _sync(device)
        warm[name] = time.perf_counter() - t0
        result = (y.detach().clone(), x.grad.detach().clone())
        if name == "moe":
            reference = result
        else:
            assert reference is not None
            row.max_rel_diff[name] = max(_rel_diff(result[0], reference[0]), _rel_diff(result[1], reference[1]))

    # Timed calls, round-robin. The layer's timed calls also time its experts from the inside (a
    # change of load then hits both alike); on CUDA the timer's marks are events, which do not
    # synchronise, so the timed calls run as they would untimed.
    runs = {name: max(1, min(cfg.repeats, int(cfg.budget_s / max(t, 1e-9)))) for name, t in warm.items()}
    times: dict[str, list[float]] = {name: [] for name in runs}
    shares: list[float] = []
    timer = ExpertTimer(moe, device)

    def timed(name: str) -> float:
        clear()
        _sync(device)
        with timer if name == "moe" else contextlib.nullcontext():
            t0 = time.perf_counter()
            step(name)
        _sync(device)
        dt = time.perf_counter() - t0
        if name == "moe":
            shares.append(timer.share())
        return dt

    for r in range(max(runs.values())):
        for name in runs:
            if r < runs[name]:
                times[name].append(timed(name))
    for name, ts in times.items():
        row.ms[name] = 1e3 * statistics.median(ts)
    row.expert_share = statistics.median(shares)
    row.runs = runs

    # Peak memory, one call each.
    for name in impls:
        clear()
        meter = _PeakMemory(device)
        with meter:
            step(name)
        row.peak_bytes[name] = meter.peak()
    clear()
    return row


# ---------------------------------------------------------------------------- rendering


TABLE_HEADER = (
    "| E | k | C | dropped | moe layout | moe tok/s | other layout | other tok/s | naive tok/s | dense tok/s "
    "| moe / other | moe / naive | moe / dense | non-expert share of moe | moe peak MiB | other peak MiB "
    "| naive peak MiB | dense peak MiB | same outputs |",
    "|---:|---:|---:|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|",
)


def _tok_s(tokens: int, ms: float | None) -> str:
    if ms is None:
        return "—"
    v = tokens / (ms / 1e3)
    return f"{v / 1e3:.1f}k" if v < 1e6 else f"{v / 1e6:.2f}M"


def _ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None:
        return "—"
    r = b / a  # time ratio = throughput ratio
    return f"{r:.1f}x" if r < 100 else f"{r:.0f}x"


def _mib(b: int | None) -> str:
    return "—" if b is None else f"{b / 2**20:.0f}"


def render_row(row: Row, tokens: int, rtol: float = SAME_RTOL[torch.float32]) -> str:
    """One markdown table row (``rtol``: the tolerance of the "same outputs" check)."""
    if row.failed is not None:
        return f"| {row.experts} | {row.k} | " + " | ".join(["—"] * 16) + f" | not measured: {row.failed} |"
    same = all(d <= rtol for d in row.max_rel_diff.values())
    diffs = ", ".join(f"{n} {d:.1e}" for n, d in row.max_rel_diff.items())
    overhead = row.overhead
    cells = [
        str(row.experts), str(row.k), str(row.capacity), f"{row.dropped:.1%}", row.layout or "—",
        _tok_s(tokens, row.ms.get("moe")), row.other_layout or "—", _tok_s(tokens, row.ms.get("other")),
        _tok_s(tokens, row.ms.get("naive")),
        _tok_s(tokens, row.ms.get("dense")) if "dense" in row.ms else "skipped",
        _ratio(row.ms.get("moe"), row.ms.get("other")),
        _ratio(row.ms.get("moe"), row.ms.get("naive")), _ratio(row.ms.get("moe"), row.ms.get("dense")),
        "—" if overhead is None else f"{overhead:.1%}",
        _mib(row.peak_bytes.get("moe")), _mib(row.peak_bytes.get("other")), _mib(row.peak_bytes.get("naive")),
        _mib(row.peak_bytes.get("dense")) if "dense" in row.peak_bytes else "skipped",
        ("yes" if same else "**no**") + f" ({diffs})",
    ]
    return "| " + " | ".join(cells) + " |"


def _verdicts(rows: Sequence[Row], device: str) -> list[str]:
    """The two targets of the issue, judged from ``rows``."""
    lines = ["", "Targets:", ""]
    big = [r for r in rows if r.experts == 64 and "naive" in r.ms]
    if device != "cuda":
        measured = "; ".join(f"k={r.k}: {r.ms['naive'] / r.ms['moe']:.1f}x" for r in big)
        lines.append(f"- at least {SPEEDUP_TARGET:g}x the naive loop at E = 64 **on GPU**: not measured "
                     f"(this run is on {device}; on {device} at E = 64: {measured or 'not in this grid'}).")
    elif big:
        ok = all(r.ms["naive"] / r.ms["moe"] >= SPEEDUP_TARGET for r in big)
        lines.append(f"- at least {SPEEDUP_TARGET:g}x the naive loop at E = 64 on GPU: "
                     f"{'met' if ok else 'not met'} ("
                     + "; ".join(f"k={r.k}: {r.ms['naive'] / r.ms['moe']:.1f}x" for r in big) + ").")
    else:
        lines.append(f"- at least {SPEEDUP_TARGET:g}x the naive loop at E = 64 on GPU: E = 64 not in this grid.")
    shares = [(r, r.overhead) for r in rows if r.overhead is not None]
    failed = [r for r in rows if r.failed is not None]
    if failed:
        lines.append("- not measured at " + ", ".join(f"E={r.experts} k={r.k} ({r.failed})" for r in failed) + ".")
    if shares:
        ok = all(s < OVERHEAD_TARGET for _, s in shares)
        lines.append(f"- routing + capacity + dispatch + combine below {OVERHEAD_TARGET:.0%} of the layer's time "
                     f"(top-k, {device}): {'met' if ok else 'not met'} at "
                     + ", ".join(f"E={r.experts} k={r.k}: {s:.1%}" for r, s in shares) + ".")
    return lines


def _notes(rows: Sequence[Row], cfg: BenchConfig, device: str) -> list[str]:
    memory = ("`torch.cuda.max_memory_allocated` during the call minus `torch.cuda.memory_allocated` before it"
              if device == "cuda" else
              "the largest running sum of the allocation events (+bytes on allocation, −bytes on free) of "
              "torch's CPU allocator during the call, recorded by `torch.profiler` with `profile_memory=True`: "
              "the bytes of tensors allocated above those alive before the call (the weights and inputs), like "
              "`torch.cuda.max_memory_allocated`; it includes the weight gradients "
              f"({2 * cfg.d_model * cfg.d_hidden * cfg.dtype.itemsize / 2**20:.1f} MiB per expert without biases)")
    lines = [
        "",
        "Notes:",
        "",
        f"- One forward + backward (`y.backward(g)`, `g` fixed random) of {cfg.tokens} tokens, d_model "
        f"{cfg.d_model}, d_hidden {cfg.d_hidden}, GELU experts with biases, {_dtype_name(cfg.dtype)}, `topk` router "
        f"(softmax probabilities of the chosen experts as combine weights), capacity factor "
        f"{cfg.capacity_factor:g} (C = ceil(factor * tokens * k / E)), `position` drop policy. "
        "tok/s = tokens / median time.",
        "- moe: the layer as configured (`dispatch=\"auto\"`; its layout per row: `buffers` = the pairs gathered "
        "into `[E, C, d]` buffers and batched matmuls (`baddbmm`), which `auto` takes where they pad nothing (capacity "
        "factor at most 1, E * C <= tokens * k); `grouped` = the kept pairs sorted by expert and grouped matmuls "
        "(`torch._grouped_mm`), no padding, where those run on this device and dtype and the buffers would pad). "
        "other: the same layer in the other layout (`grouped` where it runs, else `buffers` again).",
        "- naive: the same router and capacity decision, then `for e in range(E)`: `nonzero` of "
        "`(expert == e) & keep`, `addmm` with expert e's weights, GELU, `addmm`, `index_add_` of the "
        "weighted output (the style of `transformers`' Mixtral sparse MoE block); the per-expert weights are "
        "`w1.unbind(0)` views of the layer's stacked weights, so their gradients are stacked once, as with "
        "separate per-expert `nn.Linear`s (indexing `w1[e]` in the loop would zero-fill a full [E, ...] "
        "gradient per expert). dense: all E experts on "
        "all tokens by `baddbmm` over `[E, tokens, d]`, combined with a `[tokens, E]` gate matrix that is "
        "zero outside the kept routes. Both use the layer's own stacked weights.",
        f"- same outputs: the largest relative difference (max |Δ| / max |reference|) of y and of dL/dx "
        f"against the layer is at most {cfg.same_rtol:g} ({_dtype_name(cfg.dtype)}); the measured differences "
        "are in brackets.",
        "- non-expert share = 1 − t_experts / t_call, median over the layer's timed calls, measured inside each "
        "call: hooks mark where `moe.experts` (`StackedExperts`: the two grouped or batched matmuls, "
        "biases and GELU) starts and ends its forward and its backward"
        + (" (each mark a CUDA event on the stream, nothing synchronised: the spans are read on the GPU's "
           "timeline after the call, and the GPU's idle time counts where it happens)" if device == "cuda"
           else " (each mark a clock reading)")
        + "; the rest is the router, capacity, dispatch and combine, forward and backward (and the hooks' own cost).",
        f"- peak MiB: {memory}.",
        "- Times are medians over timed calls after one untimed warm-up; the implementations are timed "
        "round-robin. Timed calls per implementation: "
        + "; ".join(f"E={r.experts} k={r.k}: " + ", ".join(f"{n} {c}" for n, c in r.runs.items())
                    for r in rows if r.failed is None)
        + ".",
    ]
    for r in rows:
        for name, why in r.skipped.items():
            lines.append(f"- {name} skipped at E={r.experts}, k={r.k}: {why}.")
    return lines


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---------------------------------------------------------------------------- transformers' Mixtral block


#: transformers' experts implementations timed besides its default, in this order.
HF_IMPLEMENTATIONS: tuple[str, ...] = ("grouped_mm", "eager")
#: The least fraction of tokens transformers' block and the layer must route alike for "same outputs"
#: (bfloat16 router logits can break a near-tie differently from routelab's float32 ones).
ROUTE_AGREEMENT = 0.99
#: The implementations that are grouped-GEMM peers (the target compares the layer with the best of them).
HF_GROUPED: frozenset[str] = frozenset({"grouped_mm"})


@dataclass
class PeerRow:
    """What every comparison with a peer records at one size ``(E, k)``.

    Attributes:
        experts, k: the size.
        ms: median ms of one forward + backward, by implementation.
        max_rel_diff: ``max(rel. diff of y, rel. diff of dL/dx)`` against the reference, by
            implementation (against transformers' block: over the tokens both route alike).
        route_agreement: the fraction of tokens transformers' block and the layer route to the
            same experts (1 in float32; in bfloat16 the block's router scores in bfloat16 and
            routelab's in float32, so a near-tie can go the other way for a few tokens).
        failed: why the size was not measured (e.g. out of GPU memory), else ``None``.
    """

    experts: int
    k: int
    ms: dict[str, float] = field(default_factory=dict)
    max_rel_diff: dict[str, float] = field(default_factory=dict)
    route_agreement: float = 1.0
    failed: str | None = None


@dataclass
class HFRow(PeerRow):
    """The routelab layer against transformers' Mixtral sparse block at one size (:class:`PeerRow`;
    ``ms``: ``"moe"`` and one entry per implementation; ``max_rel_diff`` by implementation, the
    block against the layer).

    Attributes:
        implementations: transformers' experts implementations timed, its default first.
        default: the one transformers resolves by default for a model.
        runs: timed calls by the keys of ``ms``.
    """

    implementations: tuple[str, ...] = ()
    default: str = ""
    runs: dict[str, int] = field(default_factory=dict)

    def peer_ratio(self) -> float | None:
        """The layer's time over the best grouped-GEMM implementation's (``None``: none timed)."""
        peers = [self.ms[name] for name in self.implementations if name in HF_GROUPED and name in self.ms]
        if not peers or "moe" not in self.ms:
            return None
        return self.ms["moe"] / min(peers)


def _hf_default_implementation() -> str:
    """The experts implementation transformers resolves by default for a Mixtral model (as
    ``from_pretrained`` would; resolved on a tiny model)."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralForCausalLM

    probe = MixtralConfig(hidden_size=8, intermediate_size=8, num_local_experts=2, num_experts_per_tok=1,
                          num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1, vocab_size=8)
    return MixtralForCausalLM(probe).config._experts_implementation


def _hf_pair(E: int, k: int, cfg: BenchConfig, device: str) -> tuple[torch.nn.Module, MoE]:
    """transformers' Mixtral sparse block and the routelab layer computing the same function
    (SwiGLU experts from the block's weights, renormalised top-k, dropless), in ``cfg.dtype``."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = MixtralConfig(hidden_size=cfg.d_model, intermediate_size=cfg.d_hidden, num_local_experts=E,
                           num_experts_per_tok=k, num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1,
                           vocab_size=8)
    config._experts_implementation = _hf_default_implementation()
    torch.manual_seed(cfg.seed)
    block = MixtralSparseMoeBlock(config)
    with torch.no_grad():
        for p in block.parameters():
            torch.nn.init.normal_(p, std=cfg.d_model ** -0.5)
    block = block.to(device, cfg.dtype).train()
    experts = StackedExperts.from_hf_fused(block.experts.gate_up_proj.detach(), block.experts.down_proj.detach())
    # The block checks nothing, so the layer skips its finite check too (no host sync for it).
    moe = MoE(cfg.d_model, cfg.d_hidden, E, router="topk", k=k, router_kwargs={"renormalize": True},
              capacity_factor=None, experts=experts, check_finite=False)
    with torch.no_grad():
        moe.router.proj.weight.copy_(block.gate.weight)
    moe.router.logits_in_input_dtype = True  # as the block's gate: F.linear in the model's dtype
    return block, moe.to(device).train()


def _measure_hf(E: int, k: int, cfg: BenchConfig, device: str) -> HFRow:
    """Time the layer and transformers' block under each experts implementation, round-robin at
    one size, after checking they agree (a row with ``failed`` set when it does not fit)."""
    try:
        return _measure_hf_fitting(E, k, cfg, device)
    except _out_of_memory(device) as err:
        return HFRow(experts=E, k=k, failed=f"out of memory ({str(err).splitlines()[0][:120]})")
    finally:
        _free(device)


def _measure_hf_fitting(E: int, k: int, cfg: BenchConfig, device: str) -> HFRow:
    block, moe = _hf_pair(E, k, cfg, device)
    default = block.experts.config._experts_implementation
    implementations = tuple(dict.fromkeys((default, *HF_IMPLEMENTATIONS)))
    gen = torch.Generator().manual_seed(cfg.seed)
    x = torch.randn(1, cfg.tokens, cfg.d_model, generator=gen).to(device, cfg.dtype).requires_grad_(True)
    grad_out = torch.randn(1, cfg.tokens, cfg.d_model, generator=gen).to(device, cfg.dtype)

    def block_forward(implementation: str) -> Callable[[], Tensor]:
        def run() -> Tensor:
            block.experts.config._experts_implementation = implementation  # read by every call
            return block(x)
        return run

    forwards: dict[str, Callable[[], Tensor]] = {"moe": lambda: moe(x)[0]}
    forwards.update({name: block_forward(name) for name in implementations})
    params = list(moe.parameters()) + list(block.parameters())
    row = HFRow(experts=E, k=k, implementations=implementations, default=default)

    def step(name: str) -> tuple[float, Tensor]:
        x.grad = None
        for p in params:
            p.grad = None
        _sync(device)
        t0 = time.perf_counter()
        y = forwards[name]()
        y.backward(grad_out)
        _sync(device)
        return time.perf_counter() - t0, y

    warm, results = {}, {}
    for name in forwards:
        warm[name], y = step(name)
        results[name] = (y.detach().clone(), x.grad.detach().clone())
    # The same function on the tokens both route alike (a token's output and input gradient depend
    # on its own routes only: dropless top-k).
    same = _same_routes(block, moe, x)
    row.route_agreement = float(same.float().mean())
    for name in implementations:
        row.max_rel_diff[name] = max(_rel_diff(results[name][0][0, same], results["moe"][0][0, same]),
                                     _rel_diff(results[name][1][0, same], results["moe"][1][0, same]))
    del results
    row.ms, row.runs = time_round_robin(warm, cfg, lambda name: step(name)[0])
    block.experts.config._experts_implementation = default
    return row


def time_round_robin(warm: dict[str, float], cfg: BenchConfig,
                     call: Callable[[str], float]) -> tuple[dict[str, float], dict[str, int]]:
    """Time every implementation of ``warm`` round-robin (a change of load hits all alike).

    Args:
        warm: seconds of each implementation's warm-up call, by name.
        cfg: ``repeats`` timed calls each, fewer (at least one) where they would take more than
            ``budget_s`` by the warm-up's time.
        call: runs one timed call of an implementation, returns its seconds.

    Returns:
        ``(median ms by name, timed calls by name)``.
    """
    runs = {name: max(1, min(cfg.repeats, int(cfg.budget_s / max(t, 1e-9)))) for name, t in warm.items()}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(max(runs.values())):
        for name in runs:
            if r < runs[name]:
                times[name].append(call(name))
    return {name: 1e3 * statistics.median(ts) for name, ts in times.items()}, runs


def _same_routes(block: torch.nn.Module, moe: MoE, x: Tensor) -> Tensor:
    """``BoolTensor [tokens]``: the tokens of ``x [1, tokens, d]`` that transformers' router and the
    layer's send to the same set of experts."""
    with torch.no_grad():
        _, _, hf_index = block.gate(x[0])
        _, routes = moe(x[0])
    return (hf_index.sort(-1).values == routes.expert.sort(-1).values).all(-1)


def hf_table_header(implementations: Sequence[str], default: str) -> tuple[str, str]:
    """The header of the transformers table for these implementations (default marked)."""
    cells = ["E", "k", "moe (SwiGLU, dropless) tok/s"]
    for name in implementations:
        label = f"block `{name}`" + (" (default)" if name == default else "")
        cells += [f"{label} tok/s", f"moe / {label}"]
    cells += ["moe time / best grouped-GEMM peer's", "same outputs"]
    align = ["---:"] * (len(cells) - 1) + [":---:"]
    return "| " + " | ".join(cells) + " |", "|" + "|".join(align) + "|"


def render_hf_row(row: HFRow, tokens: int, rtol: float = SAME_RTOL[torch.float32]) -> str:
    """One markdown row of the transformers comparison."""
    if row.failed is not None:
        return f"| {row.experts} | {row.k} | not measured: {row.failed} |"
    cells = [str(row.experts), str(row.k), _tok_s(tokens, row.ms.get("moe"))]
    for name in row.implementations:
        cells += [_tok_s(tokens, row.ms.get(name)), _ratio(row.ms.get("moe"), row.ms.get(name))]
    ratio = row.peer_ratio()
    cells.append("—" if ratio is None else f"{ratio:.2f}")
    same = all(d <= rtol for d in row.max_rel_diff.values()) and row.route_agreement >= ROUTE_AGREEMENT
    diffs = ", ".join(f"{n} {d:.1e}" for n, d in row.max_rel_diff.items())
    if row.route_agreement < 1.0:
        diffs += f"; same experts for {row.route_agreement:.2%} of tokens, compared on those"
    cells.append(("yes" if same else "**no**") + f" ({diffs})")
    return "| " + " | ".join(cells) + " |"


def _emitter(lines: list[str], out: TextIO | None) -> Callable[..., None]:
    """``emit(*new)``: append lines to ``lines`` and print each to ``out`` (if any) as it comes."""

    def emit(*new: str) -> None:
        for line in new:
            lines.append(line)
            if out is not None:
                print(line, file=out, flush=True)

    return emit


def _benchmark_hf(cfg: BenchConfig, *, device: str = "cpu", out: TextIO | None = None) -> tuple[str, list[HFRow]]:
    """The layer against transformers' Mixtral sparse block at every ``(E, k)`` of ``cfg``: the
    markdown section and the rows (a one-line note and no rows when transformers is not installed)."""
    lines: list[str] = []
    emit = _emitter(lines, out)

    emit("", "**Against transformers' Mixtral sparse MoE block** (same sizes, same run):", "")
    try:
        import transformers
    except ImportError:
        emit("- not measured: transformers is not installed (`pip install routelab[hf]`).")
        return "\n".join(lines) + "\n", []
    default = _hf_default_implementation()
    implementations = tuple(dict.fromkeys((default, *HF_IMPLEMENTATIONS)))
    emit(*hf_table_header(implementations, default))
    rows = []
    for E in cfg.experts:
        for k in cfg.ks:
            row = _measure_hf(E, k, cfg, device)
            rows.append(row)
            emit(render_hf_row(row, cfg.tokens, cfg.same_rtol))
    measured = [(r, r.peer_ratio()) for r in rows if r.peer_ratio() is not None]
    if measured:
        ok = all(ratio <= PEER_TARGET for _, ratio in measured)
        emit("", f"- Target: the layer within {PEER_TARGET:g}x of the best grouped-GEMM peer's time ({device}, "
             f"{_dtype_name(cfg.dtype)}): {'met' if ok else 'not met'} ("
             + ", ".join(f"E={r.experts} k={r.k}: {ratio:.2f}" for r, ratio in measured) + ").")
    emit("", f"- transformers {transformers.__version__}: `MixtralSparseMoeBlock` (SwiGLU experts, intermediate size "
         f"{cfg.d_hidden}, no biases; renormalised top-k router; no capacity: dropless), {_dtype_name(cfg.dtype)}, "
         f"under each experts implementation (`{default}` is what transformers resolves by default for a model; one "
         "block, its `config._experts_implementation` switched before each call). The routelab layer computes the "
         "same function: `MoE(router=\"topk\", k=k, router_kwargs={\"renormalize\": True}, capacity_factor=None, "
         "experts=StackedExperts.from_hf_fused(gate_up_proj, down_proj), check_finite=False)` with the block's "
         "router weight (the block checks nothing either); same outputs = largest relative difference of y and dL/dx "
         f"within {cfg.same_rtol:g} on the tokens both route to the same experts, and those at least "
         f"{ROUTE_AGREEMENT:.0%} of the tokens (both routers score in {_dtype_name(cfg.dtype)}: the layer's "
         f"`router.logits_in_input_dtype`, as the block's gate). One forward + backward of {cfg.tokens} tokens, "
         "median of the timed calls after a "
         "warm-up, timed round-robin; moe / block = the block's time over the layer's (> 1: the layer is faster); "
         "moe time / best grouped-GEMM peer's < 1 likewise means the layer is faster.")
    return "\n".join(lines) + "\n", rows


# ---------------------------------------------------------------------------- driver


def _benchmark(cfg: BenchConfig, *, device: str = "cpu", out: TextIO | None = None) -> tuple[str, list[Row]]:
    """Measure every ``(E, k)`` of ``cfg``; return the markdown table with notes, and the rows.

    Rows are written to ``out`` as they are measured.
    """
    lines: list[str] = []
    emit = _emitter(lines, out)

    emit(*TABLE_HEADER)
    rows = []
    for E in cfg.experts:
        for k in cfg.ks:
            row = _measure(E, k, cfg, device)
            rows.append(row)
            emit(render_row(row, cfg.tokens, cfg.same_rtol))
    emit(*_verdicts(rows, device))
    emit(*_notes(rows, cfg, device))
    return "\n".join(lines) + "\n", rows




def _header(quick: bool, device: str, configs: Sequence[BenchConfig]) -> list[str]:
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    gpu = (f" ({torch.cuda.get_device_name()}; TF32 matmuls "
           f"{'on' if torch.backends.cuda.matmul.allow_tf32 else 'off'})" if device == "cuda" else "")
    cfg = configs[0]
    return [
        f"**routelab MoE layer benchmark** ({'quick' if quick else 'full'} mode)",
        "",
        f"- CPU: {_cpu_model()} ({os.cpu_count()} logical CPUs); torch threads: {torch.get_num_threads()}",
        f"- device: {device}{gpu}; routelab {routelab.__version__}, torch {torch.__version__}, "
        f"Python {platform.python_version()}; dtype {_dtype_name(cfg.dtype)}",
        f"- date: {stamp}; 1-minute load average at start: {load_average()}",
        f"- sizes: E in {list(cfg.experts)}, top-k in {list(cfg.ks)}; (d_model, d_hidden, tokens) in "
        + ", ".join(f"({c.d_model}, {c.d_hidden}, {c.tokens})" for c in configs),
        "",
    ]


def default_configs(*, quick: bool, device: str, dtype: torch.dtype = torch.float32) -> tuple[BenchConfig, ...]:
    """The sizes a run measures: :data:`QUICK` / :data:`FULL` on CPU, :data:`GPU_QUICK` /
    :data:`GPU_FULL` on CUDA (where the dense reference may take up to 16 GiB), in ``dtype``."""
    if device == "cuda":
        configs = (GPU_QUICK,) if quick else GPU_FULL
        configs = tuple(replace(c, dense_limit_gib=max(c.dense_limit_gib, 16.0)) for c in configs)
    else:
        configs = (QUICK,) if quick else (FULL,)
    return tuple(replace(c, dtype=dtype) for c in configs)


def select_configs(configs: Sequence[BenchConfig], d_models: Sequence[int]) -> tuple[BenchConfig, ...]:
    """The sizes of ``configs`` whose ``d_model`` is in ``d_models``.

    Raises:
        ValueError: none is, naming the grid's ``d_model`` values.
    """
    chosen = tuple(c for c in configs if c.d_model in set(d_models))
    if not chosen:
        raise ValueError(f"--d-model {' '.join(map(str, d_models))} selects no size of this grid; its d_model "
                         f"values are {' '.join(str(c.d_model) for c in configs)}")
    return chosen


def select_grid(configs: Sequence[BenchConfig], experts: Sequence[int] | None = None,
                ks: Sequence[int] | None = None) -> tuple[BenchConfig, ...]:
    """``configs`` measuring only these numbers of experts and top-k values (``None``: all of the grid's).

    Raises:
        ValueError: a value outside the grid, naming the grid's values.
    """
    chosen = []
    for cfg in configs:
        for name, values, grid in (("--experts", experts, cfg.experts), ("--k", ks, cfg.ks)):
            if values is not None and not set(values) <= set(grid):
                raise ValueError(f"{name} {' '.join(map(str, values))} is not in this grid; its values are "
                                 f"{' '.join(map(str, grid))}")
        chosen.append(replace(cfg, experts=tuple(e for e in cfg.experts if experts is None or e in set(experts)),
                              ks=tuple(k for k in cfg.ks if ks is None or k in set(ks))))
    return tuple(chosen)


def run_benchmark(*, quick: bool = False, threads: int = 1, device: str = "cpu", out: TextIO | None = None,
                  config: BenchConfig | None = None, dtype: str | torch.dtype = "float32",
                  d_models: Sequence[int] | None = None, experts: Sequence[int] | None = None,
                  ks: Sequence[int] | None = None, compile_mode: str | None = None) -> str:
    """Run the MoE benchmark and return its markdown report.

    Args:
        quick: small sizes instead of the issue's (:func:`default_configs`).
        threads: torch intra-op threads for the run (restored afterwards).
        device: ``"cpu"`` or ``"cuda"``.
        out: stream the report to this file as it is measured.
        config: explicit sizes (overrides ``quick`` and ``dtype``).
        dtype: ``"float32"`` or ``"bfloat16"`` (or the torch dtype).
        d_models: measure only the sizes of the grid with these ``d_model`` (e.g. one GPU size per
            call, to fit a time limit); ``None``: all.
        experts, ks: measure only these numbers of experts / top-k values of the grid; ``None``: all.
        compile_mode: measure the layer under ``torch.compile`` in this mode
            (:mod:`routelab.bench.moe_compiled`) instead of the eager tables; ``None``: eager.

    Returns:
        The markdown report: machine facts, then per size the table, targets and notes and the
        comparison with transformers' block.

    Raises:
        ValueError: unknown device, dtype or compile mode, ``device="cuda"`` without CUDA,
            ``threads < 1``, ``d_models`` that select no size of the grid, or ``experts`` / ``ks``
            outside it.
    """
    from .moe_compiled import COMPILE_MODES, benchmark_compiled  # its module imports this one

    if compile_mode is not None and compile_mode not in COMPILE_MODES:
        raise ValueError(f"compile_mode must be one of {', '.join(COMPILE_MODES)}, got {compile_mode!r}")
    check_device_and_threads(device, threads)
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        dtype = DTYPES[dtype]
    if config is not None:
        configs: tuple[BenchConfig, ...] = (config,)
    else:
        configs = default_configs(quick=quick, device=device, dtype=dtype)
    if d_models is not None:
        configs = select_configs(configs, d_models)
    configs = select_grid(configs, experts, ks)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    try:
        lines: list[str] = []
        emit = _emitter(lines, out)
        emit(*_header(quick, device, configs))
        for cfg in configs:
            if len(configs) > 1:
                emit("", f"### d_model {cfg.d_model}, d_hidden {cfg.d_hidden}, {cfg.tokens} tokens, "
                     f"{_dtype_name(cfg.dtype)}", "")
            # Every section streams its rows to ``out`` as they are measured.
            if compile_mode is not None:
                table, _ = benchmark_compiled(cfg, device=device, mode=compile_mode, out=out)
                lines.extend(table.rstrip("\n").split("\n"))
                continue
            table, _ = _benchmark(cfg, device=device, out=out)
            lines.extend(table.rstrip("\n").split("\n"))
            if cfg.hf_peer:
                hf, _ = _benchmark_hf(cfg, device=device, out=out)
                lines.extend(hf.rstrip("\n").split("\n"))
        emit("", f"Wall time of the benchmark: {time.perf_counter() - t0:.0f} s.")
        return "\n".join(lines) + "\n"
    finally:
        torch.set_num_threads(previous)
