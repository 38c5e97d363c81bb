"""Argument checks shared by the benchmarks."""

from __future__ import annotations

import torch

from .._checks import check_positive_int


def check_device_and_threads(device: str, threads: int) -> None:
    """ValueError for an unknown device, ``device="cuda"`` without CUDA, or ``threads < 1``."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was requested but torch.cuda.is_available() is False "
                         "(this torch build or machine has no usable CUDA GPU); use device='cpu'")
    check_positive_int("threads", threads)
