"""routelab._checks.device_scalar and to_device: host numbers and host tensors on the device without a
host sync (a fill; a pinned, non-blocking copy), equal to what the blocking forms give."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from host_syncs import record_host_syncs
from routelab._checks import device_scalar, to_device

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


@pytest.mark.parametrize("dtype", [None, torch.float32, torch.float64, torch.bfloat16, torch.int64])
def test_to_device_on_the_cpu_is_the_conversion(dtype) -> None:
    """On the CPU no copy is needed: the host tensor itself, converted as ``.to(dtype)`` would."""
    host = torch.from_numpy(np.array([[0.1, -2.5], [3e38, 7.0]]))
    got = to_device(host, torch.device("cpu"), dtype)
    want = host if dtype is None else host.to(dtype)
    assert got.dtype == want.dtype and got.device.type == "cpu" and torch.equal(got, want)
    if dtype is None:
        assert got is host


def test_to_device_makes_no_blocking_copy_of_host_data() -> None:
    """The recorder sees ``torch.from_numpy(a).to(d)`` (on CUDA a copy that waits for the stream)
    and not :func:`to_device` of the same data."""
    device = torch.zeros(1).device  # (a torch.device: on a GPU run it would be the GPU's)
    with record_host_syncs() as found:
        torch.from_numpy(np.ones(3)).to(device=device, dtype=torch.float32)
    assert [f.op for f in found] == ["Tensor.to(device) of host data"]
    with record_host_syncs() as found:
        to_device(torch.from_numpy(np.ones(3)), device, torch.float32)
    assert found == []


@pytest.mark.requires_cuda
def test_to_device_on_cuda_does_not_sync_and_owns_its_data() -> None:
    """On CUDA: equal values, on the device, no sync even behind queued work; the host array may
    change right after the call (the copy reads the pinned staging block, not the array)."""
    big = torch.randn(4096, 4096, device="cuda")
    array = np.arange(12, dtype=np.float64).reshape(3, 4)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(4):
            big = big @ big  # queued work the copy must not wait for
        got = to_device(torch.from_numpy(array), "cuda", torch.float32)
        bits = to_device(torch.arange(5), torch.device("cuda"))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    array[:] = -1.0
    torch.cuda.synchronize()
    assert got.is_cuda and got.dtype == torch.float32 and bits.is_cuda and bits.dtype == torch.int64
    assert torch.equal(got.cpu(), torch.arange(12, dtype=torch.float32).reshape(3, 4))
    assert torch.equal(bits.cpu(), torch.arange(5))
