"""The gathers of dispatch and combine as fused Triton kernels on CUDA: speed machinery, fenced
off from :mod:`routelab.routing._gather` (which defines what they compute and falls back to
PyTorch operators wherever these kernels do not apply).

Each kernel computes one of ``_gather``'s gathers in one pass over memory, where the PyTorch
formulation takes three to five (a zero row appended by ``cat``, an ``index_select``, float32
products, a float32 sum, a rounding copy). On a GPU these gathers are memory-bound: at 64k
tokens of width 4096 every ``[tokens, d]`` pass is half a GiB of bfloat16 read or written.

The maps are the plans' (``_gather``'s module docstring): ``token_of_row [R]`` with ``n`` for a
row of no pair, ``row_of_slot [n, s]`` with ``R`` for a dropped pair. A sentinel index reads
nothing (its value is zero), so no zero row is appended, and a row of no pair (uninitialised after
a grouped matmul) is never read.

What they compute, in the precision of ``_gather``'s PyTorch paths (each product in float32,
the sums in float32 in slot order, one rounding to the output dtype):

* :func:`gather_rows`: ``out[r] = src[index[r]]`` (dispatch forward);
* :func:`slot_sum`: ``out[t] = sum_j w[t, j] * src[index[t, j]]`` (combine forward; dispatch
  backward with no weights);
* :func:`combine_backward`: ``grad_rows[r] = w[r] * grad_y[t]`` and ``dots[r] = <rows[r],
  grad_y[t]>`` for ``t = token_of_row[r]`` in one pass (combine backward).

Float32 kernels are compiled without fused multiply-adds, so float32 results equal the PyTorch
path's bit for bit where the order of the sums is the same (all but the dots).

One program handles one output row, looping over its columns in blocks. The width ``d`` and the
number of slots are compile-time constants: Triton compiles a kernel once per dtype, width and
slot count, a handful in a model. On an H200 at 64k tokens x 4096 in bfloat16, top-2, the four
kernels take 2.2 ms where the PyTorch operators took 11.0 ms (``tools/gpu_kernel_probe.py``,
2026-11-26; each kernel near 3.6 TB/s).

A test can run the kernels in Triton's interpreter on CPU tensors: ``TRITON_INTERPRET=1`` set
before routelab is imported (Triton reads it when ``triton.language`` is imported and when a kernel
is decorated, so the kernels are decorated here, at import, under the same setting; a later change
of the variable would mix compiled and interpreted Triton in one kernel).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from types import SimpleNamespace

import torch
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build of torch comes without Triton
    triton = None

__all__ = ["usable", "gather_rows", "slot_sum", "combine_backward"]

#: The dtypes the kernels take (float64 stays on PyTorch's operators).
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: The devices the kernels run on; the CPU tests add "cpu" together with TRITON_INTERPRET=1.
DEVICE_TYPES: tuple[str, ...] = ("cuda",)
#: Columns per loop step and warps per program: 1024 columns with 4 warps is 16 bytes per thread
#: and load in half precision (tools/gpu_kernel_probe.py times other settings).
_MAX_BLOCK = 1024
_NUM_WARPS = 4


def usable(*tensors: Tensor, indices: Sequence[Tensor] = ()) -> bool:
    """Whether the fused kernels compute the gathers of these tensors: Triton importable; the
    data ``tensors`` in one of :data:`DTYPES` and the ``indices`` (the maps) ``int64``, all on one
    CUDA device; plain tensors (not fake, not batched by ``torch.func`` transforms); and no
    tracing: not under ``torch.compile`` (inductor fuses the PyTorch formulation itself) or a
    dispatch mode (which would not see the kernels).

    The maps' values are not checked: the plans build them in range (an index past the sentinel
    would read as the sentinel does, where ``index_select`` raises)."""
    if triton is None:
        return False
    first = tensors[0]
    if first.dtype not in DTYPES or first.device.type not in DEVICE_TYPES:
        return False
    if any(t.dtype != first.dtype or t.device != first.device for t in tensors):
        return False
    if any(i.dtype != torch.int64 or i.device != first.device for i in indices):
        return False
    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
        return False  # traced, or seen by a dispatch mode (fake tensors, an operator counter)
    # Plain tensors only: not fake, functional or another subclass, not batched by torch.func.
    return all(type(t) is torch.Tensor and not torch._C._functorch.is_functorch_wrapped_tensor(t)
               for t in (*tensors, *indices))


# --- kernel bodies (decorated below) ---------------------------------------------------------

def _gather_rows_body(src_ptr, index_ptr, out_ptr, n_src, D: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    i = tl.load(index_ptr + r)
    valid = i < n_src
    for start in range(0, D, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < D
        v = tl.load(src_ptr + i * D + cols, mask=inside & valid, other=0.0)
        tl.store(out_ptr + r * D + cols, v, mask=inside)


def _slot_sum_body(src_ptr, index_ptr, weight_ptr, out_ptr, n_src, D: tl.constexpr,
                   S: tl.constexpr, WEIGHTED: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    for start in range(0, D, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < D
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for j in tl.static_range(S):
            i = tl.load(index_ptr + t * S + j)
            v = tl.load(src_ptr + i * D + cols, mask=inside & (i < n_src), other=0.0).to(tl.float32)
            if WEIGHTED:
                v = v * tl.load(weight_ptr + t * S + j).to(tl.float32)
            acc = acc + v
        tl.store(out_ptr + t * D + cols, acc.to(out_ptr.dtype.element_ty), mask=inside)


def _combine_backward_body(rows_ptr, grad_y_ptr, token_ptr, weight_ptr, grad_rows_ptr, dots_ptr, n, D: tl.constexpr,
                           ROWS: tl.constexpr, DOTS: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    t = tl.load(token_ptr + r)
    valid = t < n
    if ROWS:
        w = tl.load(weight_ptr + r).to(tl.float32)
    dot = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, D, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < D
        g = tl.load(grad_y_ptr + t * D + cols, mask=inside & valid, other=0.0).to(tl.float32)
        if ROWS:
            tl.store(grad_rows_ptr + r * D + cols, (g * w).to(grad_rows_ptr.dtype.element_ty), mask=inside)
        if DOTS:
            x = tl.load(rows_ptr + r * D + cols, mask=inside & valid, other=0.0).to(tl.float32)
            dot = dot + x * g
    if DOTS:
        tl.store(dots_ptr + r, tl.sum(dot, axis=0))


#: Whether the kernels run in Triton's interpreter: ``TRITON_INTERPRET`` as it was at import.
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
#: The three kernels, decorated at import (see the module's docstring); None without Triton.
_KERNELS = None if triton is None else SimpleNamespace(
    gather_rows=triton.jit(_gather_rows_body), slot_sum=triton.jit(_slot_sum_body),
    combine_backward=triton.jit(_combine_backward_body))


def _launch(kernel_name: str, device: torch.device, rows: int, d: int, *args, **constexprs) -> None:
    """Launch ``kernel_name`` with one program per output row (``rows`` of them) on ``device``, the
    ``d`` columns in blocks of at most :data:`_MAX_BLOCK`."""
    if rows == 0:
        return
    block = min(_MAX_BLOCK, triton.next_power_of_2(max(d, 1)))
    kernel = getattr(_KERNELS, kernel_name)
    # No fused multiply-adds: in float32 a product and its sum are rounded apart, as PyTorch's.
    options = {} if _INTERPRET else {"num_warps": _NUM_WARPS, "enable_fp_fusion": False}
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        kernel[(rows,)](*args, BLOCK=block, **constexprs, **options)


def gather_rows(src: Tensor, index: Tensor) -> Tensor:
    """``out[r] = src[index[r]]``, zeros where ``index[r] = m`` (``[m, d]``, ``LongTensor [R]`` in
    ``[0, m]`` -> ``[R, d]``)."""
    src, index = src.contiguous(), index.contiguous()
    m, d = src.shape
    out = src.new_empty(index.shape[0], d)
    _launch("gather_rows", src.device, index.shape[0], d, src, index, out, m, D=d)
    return out


def slot_sum(src: Tensor, index: Tensor, weight: Tensor | None = None) -> Tensor:
    """``out[t] = sum_j weight[t, j] * src[index[t, j]]`` (``[m, d]``, ``LongTensor [n, s]`` in
    ``[0, m]``, ``[n, s]`` or None for weights 1 -> ``[n, d]``): a sentinel ``m`` adds nothing;
    products and sums in float32, slot by slot, rounded once to ``src``'s dtype."""
    src, index = src.contiguous(), index.contiguous()
    m, d = src.shape
    n, s = index.shape
    out = src.new_empty(n, d)
    if s == 0:
        return out.zero_()
    w = weight.contiguous() if weight is not None else index  # an unread placeholder when unweighted
    _launch("slot_sum", src.device, n, d, src, index, w, out, m, D=d, S=s, WEIGHTED=weight is not None)
    return out


def combine_backward(rows: Tensor, grad_y: Tensor, token_of_row: Tensor, weight_of_row: Tensor | None,
                     dots: bool) -> tuple[Tensor | None, Tensor | None]:
    """The combine's two adjoints in one pass over the rows (``rows [R, d]``, ``grad_y [n, d]``,
    ``token_of_row [R]`` in ``[0, n]``, ``weight_of_row [R]`` in ``rows``' dtype or None):
    ``grad_rows[r] = weight_of_row[r] * grad_y[t]`` (when ``weight_of_row`` is given) and
    ``dots[r] = <rows[r], grad_y[t]>`` in float32 (when ``dots``), ``t = token_of_row[r]``; zeros
    for a row of no pair (``t = n``), whose ``rows[r]`` is never read."""
    rows, grad_y, token_of_row = rows.contiguous(), grad_y.contiguous(), token_of_row.contiguous()
    R, d = rows.shape
    n = grad_y.shape[0]
    grad_rows = rows.new_empty(R, d) if weight_of_row is not None else None
    out_dots = rows.new_empty(R, dtype=torch.float32) if dots else None
    if grad_rows is None and out_dots is None:
        return None, None
    w = weight_of_row.contiguous() if weight_of_row is not None else token_of_row
    _launch("combine_backward", rows.device, R, d, rows, grad_y, token_of_row, w,
            grad_rows if grad_rows is not None else rows, out_dots if out_dots is not None else token_of_row,
            n, D=d, ROWS=weight_of_row is not None, DOTS=dots)
    return grad_rows, out_dots
