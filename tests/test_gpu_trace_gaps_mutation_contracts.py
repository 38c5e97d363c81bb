"""Contracts of ``tools/gpu_trace_gaps.py`` that mutation testing of the tool found unguarded.

Each test builds a small hand-made trace whose answer is counted by hand in its docstring (the merging
of the GPU's activities, the window and the lead, the nesting of a thread's host events into innermost
segments, the thread a gap is charged to, the threshold, the per-step summary), so that a small change
to the tool that breaks one of them is caught.
"""

from __future__ import annotations

from test_gpu_trace_gaps import _x  # one trace event (tests/ is on sys.path)
from tool_modules import load_tool

gaps = load_tool("gpu_trace_gaps")


def _by(report) -> dict[str, tuple[float, int]]:
    return {name: (t, n) for name, t, n in report.by_host_event}


# ---------------------------------------------------------------- merging and the window


def test_back_to_back_activities_are_one_busy_interval_without_an_empty_gap() -> None:
    """Two kernels that touch ([10, 20] then [20, 30]) are one busy interval: even with no threshold the
    only gap is the lead, never a zero-length gap between them."""
    trace = [
        _x("cpu_op", "aten::mm", 0, 5),
        _x("cuda_runtime", "cudaLaunchKernel", 1, 1, corr=1),
        _x("cuda_runtime", "cudaLaunchKernel", 2, 1, corr=2),
        _x("kernel", "k1", 10, 10, tid=7, corr=1),
        _x("kernel", "k2", 20, 10, tid=7, corr=2),
    ]
    report = gaps.analyse(trace, min_gap_us=0)
    assert report.busy_us == 20 and report.window_us == 30
    assert report.gaps == [(0, 10)]


def test_device_activity_before_the_first_operator_opens_the_window() -> None:
    """The window starts at the earlier of the first host operator and the first GPU activity: a kernel
    at [0, 10] before the first operator (at 20) counts in full, and the lead is zero."""
    trace = [
        _x("kernel", "early", 0, 10, tid=7),
        _x("cpu_op", "aten::mm", 20, 10),
        _x("cuda_runtime", "cudaLaunchKernel", 22, 2, corr=1),
        _x("kernel", "gemm", 40, 10, tid=7, corr=1),
    ]
    report = gaps.analyse(trace)
    assert report.window_us == 50 and report.busy_us == 20 and report.lead_us == 0
    assert report.gaps == [(10, 30)]


def test_only_host_operators_open_the_window() -> None:
    """The window opens at the first host *operator* (``cpu_op``): a CUDA call made outside any operator
    earlier (a runtime call at 0) does not move it. Operator at 10, kernel [30, 40]: window 30, lead 20."""
    trace = [
        _x("cuda_runtime", "cudaGetDeviceCount", 0, 2),
        _x("cpu_op", "aten::mm", 10, 10),
        _x("cuda_runtime", "cudaLaunchKernel", 15, 2, corr=1),
        _x("kernel", "gemm", 30, 10, tid=7, corr=1),
    ]
    report = gaps.analyse(trace)
    assert report.window_us == 30 and report.lead_us == 20 and report.busy_us == 10
    assert report.gaps == [(0, 20)]


def test_an_activity_ending_at_the_window_start_is_outside_it() -> None:
    """Window (10, 50) after a kernel [0, 10]: that kernel is not in the window (not even as an empty
    interval), so the lead runs from 10 to the next kernel at 20."""
    trace = [
        _x("cpu_op", "aten::mm", 0, 30),
        _x("kernel", "before", 0, 10, tid=7),
        _x("kernel", "inside", 20, 10, tid=7),
    ]
    report = gaps.analyse(trace, window=(10, 50))
    assert report.window_us == 40 and report.busy_us == 10
    assert report.lead_us == 10 and report.gaps == [(0, 10)]


def test_a_window_without_activity_is_all_lead() -> None:
    """A window after every GPU activity holds no busy time: its whole length is the lead (and idle)."""
    trace = [_x("cpu_op", "aten::mm", 0, 10), _x("kernel", "k", 5, 10, tid=7)]
    report = gaps.analyse(trace, window=(100, 160))
    assert report.busy_us == 0 and report.lead_us == 60 and report.idle_us == 60


# ---------------------------------------------------------------- innermost host events


def test_an_operator_and_its_child_starting_together_nest_longest_outside() -> None:
    """``aten::linear`` [0, 30] and ``aten::mm`` [0, 20] start together: the longer one is the parent.
    The launch [15, 18] inside ``aten::mm`` starts kernel [30, 40], so the lead [0, 30] splits into
    aten::mm 15 + 2, its launch 3, and aten::linear 10 ([20, 30))."""
    trace = [
        _x("cpu_op", "aten::linear", 0, 30),
        _x("cpu_op", "aten::mm", 0, 20),
        _x("cuda_runtime", "cudaLaunchKernel", 15, 3, corr=1),
        _x("kernel", "gemm", 30, 10, tid=7, corr=1),
    ]
    by = _by(gaps.analyse(trace))
    assert by == {"aten::mm": (17, 1), "cudaLaunchKernel in aten::mm": (3, 1), "aten::linear": (10, 1)}


def test_a_cuda_call_is_named_after_the_innermost_operator() -> None:
    """``aten::linear`` [0, 30] holds ``aten::mm`` [5, 20], which makes the launch [10, 12]: the launch is
    ``cudaLaunchKernel in aten::mm`` (the innermost operator, not the outermost)."""
    trace = [
        _x("cpu_op", "aten::linear", 0, 30),
        _x("cpu_op", "aten::mm", 5, 15),
        _x("cuda_runtime", "cudaLaunchKernel", 10, 2, corr=1),
        _x("kernel", "gemm", 30, 10, tid=7, corr=1),
    ]
    by = _by(gaps.analyse(trace))
    assert by == {"aten::linear": (5 + 10, 1), "aten::mm": (5 + 8, 1), "cudaLaunchKernel in aten::mm": (2, 1)}


def test_an_event_ending_where_the_next_starts_is_closed_before_it() -> None:
    """``aten::a`` [0, 10] then ``aten::b`` [10, 20] (back to back, siblings) with a launch [15, 18] in
    ``aten::b`` for kernel [25, 35]: a 10, b 5 + 2, the launch 3 (in aten::b), Python 5 ([20, 25))."""
    trace = [
        _x("cpu_op", "aten::a", 0, 10),
        _x("cpu_op", "aten::b", 10, 10),
        _x("cuda_runtime", "cudaLaunchKernel", 15, 3, corr=1),
        _x("kernel", "k", 25, 10, tid=7, corr=1),
    ]
    by = _by(gaps.analyse(trace))
    assert by == {"aten::a": (10, 1), "aten::b": (7, 1), "cudaLaunchKernel in aten::b": (3, 1),
                  gaps.NO_OPERATOR: (5, 1)}


def test_a_cuda_call_inside_a_cuda_call_is_named_after_the_operator() -> None:
    """A driver call [16, 17] inside the runtime's launch [15, 18] inside ``aten::mm`` [0, 20] is
    ``cuLaunchKernel in aten::mm`` (the operator, not ``... in cudaLaunchKernel in aten::mm``)."""
    trace = [
        _x("cpu_op", "aten::mm", 0, 20),
        _x("cuda_runtime", "cudaLaunchKernel", 15, 3, corr=1),
        _x("cuda_driver", "cuLaunchKernel", 16, 1),
        _x("kernel", "gemm", 20, 10, tid=7, corr=1),
    ]
    by = _by(gaps.analyse(trace))
    assert by == {"aten::mm": (15 + 2, 1), "cudaLaunchKernel in aten::mm": (2, 1),
                  "cuLaunchKernel in aten::mm": (1, 1)}


def test_a_child_is_clipped_to_its_parent() -> None:
    """``aten::b`` starts at 5 inside ``aten::a`` [0, 10] but is recorded to end at 15: it is clipped at
    10, after which the thread ran no event. Launch [1, 2] in aten::a for kernel [20, 30]: aten::a 1 + 3,
    its launch 1, aten::b 5 ([5, 10)), Python 10 ([10, 20))."""
    trace = [
        _x("cpu_op", "aten::a", 0, 10),
        _x("cuda_runtime", "cudaLaunchKernel", 1, 1, corr=1),
        _x("cpu_op", "aten::b", 5, 10),
        _x("kernel", "k", 20, 10, tid=7, corr=1),
    ]
    by = _by(gaps.analyse(trace))
    assert by == {"aten::a": (4, 1), "cudaLaunchKernel in aten::a": (1, 1), "aten::b": (5, 1),
                  gaps.NO_OPERATOR: (10, 1)}


# ---------------------------------------------------------------- the thread charged, the threshold


def test_a_gap_is_charged_to_the_launcher_whatever_the_order_of_the_trace() -> None:
    """Thread 1 (``aten::one`` [0, 20]) launches kernel [20, 30]; thread 2 (``aten::two`` [0, 50]) launches
    kernel [50, 60]. The trace lists the later kernel first: the lead [0, 20] is still thread 1's and the
    gap [30, 50] thread 2's."""
    trace = [
        _x("cpu_op", "aten::one", 0, 20, tid=1),
        _x("cuda_runtime", "cudaLaunchKernel", 10, 2, tid=1, corr=1),
        _x("cpu_op", "aten::two", 0, 50, tid=2),
        _x("cuda_runtime", "cudaLaunchKernel", 40, 2, tid=2, corr=2),
        _x("kernel", "second", 50, 10, tid=7, corr=2),
        _x("kernel", "first", 20, 10, tid=7, corr=1),
    ]
    report = gaps.analyse(trace)
    assert report.gaps == [(0, 20), (30, 20)]
    by = _by(report)
    assert by == {"aten::one": (18, 1), "cudaLaunchKernel in aten::one": (2, 1),
                  "aten::two": (18, 1), "cudaLaunchKernel in aten::two": (2, 1)}


def test_a_gap_of_exactly_the_threshold_is_attributed() -> None:
    """Gaps of *at least* ``min_gap_us`` count: with threshold 5, the lead of 5 and the gap of 5 are both
    listed; with threshold 6, neither."""
    trace = [
        _x("cpu_op", "aten::mm", 0, 30),
        _x("cuda_runtime", "cudaLaunchKernel", 1, 1, corr=1),
        _x("cuda_runtime", "cudaLaunchKernel", 2, 1, corr=2),
        _x("kernel", "k1", 5, 10, tid=7, corr=1),
        _x("kernel", "k2", 20, 10, tid=7, corr=2),
    ]
    assert gaps.analyse(trace, min_gap_us=5).gaps == [(0, 5), (15, 5)]
    assert sum(t for _, t, _ in gaps.analyse(trace, min_gap_us=5).by_host_event) == 10
    assert gaps.analyse(trace, min_gap_us=6).gaps == []


# ---------------------------------------------------------------- the per-step summary


def _report() -> object:
    return gaps.GapReport(window_us=4000.0, busy_us=1000.0, lead_us=500.0, gaps=[(0.0, 500.0), (1000.0, 1500.0)],
                          by_host_event=[("aten::mm", 1200.0, 2), ("aten::topk", 800.0, 1)])


def test_the_summary_divides_times_per_step_but_not_the_lead() -> None:
    """Over 2 steps: idle 3 ms of 4 ms is 1.5 of 2 ms per step; the lead (once, before the first kernel)
    is not divided; the 2 ms in listed gaps is 1 ms per step; each host event's time is per step."""
    lines = _report().lines(steps=2)
    assert lines[0] == ("GPU idle 1.500 ms of 2.000 ms per step (75.0%); before the first kernel 0.500 ms; "
                        "2 gaps of the threshold or more (1.000 ms per step)")
    assert lines[2:] == ["       0.600     2  aten::mm", "       0.400     1  aten::topk"]


def test_the_summary_lists_top_events_and_treats_zero_steps_as_one() -> None:
    """``top`` bounds the host events listed; ``steps=0`` (or less) reads as one step."""
    report = _report()
    assert report.lines(steps=1, top=1)[2:] == ["       1.200     2  aten::mm"]
    assert report.lines(steps=0) == report.lines(steps=1) == report.lines(steps=-3)
