"""Where the MoE layer's time goes on a GPU: eager time, host issue time, CUDA-graph replay, kernels.

usage: python tools/gpu_layer_profile.py OUTFILE [--brief] [--fp32] [--d-model N] [--d-hidden N] [--tokens N]
       [--cases E:K ...] [--no-triton] [--traces DIR]

For E in {8, 64} and top-1/top-2 at d_model 1024, d_hidden 4096, 8192 tokens unless given (bfloat16
unless --fp32), one forward + backward of: the MoE layer (capacity factor 1, `auto` and each layout
forced, GELU experts with biases), the SwiGLU dropless layer computing transformers' Mixtral
block, and that block (`grouped_mm` experts). Per variant it prints

* eager: median wall time of a synchronised step;
* back-to-back: the host's time to issue 10 steps without synchronising, and their wall time
  (issue time close to the wall time: the step is bound by the host's kernel launches);
* CUDA graph: the step replayed from a CUDA graph, i.e. the GPU's own time without launch
  overhead (the layer's default host checks cannot be captured: they synchronise);
* the host's own time by operator: torch.profiler's table of the operators sorted by their self
  CPU time (the 12 largest with --brief), to say which operations make a host-bound step slow;
* (without --brief) torch.profiler's table of the kernels, sorted by device time;
* on CUDA, the GPU's idle time in the profiled steps and the host work it waited for
  (``tools/gpu_trace_gaps.py`` on the profile's trace: each idle gap charged to the innermost
  operator or CUDA call of the thread that launched the kernel ending it); ``--traces DIR`` keeps
  the traces (gzipped) for a closer look;
* a second pass over the variants in reverse order (eager and back-to-back again), so that a
  difference between two variants that comes from the order they ran in shows as such.

Run it with routelab importable (PYTHONPATH=src); run it again with another checkout's src on
PYTHONPATH for an A/B comparison in the same session. On a machine without CUDA it runs tiny sizes
on the CPU (a smoke test: no graph, no device times). Used for the README's "On a GPU".
"""
import argparse
import gzip
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import routelab
from routelab.layers import MoE, StackedExperts

_parser = argparse.ArgumentParser(description="Where the MoE layer's time goes on a GPU (see the module docstring).")
_parser.add_argument("out", help="the report file")
_parser.add_argument("--brief", action="store_true", help="E=8 and E=64 top-1 only, no kernel tables")
_parser.add_argument("--fp32", action="store_true", help="float32 instead of bfloat16")
_parser.add_argument("--d-model", type=int, default=None, help="default 1024 (64 without CUDA)")
_parser.add_argument("--d-hidden", type=int, default=None, help="default 4096 (128 without CUDA)")
_parser.add_argument("--tokens", type=int, default=None, help="default 8192 (512 without CUDA)")
_parser.add_argument("--cases", nargs="+", metavar="E:K", default=None,
                     help="the (experts, top-k) cases to run, e.g. 64:1 (default 8:1 64:1 64:2; --brief 8:1 64:1)")
_parser.add_argument("--no-triton", action="store_true",
                     help="the gathers on PyTorch's operators, not the fused Triton kernels (an A/B of their cost)")
_parser.add_argument("--traces", metavar="DIR", default=None,
                     help="keep each variant's profiler trace there (CUDA; Chrome trace, gzipped)")
_args = _parser.parse_args()
if _args.no_triton:
    try:
        from routelab.routing import _gather_triton
    except ImportError:  # a checkout from before the kernels
        pass
    else:
        _gather_triton.usable = lambda *tensors, indices=(): False
out_path = _args.out
brief = _args.brief
dev = "cuda" if torch.cuda.is_available() else "cpu"
dt = torch.float32 if _args.fp32 else torch.bfloat16
d, h, n = (1024, 4096, 8192) if dev == "cuda" else (64, 128, 512)
d, h, n = _args.d_model or d, _args.d_hidden or h, _args.tokens or n
lines = [f"routelab from {routelab.__file__}; torch {torch.__version__}; device {dev} "
         f"{torch.cuda.get_device_name() if dev == 'cuda' else ''}; dtype {dt}; d {d} h {h} tokens {n}"
         + ("; Triton gathers off (--no-triton)" if _args.no_triton else "")]
results = {}


def log(s):
    print(s, flush=True)
    lines.append(s)


def sync():
    if dev == "cuda":
        torch.cuda.synchronize()


def median_ms(fn, reps=10):
    fn()
    sync()
    ts = []
    for _ in range(reps):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t)
    return 1e3 * statistics.median(ts)


def issue_ms(fn, reps=10):
    """CPU time to issue one step (no sync inside), measured over back-to-back steps with the GPU
    queue kept from draining: the wall time of reps steps minus nothing; compare with median_ms."""
    sync()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    t_issue = time.perf_counter() - t
    sync()
    t_all = time.perf_counter() - t
    return 1e3 * t_issue / reps, 1e3 * t_all / reps


def graph_ms(module, x, g, reps=10):
    """Forward+backward replayed from a CUDA graph: the GPU's own time, no launch overhead.

    A layer with its finite check on syncs with the host in forward, so it cannot be captured: it
    is reported as such, not tried. The graph's memory pool (which holds the gradients captured in
    it) is given back before returning, so the next variant has the whole GPU."""
    if dev != "cuda":
        return None
    router = getattr(getattr(module, "m", module), "router", None)
    if getattr(router, "check_finite", False):
        return "not captured: check_finite=True syncs with the host"
    graph = None
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                for p in module.parameters():
                    p.grad = None
                x.grad = None
                module(x).backward(g)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        for p in module.parameters():
            p.grad = None
        x.grad = None
        with torch.cuda.graph(graph):
            module(x).backward(g)
        return median_ms(graph.replay, reps)
    except Exception as e:  # noqa: BLE001
        return f"capture failed: {type(e).__name__}: {str(e)[:160]}"
    finally:
        for p in module.parameters():
            p.grad = None
        x.grad = None
        del graph
        sync()
        torch.cuda.empty_cache()


def profile(fn, label):
    acts = [torch.profiler.ProfilerActivity.CPU]
    if dev == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    fn()
    sync()
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(3):
            fn()
        sync()
    ka = prof.key_averages()
    attr = "self_device_time_total" if hasattr(ka[0], "self_device_time_total") else "self_cuda_time_total"
    # Kernels only: operator rows also carry their kernels' time, so summing every row counts it twice.
    kernels = [e for e in ka if str(getattr(e, "device_type", "")).endswith("CUDA")] if dev == "cuda" else []
    kernel_us = sum(getattr(e, attr) for e in (kernels or ka)) / 3
    cpu_ops = sum(e.count for e in ka if e.key.startswith("aten::")) / 3
    log(f"  [{label}] device time per step {kernel_us / 1e3:.3f} ms; aten ops per step (incl. nested) {cpu_ops:.0f}")
    if dev == "cuda":
        idle_report(prof, label)
    lines.append(f"  host time by operator [{label}], 3 steps:")
    lines.append(ka.table(sort_by="self_cpu_time_total", row_limit=12 if brief else 30, max_name_column_width=60))
    if not brief:
        sort = "self_cuda_time_total" if dev == "cuda" else "self_cpu_time_total"
        try:
            table = ka.table(sort_by=sort, row_limit=40, max_name_column_width=70)
        except Exception:  # noqa: BLE001
            table = ka.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=70)
        lines.append(table)
    return kernel_us / 1e3


def _trace_gaps():
    """tools/gpu_trace_gaps.py, imported from beside this script wherever it runs from."""
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    import gpu_trace_gaps
    return gpu_trace_gaps


def idle_report(prof, label: str) -> None:
    """Log where the GPU waited for the host in the profiled steps (and keep the trace with --traces)."""
    try:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(path))
            report = _trace_gaps().analyse(_trace_gaps().load_events(path))
            if _args.traces:
                Path(_args.traces).mkdir(parents=True, exist_ok=True)
                name = "".join(c if c.isalnum() else "-" for c in label).strip("-")
                with open(path, "rb") as src, gzip.open(Path(_args.traces) / f"{name}.json.gz", "wb") as dst:
                    shutil.copyfileobj(src, dst)
    except Exception as e:  # noqa: BLE001 (a trace this torch cannot export: say so, go on)
        log(f"  [{label}] GPU idle time: not measured ({type(e).__name__}: {str(e)[:160]})")
        return
    lines_ = report.lines(steps=3, top=8 if brief else 15)
    log(f"  [{label}] {lines_[0]}")
    for line in lines_[1:]:
        log(f"  {line}")


class YOnly(torch.nn.Module):
    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, x):
        y = self.m(x)
        return y[0] if isinstance(y, tuple) else y


def hf_block(E, k):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    cfg = MixtralConfig(hidden_size=d, intermediate_size=h, num_local_experts=E, num_experts_per_tok=k,
                        num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1, vocab_size=8)
    cfg._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    b = MixtralSparseMoeBlock(cfg)
    with torch.no_grad():
        for p in b.parameters():
            torch.nn.init.normal_(p, std=d ** -0.5)
    return b.to(dev, dt).train()


def variants(E, k):
    torch.manual_seed(0)
    out = {}
    m = MoE(d, h, E, router="topk", k=k, capacity_factor=1.0).to(dev, dt).train()
    out["gelu-bias cf1 auto, default checks"] = m
    for layout in ("grouped", "buffers"):
        m = MoE(d, h, E, router="topk", k=k, capacity_factor=1.0, check_finite=False, dispatch=layout)
        out[f"gelu-bias cf1 {layout} unchecked"] = m.to(dev, dt).train()
    b = hf_block(E, k)
    ex = StackedExperts.from_hf_fused(b.experts.gate_up_proj.detach(), b.experts.down_proj.detach())
    ms = MoE(d, h, E, router="topk", k=k, router_kwargs={"renormalize": True}, capacity_factor=None, experts=ex,
             check_finite=False)
    with torch.no_grad():
        ms.router.proj.weight.copy_(b.gate.weight)
    if hasattr(ms.router, "logits_in_input_dtype"):
        ms.router.logits_in_input_dtype = True
    out["swiglu dropless (grouped) unchecked"] = ms.to(dev).train()
    out["HF Mixtral block grouped_mm"] = b
    return out


def measure(name: str, mod: torch.nn.Module, E: int, k: int, x0: torch.Tensor, g0: torch.Tensor,
            again: bool = False) -> None:
    """Time and profile one variant; log a line and record its figures (again: the second pass, its
    eager and back-to-back times only)."""
    wrapped = YOnly(mod)
    hf = name.startswith("HF")
    x = (x0.view(1, n, d) if hf else x0).clone().requires_grad_(True)
    g = g0.view(1, n, d) if hf else g0

    def step():
        x.grad = None
        for p in wrapped.parameters():
            p.grad = None
        wrapped(x).backward(g)

    try:
        eager = median_ms(step)
        issue, allms = issue_ms(step)
        if again:
            log(f"{name:36s} eager {eager:7.3f} ms | back-to-back: CPU issue {issue:7.3f} ms, wall {allms:7.3f} ms "
                "(second pass)")
            results[f"E{E}k{k} {name}"].update(eager2_ms=eager, issue2_ms=issue)
            return
        kern = profile(step, name)
        graph = graph_ms(wrapped, x, g)
        shown = graph if isinstance(graph, str) or graph is None else f"{graph:7.3f} ms"
        log(f"{name:36s} eager {eager:7.3f} ms | back-to-back: CPU issue {issue:7.3f} ms, wall {allms:7.3f} ms "
            f"| CUDA graph {shown}")
        results[f"E{E}k{k} {name}"] = {"eager_ms": eager, "issue_ms": issue, "b2b_ms": allms, "kernel_ms": kern,
                                        "graph_ms": graph}
    except Exception as e:  # noqa: BLE001
        log(f"{name}: failed {type(e).__name__}: {str(e)[:300]}")


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn(n, d, generator=gen).to(dev, dt)
    g0 = torch.randn(n, d, generator=gen).to(dev, dt)
    grid = [(8, 1), (64, 1), (64, 2)] if not brief else [(8, 1), (64, 1)]
    if _args.cases:
        try:
            grid = [(int(e), int(k)) for e, k in (case.split(":") for case in _args.cases)]
        except ValueError:
            _parser.error(f"--cases takes E:K pairs such as 64:1, got {' '.join(_args.cases)}")
    for E, k in grid:
        log(f"\n=== E={E} k={k} ===")
        mods = variants(E, k)
        for name, mod in mods.items():
            measure(name, mod, E, k, x0, g0)
        log("  second pass, reverse order:")
        for name, mod in reversed(mods.items()):
            if f"E{E}k{k} {name}" in results:
                measure(name, mod, E, k, x0, g0, again=True)
        if dev == "cuda":
            torch.cuda.empty_cache()
    with open(out_path, "w") as f:
        f.write("\n".join(lines) + "\n\n" + json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
