"""Where the fused Triton gathers run in the tests: CUDA, else the CPU in Triton's interpreter
(``TRITON_INTERPRET=1``, which tests/conftest.py sets without CUDA). Importable from every test
directory (pytest puts ``tests/`` on ``sys.path``)."""

from __future__ import annotations

import os

import pytest
import torch

from routelab.routing import _gather_triton

#: The device types the kernels may take here.
KERNEL_DEVICES = ("cuda", "cpu") if os.environ.get("TRITON_INTERPRET") == "1" else ("cuda",)


def kernel_device(monkeypatch: pytest.MonkeyPatch) -> str:
    """The device the kernels run on here (the CPU's interpreter enabled through ``monkeypatch``), or
    a skip: no Triton, or neither CUDA nor the interpreter."""
    if _gather_triton.triton is None:
        pytest.skip("Triton is not installed")
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        return "cuda"
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no CUDA device, and Triton's interpreter is off (TRITON_INTERPRET)")
    monkeypatch.setattr(_gather_triton, "DEVICE_TYPES", KERNEL_DEVICES)
    return "cpu"

