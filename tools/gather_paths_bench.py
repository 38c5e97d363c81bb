"""Dispatch + combine + backward with the adjoint gathers against the plain formulation, same run.

usage: python tools/gather_paths_bench.py [--device cpu|cuda] [--tokens N] [--d-model N] [--k K]
       [--experts E] [--dtype float32|bfloat16] [--repeats R]

``routelab.routing._gather`` picks the adjoint-gather backward on GPUs and the plain autograd
formulation (``index_select`` + ``bmm``) on the CPU (``_adjoint_by_default``). This times both on
one ``DispatchPlan`` (capacity factor 1, position policy) of random top-k routes, round-robin,
and prints the medians and their ratio, so the default can be checked on any machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from routelab.machine import cpu_model
from routelab.routing import DispatchPlan, apply_capacity
from routelab.routing._gather import combine_rows, dispatch_rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--k", type=int, default=2)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--repeats", type=int, default=20)
    a = p.parse_args()
    dev, dtype = torch.device(a.device), getattr(torch, a.dtype)
    g = torch.Generator().manual_seed(0)
    n, d, k, E = a.tokens, a.d_model, a.k, a.experts
    expert = torch.rand(n, E, generator=g).topk(k, -1).indices.to(dev)
    capacity = -(-n * k // E)
    decision = apply_capacity(expert, torch.ones_like(expert, dtype=torch.bool), capacity, E)
    plan = DispatchPlan.build(expert, decision.keep, decision.position, E, capacity)
    x = torch.randn(n, d, generator=g).to(dev, dtype).requires_grad_(True)
    w = torch.rand(n, k, generator=g).to(dev, dtype).masked_fill(~decision.keep, 0).requires_grad_(True)

    def step(adjoint: bool) -> None:
        x.grad = w.grad = None
        rows = dispatch_rows(x, plan.token_of_row, plan.row_of_slot, adjoint=adjoint)
        y = combine_rows(rows * 1.5, w, plan.row_of_slot, plan.token_of_row, adjoint=adjoint)
        y.sum().backward()

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    times: dict[bool, list[float]] = {True: [], False: []}
    for adjoint in (True, False):
        step(adjoint)
    for _ in range(a.repeats):
        for adjoint in (True, False):
            sync()
            t0 = time.perf_counter()
            step(adjoint)
            sync()
            times[adjoint].append(time.perf_counter() - t0)
    adj, plain = (1e3 * statistics.median(times[b]) for b in (True, False))
    threads = f"{torch.get_num_threads()} thread(s)"
    where = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"{cpu_model()}, {threads}"
    print(f"{where}; torch {torch.__version__}; {n} tokens, d {d}, k {k}, E {E}, {a.dtype}")
    print(f"adjoint gathers {adj:.2f} ms, plain {plain:.2f} ms (medians of {a.repeats}, round-robin): "
          f"plain / adjoint = {plain / adj:.2f}")


if __name__ == "__main__":
    main()
