"""The MoE layer under ``torch.compile`` (``routelab bench moe --compile [MODE]``).

The eager layer issues one kernel per bookkeeping operation (router statistics, capacity, the
plan), about 180 in a forward + backward, so on a GPU at moderate sizes it is bound by the host's
launches (docs/gpu-profile-h200.md). ``torch.compile`` fuses those operations, and
``mode="reduce-overhead"`` replays the step from CUDA graphs. This benchmark measures what that
buys, per ``(E, k)`` of a :class:`~routelab.bench.moe.BenchConfig`, in one run, timed
round-robin after a warm-up that compiles:

* ``eager`` — the benchmark's layer as configured (``topk`` router, capacity factor, GELU
  experts with biases, ``dispatch="auto"``, its default checks);
* ``compiled`` — the same layer through ``torch.compile(layer, mode=..., fullgraph=True)``
  (a graph break is a failure of the row: the top-k layer is documented to compile whole);
* ``experts`` — the layer's experts alone, compiled the same way, forward + backward on the
  inputs the layer dispatches to them (same layout, same rows). ``1 - t_experts / t_compiled``
  is the compiled layer's non-expert share: routing, capacity, dispatch and combine;
* where transformers is installed and the dropless layer compiles on the grouped layout
  (bfloat16 with grouped matmuls on the device): transformers' Mixtral sparse block compiled
  (its default experts implementation) against the routelab layer computing the same function
  (dropless SwiGLU, :func:`routelab.bench.moe._hf_pair`), also compiled. A dropless float32
  layer compiles on buffers sized for the worst case (``C = tokens``), which is not a
  like-for-like comparison, so it is left out with that reason.

Each compiled output and input gradient is checked against its eager counterpart. The first
call's wall time (compilation included) is reported too.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

import torch
from torch import Tensor

from routelab.layers import MoE

from .moe import (
    OVERHEAD_TARGET,
    PEER_TARGET,
    ROUTE_AGREEMENT,
    BenchConfig,
    PeerRow,
    _dtype_name,
    _emitter,
    _free,
    _hf_pair,
    _out_of_memory,
    _ratio,
    _rel_diff,
    _same_routes,
    _sync,
    _tok_s,
    time_round_robin,
)

__all__ = ["COMPILE_MODES", "CompiledRow", "benchmark_compiled"]

#: ``torch.compile`` modes the benchmark accepts (``"reduce-overhead"``: CUDA graphs on CUDA).
COMPILE_MODES: tuple[str, ...] = ("default", "reduce-overhead", "max-autotune-no-cudagraphs")


@dataclass
class CompiledRow(PeerRow):
    """The compiled layer at one size (:class:`~routelab.bench.moe.PeerRow`).

    ``ms`` by implementation: ``"eager"``, ``"compiled"``, ``"experts"`` (the compiled experts
    alone) and, where measured, ``"swiglu"`` (the compiled dropless SwiGLU layer) and ``"block"``
    (transformers' block, compiled). ``max_rel_diff``: ``"compiled"`` against the eager layer,
    ``"block"`` the compiled block against the compiled SwiGLU layer on the tokens both route alike.

    Attributes:
        layout: the layer's dispatch layout (``"buffers"`` or ``"grouped"``).
        first_s: wall seconds of each implementation's first call (compilation included).
        hf_skipped: why transformers' block was not compared, else ``None``.
    """

    layout: str = ""
    first_s: dict[str, float] = field(default_factory=dict)
    hf_skipped: str | None = None

    @property
    def overhead(self) -> float | None:
        """``1 - t_experts / t_compiled``: the compiled layer's share of time outside the experts."""
        if "experts" not in self.ms or "compiled" not in self.ms:
            return None
        return 1.0 - self.ms["experts"] / self.ms["compiled"]

    @property
    def peer_ratio(self) -> float | None:
        """The compiled SwiGLU layer's time over the compiled block's (< 1: the layer is faster)."""
        if "swiglu" not in self.ms or "block" not in self.ms:
            return None
        return self.ms["swiglu"] / self.ms["block"]


def _compile(module: torch.nn.Module, mode: str, *, fullgraph: bool) -> Callable[..., Any]:
    return torch.compile(module, mode=None if mode == "default" else mode, fullgraph=fullgraph)


def _experts_inputs(moe: MoE, x: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """What ``moe`` passes its experts on ``x``: ``(inputs, keyword arguments)`` (the grouped
    layout's ``offsets`` and ``expert_of_row``), detached."""
    seen: list[tuple[Tensor, dict[str, Tensor]]] = []

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        seen.append((args[0].detach().clone(), {name: v.detach().clone() for name, v in kwargs.items()}))

    handle = moe.experts.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            moe(x)
    finally:
        handle.remove()
    return seen[0]


def _measure(E: int, k: int, cfg: BenchConfig, device: str, mode: str) -> CompiledRow:
    """One size, a row with ``failed`` set where it does not fit or does not compile whole."""
    try:
        return _measure_fitting(E, k, cfg, device, mode)
    except _out_of_memory(device) as err:
        return CompiledRow(experts=E, k=k, failed=f"out of memory ({str(err).splitlines()[0][:120]})")
    except torch._dynamo.exc.Unsupported as err:  # fullgraph=True: a graph break
        return CompiledRow(experts=E, k=k, failed=f"does not compile whole ({str(err).splitlines()[0][:160]})")
    except torch._dynamo.exc.TorchDynamoException as err:  # another compiler error: this size's row says it
        first = (str(err).strip().splitlines() or [""])[0][:160]
        return CompiledRow(experts=E, k=k, failed=f"compilation failed ({type(err).__name__}: {first})")
    finally:
        torch._dynamo.reset()  # the next size compiles afresh (no recompilation limit across sizes)
        _free(device)


def _measure_fitting(E: int, k: int, cfg: BenchConfig, device: str, mode: str) -> CompiledRow:
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    moe = MoE.from_config(cfg.layer(E, k)).to(device, cfg.dtype).train()
    x = torch.randn(cfg.tokens, cfg.d_model, generator=gen).to(device, cfg.dtype).requires_grad_(True)
    grad_out = torch.randn(cfg.tokens, cfg.d_model, generator=gen).to(device, cfg.dtype)
    row = CompiledRow(experts=E, k=k,
                      layout="grouped" if moe.uses_grouped(k, x.device, num_tokens=cfg.tokens) else "buffers")

    experts_in, experts_kw = _experts_inputs(moe, x)
    experts_in.requires_grad_(True)  # in the layer, the dispatched rows carry x's gradient
    grad_experts = torch.randn(experts_in.shape, generator=gen).to(device, cfg.dtype)
    compiled = _compile(moe, mode, fullgraph=True)
    compiled_experts = _compile(moe.experts, mode, fullgraph=True)

    def layer_step(fn: Callable[..., Any]) -> Callable[[], tuple[Tensor, Tensor]]:
        def run() -> tuple[Tensor, Tensor]:
            x.grad = None
            y = fn(x)[0]
            y.backward(grad_out)
            return y, x.grad
        return run

    def experts_step() -> tuple[Tensor, Tensor]:
        experts_in.grad = None
        out = compiled_experts(experts_in, **experts_kw)
        out.backward(grad_experts)
        return out, experts_in.grad

    steps: dict[str, Callable[[], tuple[Tensor, Tensor]]] = {
        "eager": layer_step(moe), "compiled": layer_step(compiled), "experts": experts_step}

    hf_x: Tensor | None = None
    block = swiglu = None
    if cfg.hf_peer:
        row.hf_skipped, block, swiglu = _hf_peer(E, k, cfg, device)
    if block is not None and swiglu is not None:
        hf_x = torch.randn(1, cfg.tokens, cfg.d_model, generator=gen).to(device, cfg.dtype).requires_grad_(True)
        hf_grad = torch.randn(1, cfg.tokens, cfg.d_model, generator=gen).to(device, cfg.dtype)
        compiled_block = _compile(block, mode, fullgraph=False)  # transformers' code: breaks are its own
        compiled_swiglu = _compile(swiglu, mode, fullgraph=True)

        def hf_step(fn: Callable[..., Any], returns_routes: bool) -> Callable[[], tuple[Tensor, Tensor]]:
            def run() -> tuple[Tensor, Tensor]:
                hf_x.grad = None
                y = fn(hf_x)
                y = y[0] if returns_routes else y
                y.backward(hf_grad)
                return y, hf_x.grad
            return run

        steps["swiglu"] = hf_step(compiled_swiglu, returns_routes=True)
        steps["block"] = hf_step(compiled_block, returns_routes=False)

    params = [p for m in (moe, block, swiglu) if m is not None for p in m.parameters()]

    def timed(name: str) -> tuple[float, tuple[Tensor, Tensor]]:
        for p in params:
            p.grad = None
        if mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        _sync(device)
        t0 = time.perf_counter()
        result = steps[name]()
        _sync(device)
        return time.perf_counter() - t0, result

    results: dict[str, tuple[Tensor, Tensor]] = {}
    warm: dict[str, float] = {}
    for name in steps:
        row.first_s[name], _ = timed(name)
        warm[name], (y, g) = timed(name)  # the second call: compiled, warm
        results[name] = (y.detach().clone(), g.detach().clone())
    row.max_rel_diff["compiled"] = max(_rel_diff(results["compiled"][0], results["eager"][0]),
                                       _rel_diff(results["compiled"][1], results["eager"][1]))
    if "block" in results:
        same = _same_routes(block, swiglu, hf_x.detach())
        row.route_agreement = float(same.float().mean())
        row.max_rel_diff["block"] = max(_rel_diff(results["block"][0][0, same], results["swiglu"][0][0, same]),
                                        _rel_diff(results["block"][1][0, same], results["swiglu"][1][0, same]))
    del results
    row.ms, _ = time_round_robin(warm, cfg, lambda name: timed(name)[0])
    return row


def _hf_peer(E: int, k: int, cfg: BenchConfig, device: str) -> tuple[str | None, Any, MoE | None]:
    """``(why not, block, layer)``: transformers' block and the dropless SwiGLU layer computing
    it, or the reason they are not compared (``block`` and ``layer`` then ``None``)."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return "transformers is not installed (`pip install routelab[hf]`)", None, None
    block, swiglu = _hf_pair(E, k, cfg, device)
    # Under torch.compile grouped matmuls take bfloat16 only (routelab.layers._grouped).
    if not (cfg.dtype == torch.bfloat16 and swiglu.uses_grouped(k, torch.device(device))):
        return (f"the dropless layer compiles grouped in bfloat16 only (with grouped matmuls on {device}); in "
                f"{_dtype_name(cfg.dtype)} it compiles on buffers sized for the worst case (C = tokens)"), None, None
    return None, block, swiglu


TABLE_HEADER = (
    "| E | k | layout | eager tok/s | compiled tok/s | compiled / eager | non-expert share (compiled) "
    "| SwiGLU dropless compiled tok/s | block compiled tok/s | layer time / block's | first call s (layer, block) "
    "| same outputs |",
    "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|:---:|",
)


def _share(overhead: float | None) -> str:
    if overhead is None:
        return "—"
    # The experts alone took longer than the whole layer: the two separate timings disagree by more
    # than the routing's cost (a loaded machine), so the share is not measured.
    return f"{overhead:.1%}" if overhead >= 0 else f"{overhead:.1%} (timing noise)"


def render_row(row: CompiledRow, tokens: int, rtol: float) -> str:
    """One markdown row (``rtol``: the tolerance of the "same outputs" check)."""
    if row.failed is not None:
        return f"| {row.experts} | {row.k} | " + " | ".join(["—"] * 9) + f" | not measured: {row.failed} |"
    ms = row.ms
    overhead, peer = row.overhead, row.peer_ratio
    diffs = ", ".join(f"{n} {d:.1e}" for n, d in row.max_rel_diff.items())
    if row.route_agreement < 1.0:
        diffs += f"; block on the {row.route_agreement:.2%} of tokens routed alike"
    # as the eager transformers table: outputs compared on too few tokens routed alike are no agreement
    same = all(d <= rtol for d in row.max_rel_diff.values()) and row.route_agreement >= ROUTE_AGREEMENT
    first = f"{row.first_s.get('compiled', 0):.0f}" + (f", {row.first_s['block']:.0f}" if "block" in row.first_s
                                                         else "")
    cells = [
        str(row.experts), str(row.k), row.layout, _tok_s(tokens, ms.get("eager")), _tok_s(tokens, ms.get("compiled")),
        _ratio(ms.get("compiled"), ms.get("eager")), _share(overhead),
        _tok_s(tokens, ms.get("swiglu")) if "swiglu" in ms else "—",
        _tok_s(tokens, ms.get("block")) if "block" in ms else "—",
        "—" if peer is None else f"{peer:.2f}", first, ("yes" if same else "**no**") + f" ({diffs})",
    ]
    return "| " + " | ".join(cells) + " |"


def benchmark_compiled(cfg: BenchConfig, *, device: str = "cpu", mode: str = "default",
                       out: TextIO | None = None) -> tuple[str, list[CompiledRow]]:
    """Measure the compiled layer at every ``(E, k)`` of ``cfg``: the markdown section and the rows.

    Args:
        cfg: the sizes (as for the eager benchmark).
        device: ``"cpu"`` or ``"cuda"``.
        mode: one of :data:`COMPILE_MODES`.
        out: stream the rows to this file as they are measured.

    Raises:
        ValueError: an unknown ``mode``.
    """
    if mode not in COMPILE_MODES:
        raise ValueError(f"mode must be one of {', '.join(COMPILE_MODES)}, got {mode!r}")
    lines: list[str] = []
    emit = _emitter(lines, out)
    emit(f"**Compiled** (`torch.compile(..., mode=\"{mode}\")`, {device}, {_dtype_name(cfg.dtype)}):", "",
         *TABLE_HEADER)
    rows = []
    for E in cfg.experts:
        for k in cfg.ks:
            row = _measure(E, k, cfg, device, mode)
            rows.append(row)
            emit(render_row(row, cfg.tokens, cfg.same_rtol))
    shares = [(r, r.overhead) for r in rows if r.overhead is not None]
    judged = [(r, s) for r, s in shares if s >= 0]
    if shares:
        verdict = ("met" if all(s < OVERHEAD_TARGET for _, s in judged) else "not met") if judged else "not judged"
        noise = [r for r, s in shares if s < 0]
        emit("", f"- Target: routing + capacity + dispatch + combine below {OVERHEAD_TARGET:.0%} of the compiled "
             f"layer's time ({device}): {verdict} ("
             + ", ".join(f"E={r.experts} k={r.k}: {s:.1%}" for r, s in judged)
             + (("; " if judged else "") + "not judged at " + ", ".join(f"E={r.experts} k={r.k}" for r in noise)
                + ": the experts alone timed slower than the layer (timing noise)" if noise else "") + ").")
    peers = [(r, r.peer_ratio) for r in rows if r.peer_ratio is not None]
    if peers:
        ok = all(p <= PEER_TARGET for _, p in peers)
        emit(f"- Target: the compiled layer within {PEER_TARGET:g}x of transformers' compiled block: "
             f"{'met' if ok else 'not met'} (" + ", ".join(f"E={r.experts} k={r.k}: {p:.2f}" for r, p in peers) + ").")
    skipped = sorted({r.hf_skipped for r in rows if r.hf_skipped})
    for why in skipped:
        emit(f"- transformers' block not compared: {why}.")
    emit("", f"- One forward + backward of {cfg.tokens} tokens, d_model {cfg.d_model}, d_hidden {cfg.d_hidden}, "
         f"{_dtype_name(cfg.dtype)}; median of the timed calls after two warm-up calls (the first compiles: its wall "
         "time is the \"first call\" column), timed round-robin. eager: the benchmark's layer as configured "
         f"(`topk`, capacity factor {cfg.capacity_factor:g}, GELU experts with biases, `dispatch=\"auto\"`, its "
         "default finite check, one host sync); compiled: `torch.compile(layer, fullgraph=True)` (the check is "
         "skipped while tracing). non-expert share = 1 − t_experts / t_compiled, t_experts the layer's experts "
         "compiled alone, forward + backward on the rows the layer dispatches to them (separate calls). "
         "SwiGLU dropless / block: the routelab layer computing transformers' Mixtral sparse block and the block "
         "(its default experts implementation), both compiled; layer time / block's < 1: the layer is faster. "
         f"same outputs: y and dL/dx within {cfg.same_rtol:g} (relative) of the eager layer's, and the block's of "
         f"the SwiGLU layer's on the tokens both route to the same experts, and those at least {ROUTE_AGREEMENT:.0%} "
         "of the tokens.")
    return "\n".join(lines) + "\n", rows
