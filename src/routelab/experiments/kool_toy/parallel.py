"""Training the chunks of a sweep on several CPU cores, one worker process per core.

Each chunk is one batched model whose tensors are small, so a chunk uses one intra-op thread
well and a second thread hardly helps; two chunks on two cores finish in about half the time.
Workers are started with ``forkserver`` (``torch`` preloaded once), never by forking a parent
whose OpenMP pool may already be running. Results come back to the parent, which alone writes
``runs.jsonl``, so an interrupted sweep keeps every chunk that finished, and workers die with the
parent even when it is killed with SIGKILL (:func:`die_with_parent`).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..kit.workers import die_with_parent
from .model import RunSpec, train_chunk
from .sweep import Chunk

__all__ = ["ChunkResult", "die_with_parent", "train_chunks"]

_progress_queue = None  # set in each worker by _init_worker


@dataclass
class ChunkResult:
    """What training one chunk produced."""

    chunk: Chunk
    results: list[dict] | None
    timings: dict[str, float]
    wall_s: float
    error: str | None = None


def _init_worker(progress_queue, threads: int | None, main_pid: int | None = None) -> None:
    global _progress_queue
    _progress_queue = progress_queue
    if threads is not None:
        torch.set_num_threads(threads)
    if main_pid is not None:
        die_with_parent(main_pid)


def _report(k: int) -> None:
    if _progress_queue is not None:
        _progress_queue.put(k)


def _train(runs: tuple[RunSpec, ...], steps: int, seed: int) -> tuple[list[dict] | None, dict, float, str | None]:
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    try:
        results = train_chunk(runs, steps, chunk_seed=seed, progress=_report, timings=timings)
    except ValueError as err:  # a library error in one chunk is recorded; the others go on
        return None, timings, time.perf_counter() - t0, f"{type(err).__name__}: {err}"
    return results, timings, time.perf_counter() - t0, None


def train_chunks(
    chunks: Sequence[Chunk],
    steps: int,
    *,
    workers: int,
    threads: int | None,
    on_progress: Callable[[int], None],
    on_done: Callable[[ChunkResult], None],
    train: Callable[..., list[dict]] = train_chunk,
) -> None:
    """Train ``chunks`` with ``workers`` processes (in this process when ``workers == 1``).

    Args:
        chunks: the chunks to train.
        steps: Adam steps per run.
        workers: processes to use (at most ``len(chunks)`` are started).
        threads: intra-op threads per worker (``None``: torch's default).
        on_progress: called in this process with the number of steps done since the last call.
        on_done: called in this process as soon as a chunk finishes (in completion order).
        train: the training function of the in-process path (``workers == 1``); worker
            processes always use :func:`~.model.train_chunk`.
    """
    workers = max(1, min(workers, len(chunks)))
    if workers == 1:
        _init_worker(None, None)
        for chunk in chunks:
            timings: dict[str, float] = {}
            t0 = time.perf_counter()
            try:  # a library error in training is the chunk's record; one in on_done is the caller's
                results = train(chunk.runs, steps, chunk_seed=chunk.seed, progress=on_progress, timings=timings)
            except ValueError as err:
                on_done(ChunkResult(chunk, None, timings, time.perf_counter() - t0, f"{type(err).__name__}: {err}"))
                continue
            on_done(ChunkResult(chunk, results, timings, time.perf_counter() - t0))
        return
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "routelab.experiments.kool_toy.model"])
    progress_queue = ctx.Queue()
    # Largest chunks first, so the last one to start is a small one.
    ordered = sorted(chunks, key=lambda c: -len(c.runs))
    with ctx.Pool(workers, initializer=_init_worker, initargs=(progress_queue, threads, os.getpid())) as pool:
        pending = {c.name: (c, pool.apply_async(_train, (c.runs, steps, c.seed))) for c in ordered}
        while pending:
            try:
                while True:
                    on_progress(progress_queue.get(timeout=0.2))
            except queue_mod.Empty:
                pass
            for name, (chunk, handle) in list(pending.items()):
                if handle.ready():
                    results, timings, wall, error = handle.get()  # re-raises anything but ValueError
                    on_done(ChunkResult(chunk, results, timings, wall, error))
                    del pending[name]
        try:
            while True:
                on_progress(progress_queue.get_nowait())
        except queue_mod.Empty:
            pass
