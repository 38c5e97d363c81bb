"""The MoE layer's host time per training step, measured on the CPU where the compute is negligible.

usage: python tools/layer_host_time.py [--dtype bfloat16] [--reps 300] [--cases E:K ...] [--router topk]

At d_model 1024 on a GPU the layer is bound by the host (docs/gpu-profile-h200.md): the GPU waits
while Python and the dispatcher issue the step's operations. This times that host work without a
GPU: a layer of d_model 16, 256 tokens on one CPU thread, where each operation's compute is a few
microseconds, so the step's time is mostly the host's. The GPU's code paths are taken where the
CPU can take them (the adjoint gathers of dispatch and combine, as on CUDA); the CUDA-only
kernels (Triton gathers, the router's float32-out matmul) are not.

Prints the median step time (forward + backward) per case, and the operators one step dispatches:
all of them, and those that compute (not views or aliases; on a GPU, each launches one kernel or
more). The counts are exact and the same on every machine, so they show a change too small for the
times' noise. Run it again with another checkout's src on PYTHONPATH for an A/B comparison on the
same machine, e.g. before and after a change:

    PYTHONPATH=src python tools/layer_host_time.py
    PYTHONPATH=/tmp/old/src python tools/layer_host_time.py
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import routelab
from routelab.layers import MoE


class _CountOperators(TorchDispatchMode):
    """Counts the operators dispatched inside it: all, and those that compute (not views or aliases)."""

    def __init__(self) -> None:
        super().__init__()
        self.all = self.computing = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.all += 1
        if not func.is_view and func not in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
            self.computing += 1
        return func(*args, **(kwargs or {}))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--reps", type=int, default=300, help="timed steps per case (after 20 warm-up steps)")
    p.add_argument("--cases", nargs="+", metavar="E:K", default=["8:1", "8:2", "64:1", "64:2"])
    p.add_argument("--router", default="topk")
    args = p.parse_args(argv)
    if args.reps < 1:
        p.error("--reps must be at least 1")
    import routelab.routing._gather as gather

    # The GPU's gathers (a checkout from before the switch has one path, which these tools set too).
    saved = (torch.get_num_threads(), getattr(gather, "_adjoint_by_default", None))
    torch.set_num_threads(1)
    gather._adjoint_by_default = lambda t: True
    try:
        _run(args)
    finally:
        torch.set_num_threads(saved[0])
        if saved[1] is None:
            del gather._adjoint_by_default
        else:
            gather._adjoint_by_default = saved[1]


def _run(args: argparse.Namespace) -> None:
    dtype = getattr(torch, args.dtype)
    print(f"routelab {routelab.__file__}; torch {torch.__version__}; {platform.processor() or platform.machine()}; "
          f"{args.dtype}, router {args.router}, capacity factor 1, d_model 16, 256 tokens, one thread")
    for case in args.cases:
        E, k = (int(v) for v in case.split(":"))
        torch.manual_seed(0)
        moe = MoE(16, 32, E, router=args.router, k=k, capacity_factor=1.0, dtype=dtype)
        x = torch.randn(256, 16, dtype=dtype, requires_grad=True)
        g = torch.randn(256, 16, dtype=dtype)
        for _ in range(20):
            moe(x)[0].backward(g)
        times = []
        for _ in range(args.reps):
            start = time.perf_counter()
            y, _ = moe(x)
            y.backward(g)
            times.append(time.perf_counter() - start)
        with _CountOperators() as ops:
            y, _ = moe(x)
            y.backward(g)
        print(f"E={E} k={k}: {statistics.median(times) * 1e6:.0f} us per step (median of {args.reps}); "
              f"{ops.all} operators, {ops.computing} that compute", flush=True)


if __name__ == "__main__":
    main()
