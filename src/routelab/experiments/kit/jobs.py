"""Calls run side by side in worker processes, each one's output lines prefixed with its name.

``routelab reproduce --jobs N`` uses this to run N experiments at once: most experiments train
small models on one intra-op thread, so on a machine with N cores N of them finish in about the
time of the longest rather than of their sum. Each call runs in a fresh ``spawn`` process (no
fork of a parent whose OpenMP pool may be running), dies with the process that started it
(:func:`~routelab.experiments.kit.workers.die_with_parent`), and sends back its return value or
its exception as text. A call that does not come back (its process was killed, or crashed)
is reported as such; the others go on. Ctrl-C stops every worker, letting its ``finally`` blocks
run (an experiment records there the invocation it interrupted): a worker the terminal's Ctrl-C
reached too stops on its own; one still running after :data:`STOP_GRACE_S` gets ``SIGTERM``, which
a worker turns into the ``KeyboardInterrupt`` that Ctrl-C raises; one still running after
:data:`TERM_GRACE_S` more is killed.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue as queue_mod
import signal
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from .workers import die_with_parent

__all__ = ["JobFailed", "PrefixedLines", "run_side_by_side"]

BAR_EVERY_S = 15.0
"""How often a redrawn progress bar (a tqdm bar, which redraws its line with ``\\r``) is passed on as a line."""

POLL_S = 0.5
"""How often the parent checks that its workers are still alive while it waits for a result."""

STOP_GRACE_S = 3.0
"""After Ctrl-C, how long the parent waits for its workers to stop on their own (the terminal's Ctrl-C reaches
them too) before it sends them ``SIGTERM``."""

TERM_GRACE_S = 30.0
"""How long a worker has, after ``SIGTERM``, to run its ``finally`` blocks before it is killed."""


def _interrupt(signum: int, frame: Any) -> None:
    """A worker's ``SIGTERM`` handler: stop as Ctrl-C stops, so that ``finally`` blocks run."""
    raise KeyboardInterrupt(f"signal {signum}")


class PrefixedLines(io.TextIOBase):
    """A text stream writing each finished line to ``target`` as ``prefix + line``.

    Text that redraws a line with ``\\r`` (a progress bar) is thinned: what the line shows last
    is passed on at most every ``bar_every`` seconds, and when the line ends.
    """

    def __init__(self, target: TextIO, prefix: str, *, bar_every: float = BAR_EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self._target, self._prefix, self._bar_every, self._clock = target, prefix, bar_every, clock
        self._pending = ""
        self._last_bar = -float("inf")

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        """Buffer ``text``; write out every line it finishes."""
        self._pending += text
        *lines, self._pending = self._pending.split("\n")
        for line in lines:
            shown = _shown(line)
            if shown.strip():
                self._emit(shown)
        if "\r" in self._pending:
            shown = _shown(self._pending)
            self._pending = "\r" + shown  # earlier redraws of this line are never shown
            now = self._clock()
            if shown.strip() and now - self._last_bar >= self._bar_every:
                self._last_bar = now
                self._emit(shown)
        return len(text)

    def flush(self) -> None:
        self._target.flush()

    def close(self) -> None:
        """Write out an unfinished last line, then flush."""
        if self._pending.strip("\r").strip():
            self._emit(_shown(self._pending))
        self._pending = ""
        self.flush()
        super().close()

    def _emit(self, line: str) -> None:
        self._target.write(f"{self._prefix}{line.rstrip()}\n")
        self._target.flush()


def _shown(line: str) -> str:
    """What a terminal shows of ``line`` after its ``\\r`` redraws: the text after the last non-final ``\\r``."""
    parts = [p for p in line.split("\r") if p]
    return parts[-1] if parts else ""


@dataclass(frozen=True)
class JobFailed:
    """A call that raised (``error``: its traceback) or whose process ended without an answer."""

    name: str
    error: str


def _worker(index: int, name: str, fn: Callable[..., Any], args: tuple, results: Any, main_pid: int) -> None:
    die_with_parent(main_pid)
    signal.signal(signal.SIGTERM, _interrupt)
    prefix = f"[{name}] "
    out, err = PrefixedLines(sys.__stdout__, prefix), PrefixedLines(sys.__stderr__, prefix)
    sys.stdout, sys.stderr = out, err
    try:
        value: Any = fn(*args)
    except BaseException:  # noqa: BLE001 - sent to the parent, which decides
        value = JobFailed(name, traceback.format_exc())
    finally:
        out.close()
        err.close()
    results.put((index, value))


def run_side_by_side(calls: Sequence[tuple[str, Callable[..., Any], tuple]], jobs: int,
                     on_start: Callable[[int], None] | None = None) -> list[Any]:
    """Run ``fn(*args)`` for every ``(name, fn, args)`` of ``calls``, at most ``jobs`` at a time.

    ``fn`` and ``args`` must be picklable (``fn`` a module-level function); each call's printed
    lines appear with the prefix ``[name] ``. Calls start in the order given.

    Args:
        calls: ``(name, fn, args)`` per call.
        jobs: worker processes at once (>= 1).
        on_start: called in this process with a call's index as it starts.

    Returns:
        Per call, in the order of ``calls``: its return value, or a :class:`JobFailed`.

    Raises:
        KeyboardInterrupt: after terminating every worker.
    """
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs must be an integer >= 1, got {jobs!r}.")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    answers: dict[int, Any] = {}
    running: dict[int, Any] = {}
    waiting = list(range(len(calls)))
    try:
        while waiting or running:
            while waiting and len(running) < jobs:
                i = waiting.pop(0)
                name, fn, args = calls[i]
                if on_start is not None:
                    on_start(i)
                proc = ctx.Process(target=_worker, args=(i, name, fn, args, results, os.getpid()),
                                   name=f"routelab-{name}")
                proc.start()
                running[i] = proc
            try:
                i, value = results.get(timeout=POLL_S)
                answers[i] = value
            except queue_mod.Empty:
                for i, proc in running.items():
                    if not proc.is_alive() and i not in answers:
                        _drain(results, answers)  # it may have answered just before it exited
                        if i not in answers:
                            answers[i] = JobFailed(calls[i][0], "its worker process ended with exit code "
                                                                f"{proc.exitcode} without an answer")
            for i in [i for i in running if i in answers]:
                running.pop(i).join()
    except BaseException:
        _stop(list(running.values()))
        raise
    finally:
        results.close()
    return [answers[i] for i in range(len(calls))]


def _stop(procs: list[Any]) -> None:
    """Stop the worker processes ``procs`` so that their ``finally`` blocks run (module docstring)."""
    for grace, send in ((STOP_GRACE_S, "terminate"), (TERM_GRACE_S, "kill")):
        deadline = time.monotonic() + grace
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in procs:
            if proc.is_alive():
                getattr(proc, send)()
    for proc in procs:
        proc.join()


def _drain(results: Any, answers: dict[int, Any]) -> None:
    """Move every answer already in ``results`` into ``answers``."""
    while True:
        try:
            i, value = results.get(timeout=0.1)
        except queue_mod.Empty:
            return
        answers[i] = value
