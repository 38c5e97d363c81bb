"""Half-precision matmuls with float32 results on CUDA: speed machinery, fenced off from the
algorithms that use it (the routers' scores, the combine's weight gradient).

The product of two bfloat16 (or two float16) numbers is exact in float32, so a matmul that reads
half-precision operands, sums in float32 and writes float32 computes what the same matmul on
float32 copies computes (up to the order of the float32 sums), on the tensor cores and without the
copies. torch (>= 2.8) has it as ``torch.mm`` / ``torch.bmm`` with ``out_dtype=torch.float32``, with
CUDA kernels only. On an H200 at 64k tokens x 4096 (``tools/gpu_kernel_probe.py``, 2026-11-26):
router logits 1.58 -> 0.20 ms, per-row dots 1.76 -> 1.00 ms.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["HALF", "half_kernels", "mm_f32", "row_dots_f32"]

HALF = (torch.bfloat16, torch.float16)
_OUT_DTYPE = "dtype" in torch.ops.aten.mm.overloads() and "dtype" in torch.ops.aten.bmm.overloads()


def half_kernels(*tensors: Tensor) -> bool:
    """Whether these tensors take the float32-out kernels: CUDA, one half-precision dtype, not
    batched by ``torch.func.vmap`` (its batching rules do not cover ``out_dtype``; the forward of an
    autograd function under ``torch.func.grad`` sees plain tensors and may take them), and not
    under ``torch.compile`` (inductor fuses the float32 paths' casts; ``out_dtype`` matmuls compiled
    inside routelab's autograd functions are untested on a GPU)."""
    first = tensors[0]
    if not (_OUT_DTYPE and first.dtype in HALF and all(t.is_cuda and t.dtype == first.dtype for t in tensors)):
        return False
    if torch.compiler.is_compiling():
        return False
    return not any(torch._C._functorch.is_functorch_wrapped_tensor(t) for t in tensors)


def mm_f32(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` (``[m, k] @ [k, n]``) in float32 for half-precision ``a`` and ``b`` of one dtype:
    exact products summed in float32, float32 out. One tensor-core matmul on CUDA; elsewhere (the
    CPU tests of the paths that use it) the same sums through float32 copies."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def row_dots_f32(a: Tensor, b: Tensor) -> Tensor:
    """``<a[r], b[r]>`` per row (``[R, d]``, ``[R, d]`` -> ``[R]`` float32) for half-precision
    ``a`` and ``b`` of one dtype: exact products summed in float32. One batched ``1 x d x 1`` matmul
    on CUDA (no ``[R, d]`` float32 products written and read back); elsewhere through float32
    copies."""
    if a.is_cuda:
        return torch.bmm(a.unsqueeze(1), b.unsqueeze(2), out_dtype=torch.float32).view(-1)
    return (a.float() * b.float()).sum(-1)
