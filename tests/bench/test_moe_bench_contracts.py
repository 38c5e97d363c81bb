"""Contracts of the ``routelab bench moe`` tables against hand-computed values (mutation review s43).

The numbers a user reads (tokens/s, ratios and their direction, MiB, the non-expert share, the
"same outputs" verdict, the targets) are checked on hand-made rows or with a fake clock, so that
nothing depends on the machine's speed; the peer-correctness checks are checked to catch a wrong
input gradient, not only a wrong output.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from test_bench import table_rows

from routelab.bench import moe as bench
from routelab.bench import moe_compiled, moe_parallel
from routelab.layers import MoE

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

TINY = bench.BenchConfig(d_model=8, d_hidden=16, tokens=32, experts=(4,), ks=(1,), repeats=1, budget_s=1.0,
                         hf_peer=False)
needs_gloo = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is needed")


def _fake_clock(tick: float) -> SimpleNamespace:
    """A ``time`` module whose ``perf_counter`` advances by ``tick`` seconds at every reading."""
    state = {"now": 0.0}

    def perf_counter() -> float:
        state["now"] += tick
        return state["now"]

    return SimpleNamespace(perf_counter=perf_counter)


def _skew_input_gradient(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``y`` unchanged, but ``dL/dx`` off by ``0.5 * dL/dy``: a peer with the right output and a wrong gradient."""
    return y + 0.5 * (x - x.detach())


# ---------------------------------------------------------------------------- the eager table


def test_a_row_renders_hand_computed_throughput_ratios_and_memory() -> None:
    row = bench.Row(experts=4, k=2, layout="buffers", other_layout="grouped", capacity=16, dropped=0.125,
                    ms={"moe": 4.0, "other": 8.0, "naive": 20.0, "dense": 40.0}, expert_share=0.75,
                    peak_bytes={"moe": 3 * 2**20, "other": 5 * 2**20, "naive": 7 * 2**20, "dense": None},
                    max_rel_diff={"other": 1e-6, "naive": 0.0, "dense": 5e-5})
    header, _ = table_rows("\n".join(bench.TABLE_HEADER))
    cells = dict(zip(header, table_rows("\n".join([*bench.TABLE_HEADER, bench.render_row(row, 8192)]))[1][0]))
    # tokens / median seconds: 8192 / 0.004 s = 2.048M tok/s; ratios are time(peer) / time(moe) (> 1: moe faster).
    assert [cells[f"{n} tok/s"] for n in ("moe", "other", "naive", "dense")] == ["2.05M", "1.02M", "409.6k", "204.8k"]
    assert [cells[f"moe / {n}"] for n in ("other", "naive", "dense")] == ["2.0x", "5.0x", "10.0x"]
    assert [cells[f"{n} peak MiB"] for n in ("moe", "other", "naive", "dense")] == ["3", "5", "7", "—"]
    assert cells["non-expert share of moe"] == "25.0%" and cells["dropped"] == "12.5%"
    assert cells["same outputs"].startswith("yes")
    row.max_rel_diff["naive"] = 2 * bench.SAME_RTOL[torch.float32]  # one reference off: the row says so
    assert "**no**" in bench.render_row(row, 8192)


def test_overhead_is_one_minus_the_expert_share() -> None:
    assert bench.Row(experts=4, k=1, expert_share=0.8).overhead == pytest.approx(0.2)
    assert bench.Row(experts=4, k=1).overhead is None


def test_relative_difference_is_the_largest_difference_over_the_largest_reference() -> None:
    a, b = torch.tensor([0.0, 0.0, 0.0, 1.0]), torch.tensor([0.0, 0.0, 0.0, 2.0])
    assert bench._rel_diff(a, b) == pytest.approx(0.5)  # max |a - b| / max |b|, not a mean


def test_expert_timer_sums_the_forward_and_backward_spans() -> None:
    timer = bench.ExpertTimer(MoE(8, 16, 4, router="topk", k=1), "cpu")
    timer.marks = {"call_start": 0.0, "fwd_start": 1.0, "fwd_end": 1.5, "bwd_start": 2.0, "bwd_end": 2.75,
                   "call_end": 4.0}
    assert timer.seconds == pytest.approx(0.5 + 0.75)
    assert timer.share() == pytest.approx(1.25 / 4.0)


def test_expert_timer_reads_cuda_events_in_seconds() -> None:
    """CUDA events report milliseconds; the timer's spans are seconds (no GPU needed: stand-in events)."""

    class Event:
        def __init__(self, ms: float) -> None:
            self.ms = ms

        def elapsed_time(self, end: Event) -> float:
            return end.ms - self.ms

        def synchronize(self) -> None:
            pass

    timer = bench.ExpertTimer(MoE(8, 16, 4, router="topk", k=1), "cuda")
    timer.marks = {name: Event(ms) for name, ms in (("call_start", 0.0), ("fwd_start", 1.0), ("fwd_end", 3.0),
                                                    ("bwd_start", 4.0), ("bwd_end", 7.0), ("call_end", 10.0))}
    assert timer.seconds == pytest.approx(0.005)
    assert timer.share() == pytest.approx(0.5)


def test_cpu_peak_memory_is_the_largest_running_sum_in_time_order() -> None:
    meter = bench._PeakMemory("cpu")
    with meter:
        a = torch.empty(2**20)  # 4 MiB, freed before the next
        del a
        b = torch.empty(2**18)  # 1 MiB
        del b
        c = torch.empty(2**18)  # 1 MiB, alive at the end
    assert c.numel() == 2**18
    peak = meter.peak()
    assert peak is not None and 4 * 2**20 <= peak < 5 * 2**20


def test_timed_calls_are_in_milliseconds_and_fit_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fake clock that advances 0.25 s per reading: a reference's call is one tick (250 ms), and a
    budget of 0.6 s per implementation leaves int(0.6 / 0.25) = 2 of the 5 repeats."""
    monkeypatch.setattr(bench, "time", _fake_clock(0.25))
    row = bench._measure(4, 1, dataclasses.replace(TINY, repeats=5, budget_s=0.6), "cpu")
    assert row.runs == {"moe": 2, "other": 2, "naive": 2, "dense": 2}
    assert [row.ms[n] for n in ("other", "naive", "dense")] == [250.0, 250.0, 250.0]


def test_same_outputs_compares_input_gradients_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """A reference with the layer's output but a wrong dL/dx is not the same function."""
    real = bench.FORWARDS["naive"]
    monkeypatch.setitem(bench.FORWARDS, "naive", lambda moe, x: _skew_input_gradient(real(moe, x), x))
    row = bench._measure(4, 1, TINY, "cpu")
    assert row.max_rel_diff["naive"] > 0.1
    assert row.max_rel_diff["other"] <= TINY.same_rtol and row.max_rel_diff["dense"] <= TINY.same_rtol
    assert "**no**" in bench.render_row(row, TINY.tokens, TINY.same_rtol)


def test_dense_memory_limit_is_in_gib_of_the_dtype() -> None:
    # [E, tokens, d_hidden] twice in float32: 2 * 4 * 32 * 16 * 4 bytes = 2**14 bytes = 2**-16 GiB (1.53e-5).
    below = bench._measure(4, 1, dataclasses.replace(TINY, dense_limit_gib=2e-5), "cpu")
    above = bench._measure(4, 1, dataclasses.replace(TINY, dense_limit_gib=1e-5), "cpu")
    assert "dense" in below.ms and "dense" not in below.skipped
    assert "dense" not in above.ms and "need 0 GiB (limit 1e-05 GiB)" in above.skipped["dense"]


@pytest.mark.parametrize(("naive_ms", "verdict"), [(3.0, "met"), (1.5, "not met")])
def test_gpu_speedup_target_is_naive_time_over_layer_time(naive_ms: float, verdict: str) -> None:
    rows = [bench.Row(experts=8, k=1, ms={"moe": 1.0, "naive": 1.0}, expert_share=0.95),
            bench.Row(experts=64, k=1, ms={"moe": 1.0, "naive": naive_ms}, expert_share=0.95)]
    text = "\n".join(bench._verdicts(rows, "cuda"))
    assert f"at least 2x the naive loop at E = 64 on GPU: {verdict} (k=1: {naive_ms:.1f}x)." in text


@pytest.mark.parametrize(("expert_share", "verdict"), [(0.95, "met"), (0.5, "not met")])
def test_overhead_target_is_judged_on_the_non_expert_share(expert_share: float, verdict: str) -> None:
    rows = [bench.Row(experts=8, k=1, ms={"moe": 1.0, "naive": 2.0}, expert_share=expert_share)]
    text = "\n".join(bench._verdicts(rows, "cpu"))
    assert f"below 10% of the layer's time (top-k, cpu): {verdict} at E=8 k=1: {1 - expert_share:.1%}." in text


def test_grid_selection_refuses_any_value_outside_the_grid() -> None:
    gpu = bench.default_configs(quick=False, device="cuda")
    with pytest.raises(ValueError, match="--experts 8 16 is not in this grid"):
        bench.select_grid(gpu, [8, 16])
    with pytest.raises(ValueError, match="--k 1 3 is not in this grid"):
        bench.select_grid(gpu, ks=[1, 3])


def test_run_benchmark_restores_a_different_thread_count() -> None:
    assert torch.get_num_threads() == 1
    bench.run_benchmark(config=TINY, threads=2)
    assert torch.get_num_threads() == 1


def test_run_benchmark_refuses_an_unknown_dtype_by_name() -> None:
    with pytest.raises(ValueError, match="dtype must be one of float32, bfloat16, got 'float16'"):
        bench.run_benchmark(config=TINY, dtype="float16")


@pytest.mark.parametrize(("experts", "ks"), [((2,), (4,)), ((4, 2), (1, 4))], ids=["one-size", "last-size"])
def test_k_larger_than_the_experts_is_refused_by_name_when_the_grid_is_made(experts: tuple[int, ...],
                                                                             ks: tuple[int, ...]) -> None:
    """The config refuses the grid, so no table starts (review s43: a grid whose last size had k > E
    measured and streamed three rows first, in the eager and the compiled table alike)."""
    with pytest.raises(ValueError, match=r"k=4 is larger than E=2"):
        dataclasses.replace(TINY, experts=experts, ks=ks)


@pytest.mark.parametrize(("moe_ms", "verdict"), [(1.0, "met"), (1.5, "not met")])
def test_transformers_target_is_layer_time_over_the_grouped_peer(monkeypatch: pytest.MonkeyPatch, moe_ms: float,
                                                                 verdict: str) -> None:
    pytest.importorskip("transformers")
    row = bench.HFRow(experts=4, k=1, ms={"moe": moe_ms, "grouped_mm": 1.0, "eager": 3.0},
                      max_rel_diff={"grouped_mm": 0.0, "eager": 0.0}, implementations=("grouped_mm", "eager"),
                      default="grouped_mm")
    monkeypatch.setattr(bench, "_hf_default_implementation", lambda: "grouped_mm")
    monkeypatch.setattr(bench, "_measure_hf", lambda E, k, cfg, device: row)
    text, _ = bench._benchmark_hf(TINY)
    assert row.peer_ratio() == pytest.approx(moe_ms)
    assert f"grouped-GEMM peer's time (cpu, float32): {verdict} (E=4 k=1: {moe_ms:.2f})." in text
    header, body = table_rows(text)
    assert dict(zip(header, body[0]))["moe / block `eager`"] == f"{3.0 / moe_ms:.1f}x"


# ---------------------------------------------------------------------------- the compiled table


def test_compiled_row_renders_hand_computed_ratios() -> None:
    row = moe_compiled.CompiledRow(experts=4, k=1, layout="buffers",
                                   ms={"eager": 3.0, "compiled": 1.0, "experts": 0.75, "swiglu": 1.0, "block": 2.0},
                                   max_rel_diff={"compiled": 0.0}, first_s={"compiled": 12.0, "block": 30.0})
    assert row.overhead == pytest.approx(0.25) and row.peer_ratio == pytest.approx(0.5)
    header, body = table_rows("\n".join([*moe_compiled.TABLE_HEADER, moe_compiled.render_row(row, 8192, 1e-4)]))
    cells = dict(zip(header, body[0]))
    assert cells["compiled / eager"] == "3.0x"  # eager time over compiled time: > 1, the compiled layer is faster
    assert cells["non-expert share (compiled)"] == "25.0%" and cells["layer time / block's"] == "0.50"
    assert cells["first call s (layer, block)"] == "12, 30" and cells["same outputs"].startswith("yes")
    row.max_rel_diff["compiled"] = 1e-3
    assert "**no**" in moe_compiled.render_row(row, 8192, 1e-4)


@pytest.mark.parametrize(("agreement", "same"), [(1.0, True), (0.99, True), (0.98, False), (0.5, False)])
def test_same_outputs_needs_the_tokens_routed_alike_in_the_compiled_table_as_in_the_eager(agreement: float,
                                                                                          same: bool) -> None:
    """Outputs compared on the tokens both route alike are no agreement when those are under
    ROUTE_AGREEMENT (99 %) of the tokens: the eager transformers table said **no** at 50 % and the
    compiled one "yes" (review s43)."""
    assert bench.ROUTE_AGREEMENT == 0.99
    compiled = moe_compiled.CompiledRow(experts=8, k=2, layout="grouped", route_agreement=agreement,
                                        ms={"eager": 2.0, "compiled": 1.0, "experts": 0.9, "swiglu": 1.0, "block": 1.0},
                                        max_rel_diff={"compiled": 1e-3, "block": 1e-3})
    eager = bench.HFRow(experts=8, k=2, ms={"moe": 1.0, "grouped_mm": 1.0}, max_rel_diff={"grouped_mm": 1e-3},
                        route_agreement=agreement, implementations=("grouped_mm",), default="grouped_mm")
    for text in (moe_compiled.render_row(compiled, 1024, 3e-2), bench.render_hf_row(eager, 1024, 3e-2)):
        verdict = text.rsplit("|", 2)[1].strip()
        assert verdict.startswith("yes" if same else "**no**"), text


@pytest.mark.parametrize(("swiglu_ms", "verdict"), [(1.0, "met"), (1.5, "not met")])
def test_compiled_peer_target_is_layer_time_over_block_time(monkeypatch: pytest.MonkeyPatch, swiglu_ms: float,
                                                            verdict: str) -> None:
    row = moe_compiled.CompiledRow(experts=4, k=1, layout="grouped", max_rel_diff={"compiled": 0.0, "block": 0.0},
                                   ms={"eager": 2.0, "compiled": 1.0, "experts": 0.95, "swiglu": swiglu_ms,
                                       "block": 1.0})
    monkeypatch.setattr(moe_compiled, "_measure", lambda E, k, cfg, device, mode: row)
    text, _ = moe_compiled.benchmark_compiled(TINY)
    assert (f"the compiled layer within 1.2x of transformers' compiled block: {verdict} (E=4 k=1: {swiglu_ms:.2f})"
            in text)


@pytest.mark.parametrize("skew", [False, True], ids=["same-function", "wrong-input-gradient"])
def test_compiled_check_compares_outputs_and_input_gradients(monkeypatch: pytest.MonkeyPatch, skew: bool) -> None:
    """A stand-in compiler (no compilation: fast) that returns the layer itself agrees exactly; one
    whose input gradient is wrong is caught."""

    def fake_compile(module, mode, *, fullgraph):
        if not (skew and isinstance(module, MoE)):
            return module

        def skewed(x):
            y, routes = module(x)
            return _skew_input_gradient(y, x), routes
        return skewed

    monkeypatch.setattr(moe_compiled, "_compile", fake_compile)
    text, rows = moe_compiled.benchmark_compiled(TINY)
    diff = rows[0].max_rel_diff["compiled"]
    if skew:
        assert diff > 0.1 and "| **no** (compiled" in text
    else:
        assert diff == 0.0 and "| yes (compiled 0.0e+00) |" in text


# ---------------------------------------------------------------------------- the expert-parallel table


def test_parallel_table_counts_the_global_batch_and_divides_their_time_by_ours() -> None:
    cfg = dataclasses.replace(moe_parallel.QUICK, tokens_per_rank=24)
    times = {("capacity", "routelab"): 0.5, ("capacity", "deepspeed"): 1.0,
             ("dropless", "routelab"): 0.25, ("dropless", "deepspeed"): 0.125}
    text = "\n".join(moe_parallel._table(cfg, {2: {"times": times, "checks": {"routelab_vs_single": 1e-7}}}))
    # 2 ranks x 24 tokens = 48 tokens per step; routelab / DeepSpeed = DeepSpeed's time over ours.
    assert "| 2 | capacity | 96 | 48 | 2.00x | — |" in text
    assert "| 2 | dropless | 192 | 384 | 0.50x | — |" in text
    assert "| 2 | 1.0e-07 | — | — |" in text


def test_parallel_world_sizes_are_positive_integers_dividing_the_experts() -> None:
    cfg = dataclasses.replace(moe_parallel.QUICK, experts=4)
    with pytest.raises(ValueError, match="world size 8 does not divide the 4 experts"):
        moe_parallel.run_benchmark(world_sizes=(8,), config=cfg, deepspeed=False)
    with pytest.raises(ValueError, match="positive integers, got True"):
        moe_parallel.run_benchmark(world_sizes=(True,), config=cfg, deepspeed=False)


PARALLEL_TINY = dataclasses.replace(moe_parallel.QUICK, d_model=16, d_hidden=32, experts=4, tokens_per_rank=24,
                                    warmup=0, repeats=1, timeout=60.0)


def _slowest_rank_worker(rank: int, world: int) -> dict:
    """The benchmark's worker with a clock on which rank r's steps take r + 1 seconds."""
    moe_parallel.time = _fake_clock(rank + 1.0)
    return moe_parallel._worker(rank, world, PARALLEL_TINY, False, "cpu")


def _skewed_gradient_worker(rank: int, world: int) -> dict:
    """The benchmark's worker with an expert-parallel layer whose input gradient is wrong."""
    real = moe_parallel.ExpertParallelMoE

    class Skewed(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor) -> tuple:
            y, *rest = self.inner(x)
            return (_skew_input_gradient(y, x), *rest)

    moe_parallel.ExpertParallelMoE = SimpleNamespace(from_moe=lambda moe: Skewed(real.from_moe(moe)))
    return moe_parallel._worker(rank, world, PARALLEL_TINY, False, "cpu")


@needs_gloo
def test_parallel_step_time_is_the_slowest_ranks() -> None:
    from routelab.parallel import run_workers

    results = run_workers(_slowest_rank_worker, 2, timeout=60)
    assert all(r["times"][(mode, "routelab")] == 2.0 for r in results for mode in moe_parallel.MODES)


@needs_gloo
def test_parallel_check_against_the_single_process_includes_the_input_gradient() -> None:
    from routelab.parallel import run_workers

    results = run_workers(_skewed_gradient_worker, 2, timeout=60)
    assert all(r["checks"]["routelab_vs_single"] > 0.1 for r in results)


@needs_gloo
def test_parallel_main_writes_the_report_to_out(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "parallel.md"
    assert moe_parallel.main(["--world-size", "1", "--quick", "--no-deepspeed", "--tokens-per-rank", "16",
                              "--d-model", "16", "--d-hidden", "32", "--experts", "4", "--repeats", "1",
                              "--out", str(out)]) == 0
    text = out.read_text()
    assert text.startswith("# Expert-parallel MoE benchmark (quick)") and "| 1 | dropless |" in text
    assert text in capsys.readouterr().out
