"""routelab._checks.device_scalar: a host number on the device by a fill, equal to torch.as_tensor's."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from host_syncs import record_host_syncs
from routelab._checks import device_scalar

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.int64]


@given(value=st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-2**62, 2**62),
                       st.integers(-2**1100, 2**1100)),
       dtype=st.sampled_from(DTYPES))
def test_the_fill_equals_as_tensors_conversion(value, dtype) -> None:
    """The value as ``torch.as_tensor(value, dtype=dtype)`` converts it (rounded to nearest, to
    +-inf beyond the dtype's range), on ``like``'s device, 0-dim; an integer beyond float64 is +-inf
    (as_tensor raises there)."""
    if dtype == torch.int64 and not (isinstance(value, int) and abs(value) < 2**62):
        return  # (integer dtypes take integers: the capacity and token counts)
    like = torch.zeros(3, dtype=torch.float32)
    got = device_scalar(value, like, dtype)
    assert got.shape == () and got.dtype == dtype and got.device == like.device
    try:
        want = torch.as_tensor(value, dtype=dtype)
    except (OverflowError, RuntimeError):
        assert isinstance(value, int) and got.item() == (math.inf if value > 0 else -math.inf)
        return
    assert torch.equal(got, want) or (math.isnan(got.item()) and math.isnan(want.item()))


def test_the_default_dtype_is_likes() -> None:
    like = torch.zeros(2, dtype=torch.bfloat16)
    assert device_scalar(0.1, like).dtype == torch.bfloat16
    assert device_scalar(7, torch.zeros(1, dtype=torch.long)).item() == 7


@pytest.mark.parametrize("value", [0.5, 3, 1e300, 2**2000])
def test_no_copy_from_the_host(value) -> None:
    """The whole point: no ``torch.tensor(..., device=)`` (a sync on CUDA, pytorch#190217). A value
    beyond the dtype's range is rounded on the host (a CPU tensor: no device involved)."""
    like = torch.zeros(2)
    with record_host_syncs() as found:
        device_scalar(value, like)
    assert [f for f in found if "host data" in f.op] == []


@pytest.mark.requires_cuda
def test_a_fill_on_cuda_does_not_sync() -> None:
    like = torch.zeros(2, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for value in (0.5, 3, 1e300):
            device_scalar(value, like)
        device_scalar(5, like, torch.long)
    finally:
        torch.cuda.set_sync_debug_mode("default")
