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
    assert "aten::" in out.split("largest first")[1]


def test_it_leaves_the_gathers_default_path_as_it_found_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from routelab.routing import _gather

    default = _gather._adjoint_by_default
    monkeypatch.setattr(sys, "argv", ["layer_traffic.py", "--d-model", "16", "--d-hidden", "32", "--tokens", "32",
                                      "--experts", "4", "--top", "1"])
    _load().main()
    assert _gather._adjoint_by_default is default
