"""What a result was measured with: routelab's version and commit, the software, the machine's load.

Every report (and the benchmarks' tables) states these facts, read when the report is written,
through the functions here.
"""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path

import routelab
from routelab.machine import load_average  # re-exported: reports state it too

__all__ = ["git_commit", "load_average", "routelab_version", "software_line"]


def git_commit() -> str | None:
    """The short commit of the routelab checkout, with ``+dirty`` when ``src/`` has changes;
    ``None`` when routelab does not run from a git checkout (or git is missing)."""
    root = Path(routelab.__file__).resolve().parents[2]
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", "src"], capture_output=True,
                               text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (commit + ("+dirty" if dirty else "")) if commit else None


def routelab_version() -> str:
    """``"0.1.0 (commit abc1234)"``: the version, and the commit when there is one."""
    commit = git_commit()
    return f"{routelab.__version__} (commit {commit})" if commit else routelab.__version__


def software_line(threads: int | None = None) -> str:
    """``"routelab 0.1.0 (commit abc1234), torch 2.5.1, Python 3.11.9, x86_64"``, plus
    ``", N torch thread(s)"`` when ``threads`` is given."""
    import torch

    line = (f"routelab {routelab_version()}, torch {torch.__version__}, Python {platform.python_version()}, "
            f"{platform.machine()}")
    return line if threads is None else f"{line}, {threads} torch thread(s)"
