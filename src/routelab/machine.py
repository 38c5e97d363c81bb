"""Facts about the machine a number was measured on, for benchmark tables and reports."""

from __future__ import annotations

import os
import platform

__all__ = ["cpu_model", "load_average"]


def cpu_model() -> str:
    """The CPU's model name from ``/proc/cpuinfo``, else :func:`platform.processor`."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def load_average() -> str:
    """The 1-minute load average (other work on the machine skews timings), or ``"unavailable"``."""
    try:
        return f"{os.getloadavg()[0]:.2f}"
    except (AttributeError, OSError):
        return "unavailable"
