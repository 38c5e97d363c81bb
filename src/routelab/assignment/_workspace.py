"""Scratch tensors reused across calls of the CPU solvers.

PyTorch's CPU allocator hands large temporaries back to the operating system when they are
freed, so the next call's temporaries of the same size start on fresh pages and pay a page fault
per 4 KiB page the first time they are written. On the machines this library is benchmarked on
(virtual machines), a fault costs about 3 us: an ``n x k`` float32 temporary at ``n = 4096``,
``k = 64`` (1 MiB) costs ~0.8 ms of faults against ~0.03 ms of arithmetic. The solvers therefore
keep their few large scratch tensors here, one set per thread, and reuse them call after call.
CUDA has its own caching allocator: there :func:`scratch` simply allocates.

Scratch tensors are never returned to callers: every public function copies what it returns.

The two ``[B, n, k]``-sized slots :data:`SCORES_A` and :data:`SCORES_B` are shared by the
phases of the balanced-assignment solver, which run one after the other (prices: logits and
softmax; start: reduced scores and the top-two work space; cycle cancelling: the move-cost
table in A). Fewer distinct megabytes stay warmer in the caches between calls.
"""

from __future__ import annotations

import threading

import torch

__all__ = ["scratch", "clear", "NORMALISED", "SCORES_A", "SCORES_B"]

SCORES_A = "scores-sized.a"
SCORES_B = "scores-sized.b"
#: The normalised scores every phase of the balanced-assignment solver reads.
NORMALISED = "scores-sized.normalised"
#: The largest scratch tensor kept between calls (a one-off huge batch should not pin its memory).
MAX_CACHED_BYTES = 64 << 20

_local = threading.local()


def scratch(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised tensor of ``shape`` for the caller's scratch slot ``name``.

    Two calls with the same ``name`` (same thread, dtype and device) share memory, so a caller
    must use a distinct name for every scratch tensor that is alive at the same time. The slot
    grows to the largest size requested and is kept until :func:`clear`; requests above
    ``MAX_CACHED_BYTES`` are plain allocations (not kept).
    """
    device = torch.device(device)
    numel = 1
    for size in shape:
        numel *= size
    if device.type != "cpu" or numel * dtype.itemsize > MAX_CACHED_BYTES:
        return torch.empty(shape, dtype=dtype, device=device)
    slots: dict = getattr(_local, "slots", None) or {}
    _local.slots = slots
    key = (name, dtype)
    buffer = slots.get(key)
    if buffer is None or buffer.numel() < numel:
        # A normal tensor even when created under torch.inference_mode(): an inference tensor
        # could not be written to by a later call made outside inference mode.
        with torch.inference_mode(False):
            buffer = torch.empty(numel, dtype=dtype, device=device)  # (the CPU: not the default device)
        slots[key] = buffer
    return buffer[:numel].view(shape)


def clear() -> None:
    """Free this thread's scratch tensors (they are re-created on the next solver call).

    Exported as :func:`routelab.assignment.clear_scratch`.
    """
    _local.slots = {}
