"""The test suite's hang guard (tests/hang_guard.py): it fails a call that runs too long, but not
while numba compiles (an exception thrown into numba's compiler corrupts the kernel for the rest of
the process), and compilation itself stays bounded."""

from __future__ import annotations

import signal
import time

import pytest

from hang_guard import Hang, returns_within

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGALRM"), reason="the guard needs SIGALRM")


def _busy(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


# The same loop, as if it were numba's compiler: the guard looks at the frames' file names.
_fake: dict = {}
_source = "def busy_compiling(busy, seconds):\n    busy(seconds)\n"
exec(compile(_source, "/site-packages/numba/core/compiler.py", "exec"), _fake)


def test_a_call_past_its_limit_raises_hang_naming_it():
    with pytest.raises(Hang, match=r"solve did not return within 0.1 s \(hang\?\)"), returns_within(0.1, "solve"):
        _busy(2.0)


def test_a_call_within_its_limit_returns_and_the_timer_is_cleared():
    old = signal.getsignal(signal.SIGALRM)
    with returns_within(1.0):
        _busy(0.05)
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert signal.getsignal(signal.SIGALRM) is old


def test_compilation_is_not_counted_but_is_bounded():
    with returns_within(0.1, compile_limit=5.0):
        _fake["busy_compiling"](_busy, 0.5)  # five ticks inside "numba": no Hang
    with pytest.raises(Hang, match=r"and 0.3 s more while numba compiled"), returns_within(0.1, compile_limit=0.25):
        _fake["busy_compiling"](_busy, 3.0)
