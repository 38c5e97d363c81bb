"""One writer per results directory: an advisory lock beside it.

Two invocations writing one experiment's directory would train the same runs twice and count both
in the report. :func:`lock_results` holds ``DIR/../.NAME.lock`` (next to the directory, so that
``--fresh`` can move the directory itself aside) for as long as the returned handle is open; the
operating system releases it however the process ends. ``routelab reproduce`` and the
experiments' own commands (``python -m routelab.experiments.lm_routers``, ...) take the same lock
for the same directory.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import IO

try:
    import fcntl
except ImportError:  # not on POSIX: results directories are not locked (a warning says so)
    fcntl = None  # type: ignore[assignment]

__all__ = ["ResultsBusy", "lock_results", "run_locked"]


class ResultsBusy(Exception):
    """Another process holds a results directory's lock (its pid and start time in the message)."""


def _unguarded(exp_dir: Path, why: str) -> None:
    print(f"routelab: warning: {exp_dir} is not locked ({why}): do not run two invocations into it at once",
          file=sys.stderr, flush=True)


def lock_results(exp_dir: str | os.PathLike[str], holder: str = "routelab") -> IO[str]:
    """Lock the results directory ``exp_dir`` for this process; close the returned file to release it.

    Args:
        exp_dir: the directory (its parent is created if needed; the directory itself need not exist).
        holder: what the lock file names as the holder (with this process's pid and the time).

    Raises:
        ResultsBusy: another process holds it.
        OSError: the lock file cannot be created (an unwritable parent, a file in the way).

    Where the platform or the file system has no locks, a warning says so and nothing is locked.
    """
    exp_dir = Path(exp_dir)
    exp_dir.parent.mkdir(parents=True, exist_ok=True)
    handle = open(exp_dir.parent / f".{exp_dir.name}.lock", "a+", encoding="utf-8")  # noqa: SIM115
    if fcntl is None:
        _unguarded(exp_dir, "this platform has no fcntl.flock")
        return handle
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        other = handle.read().strip() or "another process"
        handle.close()
        raise ResultsBusy(f"{exp_dir} is being written by {other}; wait for it to finish, or use another "
                          "output directory") from None
    except OSError as err:  # a file system without locks (some network or FUSE mounts)
        _unguarded(exp_dir, f"its file system refuses locks ({err.strerror or err})")
        return handle
    handle.seek(0)
    handle.truncate()
    handle.write(f"{holder} (pid {os.getpid()}, started {datetime.now(UTC):%Y-%m-%d %H:%M:%S} UTC)")
    handle.flush()
    return handle


def run_locked(exp_dir: str | os.PathLike[str], holder: str, run: Callable[[], Path]) -> int:
    """An experiment's own command: ``run()`` (which writes ``exp_dir`` and returns its report)
    under the directory's lock; prints ``report: PATH`` and returns 0, or prints the holder and
    returns 2 when another process writes the directory."""
    try:
        lock = lock_results(exp_dir, holder)
    except ResultsBusy as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:
        print(f"report: {run()}")
    finally:
        lock.close()
    return 0
