"""Worker processes that die with the process that started them.

A worker process (a pool worker of the kool-toy sweep, an experiment run side by side by
``routelab reproduce --jobs``) holds no state worth saving, but it outlives a killed parent
unless told otherwise, and keeps a core busy for minutes. :func:`die_with_parent` arms the guard.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

__all__ = ["WATCH_INTERVAL_S", "die_with_parent"]

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
WATCH_INTERVAL_S = 0.25
"""How often a worker's watchdog checks that the process that started the work is alive."""


def die_with_parent(main_pid: int) -> None:
    """Make this worker process exit as soon as its parent or ``main_pid`` is gone.

    Pool workers otherwise outlive a killed sweep: a worker in the middle of a chunk keeps
    computing until the chunk ends (tens of seconds), since nothing tells it that nobody will
    read its result. Two mechanisms, both armed here (in the worker initializer):

    * everywhere: a daemon watchdog thread that calls ``os._exit`` within
      :data:`WATCH_INTERVAL_S` once ``main_pid`` (the process running the sweep) no longer
      exists or has become a zombie, or the worker's parent changed (it was re-parented). With
      ``forkserver`` the worker's parent is the fork server, which stays up as long as any
      worker does, so it is this check of ``main_pid`` that catches a killed sweep.
    * Linux: ``prctl(PR_SET_PDEATHSIG, SIGKILL)``, so the kernel kills the worker at once if
      its parent (the fork server) is killed.

    A worker holds no state worth saving: the main process alone writes ``runs.jsonl``.
    """
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):  # no libc / prctl: the watchdog alone
            pass
    if not (_alive(main_pid) and _alive(parent)):  # died before the guard was armed
        os._exit(1)

    def watch() -> None:
        while True:
            time.sleep(WATCH_INTERVAL_S)
            if os.getppid() != parent or not _alive(main_pid):
                os._exit(1)

    threading.Thread(target=watch, name="routelab-die-with-parent", daemon=True).start()


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists (a zombie counts as gone on Linux)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    if sys.platform.startswith("linux"):
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
        except (OSError, IndexError):
            return False
    return True
