"""Smoke tests of routelab.bench.assignment on tiny sizes (a few seconds in all), and the
argument checks both benchmarks share."""

from __future__ import annotations

import io

import pytest
import torch

from routelab.bench import assignment as bench
from routelab.bench import moe as moe_bench

TINY_GRID = [(16, 2), (16, 4), (32, 2), (32, 4)]


def table_rows(markdown: str) -> tuple[list[str], list[list[str]]]:
    """The header cells and body rows (as cells) of the first markdown table in ``markdown``."""
    lines = [line for line in markdown.splitlines() if line.startswith("|")]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    header, body = cells[0], cells[2:]  # cells[1] is the |---| separator
    return header, body


def test_benchmark_tiny_grid() -> None:
    out = io.StringIO()
    text = bench._benchmark(TINY_GRID, 1, budget_s=1.0, out=out)
    assert out.getvalue() == text  # the report is streamed as it is built

    header, body = table_rows(text)
    assert "same optimum" in header and "speed-up" in header
    col = {name: i for i, name in enumerate(header)}
    assert [(int(r[col["n"]]), int(r[col["k"]])) for r in body] == TINY_GRID
    for row in body:
        assert row[col["same optimum"]] == "yes"
        speedup = row[col["speed-up"]]
        assert speedup.endswith("x") and float(speedup[:-1]) > 0
        for name in ("routelab ms", "scipy ms", "gumbel_matching ms"):
            assert float(row[col[name]]) > 0
        assert float(row[col["sinkhorn ms"]].split()[0]) > 0
    assert "Growth of routelab's median time" in text
    assert "float64" in text  # scipy's problem is stated honestly


def test_scipy_is_skipped_with_an_estimate() -> None:
    text = bench._benchmark([(16, 4), (64, 4)], 1, budget_s=1.0, scipy_limit_s=0.0)
    _, body = table_rows(text)
    assert body[0][5] == "yes"
    assert body[1][3].startswith("skipped (est. ") and body[1][5] == "—"


def test_batched_timing_on_cpu() -> None:
    text = bench._batched_timing(3, 16, 4, repeats=1, budget_s=1.0, device="cpu")
    _, body = table_rows(text)
    assert [r[0] for r in body] == ["1", "3"]
    assert all(r[-1] == "yes" for r in body)


def test_run_benchmark_header_and_threads_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench, "QUICK_NS", (16,))
    monkeypatch.setattr(bench, "KS", (2, 4))
    monkeypatch.setattr(bench, "QUICK_REPEATS", {16: 1})
    before = torch.get_num_threads()
    out = io.StringIO()
    text = bench.run_benchmark(quick=True, threads=1, out=out)
    assert torch.get_num_threads() == before
    assert out.getvalue() == text
    for fact in ("CPU:", f"torch {torch.__version__}", "torch threads: 1", "device: cpu",
                 "dtype: float32", "date:"):
        assert fact in text
    _, body = table_rows(text)
    assert len(body) == 2


@pytest.mark.parametrize("module", [bench, moe_bench], ids=["assignment", "moe"])
def test_run_benchmark_rejects_bad_arguments(module) -> None:
    with pytest.raises(ValueError, match="device"):
        module.run_benchmark(device="tpu")
    with pytest.raises(ValueError, match="threads"):
        module.run_benchmark(threads=0)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="cuda"):
            module.run_benchmark(device="cuda")


def test_paired_timing_alternates_and_keeps_instance_order() -> None:
    """Every function solves every instance; the order rotates from instance to instance, so a
    drift in the machine's speed hits all functions alike."""
    calls: list[tuple[str, int]] = []

    def make(name: str):
        def fn(i: int) -> tuple[str, int]:
            calls.append((name, i))
            return name, i
        return fn

    timings, results = bench._time_paired({"a": make("a"), "b": make("b")}, repeats=4, budget_s=10.0, device="cpu")
    assert calls[:2] == [("a", 0), ("b", 0)]  # warm-ups
    timed = calls[2:]
    assert timed == [("a", 0), ("b", 0), ("b", 1), ("a", 1), ("a", 2), ("b", 2), ("b", 3), ("a", 3)]
    assert results == {"a": [("a", i) for i in range(4)], "b": [("b", i) for i in range(4)]}
    assert timings["a"].runs == timings["b"].runs == 4 and timings["a"].median_ms >= 0


def test_paired_timing_respects_the_budget() -> None:
    import time as _time

    timings, _ = bench._time_paired({"slow": lambda i: _time.sleep(0.02), "fast": lambda i: None},
                                    repeats=50, budget_s=0.1, device="cpu")
    assert 1 <= timings["slow"].runs <= 6
