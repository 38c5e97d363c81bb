"""Expert-parallel MoE benchmark: routelab vs DeepSpeed's MoE layer, over gloo (``routelab bench moe --world-size N``).

For every world size ``W`` the benchmark starts ``W`` local gloo processes on 127.0.0.1
(:func:`routelab.parallel.run_workers`, one intra-op thread each), or, under ``torchrun``,
runs in the processes ``torchrun`` started (``torchrun --nproc_per_node=N -m
routelab.bench.moe_parallel``). Shapes are per rank (weak scaling): every rank holds
``tokens_per_rank`` tokens and ``E / W`` experts of a top-1 (Switch) MoE.

Compared, with the same weights on every rank (one ``torch.manual_seed``):

* ``routelab`` — :class:`routelab.parallel.ExpertParallelMoE` (``router="switch"``), routing
  and capacity on the global batch;
* ``deepspeed`` — ``deepspeed.moe.layer.MoE`` (``k=1``, ``ep_size=W``, ``use_rts=False``,
  the expert an ``nn.Sequential(Linear, GELU, Linear)`` holding the same weights), which gates
  each rank's tokens locally (local capacity) and exchanges ``[E, C, d]`` buffers; only when
  DeepSpeed can be imported (it is no dependency of routelab: install it with
  ``DS_BUILD_OPS=0 DS_ACCELERATOR=cpu pip install --no-build-isolation deepspeed``);
* ``single`` — the single-process :class:`routelab.layers.MoE` (``W = 1`` only), the cost of
  the layer without any communication.

Two modes: ``capacity`` (``capacity_factor=1``; DeepSpeed ``drop_tokens=True``) and
``dropless`` (``capacity_factor=None``; DeepSpeed ``drop_tokens=False``). In dropless top-1
both layers compute the same function, ``y_t = p(e_t | x_t) FFN_{e_t}(x_t)``: the run checks
it (largest ``|y_ds - y_ours|`` and ``|dx_ds - dx_ours|``) and checks ours against the
single-process layer on the concatenated global batch. With capacity the two differ by design
(global vs per-rank capacity), so only speed is compared.

Throughput: global tokens per second of one forward + backward (``y.backward(g)`` with a fixed
random ``g``), ``W * tokens_per_rank / t`` where ``t`` is the step time of the slowest rank
(barrier before and after each step), median over ``repeats`` steps after ``warmup`` steps;
implementations are timed round-robin so load changes on the machine hit them alike.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any, TextIO

import torch
import torch.distributed as dist
from torch import Tensor, nn

import routelab
from routelab.layers import MoE, MoEConfig
from routelab.parallel import ExpertParallelMoE, init_distributed, run_workers, under_torchrun

from .._checks import positive_int_arg
from ..machine import cpu_model as _cpu_model

__all__ = ["FULL", "QUICK", "ParallelBenchConfig", "deepspeed_available", "run_benchmark"]

MODES: tuple[str, ...] = ("capacity", "dropless")


@dataclass(frozen=True)
class ParallelBenchConfig:
    """Sizes and repeats of one run (shapes are per rank)."""

    d_model: int = 256
    d_hidden: int = 1024
    experts: int = 8
    tokens_per_rank: int = 1024
    world_sizes: tuple[int, ...] = (1, 2, 4)
    warmup: int = 2
    repeats: int = 7
    timeout: float = 900.0

    def layer(self, mode: str) -> MoEConfig:
        """The measured layer: Switch (top-1) routing, capacity factor 1 (``"capacity"``) or dropless."""
        return MoEConfig(self.d_model, self.d_hidden, self.experts, router="switch",
                         capacity_factor=1.0 if mode == "capacity" else None)


FULL = ParallelBenchConfig()
QUICK = replace(FULL, d_model=64, d_hidden=128, tokens_per_rank=256, warmup=1, repeats=3, timeout=300.0)


def deepspeed_available() -> tuple[bool, str]:
    """Whether ``deepspeed.moe`` can be imported here, and its version or the import error."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
    try:
        import deepspeed
        from deepspeed.moe.layer import MoE as _  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - reported in the table
        return False, f"{type(exc).__name__}: {exc}".splitlines()[0]
    return True, deepspeed.__version__


def _reference(cfg: ParallelBenchConfig, mode: str, device: torch.device) -> MoE:
    torch.manual_seed(0)
    moe = MoE.from_config(cfg.layer(mode), device=device)
    with torch.no_grad():  # a spread-out router: every expert gets tokens
        moe.router.proj.weight.normal_(0.0, 1.0 / cfg.d_model ** 0.5)
    return moe


def _deepspeed_layer(moe: MoE, mode: str, world: int, rank: int, device: torch.device) -> nn.Module:
    """DeepSpeed's MoE layer holding ``moe``'s weights (this rank's experts)."""
    import deepspeed
    from deepspeed.moe.layer import MoE as DSMoE

    os.environ.setdefault("LOCAL_RANK", str(rank))
    deepspeed.init_distributed(dist_backend=dist.get_backend())
    ex = moe.experts
    d, h = ex.d_model, ex.d_hidden
    expert = nn.Sequential(nn.Linear(d, h), nn.GELU(), nn.Linear(h, d)).to(device)
    layer = DSMoE(hidden_size=d, expert=expert, num_experts=moe.num_experts, ep_size=world, k=1,
                  capacity_factor=1.0, eval_capacity_factor=1.0, min_capacity=0,
                  drop_tokens=(mode == "capacity"), use_rts=False).to(device)
    layer.set_deepspeed_parallelism()  # what deepspeed.initialize() does for every MoE module: the ep group
    local = moe.num_experts // world
    with torch.no_grad():
        layer.deepspeed_moe.gate.wg.weight.copy_(moe.router.proj.weight)
        for i, net in enumerate(layer.deepspeed_moe.experts.deepspeed_experts):
            e = rank * local + i
            net[0].weight.copy_(ex.w1[e].t())
            net[0].bias.copy_(ex.b1[e, 0])
            net[2].weight.copy_(ex.w2[e].t())
            net[2].bias.copy_(ex.b2[e, 0])
    return layer


def _worker(rank: int, world: int, cfg: ParallelBenchConfig, with_deepspeed: bool, device_name: str) -> dict:
    device = torch.device(device_name)
    n, d = cfg.tokens_per_rank, cfg.d_model
    torch.manual_seed(1)
    x_all = torch.randn(world * n, d, device=device)
    g_all = torch.randn(world * n, d, device=device)
    x, g = x_all[rank * n:(rank + 1) * n], g_all[rank * n:(rank + 1) * n]
    result: dict[str, Any] = {"times": {}, "checks": {}}
    for mode in MODES:
        moe = _reference(cfg, mode, device)  # the same weights on every rank
        impls: dict[str, nn.Module] = {"routelab": ExpertParallelMoE.from_moe(moe)}
        if world == 1:
            impls["single"] = moe
        if with_deepspeed:
            impls["deepspeed"] = _deepspeed_layer(moe, mode, world, rank, device)

        def step(name: str) -> tuple[Tensor, Tensor]:
            xi = x.clone().requires_grad_(True)
            if name == "deepspeed":
                y = impls[name](xi.unsqueeze(0))[0].squeeze(0)
            else:
                y = impls[name](xi)[0]
            y.backward(g)
            return y.detach(), xi.grad

        # Same function: ours vs the single process on the global batch, DeepSpeed vs ours.
        y_ours, dx_ours = step("routelab")
        if mode == "dropless":
            xr = x_all.clone().requires_grad_(True)
            yr = moe(xr)[0]
            yr.backward(g_all)
            yr = yr.detach()
            result["checks"]["routelab_vs_single"] = max(
                float((y_ours - yr[rank * n:(rank + 1) * n]).abs().max()),
                float((dx_ours - xr.grad[rank * n:(rank + 1) * n]).abs().max()))
            if with_deepspeed:
                y_ds, dx_ds = step("deepspeed")
                result["checks"]["deepspeed_vs_routelab_y"] = float((y_ds - y_ours).abs().max())
                result["checks"]["deepspeed_vs_routelab_dx"] = float((dx_ds - dx_ours).abs().max())
        for _ in range(cfg.warmup):
            for name in impls:
                step(name)
        times: dict[str, list[float]] = {name: [] for name in impls}
        for _ in range(cfg.repeats):
            for name in impls:
                for m in impls.values():
                    m.zero_grad(set_to_none=True)
                dist.barrier()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                step(name)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                dist.barrier()
                times[name].append(time.perf_counter() - t0)
        # The step of the slowest rank.
        for name, ts in times.items():
            t = torch.tensor(ts, dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            result["times"][(mode, name)] = statistics.median(t.tolist())
    for key in list(result["checks"]):
        t = torch.tensor([result["checks"][key]], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        result["checks"][key] = float(t)
    result["backend"] = dist.get_backend()
    return result


def _fmt_rate(tokens: int, seconds: float | None) -> str:
    return "—" if seconds is None else f"{tokens / seconds:,.0f}"


def _table(cfg: ParallelBenchConfig, results: dict[int, dict]) -> list[str]:
    lines = [
        "| world size | mode | routelab tokens/s | DeepSpeed tokens/s | routelab / DeepSpeed "
        "| single-process MoE tokens/s |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for world in sorted(results):
        times = results[world]["times"]
        tokens = world * cfg.tokens_per_rank
        for mode in MODES:
            ours, theirs, single = (times.get((mode, k)) for k in ("routelab", "deepspeed", "single"))
            ratio = "—" if theirs is None else f"{theirs / ours:.2f}x"
            lines.append(f"| {world} | {mode} | {_fmt_rate(tokens, ours)} | {_fmt_rate(tokens, theirs)} | {ratio} "
                         f"| {_fmt_rate(tokens, single)} |")
    lines += ["", "Same function (dropless top-1, largest absolute difference over ranks):", ""]
    lines += ["| world size | routelab vs single process (y, dx) | DeepSpeed vs routelab y "
              "| DeepSpeed vs routelab dx |",
              "|---:|---:|---:|---:|"]
    for world in sorted(results):
        c = results[world]["checks"]
        def f(key: str) -> str:
            return f"{c[key]:.1e}" if key in c else "—"
        lines.append(f"| {world} | {f('routelab_vs_single')} | {f('deepspeed_vs_routelab_y')} | "
                     f"{f('deepspeed_vs_routelab_dx')} |")
    return lines


def _header(cfg: ParallelBenchConfig, quick: bool, ds: tuple[bool, str], backend: str, launcher: str) -> list[str]:
    """The report's opening lines: versions, the machine (under NCCL, which times GPUs, the GPU model
    of this rank's device: every rank has its own), the sizes, the date and the load."""
    deepspeed = f"DeepSpeed {ds[1]}" if ds[0] else f"DeepSpeed absent ({ds[1]}); its columns are empty"
    gpu = (f"; GPU: {torch.cuda.get_device_name()} (one per rank)"
           if backend == "nccl" and torch.cuda.is_available() else "")
    return [
        f"# Expert-parallel MoE benchmark{' (quick)' if quick else ''}",
        "",
        f"- routelab {routelab.__version__}, torch {torch.__version__}, {deepspeed}",
        f"- machine: {_cpu_model()}, {os.cpu_count()} logical CPUs{gpu}; backend {backend}; {launcher}",
        f"- per rank: {cfg.tokens_per_rank} tokens, d_model={cfg.d_model}, d_hidden={cfg.d_hidden}; "
        f"E={cfg.experts} experts in all (E/W per rank), top-1 (Switch) routing, capacity factor 1 or dropless",
        f"- forward + backward, median of {cfg.repeats} steps after {cfg.warmup} warm-up steps, slowest rank; "
        "tokens/s counts the global batch (W x tokens per rank)",
        f"- {datetime.now(UTC).strftime('%Y-%m-%d %H:%M UTC')}; load average at the end "
        f"{', '.join(f'{v:.1f}' for v in os.getloadavg())} (1, 5, 15 min; "
        "other work on the machine slows every column)",
        "",
    ]


def benchmark_config(*, world_sizes: Sequence[int] | None = None, quick: bool = False,
                     config: ParallelBenchConfig | None = None) -> ParallelBenchConfig:
    """The configuration :func:`run_benchmark` measures, its world sizes checked.

    Raises:
        ValueError: a world size that is not a positive integer, or that does not divide the experts
            (each rank holds E/W of them).
    """
    cfg = config or (QUICK if quick else FULL)
    if world_sizes:
        cfg = replace(cfg, world_sizes=tuple(world_sizes))
    for w in cfg.world_sizes:
        if isinstance(w, bool) or not isinstance(w, int) or w < 1:
            raise ValueError(f"world sizes must be positive integers, got {w!r} in {list(cfg.world_sizes)}")
        if cfg.experts % w:
            raise ValueError(
                f"world size {w} does not divide the {cfg.experts} experts; use a divisor of {cfg.experts}"
            )
    return cfg


def run_benchmark(*, world_sizes: Sequence[int] | None = None, quick: bool = False, deepspeed: bool = True,
                  config: ParallelBenchConfig | None = None, out: TextIO | None = None) -> str:
    """Run the benchmark on local gloo workers (one process group per world size).

    Args:
        world_sizes: the world sizes to measure (default: the config's, 1 2 4).
        quick: smaller shapes and fewer steps.
        deepspeed: include DeepSpeed when it can be imported.
        config: explicit sizes (overrides ``quick``).
        out: where progress and the table are printed as they come.

    Returns:
        The markdown report (header, throughput table, equality table).
    """
    cfg = benchmark_config(world_sizes=world_sizes, quick=quick, config=config)
    ds = deepspeed_available() if deepspeed else (False, "disabled")
    results: dict[int, dict] = {}
    backend = "gloo"
    for w in cfg.world_sizes:
        if out is not None:
            print(f"world size {w}: starting {w} gloo worker(s)...", file=out, flush=True)
        start = time.monotonic()
        res = run_workers(_worker, w, cfg, ds[0], "cpu", timeout=cfg.timeout)
        results[w] = res[0]
        if out is not None:
            print(f"world size {w}: done in {time.monotonic() - start:.0f} s", file=out, flush=True)
    launcher = "local workers forked by run_workers on 127.0.0.1, 1 thread each"
    text = "\n".join(_header(cfg, quick, ds, backend, launcher) + _table(cfg, results)) + "\n"
    if out is not None:
        print(text, file=out, flush=True)
    return text


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m routelab.bench.moe_parallel`` — under torchrun, or spawning local gloo workers."""
    parser = argparse.ArgumentParser(prog="python -m routelab.bench.moe_parallel", description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=positive_int_arg, nargs="+", default=None,
                        help="local gloo workers to start (ignored under torchrun)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-deepspeed", action="store_true")
    parser.add_argument("--out", default=None, help="also write the report to this file (rank 0)")
    for name in ("tokens-per-rank", "d-model", "d-hidden", "experts", "repeats"):
        parser.add_argument(f"--{name}", type=positive_int_arg, default=None,
                            help="override the size of --quick or the full run")
    args = parser.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    overrides = {k: getattr(args, k) for k in ("tokens_per_rank", "d_model", "d_hidden", "experts", "repeats")
                 if getattr(args, k) is not None}
    cfg = replace(cfg, **overrides)
    ds = deepspeed_available() if not args.no_deepspeed else (False, "disabled")
    if under_torchrun():
        rank, world = init_distributed()
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        if device == "cpu":
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world))))
        res = _worker(rank, world, replace(cfg, world_sizes=(world,)), ds[0], device)
        if rank == 0:
            launcher = f"torchrun, {torch.get_num_threads()} thread(s) per rank"
            text = "\n".join(_header(replace(cfg, world_sizes=(world,)), args.quick, ds, dist.get_backend(), launcher)
                             + _table(cfg, {world: res})) + "\n"
            print(text, flush=True)
            if args.out:
                with open(args.out, "w") as fh:
                    fh.write(text)
        dist.destroy_process_group()
        return 0
    text = run_benchmark(world_sizes=args.world_size, quick=args.quick, deepspeed=not args.no_deepspeed,
                         config=cfg, out=sys.stdout)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
