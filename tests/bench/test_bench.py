"""Smoke tests of routelab.bench.assignment on tiny sizes (a few seconds in all), and the
argument checks both benchmarks share."""

from __future__ import annotations

import io
import re

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


def _tables(markdown: str) -> list[tuple[list[str], list[list[str]]]]:
    """Every markdown table in ``markdown``: (header cells, body rows as cells)."""
    tables: list[list[str]] = []
    previous_was_table = False
    for line in markdown.splitlines():
        is_table = line.startswith("|")
        if is_table and not previous_was_table:
            tables.append([])
        if is_table:
            tables[-1].append(line)
        previous_was_table = is_table
    return [table_rows("\n".join(t)) for t in tables]


BATCHED_COLUMNS = ["method", "ms per call", "ms per instance", "ratio to batched", "host syncs per call", "feasible",
                   "objective"]


def test_batched_section_on_cpu() -> None:
    """The section the GPU run prints, on CPU with tiny sizes: one table per size, five rows, every
    solver's result feasible, the exact rows equal in objective, the on-device and host rows
    skipped on CPU."""
    out = io.StringIO()
    sizes = [(3, 32, 4), (2, 16, 2)]
    text = bench._batched_section(sizes, repeats=2, budget_s=5.0, device="cpu", out=out)
    assert out.getvalue() == text
    tables = _tables(text)
    assert len(tables) == len(sizes)
    for (b, n, k), (header, body) in zip(sizes, tables):
        assert f"{b} instances of n={n}, k={k}" in text
        assert header == BATCHED_COLUMNS
        assert len(body) == 5 and all(len(row) == len(header) for row in body)
        batched, device, loop, auction, host = body
        assert "on_host=False" in device[0] and device[1].startswith("skipped (device is cpu")
        assert "one call" in batched[0] and "per instance" in loop[0] and "fairseq_auction" in auction[0]
        for row in (batched, loop, auction):
            assert float(row[1]) > 0 and float(row[2]) > 0
            assert row[3].endswith("x") and float(row[3][:-1]) > 0
            assert row[4] == "n/a (CPU)"
            assert row[5] == "yes"
        assert batched[3] == "1.0x" and batched[6].startswith("reference")
        assert loop[6] == "same"
        mean, largest = (float(x) for x in auction[6].removeprefix("gap mean ").split(", max "))
        assert 0 <= mean <= largest
        assert host[0].startswith("host") and host[1].startswith("skipped (device is cpu")
    assert "only counted on CUDA" in text


def test_measure_batched_checks_feasibility_and_objectives() -> None:
    size = bench._measure_batched(4, 32, 4, repeats=2, budget_s=5.0, device="cpu", seed=3)
    assert (size.b, size.n, size.k) == (4, 32, 4)
    assert set(size.methods) == {"batched", "device", "loop", "auction", "host"}
    runs = size.methods["batched"].timing.runs
    assert size.instances == 4 * runs
    assert size.same_optimum and size.auction_above == 0
    assert 0 <= size.auction_gap_mean <= size.auction_gap_max < 1
    for key in ("batched", "loop", "auction"):
        m = size.methods[key]
        assert m.feasible is True and m.host_syncs is None and m.timing.runs == runs
    for key in ("device", "host"):
        assert size.methods[key].timing is None and size.methods[key].skipped


def test_an_auction_answer_over_capacity_is_left_out_of_its_gap(monkeypatch: pytest.MonkeyPatch) -> None:
    """An auction that ignores capacity (argmax per token) scores above the optimum: it must not
    count as beating routelab, nor give a negative gap; its instances are reported infeasible."""
    monkeypatch.setattr(bench, "fairseq_auction", lambda scores: scores.argmax(-1))
    size = bench._measure_batched(4, 32, 4, repeats=1, budget_s=5.0, device="cpu", seed=3)
    assert size.methods["auction"].feasible is False
    assert size.auction_above == 0 and size.auction_infeasible > 0
    assert size.same_optimum
    text = "\n".join(bench._batched_notes([size], device="cpu"))
    assert "beat routelab" not in text and "over capacity on" in text


def test_measure_batched_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError, match="k must divide n"):
        bench._measure_batched(2, 10, 4, repeats=1, budget_s=1.0, device="cpu")
    with pytest.raises(ValueError, match="positive"):
        bench._measure_batched(0, 8, 4, repeats=1, budget_s=1.0, device="cpu")


def test_batch_feasible_and_objectives() -> None:
    ok = torch.tensor([[0, 1, 0, 1], [1, 1, 0, 0]])
    assert bench._batch_feasible(ok, 2, 4, 2)
    assert not bench._batch_feasible(torch.tensor([[0, 0, 0, 1], [1, 1, 0, 0]]), 2, 4, 2)  # over capacity
    assert not bench._batch_feasible(torch.tensor([[0, 1, 0, 2], [1, 1, 0, 0]]), 2, 4, 2)  # no expert 2
    assert not bench._batch_feasible(ok[:1], 2, 4, 2)  # wrong shape
    assert not bench._batch_feasible(ok.float(), 2, 4, 2)
    scores = torch.arange(16, dtype=torch.float32).reshape(2, 4, 2)
    assert bench._batch_objectives(scores, ok).tolist() == [0 + 3 + 4 + 7, 9 + 11 + 12 + 14]


def test_count_host_syncs_is_none_off_cuda() -> None:
    called: list[int] = []
    assert bench.count_host_syncs(lambda: called.append(1), device="cpu") is None
    assert bench.count_host_syncs(lambda: called.append(1), device=torch.device("cpu")) is None
    assert called == []


def test_sync_sites_name_the_innermost_frame_inside_the_package(tmp_path) -> None:
    """host_sync_sites' counting, without a GPU: warnings with torch's sync-debug text counted by the
    innermost frame under the package directory; other warnings passed on after the call."""
    import importlib.util
    import warnings

    package = tmp_path / "pkg"
    package.mkdir()
    (package / "mod.py").write_text(
        "import warnings\n"
        "def inner():\n"
        "    warnings.warn('called a synchronizing CUDA operation')\n"
        "def outer():\n"
        "    inner()\n"
        "    inner()\n"
        "    warnings.warn('called a synchronizing CUDA operation')\n")
    spec = importlib.util.spec_from_file_location("pkg_mod_for_sites", package / "mod.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    def fn() -> None:
        mod.outer()
        warnings.warn("called a synchronizing CUDA operation", stacklevel=1)  # from no frame of the package
        warnings.warn("an unrelated warning", UserWarning, stacklevel=1)

    with pytest.warns(UserWarning, match="an unrelated warning"):
        sites = bench._sync_warning_sites(fn, str(package))
    assert sites == {"pkg/mod.py:3": 2, bench.OUTSIDE: 1, "pkg/mod.py:7": 1}
    assert list(sites) == ["pkg/mod.py:3", "(outside routelab)", "pkg/mod.py:7"]  # most frequent first, then by name
    assert bench.host_sync_sites(fn, device="cpu") is None


def test_the_batched_table_lists_the_sync_sites() -> None:
    m = bench.BatchedMethod("routelab on the device", timing=bench.Timing(median_ms=2.0, runs=1),
                            host_syncs=3, sync_sites={"routelab/a.py:1": 2, "routelab/b.py:9": 1}, feasible=True)
    size = bench.BatchedSize(b=2, n=8, k=2, methods={"batched": m})
    text = "\n".join(bench._render_batched(size))
    assert "- routelab on the device: `routelab/a.py:1` 2, `routelab/b.py:9` 1" in text


@pytest.mark.requires_no_cuda
def test_count_host_syncs_needs_cuda_for_cuda() -> None:
    with pytest.raises(ValueError, match="CUDA"):
        bench.count_host_syncs(lambda: None, device="cuda")


@pytest.mark.requires_cuda
def test_count_host_syncs_on_cuda() -> None:
    before = torch.cuda.get_sync_debug_mode()
    assert bench.count_host_syncs(lambda: torch.zeros(1, device="cuda").item(), device="cuda") >= 1
    x = torch.ones(8, device="cuda")
    assert bench.count_host_syncs(lambda: x * 2 + 1, device="cuda") == 0
    assert torch.cuda.get_sync_debug_mode() == before

    def fails() -> None:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        bench.count_host_syncs(fails, device="cuda")
    assert torch.cuda.get_sync_debug_mode() == before
    # where: the line of routelab that read the value back (check_finite's float(top))
    from routelab._checks import check_finite

    sites = bench.host_sync_sites(lambda: check_finite(torch.ones(3, device="cuda"), "x", "fix"), device="cuda")
    assert len(sites) == 1 and next(iter(sites)).startswith("routelab/_checks.py:"), sites


@pytest.mark.requires_cuda
def test_batched_section_on_cuda() -> None:
    text = bench._batched_section([(3, 32, 4)], repeats=2, budget_s=5.0, device="cuda")
    [(header, body)] = _tables(text)
    assert header == BATCHED_COLUMNS
    rows = {row[0]: row for row in body}
    # The batch in one call (as a user calls it: on the host at this size), on the device
    # (on_host=False), one call per instance, the auction, the host round trip (the H200 run of
    # 2026-11-26 printed these five; a test that expected four failed there).
    assert len(rows) == len(body) == 5
    by = {key: next(row for name, row in rows.items() if name.startswith(prefix))
          for key, prefix in (("the batch in one call", "routelab `balanced_assignment`, the batch in one call"),
                              ("on_host=False", "routelab `balanced_assignment(on_host=False)`"),
                              ("one call per instance", "routelab `balanced_assignment`, one call per instance"),
                              ("auction", "BASE-layers auction"), ("host: copy", "host: copy"))}
    for row in body:
        assert row[5] == "yes"
        assert int(row[4].split()[0]) >= 0
    assert int(by["auction"][4].split()[0]) >= 1  # the auction syncs every round
    assert by["the batch in one call"][6] == "reference (exact)"
    for key in ("on_host=False", "one call per instance", "host: copy"):
        assert by[key][6] == "same", key
    assert int(by["host: copy"][4].split()[0]) <= 2
    assert "torch.cuda.synchronize()" in text


@pytest.mark.requires_cuda
def test_run_benchmark_on_cuda_has_the_batched_section(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench, "QUICK_NS", (16,))
    monkeypatch.setattr(bench, "KS", (4,))
    monkeypatch.setattr(bench, "QUICK_REPEATS", {16: 1})
    monkeypatch.setattr(bench, "BATCH_SIZES", ((2, 32, 4), (2, 16, 2)))
    text = bench.run_benchmark(quick=True, device="cuda")
    assert len(_tables(text)) == 3
    assert "Batched on cuda: 2 instances of n=32, k=4" in text


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
    assert "Batched on" not in text  # the batched section runs on CUDA only


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
    assert calls[:4] == [("a", 0), ("b", 0), ("a", 0), ("b", 0)]  # warm-ups: one-off costs, then sizing
    timed = calls[4:]
    assert timed == [("a", 0), ("b", 0), ("b", 1), ("a", 1), ("a", 2), ("b", 2), ("b", 3), ("a", 3)]
    assert results == {"a": [("a", i) for i in range(4)], "b": [("b", i) for i in range(4)]}
    assert timings["a"].runs == timings["b"].runs == 4 and timings["a"].median_ms >= 0


def test_paired_timing_respects_the_budget() -> None:
    import time as _time

    timings, _ = bench._time_paired({"slow": lambda i: _time.sleep(0.02), "fast": lambda i: None},
                                    repeats=50, budget_s=0.1, device="cpu")
    assert 1 <= timings["slow"].runs <= 6


def test_a_slow_first_call_does_not_cut_the_timed_calls() -> None:
    """A review found the first grid point timed once instead of 5 times: its only warm-up call
    included the compiled kernel's one-off load (1.7 s against 0.4 ms), which seemed to spend the
    budget. The call that sizes the run now comes after an untimed first call."""
    import time as _time

    first = [True]

    def loads_once(i: int) -> None:
        if first[0]:
            first[0] = False
            _time.sleep(0.3)  # the one-off cost, above the whole budget

    timings, _ = bench._time_paired({"fn": loads_once}, repeats=5, budget_s=0.2, device="cpu")
    assert timings["fn"].runs == 5


def test_render_batched_with_counted_syncs_and_a_host_row() -> None:
    """The CUDA-only cells (sync counts, the host row) rendered from a hand-made measurement."""
    timing = bench.Timing(median_ms=2.0, runs=3)
    size = bench.BatchedSize(b=4, n=8, k=2, requested=3, instances=12, auction_gap_mean=1e-3, auction_gap_max=4e-3)
    size.methods = {
        "batched": bench.BatchedMethod("batched", timing=timing, host_syncs=5, feasible=True),
        "loop": bench.BatchedMethod("loop", timing=bench.Timing(8.0, 3), host_syncs=5, per_instance_calls=True,
                                    feasible=True),
        "auction": bench.BatchedMethod("auction", timing=bench.Timing(40.0, 3), host_syncs=13,
                                       per_instance_calls=True, feasible=True),
        "host": bench.BatchedMethod("host", timing=bench.Timing(3.0, 3), host_syncs=2, feasible=False),
    }
    header, body = table_rows("\n".join(bench._render_batched(size)))
    assert header == BATCHED_COLUMNS
    assert [row[4] for row in body] == ["5", "5 (instance 0 alone)", "13 (instance 0 alone)", "2"]
    assert [row[3] for row in body] == ["1.0x", "4.0x", "20x", "1.5x"]
    assert [row[2] for row in body] == ["0.5", "2.00", "10.0", "0.75"]
    assert body[3][5] == "NO" and body[3][6] == "same"
    assert body[2][6] == "gap mean 1.00e-03, max 4.00e-03"


def test_on_host_matches_the_device_solve() -> None:
    x = torch.randn(3, 16, 4, generator=torch.Generator().manual_seed(5))
    ours, host = bench.balanced_assignment(x), bench._on_host(x)
    assert bench._batch_feasible(host, 3, 16, 4)
    assert torch.allclose(bench._batch_objectives(x, host), bench._batch_objectives(x, ours), rtol=1e-6)


def test_the_objectives_note_shows_the_first_instance_that_disagrees(monkeypatch) -> None:
    """Audit finding: the "objectives differ" note printed the last instance's (equal) objectives."""
    import routelab.bench.assignment as A
    from routelab.assignment import balanced_assignment as real

    first = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))

    def faulty(scores, *args, **kwargs):
        z = real(scores, *args, **kwargs)
        if scores.dim() == 2 and torch.equal(scores, first):  # instance 0 only: two tokens swap experts
            z = z.clone()
            j = int((z != z[0]).nonzero()[0])
            z[0], z[j] = z[j].clone(), z[0].clone()
        return z

    monkeypatch.setattr(A, "balanced_assignment", faulty)
    text = A._benchmark([(64, 4)], 3, budget_s=10.0, seed=0)
    note = next(line for line in text.splitlines() if "objectives differ" in line)
    ours, scipy = (float(v.rstrip(".")) for v in re.findall(r"(?:routelab|scipy) ([-0-9.]+)", note))
    assert ours < scipy  # instance 0's suboptimal objective, not a later instance's equal pair
