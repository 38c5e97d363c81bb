"""Time ``sinkhorn()`` (sweeps, then Newton's finish on sharp matrices) against the sweeps alone.

The reference runs in the same process, after routelab's call at each scale: the same
``sinkhorn`` call with its Newton finish switched off (``NEWTON_MAX_K = 0``): up to ``max_iter``
sweeps, what ``sinkhorn`` ran before. Logits ``randn(n, k) * scale`` in float32; the median of ``--repeats``
calls after one warm-up each; "no" where the method did not reach the tolerance::

    OMP_NUM_THREADS=1 python tools/sinkhorn_sharp.py [--n 512] [--k 16] [--scales 10 50 100 300 1000]
"""

from __future__ import annotations

import argparse
import importlib
import time
from datetime import UTC, datetime

import torch

from routelab.assignment import sinkhorn
from routelab.machine import cpu_model, load_average

sinkhorn_module = importlib.import_module("routelab.assignment.sinkhorn")  # the package exports the function


def _time(fn, repeats: int) -> tuple[float, bool]:
    """Median seconds of ``fn()`` over ``repeats`` calls (after a warm-up) and whether it converged."""
    fn()
    times, ok = [], True
    for _ in range(repeats):
        start = time.perf_counter()
        ok = fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2], ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=512)
    parser.add_argument("--k", type=int, default=16)
    parser.add_argument("--scales", type=float, nargs="+", default=[10, 50, 100, 300, 1000])
    parser.add_argument("--max-iter", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    for name in ("n", "k", "max_iter", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    n, k = args.n, args.k
    print(f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {cpu_model()}, torch {torch.__version__}, 1-minute load "
          f"average {load_average()}")
    print(f"n={n}, k={k}, float32, max_iter={args.max_iter}, default tol, torch threads {torch.get_num_threads()}, "
          f"median of {args.repeats} calls after a warm-up")
    print("| logit scale | sinkhorn ms | converged | sweeps alone ms | converged | sweeps / sinkhorn |")
    print("|---:|---:|:---:|---:|:---:|---:|")
    for scale in args.scales:
        log_p = torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * scale

        def call() -> bool:
            try:
                sinkhorn(log_p, max_iter=args.max_iter)
                return True
            except ValueError:  # did not converge
                return False

        t_new, ok_new = _time(call, args.repeats)
        newton_k = sinkhorn_module.NEWTON_MAX_K
        sinkhorn_module.NEWTON_MAX_K = 0  # the sweeps alone
        try:
            t_ref, ok_ref = _time(call, args.repeats)
        finally:
            sinkhorn_module.NEWTON_MAX_K = newton_k
        print(f"| {scale:g} | {t_new * 1e3:.1f} | {'yes' if ok_new else 'no'} | {t_ref * 1e3:.1f} | "
              f"{'yes' if ok_ref else 'no'} | {t_ref / t_new:.1f}x |")


if __name__ == "__main__":
    main()
