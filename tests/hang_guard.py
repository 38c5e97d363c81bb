"""Fail a test, instead of hanging it, when a library call runs too long; JIT compilation excepted.

The guard is a ``SIGALRM`` timer. When it fires inside numba's compiler (the first call of a
compiled assignment kernel for a dtype, on a fresh on-disk cache: 10-60 s on a loaded 2-core
machine), it is re-armed instead of raising: an exception thrown into numba mid-compilation leaves
the kernel's library half built, and every later call in the process then fails with numba's
"no compiled object yet" (seen once in ``make fuzz`` on a fresh clone, and once in a CI-like run
beside three other jobs). Compilation time is bounded separately, by ``compile_limit`` seconds in
all, so a compiler that never returns still fails the test.

Importable from every test directory (pytest puts ``tests/`` on ``sys.path``). Without ``SIGALRM``
(Windows) the guard does nothing.
"""

from __future__ import annotations

import contextlib
import signal
import traceback
from collections.abc import Iterator
from types import FrameType

__all__ = ["Hang", "returns_within"]


class Hang(AssertionError):
    """A library call ran longer than its time limit (a hang, or a missing loop bound)."""


def _compiling(frame: FrameType | None) -> bool:
    """Whether ``frame`` or one of its callers is numba's compiler at work."""
    while frame is not None:
        name = frame.f_code.co_filename.replace("\\", "/")
        if "/numba/core/" in name or "/llvmlite/" in name:
            return True
        frame = frame.f_back
    return False


@contextlib.contextmanager
def returns_within(seconds: float, what: str = "call", compile_limit: float = 600.0) -> Iterator[None]:
    """Raise :class:`Hang` in the block when it runs longer than ``seconds`` outside JIT compilation.

    Args:
        seconds: the block's limit, not counting the ticks that found numba compiling (``<= 0``: no limit).
        what: the call's name, for the message.
        compile_limit: the most seconds of compilation tolerated on top of ``seconds``.
    """
    if seconds <= 0 or not hasattr(signal, "SIGALRM"):
        yield
        return
    granted = 0.0

    def on_alarm(signum: int, frame: FrameType | None) -> None:  # noqa: ARG001
        nonlocal granted
        if _compiling(frame) and granted < compile_limit:
            granted += seconds
            signal.setitimer(signal.ITIMER_REAL, seconds)
            return
        where = "".join(traceback.format_stack(frame, limit=4))
        extra = f" (and {granted:g} s more while numba compiled)" if granted else ""
        raise Hang(f"{what} did not return within {seconds:g} s{extra} (hang?); interrupted at:\n{where}")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
