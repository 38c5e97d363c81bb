"""Grouped matmuls for the stacked experts: speed machinery, fenced off from the layer.

``torch.nn.functional.grouped_mm(rows, weight, offs=offsets)`` (``torch._grouped_mm`` in torch
versions without the public name) multiplies the rows of group ``e`` (rows
``offsets[e-1]:offsets[e]`` of ``rows [R, a]``) by ``weight[e] [a, b]`` in one call, without
padding the groups to a common size. Which dtypes, devices and layouts it accepts differs between
torch versions and GPUs (and ``torch.compile`` accepts bfloat16 only), so :func:`grouped_mm_supported`
probes it once per device and dtype on a tiny problem against a per-group reference, forward and
backward, and the stacked experts fall back to batched matmuls over padded buffers where it
says no. On CUDA only bfloat16 is accepted: torch's other dtypes run a host-synchronising loop
over the groups there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch
from torch import Tensor

__all__ = ["grouped_mm", "grouped_mm_supported", "grouped_mm_unsupported_reason"]

#: Row strides of every operand must be multiples of this many bytes.
_ALIGNMENT_BYTES = 16

#: The operator: the public name where torch has it, else the private one (torch 2.8-2.9), else None.
_OPERATOR = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)

#: The probe's verdict per (device type, device index, dtype): ``None`` where the grouped product
#: matched per-expert matmuls, else why not.
_PROBED: dict[tuple[str, int | None, torch.dtype], str | None] = {}


def grouped_mm(rows: Tensor, weight: Tensor, offsets: Tensor) -> Tensor:
    """``out[r] = rows[r] @ weight[e]`` for the rows ``r`` of group ``e``.

    Args:
        rows: ``[R, a]``, grouped: group ``e`` is rows ``offsets[e-1] <= r < offsets[e]``.
        weight: ``[E, a, b]``.
        offsets: ``IntTensor [E]`` (int32), non-decreasing, ``offsets[-1] <= R``.

    Returns:
        ``[R, b]``; rows from ``offsets[-1]`` on are unspecified (uninitialised memory), as are
        their input gradients.
    """
    return _OPERATOR(rows, weight, offs=offsets)


def _aligned(dtype: torch.dtype, widths: Iterable[int]) -> bool:
    size = dtype.itemsize
    return all((w * size) % _ALIGNMENT_BYTES == 0 for w in widths)


def _misaligned(t: Tensor) -> bool:
    """Whether ``t``'s data does not start at a multiple of 16 bytes; True where it cannot be read
    (a tensor without storage, as inside ``torch.func`` transforms: the buffers layout is then used)."""
    try:
        return t.data_ptr() % _ALIGNMENT_BYTES != 0
    except RuntimeError:
        return True


def grouped_mm_supported(device: torch.device, dtype: torch.dtype, widths: Iterable[int],
                         tensors: Iterable[Tensor] = ()) -> bool:
    """Whether :func:`grouped_mm` runs here, on contiguous operands whose row widths are ``widths``.

    Eagerly, a tiny grouped product (three groups, one of them empty, and rows past the last
    group) is computed once per device and dtype and compared, with its gradients, with the
    per-group matmuls; any error or mismatch is a no, for the rest of the process. While
    ``torch.compile`` traces, only bfloat16 is accepted (the operator's meta function refuses
    the others), from the probe's earlier verdict when there is one.

    Args:
        device: where the operands are.
        dtype: their dtype.
        widths: the last dimension of every operand (e.g. ``d_model`` and ``d_hidden``), each of
            which must be a multiple of 16 bytes.
        tensors: operands whose storage must start at a multiple of 16 bytes (weights loaded by
            memory-mapping need not; the kernels of some torch versions require it).
    """
    return grouped_mm_unsupported_reason(device, dtype, widths, tensors) is None


def grouped_mm_unsupported_reason(device: torch.device, dtype: torch.dtype, widths: Iterable[int],
                                  tensors: Iterable[Tensor] = ()) -> str | None:
    """Why :func:`grouped_mm` does not run here (``None``: it does); the arguments and the checks
    of :func:`grouped_mm_supported`, whose answer this is."""
    widths = tuple(widths)
    if _OPERATOR is None:
        return f"torch {torch.__version__} has no grouped matmul (torch.nn.functional.grouped_mm or torch._grouped_mm)"
    if device.type not in ("cpu", "cuda"):
        return f"grouped matmuls are used on CPU and CUDA devices only, not {device.type}"
    if device.type == "cuda" and dtype != torch.bfloat16:
        # torch's CUDA kernels for grouped matmuls are bfloat16 ones; other dtypes run a per-group
        # fallback that reads the offsets on the host, a synchronisation per call (seen on an H200,
        # torch 2.11), which the grouped layout exists to avoid.
        return (f"on CUDA only bfloat16 runs grouped, not {dtype}: torch's grouped matmul in other dtypes "
                "reads the group sizes on the host, a synchronisation per call")
    if not _aligned(dtype, widths):
        return (f"d_model and d_hidden must be multiples of {_ALIGNMENT_BYTES} bytes: {widths} x "
                f"{dtype.itemsize} bytes ({dtype})")
    key = (device.type, device.index, dtype)
    if torch.compiler.is_compiling():  # (storage addresses cannot be read while tracing)
        if dtype != torch.bfloat16:
            return (f"under torch.compile only bfloat16 runs grouped, not {dtype} "
                    "(torch's grouped matmul cannot be traced in it)")
        return _PROBED.get(key)
    if any(_misaligned(t) for t in tensors):
        return (f"the expert weights' storage must start at a multiple of {_ALIGNMENT_BYTES} bytes "
                "(memory-mapped weights need not)")
    if key not in _PROBED:
        _PROBED[key] = _probe(device, dtype)
    return _PROBED[key]


def _probe(device: torch.device, dtype: torch.dtype) -> str | None:
    """Run a tiny grouped product forward and backward against per-group matmuls.

    Returns ``None`` where it matched, else why not: torch's own error where the product raised
    (e.g. a dtype its kernel does not take), or that its values or gradients differed.
    """
    where = f"on {device.type} in {dtype} (torch {torch.__version__})"
    gen = torch.Generator().manual_seed(0)
    a, b = 16, 8
    sizes = (3, 0, 5)
    cpu = torch.device("cpu")  # the references live on the host, whatever the default device
    offsets = torch.tensor(sizes, dtype=torch.int32, device=cpu).cumsum(0).to(torch.int32)
    total = int(offsets[-1])
    rows_ref = torch.randn(total + 2, a, generator=gen, device=cpu)
    weight_ref = torch.randn(len(sizes), a, b, generator=gen, device=cpu)
    grad_ref = torch.randn(total, b, generator=gen, device=cpu)
    try:
        # Its own autograd graph, out of any caller's: no autocast, and no saved-tensor hooks (a
        # first forward under activation checkpointing would count the probe's saved tensors, which
        # the recomputation, finding the verdict cached, does not save again). Where hooks are
        # disabled (vmap, AOTAutograd), pushing one raises: none is pushed, none would run.
        own_hooks = (torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
                     if torch._C._autograd._saved_tensors_hooks_is_enabled() else contextlib.nullcontext())
        with torch.inference_mode(False), torch.enable_grad(), torch.autocast(device.type, enabled=False), own_hooks:
            rows = rows_ref.to(device, dtype).requires_grad_(True)
            weight = weight_ref.to(device, dtype).requires_grad_(True)
            out = grouped_mm(rows, weight, offsets.to(device))
            out[:total].backward(grad_ref.to(device, dtype))
            starts = (0, *offsets[:-1].tolist())
            expected = torch.cat([rows_ref[s:s + n] @ weight_ref[e] for e, (s, n) in enumerate(zip(starts, sizes))])
            weight_grad = torch.stack([rows_ref[s:s + n].T @ grad_ref[s:s + n] for s, n in zip(starts, sizes)])
            rows_grad = torch.cat([grad_ref[s:s + n] @ weight_ref[e].T for e, (s, n) in enumerate(zip(starts, sizes))])
            tol = 1e-4 if dtype in (torch.float32, torch.float64) else 5e-2
            matched = bool(
                torch.allclose(out[:total].float().cpu(), expected, rtol=tol, atol=tol * 10)
                and torch.allclose(weight.grad.float().cpu(), weight_grad, rtol=tol, atol=tol * 10)
                and torch.allclose(rows.grad[:total].float().cpu(), rows_grad, rtol=tol, atol=tol * 10)
            )
    except (RuntimeError, NotImplementedError, TypeError, ValueError) as error:
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        return f"torch's grouped matmul raised {where}: {first_line}"
    return None if matched else f"a tiny grouped product did not match per-expert matmuls {where}"
