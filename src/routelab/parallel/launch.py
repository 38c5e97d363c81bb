"""Starting process groups: under ``torchrun`` (any number of machines) or as local gloo workers.

* :func:`init_distributed` — inside a script started by ``torchrun`` (it reads ``RANK``,
  ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``LOCAL_RANK`` from the environment):
  NCCL when every local rank has a GPU of its own (and binds the process to GPU ``LOCAL_RANK``),
  gloo otherwise.
* :func:`run_workers` — run ``fn(rank, world_size, *args)`` in ``world_size`` local processes
  joined by gloo (default) or NCCL on ``127.0.0.1`` (tests, ``routelab bench moe --world-size N``).
  gloo children are forked (cheap: torch is already imported) on a machine without a GPU, and
  spawned on one with a GPU (a forked child can use neither CUDA nor autograd once the parent
  has run a backward there); NCCL children are spawned, and rank ``r`` is bound to GPU ``r``
  (NCCL refuses two ranks of one communicator on one device: a GPU per rank). Children are
  single-threaded; every collective has a timeout, the parent waits with a deadline, and the
  first failing rank's traceback is raised in the parent after the other ranks are terminated,
  so a broken rank never hangs the caller.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .._checks import check_positive_int

__all__ = ["default_backend", "free_port", "init_distributed", "run_workers", "under_torchrun"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def under_torchrun() -> bool:
    """Whether this process was started by ``torchrun`` (or another env:// launcher)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def default_backend(local_world_size: int = 1) -> str:
    """``"nccl"`` when CUDA and NCCL are available with at least ``local_world_size`` GPUs, else ``"gloo"``.

    Args:
        local_world_size: processes on this machine (torchrun's ``LOCAL_WORLD_SIZE``), one GPU each.
    """
    check_positive_int("local_world_size", local_world_size)
    if not (dist.is_available() and dist.is_nccl_available() and torch.cuda.is_available()):
        return "gloo"
    return "nccl" if torch.cuda.device_count() >= local_world_size else "gloo"


def _backend_from_environment() -> str:
    """:func:`default_backend` for this machine's ``LOCAL_WORLD_SIZE``, the same on every rank.

    Without ``LOCAL_WORLD_SIZE`` (an env:// launcher other than torchrun) the number of processes per
    machine is unknown, and guessing it from the rank's ``LOCAL_RANK`` would let the ranks of one
    job pick different backends (NCCL on local rank 0, gloo on rank 1 of a one-GPU machine): gloo
    where NCCL is out of the question anyway, else a RuntimeError naming the variable.
    """
    value = os.environ.get("LOCAL_WORLD_SIZE")
    if value is None:
        if default_backend(1) == "gloo":  # no CUDA or no NCCL: gloo whatever the local world size
            return "gloo"
        raise RuntimeError(
            "init_distributed(backend=None) picks NCCL only when every process on a machine has a GPU of its "
            "own, which needs LOCAL_WORLD_SIZE (the processes per machine; torchrun sets it) and this launcher "
            "did not set it: set LOCAL_WORLD_SIZE, or pass backend='nccl' or backend='gloo'")
    try:
        local_world = int(value)
    except ValueError:
        raise ValueError(
            f"LOCAL_WORLD_SIZE must be a positive integer (processes per machine), got {value!r}") from None
    return default_backend(local_world)


def init_distributed(backend: str | None = None, *, timeout: float = 300.0) -> tuple[int, int]:
    """Initialise the default process group from the ``torchrun`` environment.

    Args:
        backend: ``"nccl"``, ``"gloo"`` or ``None``: NCCL if CUDA and NCCL are available and the
            machine has a GPU for each of its local ranks (``LOCAL_WORLD_SIZE``; NCCL cannot put
            two ranks of one group on the same GPU), else gloo. The choice is the same on every
            rank: without ``LOCAL_WORLD_SIZE`` it is gloo where CUDA or NCCL is missing, else a
            RuntimeError that asks for the variable or an explicit ``backend``.
        timeout: seconds before a stuck collective raises instead of hanging.

    Returns:
        ``(rank, world_size)``. With NCCL the current CUDA device is set to ``LOCAL_RANK``.

    Raises:
        RuntimeError: not started by ``torchrun`` (the environment variables are missing),
            ``backend="nccl"`` without a GPU for this process's ``LOCAL_RANK``, or ``backend=None``
            on a machine with CUDA and NCCL without ``LOCAL_WORLD_SIZE``.
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if not under_torchrun():
        raise RuntimeError(
            "init_distributed() reads RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the environment: start the "
            "script with torchrun --nproc_per_node=N script.py (or use run_workers for local gloo workers)"
        )
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if backend is None:
        backend = _backend_from_environment()
    if backend == "nccl":
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if local_rank >= gpus:
            raise RuntimeError(f"backend='nccl' needs a GPU per process: LOCAL_RANK={local_rank} but this machine "
                               f"has {gpus} CUDA device(s); start at most {gpus} processes per machine, or use gloo")
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout))
    return dist.get_rank(), dist.get_world_size()


def _child(fn: Callable[..., Any], rank: int, world: int, port: int, timeout: float, threads: int,
           results: Any, args: tuple, backend: str = "gloo") -> None:
    try:
        torch.set_num_threads(threads)
        if backend == "nccl":  # one GPU per rank (run_workers checked there are enough)
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout))
        try:
            out = fn(rank, world, *args)
        except BaseException:  # noqa: BLE001 - reported to the parent
            # Before the group is torn down: a peer waiting in a collective then fails with a lost
            # connection, and the parent lists the errors as they arrive, the cause first.
            results.put((rank, False, traceback.format_exc()))
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
            return
        dist.destroy_process_group()
        # Plain pickle (by value): torch's shared-memory reductions would need this process alive.
        results.put((rank, True, pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((rank, False, traceback.format_exc()))


def run_workers(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 60.0, threads: int = 1,
                start_method: str | None = None, backend: str = "gloo") -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local ranks; return the results by rank.

    Args:
        fn: a module-level function (picklable for ``start_method != "fork"``, i.e. always with
            NCCL); its return value must be picklable (return CPU tensors: a CUDA tensor would
            need the GPU in the parent).
        world_size: number of processes.
        *args: passed to ``fn`` after ``rank, world_size`` (picklable unless forked).
        timeout: seconds: the collectives' timeout and the deadline for the whole run
            (spawned children also spend it importing torch).
        threads: ``torch.set_num_threads`` in every child.
        start_method: ``"fork"``, ``"forkserver"`` or ``"spawn"``; ``None``: ``"fork"`` for gloo
            on a machine without a GPU (fast), ``"spawn"`` for NCCL and wherever CUDA is available.
        backend: ``"gloo"`` (CPU) or ``"nccl"`` (CUDA; rank ``r`` uses GPU ``r``: NCCL refuses
            two ranks of one communicator on one device, so ``world_size`` GPUs are needed).

    Raises:
        ValueError: an unknown backend, NCCL without CUDA / NCCL support, or NCCL with fewer GPUs
            than ranks.
        RuntimeError: a rank raised (its traceback is in the message) or died.
        TimeoutError: not every rank finished within ``timeout`` seconds.
    """
    check_positive_int("world_size", world_size)
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl" and not (torch.cuda.is_available() and dist.is_nccl_available()):
        raise ValueError("backend='nccl' needs a CUDA device and a torch build with NCCL "
                         f"(torch.cuda.is_available()={torch.cuda.is_available()}, "
                         f"dist.is_nccl_available()={dist.is_nccl_available()})")
    if backend == "nccl" and world_size > torch.cuda.device_count():
        raise ValueError(f"backend='nccl' needs one GPU per rank (NCCL refuses two ranks of one communicator on "
                         f"one device): world_size={world_size}, but {torch.cuda.device_count()} GPU(s); use "
                         f"world_size <= {torch.cuda.device_count()}, or backend='gloo'")
    if start_method is None:
        # A forked child cannot use CUDA, nor autograd once the parent has run any backward on a
        # machine with a GPU: autograd then starts a thread per GPU, which does not survive fork
        # (seen on an H200 with a backward on CPU tensors alone). Spawn wherever there is a GPU.
        start_method = "spawn" if backend == "nccl" or torch.cuda.is_available() else "fork"
    ctx = mp.get_context(start_method)
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, world_size, port, timeout, threads, results, args, backend),
                         daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    out: dict[int, Any] = {}
    error: str | None = None
    try:
        while len(out) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(out))
                raise TimeoutError(f"ranks {missing} of {world_size} did not finish within {timeout:.0f} s")
            try:
                rank, ok, value = results.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in out and p.exitcode not in (None, 0)]
                if dead:
                    error = f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}"
                    break
                continue
            if not ok:
                errors = {rank: value}
                # The other ranks usually fail a moment later (their peer vanished): collect them
                # briefly and report every traceback, the first failure first.
                grace = time.monotonic() + 2.0
                while len(errors) + len(out) < world_size and time.monotonic() < grace:
                    try:
                        r2, ok2, v2 = results.get(timeout=0.2)
                    except queue.Empty:
                        continue
                    if not ok2:
                        errors[r2] = v2
                error = "\n".join(f"rank {r} of {world_size} failed:\n{tb}" for r, tb in errors.items())
                break
            out[rank] = pickle.loads(value)
    finally:
        for p in procs:  # only the processes started here
            if error is not None or len(out) < world_size:
                if p.is_alive():
                    p.terminate()
            p.join(timeout=5)
        results.close()
    if error is not None:
        raise RuntimeError(error)
    return [out[r] for r in range(world_size)]
