"""tools/gpu_trace_gaps.py: the GPU's idle gaps in a profiler trace and the host work they waited for,
against a hand-made trace whose answer is known, and on a real (CPU-only) torch.profiler trace."""

from __future__ import annotations

import gzip
import json

import pytest
import torch

from tool_modules import load_tool

gaps = load_tool("gpu_trace_gaps")


def _x(cat: str, name: str, ts: float, dur: float, tid: int = 1, corr: int | None = None) -> dict:
    event = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": tid}
    if corr is not None:
        event["args"] = {"correlation": corr}
    return event


def _trace() -> list[dict]:
    """Thread 1: aten::topk [0, 30] launching kernel 1 at 25; aten::mm [40, 60] launching kernel 2 at 55.
    Thread 2 runs an operator during the second gap, but launches nothing: it is not waited for.
    The GPU: kernel 1 [29, 35], kernel 2 [59, 100], a memset [70, 80] inside it on another stream."""
    return [
        _x("cpu_op", "aten::topk", 0, 30),
        _x("cuda_runtime", "cudaLaunchKernel", 25, 3, corr=1),
        _x("cpu_op", "aten::mm", 40, 20),
        _x("cuda_runtime", "cudaLaunchKernel", 55, 3, corr=2),
        _x("cpu_op", "aten::add", 36, 10, tid=2),
        _x("kernel", "topk_kernel", 29, 6, tid=7, corr=1),
        _x("kernel", "gemm", 59, 41, tid=7, corr=2),
        _x("gpu_memset", "Memset", 70, 10, tid=8),
        {"ph": "i", "cat": "cpu_instant_event", "name": "noise", "ts": 50, "pid": 0, "tid": 1},
    ]


def test_idle_time_and_its_attribution_match_the_hand_count() -> None:
    report = gaps.analyse(_trace())
    assert report.window_us == 100 and report.busy_us == 47 and report.idle_us == 53
    assert report.lead_us == 29
    assert report.gaps == [(0, 29), (35, 24)]
    by = {name: (t, n) for name, t, n in report.by_host_event}
    assert by["aten::topk"] == (26, 1)  # [0, 25) and [28, 29): the rest of the lead
    assert by["cudaLaunchKernel in aten::topk"] == (3, 1)
    assert by["aten::mm"] == (16, 1)  # [40, 55) and [58, 59)
    assert by["cudaLaunchKernel in aten::mm"] == (3, 1)
    assert by[gaps.NO_OPERATOR] == (5, 1)  # [35, 40): thread 1 between operators
    assert "aten::add" not in by  # thread 2 launched nothing the GPU waited for
    assert sum(t for _, t, _ in report.by_host_event) == pytest.approx(29 + 24)
    assert report.by_host_event[0][0] == "aten::topk"  # largest first
    text = "\n".join(report.lines(steps=1))
    assert "GPU idle 0.053 ms of 0.100 ms per step (53.0%)" in text and "aten::mm" in text


def test_a_threshold_leaves_short_gaps_unattributed_and_a_window_clips() -> None:
    report = gaps.analyse(_trace(), min_gap_us=25)
    assert report.gaps == [(0, 29)] and report.idle_us == 53  # idle still counts every gap
    clipped = gaps.analyse(_trace(), window=(30, 100))
    assert clipped.window_us == 70 and clipped.busy_us == 5 + 41 and clipped.lead_us == 0
    assert clipped.gaps == [(5, 24)]


def test_the_command_reads_a_gzipped_trace(tmp_path, capsys) -> None:
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": _trace()}, f)
    gaps.main([str(path), "--steps", "2"])
    out = capsys.readouterr().out
    assert "GPU idle 0.026 ms of 0.050 ms per step" in out and "cudaLaunchKernel in aten::mm" in out


def test_a_real_trace_without_a_gpu_reads_and_says_so(tmp_path) -> None:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.randn(8, 8).mm(torch.randn(8, 8)).sum()
    path = tmp_path / "cpu.json"
    prof.export_chrome_trace(str(path))
    report = gaps.analyse(gaps.load_events(path))
    assert report.window_us == 0 and report.lines() == ["no GPU activity in the trace"]


def test_the_layer_profile_reports_the_idle_time_of_a_trace_and_keeps_it(tmp_path, monkeypatch) -> None:
    """tools/gpu_layer_profile.py's idle report (run on CUDA there): through a real profiler object here,
    which holds no GPU activity, and --traces keeps the trace gzipped."""
    import sys

    monkeypatch.setattr(sys, "argv", ["gpu_layer_profile.py", str(tmp_path / "out.txt"), "--traces",
                                      str(tmp_path / "traces")])
    profile_tool = load_tool("gpu_layer_profile")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.randn(8, 8).mm(torch.randn(8, 8)).sum()
    profile_tool.idle_report(prof, "a variant, E=8")
    assert profile_tool.lines[-1] == "  [a variant, E=8] no GPU activity in the trace"
    kept = tmp_path / "traces" / "a-variant--E-8.json.gz"
    assert gaps.analyse(gaps.load_events(kept)).window_us == 0


def test_activities_of_no_duration_end_their_gaps_and_a_gap_without_a_launch_is_charged_to_nobody() -> None:
    """Found by a mutation review: a kernel of no duration that ends a gap charges it to its own launcher
    (not to the next activity's), and one at the window's end still ends its gap, so that with no
    threshold the listed gaps sum to the idle time; a gap ended by an activity whose launch is not in the
    trace is charged to no thread; a window without activity lists its whole length as the lead."""
    trace = [_x("cpu_op", "aten::a", 0, 10), _x("cuda_runtime", "cudaLaunchKernel", 5, 1, corr=1),
             _x("cpu_op", "aten::b", 0, 30, tid=2), _x("cuda_runtime", "cudaLaunchKernel", 25, 1, tid=2, corr=2),
             _x("kernel", "k1", 20, 0, tid=7, corr=1), _x("kernel", "k2", 30, 5, tid=7, corr=2),
             _x("gpu_memset", "Memset", 40, 0, tid=8)]  # no launch recorded, the window's last activity
    report = gaps.analyse(trace, min_gap_us=0)
    assert report.window_us == 40 and report.busy_us == 5
    assert report.gaps == [(0, 20), (20, 10), (35, 5)]
    assert sum(length for _, length in report.gaps) == report.idle_us
    by = {name: t for name, t, _ in report.by_host_event}
    # [0, 20) waits for thread 1 (k1's launcher): aten::a [0, 5) + [6, 10), its launch [5, 6), then Python
    # [20, 30) waits for thread 2 (k2's): aten::b around its launch [25, 26)
    assert by == {"aten::a": 9, "cudaLaunchKernel in aten::a": 1, gaps.NO_OPERATOR: 10, "aten::b": 9,
                  "cudaLaunchKernel in aten::b": 1, gaps.NO_LAUNCH: 5}
    empty = gaps.analyse([_x("cpu_op", "aten::a", 0, 10), _x("kernel", "k", 50, 5, corr=1)], window=(0, 40))
    assert empty.busy_us == 0 and empty.lead_us == 40 and empty.gaps == [(0, 40)] and empty.by_host_event == []
