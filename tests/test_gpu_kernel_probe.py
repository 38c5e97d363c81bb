"""tools/gpu_kernel_probe.py (the README's kernel probe table), on tiny sizes on the CPU: every
operation is printed with each form's time or the reason it could not run, and forms that run
agree with the first."""

from __future__ import annotations

import re
import sys

import pytest

from tool_modules import load_tool


def test_the_probe_prints_every_form_and_the_forms_that_run_agree(capsys: pytest.CaptureFixture[str],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["gpu_kernel_probe.py", "--tokens", "16", "--d-model", "16", "--experts", "4",
                                      "--reps", "1"])
    load_tool("gpu_kernel_probe").main()
    out = capsys.readouterr().out
    titles = ["router logits [tokens, E] float32", "router input gradient", "a zero row appended",
              "combine's weighted sum over 2 slots", "per-row dots", "dispatch forward", "combine forward:",
              "dispatch backward", "combine backward", "the dots", "other launch settings",
              "expert matmul + bias", "the matmul alone", "router top-2 experts"]
    for title in titles:
        assert title in out
    timed = r"([\d.]+) ms +max \|difference\| from the first ([\d.e+-]+)"
    rows = re.findall(rf"^  (.+?) +(?:{timed}|failed: (.*))$", out, re.M)
    assert len(rows) >= 14 + 20
    for name, ms, diff, failure in rows:
        if failure:  # the out_dtype forms have CUDA kernels only
            assert "out_dtype" in name, (name, failure)
        else:
            # bfloat16 results: forms that sum in another order differ by a rounding at most
            assert float(ms) >= 0 and float(diff) <= 0.05, (name, diff)
