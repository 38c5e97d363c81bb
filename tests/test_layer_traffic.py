"""tools/layer_traffic.py (the byte and operator counts of docs/gpu-profile-h200.md), on tiny sizes."""

from __future__ import annotations

import re
import sys
from types import ModuleType

import pytest
import torch

from tool_modules import load_tool


def _load() -> ModuleType:
    return load_tool("layer_traffic")


def test_an_operator_counts_its_arguments_read_and_its_outputs_written_and_a_view_nothing() -> None:
    traffic = _load()
    x, index = torch.randn(10, 4), torch.tensor([1, 3, 5])
    with traffic.Traffic() as mode:
        y = torch.index_select(x, 0, index)
        y.view(-1).t()  # views move no bytes
    ((phase, name, shapes), (calls, read, written)), = mode.table.items()
    assert (phase, name, calls) == ("rest", "aten::index_select", 1)
    assert read == 10 * 4 * 4 + 3 * 8 and written == 3 * 4 * 4
    assert shapes == "[3, 4]float32"


@pytest.mark.parametrize("args", [[], ["--k", "2", "--swiglu-dropless"]])
def test_the_report_splits_experts_from_the_rest(args: list[str], capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    traffic = _load()
    monkeypatch.setattr(sys, "argv", ["layer_traffic.py", "--d-model", "16", "--d-hidden", "32", "--tokens", "64",
                                      "--experts", "4", "--top", "3", *args])
    traffic.main()
    out = capsys.readouterr().out
    units = {name: float(value) for name, value in re.findall(r"(total|experts|rest): .*?= +([\d.]+) units", out)}
    assert set(units) == {"total", "experts", "rest"}
    assert units["experts"] > 0 and units["rest"] > 0
    assert units["total"] == pytest.approx(units["experts"] + units["rest"], abs=0.2)
    # (operators by name: ATen's, and where Triton is installed the fused gathers, which on the small
    # dropless layer can fill the top rows)
    assert re.search(r"(aten|triton)::\w+", out.split("largest first")[1])


def test_it_leaves_the_gathers_and_the_half_kernels_as_it_found_them(monkeypatch: pytest.MonkeyPatch) -> None:
    from routelab import _float32_out
    from routelab.routing import _gather

    saved = (_gather._adjoint_by_default, _float32_out.half_kernels, _float32_out.mm_f32, _float32_out.row_dots_f32)
    monkeypatch.setattr(sys, "argv", ["layer_traffic.py", "--d-model", "16", "--d-hidden", "32", "--tokens", "32",
                                      "--experts", "4", "--top", "1"])
    _load().main()
    assert (_gather._adjoint_by_default, _float32_out.half_kernels, _float32_out.mm_f32,
            _float32_out.row_dots_f32) == saved


def test_the_gpu_paths_count_the_float32_out_matmuls_as_one_kernel_each(capsys: pytest.CaptureFixture[str],
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """--gather adjoint counts the CUDA path: the router's three matmuls and the combine's dots as
    the float32-out kernels (reading half precision), with no float32 copy of x; a factory such as
    new_zeros reads nothing."""
    traffic = _load()
    monkeypatch.setattr(sys, "argv", ["layer_traffic.py", "--d-model", "16", "--d-hidden", "32", "--tokens", "64",
                                      "--experts", "4", "--top", "60", "--trace"])
    traffic.main()
    out = capsys.readouterr().out
    table = out.split("largest first")[1]
    calls: dict[str, int] = {}
    for m in re.finditer(r"^ +(\d+) .*?  (aten::\S+)  ", table, re.M):
        calls[m.group(2)] = calls.get(m.group(2), 0) + int(m.group(1))
    assert calls.get("aten::mm(out_dtype=float32)", 0) == 2  # the logits and the weight's gradient
    # the combine's weight-gradient dots (in the fused combine backward where Triton is installed)
    from routelab.routing import _gather_triton
    assert calls.get("aten::bmm(out_dtype=float32)", 0) == (0 if _gather_triton.triton is not None else 1)
    assert "aten::_to_copy  [64, 16]float32" not in table  # no float32 copy of x
    with traffic.Traffic() as mode:
        torch.randn(100, 4).new_zeros(1, 4)
    assert mode.table[("rest", "aten::new_zeros", "[1, 4]float32")][1:] == [0, 16]


def test_the_gpu_paths_count_each_fused_gather_as_one_kernel(capsys: pytest.CaptureFixture[str],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """With Triton installed, --gather adjoint counts the four gathers as the fused kernels (two
    slot sums, one gather, one combine backward), none of the operators they replace, and leaves
    routelab's kernel functions as it found them."""
    pytest.importorskip("triton")
    from routelab.routing import _gather_triton

    saved = {name: getattr(_gather_triton, name) for name in ("usable", "gather_rows", "slot_sum", "combine_backward")}
    traffic = _load()
    monkeypatch.setattr(sys, "argv", ["layer_traffic.py", "--d-model", "16", "--d-hidden", "32", "--tokens", "64",
                                      "--experts", "4", "--k", "2", "--top", "60"])
    traffic.main()
    table = capsys.readouterr().out.split("largest first")[1]
    calls = {m.group(2): int(m.group(1)) for m in re.finditer(r"^ +(\d+) .*?  (triton::\S+)  ", table, re.M)}
    assert calls == {"triton::slot_sum": 2, "triton::gather_rows": 1, "triton::combine_backward": 1}
    assert not re.search(r"aten::index_select  \[\d+, 16\]", table)  # no d_model-wide gather
    assert "aten::addcmul" not in table and "aten::cat  [65, 16]" not in table
    assert "aten::bmm(out_dtype=float32)" not in table  # the dots are in the combine's kernel
    assert {name: getattr(_gather_triton, name) for name in saved} == saved
