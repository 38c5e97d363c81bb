"""``routelab bench moe --compile``: the layer under torch.compile against eager and transformers' block."""

from __future__ import annotations

import dataclasses
import io

import pytest
import torch
from test_bench import table_rows

from routelab import cli
from routelab.bench import moe as bench
from routelab.bench import moe_compiled

TINY = bench.BenchConfig(d_model=16, d_hidden=32, tokens=64, experts=(4,), ks=(2,), repeats=2, budget_s=5.0,
                         hf_peer=False)


def test_compiled_layer_is_timed_against_eager_and_its_experts() -> None:
    """One size compiled (inductor on the CPU): the compiled layer computes the eager layer's
    outputs and input gradients, and its non-expert share is measured from its experts alone."""
    out = io.StringIO()
    text, rows = moe_compiled.benchmark_compiled(TINY, out=out)
    assert out.getvalue() == text  # streamed as measured
    row = rows[0]
    assert row.failed is None, row.failed
    assert set(row.ms) == {"eager", "compiled", "experts"} and all(v > 0 for v in row.ms.values())
    assert row.max_rel_diff["compiled"] <= TINY.same_rtol
    assert row.overhead is not None and row.overhead < 1 and row.peer_ratio is None
    assert row.first_s["compiled"] > row.ms["compiled"] / 1e3  # the first call compiled
    header, body = table_rows(text)
    col = {name: i for i, name in enumerate(header)}
    assert body[0][col["same outputs"]].startswith("yes") and body[0][col["layout"]] == row.layout
    assert "Target: routing + capacity + dispatch + combine below 10% of the compiled layer's time (cpu)" in text


def test_float32_dropless_layer_is_not_compared_with_the_block() -> None:
    """A dropless float32 layer compiles on worst-case buffers: no like-for-like comparison, and
    the report says why instead of timing it."""
    pytest.importorskip("transformers")
    reason, block, layer = moe_compiled._hf_peer(4, 2, dataclasses.replace(TINY, hf_peer=True), "cpu")
    assert block is None and layer is None
    assert "compiles grouped in bfloat16 only" in reason and "C = tokens" in reason


def test_a_graph_break_fails_the_row_and_the_run_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def fitting(E, k, cfg, device, mode):
        calls.append(E)
        raise torch._dynamo.exc.Unsupported("graph break: data-dependent branch\nmore")

    monkeypatch.setattr(moe_compiled, "_measure_fitting", fitting)
    text, rows = moe_compiled.benchmark_compiled(dataclasses.replace(TINY, experts=(4, 8), ks=(1,)))
    assert calls == [4, 8] and all(r.failed for r in rows)
    assert "not measured: does not compile whole (graph break: data-dependent branch)" in text


def test_compile_mode_is_checked(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="mode must be one of default, reduce-overhead"):
        moe_compiled.benchmark_compiled(TINY, mode="fast")
    with pytest.raises(ValueError, match="compile_mode must be one of"):
        bench.run_benchmark(config=TINY, compile_mode="fast")
    with pytest.raises(SystemExit):
        cli.main(["bench", "moe", "--compile", "fast"])
    assert "invalid choice: 'fast'" in capsys.readouterr().err


@pytest.mark.requires_cuda
def test_compiled_on_cuda_against_the_block() -> None:
    """bfloat16 on the GPU: the compiled layer, its experts, and the compiled SwiGLU layer against
    transformers' compiled block (grouped matmuls), all in one run, with CUDA graphs."""
    pytest.importorskip("transformers")
    cfg = dataclasses.replace(TINY, d_model=64, d_hidden=128, tokens=512, dtype=torch.bfloat16, hf_peer=True)
    text, rows = moe_compiled.benchmark_compiled(cfg, device="cuda", mode="reduce-overhead")
    row = rows[0]
    assert row.failed is None, row.failed
    assert {"eager", "compiled", "experts", "swiglu", "block"} == set(row.ms)
    assert max(row.max_rel_diff.values()) <= cfg.same_rtol and "**no**" not in text


def test_bfloat16_dropless_layer_is_compared_where_it_compiles_grouped() -> None:
    pytest.importorskip("transformers")
    cfg = dataclasses.replace(TINY, dtype=torch.bfloat16, hf_peer=True)
    reason, block, layer = moe_compiled._hf_peer(4, 2, cfg, "cpu")
    if layer is None:  # grouped matmuls do not run on this CPU build: then the reason says so
        assert "compiles grouped in bfloat16 only" in reason
    else:
        assert reason is None and layer.uses_grouped(2, torch.device("cpu"))
        assert type(block).__name__ == "MixtralSparseMoeBlock"


def test_a_negative_share_is_not_judged(monkeypatch: pytest.MonkeyPatch) -> None:
    """Experts alone timed slower than the whole layer (separate calls on a loaded machine): the
    share is printed as noise and the target is not claimed from it."""
    row = moe_compiled.CompiledRow(experts=4, k=1, layout="buffers",
                                   ms={"eager": 2.0, "compiled": 1.0, "experts": 1.2},
                                   max_rel_diff={"compiled": 0.0})
    assert "-20.0% (timing noise)" in moe_compiled.render_row(row, 64, 1e-4)
    good = moe_compiled.CompiledRow(experts=8, k=1, layout="buffers", ms={"eager": 2.0, "compiled": 1.0,
                                                                          "experts": 0.95})
    rows = iter([row, good])
    monkeypatch.setattr(moe_compiled, "_measure", lambda E, k, cfg, device, mode: next(rows))
    text, _ = moe_compiled.benchmark_compiled(dataclasses.replace(TINY, experts=(4, 8), ks=(1,)))
    assert "(cpu): met (E=8 k=1: 5.0%; not judged at E=4 k=1: the experts alone timed slower" in text


def test_another_compiler_error_fails_the_row_only(monkeypatch: pytest.MonkeyPatch) -> None:
    def fitting(E, k, cfg, device, mode):
        raise torch._dynamo.exc.TorchDynamoException("no C++ compiler found\nmore")

    monkeypatch.setattr(moe_compiled, "_measure_fitting", fitting)
    text, rows = moe_compiled.benchmark_compiled(dataclasses.replace(TINY, experts=(4, 8), ks=(1,)))
    assert all(r.failed == "compilation failed (TorchDynamoException: no C++ compiler found)" for r in rows)
