"""tools/gpu_env.py (the environment check of `make test-gpu`), run on CPU with packages hidden."""

from __future__ import annotations

import importlib.util
from types import ModuleType

import pytest
import torch

from tool_modules import load_tool


def _load() -> ModuleType:
    return load_tool("gpu_env")


def _hide(monkeypatch: pytest.MonkeyPatch, module: ModuleType, *names: str) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(module.importlib.util, "find_spec", lambda name, *a: None if name in names else real(name, *a))


def test_reports_torch_and_passes_without_cuda_unless_required(capsys: pytest.CaptureFixture[str],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    gpu_env = _load()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _hide(monkeypatch, gpu_env, "numba")
    assert gpu_env.main([]) == 0
    out = capsys.readouterr().out
    assert f"torch {torch.__version__}" in out and "torch.cuda.is_available(): False" in out
    assert "optional numba: missing -> the compiled assignment kernel's tests" in out
    assert gpu_env.main(["--require-cuda"]) == 1
    assert "CUDA is not available" in capsys.readouterr().out


def test_a_missing_required_package_fails_with_the_fix(capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    gpu_env = _load()
    _hide(monkeypatch, gpu_env, "scipy", "hypothesis")
    assert gpu_env.main([]) == 1
    out = capsys.readouterr().out
    assert "required scipy: MISSING" in out and "missing required package(s): scipy, hypothesis" in out
    assert "make gpu-wheels" in out
