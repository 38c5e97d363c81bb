"""tools/layer_host_time.py (the host-time A/B of docs/gpu-sessions.md), with a few steps."""

from __future__ import annotations

import re

import pytest
import torch

import routelab.routing._gather as gather
from tool_modules import load_tool


def test_one_line_per_case_and_the_switches_restored(capsys: pytest.CaptureFixture[str]) -> None:
    before = (gather._adjoint_by_default, torch.get_num_threads())
    load_tool("layer_host_time").main(["--reps", "3", "--cases", "4:1", "4:2", "--dtype", "float32"])
    out = capsys.readouterr().out
    assert "float32, router topk" in out
    steps = re.findall(r"^E=(\d+) k=(\d+): (\d+) us per step \(median of 3\); (\d+) operators, (\d+) that compute$",
                       out, re.M)
    assert [(e, k) for e, k, *_ in steps] == [("4", "1"), ("4", "2")]
    assert all(int(us) > 0 and int(every) > int(computing) > 0 for _, _, us, every, computing in steps)
    assert int(steps[1][3]) > int(steps[0][3])  # two slots take more operators than one
    assert (gather._adjoint_by_default, torch.get_num_threads()) == before


def test_bad_reps_is_a_usage_error() -> None:
    with pytest.raises(SystemExit):
        load_tool("layer_host_time").main(["--reps", "0"])
