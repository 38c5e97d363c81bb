"""Where a GPU waits for its host: the idle gaps of a torch.profiler trace and the host work during them.

usage: python tools/gpu_trace_gaps.py TRACE.json[.gz] [--min-gap-us 5] [--top 12] [--steps N]

A step bound by the host (docs/gpu-profile-h200.md: the MoE layer at d_model 1024 in bfloat16) leaves
the GPU idle between kernels while Python and the dispatcher prepare the next launch; a host sync
leaves it idle while the host catches up. Operator tables (self CPU time) say what the host spends
time on, not which of it the GPU waited for. This reads a Chrome trace written by
``torch.profiler.profile(...).export_chrome_trace`` with CPU and CUDA activities and reports:

* the window: from the first host operator to the end of the last GPU activity (kernels, memcpys,
  memsets on any stream), and the GPU's busy time in it (the union of its activities);
* every idle gap of at least ``--min-gap-us`` (the lead before the first activity included);
* the idle time attributed to host work: each gap belongs to the thread that launched the activity
  ending it (the GPU waited for that thread), and its time to that thread's innermost event at each
  instant (an operator such as ``aten::topk``, or a runtime call inside one, reported as
  ``cudaLaunchKernel in aten::topk``); time in no event is ``(no operator: Python)``, and a gap ended
  by an activity whose launch the trace does not hold is ``(launch not in the trace)``.

Used by ``tools/gpu_layer_profile.py`` (its per-variant "GPU idle" lines); runs anywhere on a saved
trace (the CPU included: it only reads JSON).
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["GapReport", "analyse", "load_events", "main"]

#: Trace categories of work on the GPU's timeline.
DEVICE_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})

#: Trace categories of host events that nest on a thread: operators and the CUDA API calls they make.
HOST_CATEGORIES = frozenset({"cpu_op", "cuda_runtime", "cuda_driver", "user_annotation"})

#: Categories whose events are calls into CUDA (named "... in <operator>" when innermost).
API_CATEGORIES = frozenset({"cuda_runtime", "cuda_driver"})

#: The name of idle time during which the issuing thread ran no recorded event.
NO_OPERATOR = "(no operator: Python)"

#: The name of a gap ended by an activity whose launch is not in the trace (no thread to charge).
NO_LAUNCH = "(launch not in the trace)"


@dataclass
class GapReport:
    """The idle time of a GPU in a trace window, in microseconds, and who it waited for.

    Attributes:
        window_us: from the first host operator to the end of the last GPU activity.
        busy_us: the union of the GPU's activities in the window.
        lead_us: idle time before the first GPU activity.
        gaps: idle gaps of at least the threshold (the lead included): ``(start offset in the
            window, length)``, in the order they occur.
        by_host_event: idle time (in gaps of at least the threshold) per innermost host event of the
            issuing thread, largest first: ``(name, microseconds, gaps it appears in)``.
    """

    window_us: float
    busy_us: float
    lead_us: float
    gaps: list[tuple[float, float]] = field(default_factory=list)
    by_host_event: list[tuple[str, float, int]] = field(default_factory=list)

    @property
    def idle_us(self) -> float:
        """The GPU's idle time in the window (every gap, however short)."""
        return self.window_us - self.busy_us

    def lines(self, *, steps: int = 1, top: int = 12) -> list[str]:
        """A readable summary, per step where the window holds ``steps`` steps."""
        per = max(steps, 1)
        if self.window_us <= 0:
            return ["no GPU activity in the trace"]
        counted = sum(length for _, length in self.gaps)
        out = [f"GPU idle {self.idle_us / 1e3 / per:.3f} ms of {self.window_us / 1e3 / per:.3f} ms per step "
               f"({self.idle_us / self.window_us:.1%}); before the first kernel {self.lead_us / 1e3:.3f} ms; "
               f"{len(self.gaps)} gaps of the threshold or more ({counted / 1e3 / per:.3f} ms per step)"]
        if self.by_host_event:
            out.append("  idle time by the issuing thread's innermost host event (ms per step, gaps):")
            out += [f"    {t / 1e3 / per:8.3f}  {n:4d}  {name}" for name, t, n in self.by_host_event[:top]]
        return out


def load_events(path: str | Path) -> list[dict[str, Any]]:
    """The ``traceEvents`` of a Chrome trace (``.json`` or ``.json.gz``)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def _complete(events: Iterable[dict[str, Any]], categories: frozenset[str]) -> list[dict[str, Any]]:
    return [e for e in events if e.get("ph") == "X" and e.get("cat") in categories and "ts" in e and "dur" in e]


def _merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of intervals as sorted, disjoint intervals."""
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _leaf_segments(host: list[dict[str, Any]]) -> dict[Any, list[tuple[float, float, str]]]:
    """Per thread, the time ranges where one event is the innermost running one, with its name.

    Events of a thread nest (an operator contains the operators and CUDA calls it makes); a call into
    CUDA is named after the operator around it."""
    by_thread: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for e in host:
        by_thread[(e.get("pid"), e.get("tid"))].append(e)
    out: dict[Any, list[tuple[float, float, str]]] = {}
    for thread, evs in by_thread.items():
        evs.sort(key=lambda e: (float(e["ts"]), -float(e["dur"])))
        segments: list[tuple[float, float, str]] = []
        stack: list[tuple[float, str]] = []  # (end, name) of the open events, innermost last
        cursor = None

        def close_until(t: float) -> None:
            nonlocal cursor
            while stack and stack[-1][0] <= t:
                end, name = stack.pop()
                if cursor is not None and end > cursor:
                    segments.append((cursor, end, name))
                cursor = end if cursor is None or end > cursor else cursor

        for e in evs:
            start, end = float(e["ts"]), float(e["ts"]) + float(e["dur"])
            close_until(start)
            if stack and cursor is not None and start > cursor:
                segments.append((cursor, start, stack[-1][1]))
            name = e["name"]
            if e.get("cat") in API_CATEGORIES and stack:
                name = f"{name} in {stack[-1][1].split(' in ')[-1]}"
            end = min(end, stack[-1][0]) if stack else end  # (a child never outlives its parent)
            stack.append((end, name))
            cursor = start
        close_until(float("inf"))
        out[thread] = segments
    return out


def analyse(events: list[dict[str, Any]], *, min_gap_us: float = 5.0,
            window: tuple[float, float] | None = None) -> GapReport:
    """The GPU's idle gaps in ``events`` and the host work the GPU waited for in them.

    Args:
        events: a trace's ``traceEvents`` (:func:`load_events`).
        min_gap_us: gaps shorter than this are idle time but are not attributed (a launch's own
            latency between back-to-back kernels).
        window: ``(start, end)`` in the trace's microseconds; default from the first host operator to
            the end of the last GPU activity.

    Returns:
        A :class:`GapReport`.
    """
    device = _complete(events, DEVICE_CATEGORIES)
    host = _complete(events, HOST_CATEGORIES)
    if not device:
        return GapReport(0.0, 0.0, 0.0)
    busy = _merged([(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in device])
    if window is None:
        starts = [float(e["ts"]) for e in host if e.get("cat") == "cpu_op"] or [busy[0][0]]
        window = (min(min(starts), busy[0][0]), busy[-1][1])
    w0, w1 = window
    # (an activity of no duration inside the window still ends a gap; one ending at the window's start is before it)
    busy = [(max(s, w0), min(e, w1)) for s, e in busy if (e > w0 and s < w1) or (s == e and w0 < s <= w1)]
    busy_us = sum(e - s for s, e in busy)
    # Which thread launched each device activity (by the correlation id of its CUDA call).
    launcher = {}
    for e in host:
        corr = (e.get("args") or {}).get("correlation")
        if e.get("cat") in API_CATEGORIES and corr is not None:
            launcher[corr] = (e.get("pid"), e.get("tid"))
    first_of_interval = []  # for each busy interval, the thread that launched its first activity
    device.sort(key=lambda e: float(e["ts"]))
    i = 0
    for start, _end in busy:
        # (the activities that start before this interval belong to earlier ones: merged intervals are disjoint)
        while i < len(device) and float(device[i]["ts"]) < start:
            i += 1
        corr = (device[i].get("args") or {}).get("correlation") if i < len(device) else None
        first_of_interval.append(launcher.get(corr))
    leaves = _leaf_segments(host)
    gaps: list[tuple[float, float]] = []
    attributed: dict[str, float] = defaultdict(float)
    appears: dict[str, int] = defaultdict(int)
    previous_end = w0
    for (start, end), thread in zip(busy, first_of_interval):
        gap = (previous_end, start)
        previous_end = end
        if gap[1] - gap[0] < min_gap_us:
            continue
        gaps.append((gap[0] - w0, gap[1] - gap[0]))
        covered = 0.0
        names = set()
        if thread is None:  # nobody to charge: the launch is not in the trace
            attributed[NO_LAUNCH] += gap[1] - gap[0]
            appears[NO_LAUNCH] += 1
            continue
        for s, e, name in leaves.get(thread, ()):
            overlap = min(e, gap[1]) - max(s, gap[0])
            if overlap > 0:
                attributed[name] += overlap
                covered += overlap
                names.add(name)
        if gap[1] - gap[0] - covered > 1e-9:
            attributed[NO_OPERATOR] += gap[1] - gap[0] - covered
            names.add(NO_OPERATOR)
        for name in names:
            appears[name] += 1
    lead = busy[0][0] - w0 if busy else w1 - w0
    if not busy and lead >= min_gap_us:
        gaps.append((0.0, lead))  # the whole window is the lead, ended by no activity: charged to nobody
    ranked = sorted(((name, t, appears[name]) for name, t in attributed.items()), key=lambda r: -r[1])
    return GapReport(window_us=w1 - w0, busy_us=busy_us, lead_us=lead, gaps=gaps, by_host_event=ranked)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace", help="a Chrome trace of torch.profiler (.json or .json.gz)")
    p.add_argument("--min-gap-us", type=float, default=5.0, help="shortest gap attributed (default 5 us)")
    p.add_argument("--top", type=int, default=12, help="host events listed (default 12)")
    p.add_argument("--steps", type=int, default=1, help="steps in the trace, for per-step figures (default 1)")
    a = p.parse_args(argv)
    report = analyse(load_events(a.trace), min_gap_us=a.min_gap_us)
    print("\n".join(report.lines(steps=a.steps, top=a.top)))


if __name__ == "__main__":
    main()
