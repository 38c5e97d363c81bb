"""Correctness tests of routelab.bench.moe on tiny sizes (never timing: seconds in all)."""

from __future__ import annotations

import dataclasses
import io
import sys
from pathlib import Path

import pytest
import torch
from test_bench import table_rows

from routelab import cli
from routelab.bench import moe as bench
from routelab.layers import MoE

TINY = bench.BenchConfig(d_model=16, d_hidden=32, tokens=64, experts=(4, 8), ks=(1, 2), repeats=1, budget_s=1.0)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("capacity_factor", [0.5, 1.0, None])
@pytest.mark.parametrize("weighted", [False, True])
def test_references_match_the_layer(k: int, capacity_factor: float | None, weighted: bool) -> None:
    # weighted: drop by score and combine with gate * importance weight * skip correction.
    torch.manual_seed(0)
    moe = MoE(8, 16, 4, router="topk", k=k, capacity_factor=capacity_factor,
              drop_policy="score" if weighted else "position", importance_weighting=weighted)
    x = torch.randn(40, 8, requires_grad=True)
    y, routes = moe(x)
    if capacity_factor == 0.5:
        assert float(routes.stats["dropped_fraction"]) > 0  # the references must drop the same pairs
        if weighted:  # the skip correction is not trivially 1
            assert float(routes.weight.max()) > 1
    g = torch.randn_like(y)
    (gx,) = torch.autograd.grad(y, x, g)
    for fn in (bench.naive_forward, bench.dense_forward):
        y_ref = fn(moe, x)
        (gx_ref,) = torch.autograd.grad(y_ref, x, g)
        torch.testing.assert_close(y_ref, y, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(gx_ref, gx, rtol=1e-5, atol=1e-6)


def test_references_use_the_layer_weights() -> None:
    torch.manual_seed(1)
    moe = MoE(8, 16, 4, router="topk", k=2)
    x = torch.randn(32, 8)
    g = torch.randn(32, 8)
    grads = []
    for fn in (lambda m, t: m(t)[0], bench.naive_forward, bench.dense_forward):
        moe.zero_grad(set_to_none=True)
        fn(moe, x).backward(g)
        grads.append((moe.experts.w1.grad.clone(), moe.router.proj.weight.grad.clone()))
    for w1, proj in grads[1:]:
        torch.testing.assert_close(w1, grads[0][0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(proj, grads[0][1], rtol=1e-5, atol=1e-6)


def test_benchmark_tiny_grid() -> None:
    out = io.StringIO()
    text, rows = bench._benchmark(TINY, out=out)
    assert out.getvalue() == text  # streamed as measured
    header, body = table_rows(text)
    col = {name: i for i, name in enumerate(header)}
    assert [(int(r[col["E"]]), int(r[col["k"]])) for r in body] == [(4, 1), (4, 2), (8, 1), (8, 2)]
    for r, row in zip(body, rows):
        assert r[col["same outputs"]].startswith("yes")
        assert set(row.ms) == set(bench.IMPLEMENTATIONS)
        assert all(v > 0 for v in row.ms.values())
        assert row.expert_share is not None and 0 < row.expert_share < 1 and row.overhead is not None
        assert row.capacity == -(-TINY.tokens * row.k // row.experts)
        assert r[col["moe / naive"]].endswith("x") and r[col["moe / other"]].endswith("x")
        assert r[col["moe layout"]] == row.layout == (
            "grouped" if MoE(16, 32, 4, k=row.k).uses_grouped(row.k, torch.device("cpu"), num_tokens=TINY.tokens)
            else "buffers")
        assert r[col["other layout"]] == row.other_layout in ("grouped", "buffers")
    assert "Targets:" in text and "not measured" in text  # the GPU target is not claimed on CPU


def test_other_reference_is_the_layer_in_the_other_layout() -> None:
    """The "other" implementation is the same layer in the layout auto does not pick, the setting restored."""
    torch.manual_seed(2)
    x = torch.randn(40, 16)
    grouped_runs = MoE(16, 32, 4, router="topk", k=2).uses_grouped(2, x.device)
    # Dropless: auto takes grouped where it runs, so the other is buffers (buffers both ways where it does not).
    for factor, other in ((None, "buffers"), (1.0, "grouped" if grouped_runs else "buffers")):
        moe = MoE(16, 32, 4, router="topk", k=2, capacity_factor=factor)
        assert bench.other_layout(moe, x) == other
        y = bench.FORWARDS["other"](moe, x)
        assert moe.dispatch == "auto"
        moe.dispatch = other
        torch.testing.assert_close(y, moe(x)[0])


def test_bfloat16_tiny_grid() -> None:
    cfg = dataclasses.replace(TINY, experts=(4,), ks=(2,), dtype=torch.bfloat16, hf_peer=False)
    text, rows = bench._benchmark(cfg)
    _, body = table_rows(text)
    assert body[0][-1].startswith("yes") and set(rows[0].ms) == set(bench.IMPLEMENTATIONS)
    assert "bfloat16" in text and f"at most {bench.SAME_RTOL[torch.bfloat16]:g}" in text
    with pytest.raises(ValueError, match="dtype must be one of float32, bfloat16"):
        bench.BenchConfig(dtype=torch.float16)


def test_a_size_that_does_not_fit_is_reported_and_the_run_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def fitting(E, k, cfg, device):
        calls.append((E, k))
        if E == 8:
            raise MemoryError("CUDA out of memory. Tried to allocate 12 GiB")
        return real(E, k, cfg, device)

    real = bench._measure_fitting
    monkeypatch.setattr(bench, "_measure_fitting", fitting)
    monkeypatch.setattr(bench, "_out_of_memory", lambda device: (MemoryError,))
    text, rows = bench._benchmark(dataclasses.replace(TINY, hf_peer=False))
    assert calls == [(4, 1), (4, 2), (8, 1), (8, 2)]
    assert [r.failed is None for r in rows] == [True, True, False, False]
    assert "not measured: out of memory (CUDA out of memory. Tried to allocate 12 GiB)" in text
    assert "- not measured at E=8 k=1 (out of memory" in text


def test_default_configs() -> None:
    assert bench.default_configs(quick=True, device="cpu") == (bench.QUICK,)
    gpu = bench.default_configs(quick=False, device="cuda", dtype=torch.bfloat16)
    assert [(c.d_model, c.tokens) for c in gpu] == [(1024, 8192), (2048, 32768), (4096, 65536)]
    assert all(c.dtype == torch.bfloat16 and c.dense_limit_gib >= 16 for c in gpu)


def test_dense_is_skipped_over_its_memory_limit() -> None:
    cfg = bench.BenchConfig(d_model=8, d_hidden=16, tokens=32, experts=(4,), ks=(1,), repeats=1, budget_s=1.0,
                            dense_limit_gib=1e-9)
    text, rows = bench._benchmark(cfg)
    assert "dense" not in rows[0].ms and "dense" in rows[0].skipped
    _, body = table_rows(text)
    assert "skipped" in body[0]
    assert "dense skipped at E=4, k=1" in text


def test_run_benchmark_restores_threads() -> None:  # bad arguments: tests/bench/test_bench.py
    before = torch.get_num_threads()
    text = bench.run_benchmark(config=bench.BenchConfig(d_model=8, d_hidden=16, tokens=32, experts=(4,), ks=(1,),
                                                        repeats=1, budget_s=1.0), threads=1)
    assert torch.get_num_threads() == before
    assert "routelab MoE layer benchmark" in text and "Wall time" in text


def test_cli_bench_moe(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(bench, "QUICK", bench.BenchConfig(d_model=8, d_hidden=16, tokens=32, experts=(4,), ks=(2,),
                                                          repeats=1, budget_s=1.0))
    table = tmp_path / "moe.md"
    assert cli.main(["bench", "moe", "--quick", "--out", str(table)]) == 0
    assert "| 4 | 2 |" in table.read_text()
    if not torch.cuda.is_available():
        assert cli.main(["bench", "moe", "--device", "cuda"]) == 2
        assert "cuda" in capsys.readouterr().err
    assert cli.main(["bench", "moe", "--quick", "--dtype", "bfloat16"]) == 0
    assert "dtype bfloat16" in capsys.readouterr().out
    assert cli.main(["bench", "assignment", "--dtype", "bfloat16"]) == 2
    assert "--dtype applies to `routelab bench moe` (single process) only" in capsys.readouterr().err
    assert cli.main(["bench", "assignment", "--compile", "--k", "1"]) == 2
    assert "--k, --compile apply to `routelab bench moe`" in capsys.readouterr().err


def test_expert_timer_spans_forward_and_backward() -> None:
    torch.manual_seed(0)
    moe = MoE(8, 16, 4, router="topk", k=1)
    x = torch.randn(32, 8, requires_grad=True)
    timer = bench.ExpertTimer(moe, "cpu")
    with timer:
        moe(x)[0].sum().backward()
    m = timer.marks
    assert m["call_start"] <= m["fwd_start"] <= m["fwd_end"] <= m["bwd_start"] <= m["bwd_end"] <= m["call_end"]
    assert timer.seconds > 0
    assert 0 < timer.share() < 1
    assert not moe.experts._forward_hooks and not moe.experts._forward_pre_hooks  # removed on exit
    with pytest.raises(RuntimeError, match="did not fire"):
        with timer:
            moe(x.detach())  # no backward
        _ = timer.seconds  # reading the time of a forward without backward raises


def test_cpu_peak_memory_counts_tensor_bytes() -> None:
    meter = bench._PeakMemory("cpu")
    with meter:
        a = torch.randn(256, 1024, requires_grad=True)  # 1 MiB
        b = (a * 2).relu()  # +1 MiB (mul) +1 MiB (relu)
        b.sum().backward()  # +1 MiB (relu backward), then the mul's backward and a.grad
        del b
    peak = meter.peak()
    assert peak is not None and 3 * 2**20 <= peak <= 6 * 2**20


def test_transformers_mixtral_block_is_a_peer_at_the_same_sizes(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("transformers")
    cfg = bench.BenchConfig(d_model=16, d_hidden=32, tokens=48, experts=(4,), ks=(1, 2), repeats=1, budget_s=1.0)
    text, rows = bench._benchmark_hf(cfg)
    assert [(r.experts, r.k) for r in rows] == [(4, 1), (4, 2)]
    for row in rows:
        # The layer computes the block's function under every experts implementation.
        assert row.implementations[0] == row.default and {"grouped_mm", "eager"} <= set(row.implementations)
        assert set(row.max_rel_diff) == set(row.implementations)
        assert max(row.max_rel_diff.values()) <= bench.SAME_RTOL[torch.float32]
        assert set(row.ms) == {"moe", *row.implementations} and all(v > 0 for v in row.ms.values())
        assert row.peer_ratio() == pytest.approx(row.ms["moe"] / row.ms["grouped_mm"])
    header, body = table_rows(text)
    assert len(header) == len(body[0]) and body[1][:2] == ["4", "2"]
    assert "block `grouped_mm`" in " ".join(header) and "Mixtral sparse MoE block" in text
    assert "Target: the layer within 1.2x of the best grouped-GEMM peer" in text
    monkeypatch.setitem(sys.modules, "transformers", None)  # not installed: said, not measured
    text, rows = bench._benchmark_hf(cfg)
    assert rows == [] and "not measured: transformers is not installed" in text


@pytest.mark.requires_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_run_benchmark_on_cuda(dtype: str) -> None:
    """The whole benchmark on the GPU at tiny sizes: every implementation agrees with the layer,
    peak memory is read from the CUDA allocator, and transformers' block is timed beside it."""
    cfg = dataclasses.replace(TINY, experts=(4,), ks=(2,), dtype=bench.DTYPES[dtype])
    text = bench.run_benchmark(config=cfg, device="cuda")
    assert torch.cuda.get_device_name() in text and "TF32 matmuls" in text
    header, body = table_rows(text.split("**Against")[0])
    col = {name: i for i, name in enumerate(header)}
    assert body[0][col["same outputs"]].startswith("yes") and body[0][col["moe peak MiB"]] != "—"
    assert "block `grouped_mm`" in text and "**no**" not in text


def test_bfloat16_transformers_comparison_compares_the_tokens_routed_alike() -> None:
    """In bfloat16 transformers' router scores in bfloat16 and routelab's in float32: outputs are
    compared on the tokens both send to the same experts, and those must be nearly all of them."""
    pytest.importorskip("transformers")
    cfg = bench.BenchConfig(d_model=64, d_hidden=128, tokens=1024, experts=(8,), ks=(2,), repeats=1, budget_s=1.0,
                            dtype=torch.bfloat16)
    text, rows = bench._benchmark_hf(cfg)
    row = rows[0]
    assert bench.ROUTE_AGREEMENT <= row.route_agreement <= 1.0
    assert max(row.max_rel_diff.values()) <= bench.SAME_RTOL[torch.bfloat16]
    assert "| yes (" in text
    row.route_agreement = 0.9  # too many tokens routed differently: not the same function
    assert "**no**" in bench.render_hf_row(row, cfg.tokens, cfg.same_rtol)


def test_the_expert_share_is_measured_inside_the_timed_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every timed call of the layer (and no other call) runs inside the timer, on every device."""
    calls = {"timed": 0}
    real_enter = bench.ExpertTimer.__enter__

    def counting_enter(self):
        calls["timed"] += 1
        return real_enter(self)

    monkeypatch.setattr(bench.ExpertTimer, "__enter__", counting_enter)
    cfg = dataclasses.replace(TINY, experts=(4,), ks=(1,), repeats=3, budget_s=60.0, hf_peer=False)
    row = bench._measure(4, 1, cfg, "cpu")
    assert calls["timed"] == row.runs["moe"] == 3 and 0 < row.expert_share < 1


@pytest.mark.requires_cuda
def test_the_cuda_expert_timer_marks_by_events_without_synchronising() -> None:
    """On CUDA the marks are events: a layer that makes no host sync (check_finite=False,
    capacity factor 1) makes none under the timer either, and the spans nest on the GPU's clock."""
    torch.manual_seed(0)
    moe = MoE(64, 128, 8, router="topk", k=2, check_finite=False).cuda().to(torch.bfloat16)
    x = torch.randn(512, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn_like(x)
    moe(x)[0].backward(g)  # warm-up
    timer = bench.ExpertTimer(moe, "cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with timer:
            moe(x)[0].backward(g)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    m = timer.marks
    assert all(isinstance(e, torch.cuda.Event) for e in m.values())
    spans = [m["call_start"].elapsed_time(m[k]) for k in ("fwd_start", "fwd_end", "bwd_start", "bwd_end", "call_end")]
    assert spans == sorted(spans) and spans[0] >= 0
    assert 0 < timer.share() < 1


def test_d_model_selects_sizes_of_the_grid(capsys: pytest.CaptureFixture[str]) -> None:
    gpu = bench.default_configs(quick=False, device="cuda")
    assert [c.d_model for c in bench.select_configs(gpu, [2048])] == [2048]
    assert [c.d_model for c in bench.select_configs(gpu, [4096, 1024])] == [1024, 4096]
    with pytest.raises(ValueError, match="selects no size of this grid; its d_model values are 1024 2048 4096"):
        bench.select_configs(gpu, [512 + 1])
    assert cli.main(["bench", "moe", "--quick", "--d-model", "513"]) == 2
    assert "its d_model values are 64" in capsys.readouterr().err
    assert cli.main(["bench", "assignment", "--d-model", "64"]) == 2


def test_experts_and_k_select_the_grid(capsys: pytest.CaptureFixture[str]) -> None:
    gpu = bench.default_configs(quick=False, device="cuda")
    chosen = bench.select_grid(gpu, [64], [1])
    assert [(c.d_model, c.experts, c.ks) for c in chosen] == [(1024, (64,), (1,)), (2048, (64,), (1,)),
                                                               (4096, (64,), (1,))]
    assert bench.select_grid(gpu) == tuple(gpu)
    with pytest.raises(ValueError, match="--experts 16 is not in this grid; its values are 8 64"):
        bench.select_grid(gpu, [16])
    assert cli.main(["bench", "moe", "--quick", "--k", "3"]) == 2
    assert "--k 3 is not in this grid; its values are 1 2" in capsys.readouterr().err
