"""Router scores in float32 from inputs of any dtype, at the input's memory cost.

Routing decisions (top-k, capacity, balanced assignment) are fragile in half precision, so
routelab's routers score in float32 whatever the input dtype, also inside ``torch.autocast``
regions (which would otherwise run the scoring matmul in half precision). The plain way,
``F.linear(x.float(), w.float())``, keeps the float32 copy of ``x`` alive for the backward: for a
bfloat16 model that is twice the layer's input, per MoE layer (128 MiB at 8192 tokens of width
4096). :func:`float32_linear` computes the same values and gradients but saves ``x`` in its own
dtype and casts again in the backward.

On CUDA, a bfloat16 or float16 ``x`` with a weight of its dtype is scored on the tensor cores
instead (:mod:`routelab._float32_out`): the products of half-precision numbers are exact in
float32, so a half-precision matmul that sums in float32 and writes float32 gives the float32
linear's values without the float32 copies of ``x`` and without the float32 (non-tensor-core)
matmuls. At d_model 4096 and 64k bfloat16 tokens those were about 4 ms of a
31 ms MoE layer step on an H200 (docs/gpu-profile-h200.md).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _autograd, _float32_out

__all__ = ["float32_linear", "full_precision"]


def full_precision(device: torch.device) -> AbstractContextManager[None]:
    """``torch.autocast`` off on ``device``'s type where it is on (else a no-op context; also on
    device types autocast does not know, such as ``meta``)."""
    # (Dynamo cannot trace the availability query in torch 2.11; the device types it compiles for
    # all have autocast.)
    if not torch.compiler.is_compiling() and not torch.amp.is_autocast_available(device.type):
        return nullcontext()
    if torch.is_autocast_enabled(device.type):
        return torch.autocast(device.type, enabled=False)
    return nullcontext()


def _split_bfloat16(g: Tensor) -> Tensor:
    """``g [m, n]`` float32 as ``[hi, lo] [m, 2n]`` bfloat16 with ``hi + lo = g``: ``hi`` is ``g``
    rounded (clamped to bfloat16's largest finite number first, so that a finite ``g`` beyond it
    stays finite), ``lo`` its rounded remainder (0 where ``g`` is not finite, whose ``hi`` carries
    it). A bfloat16 matmul of ``[hi, lo]`` against ``[w; w]`` then sums ``g @ w`` in float32 from
    exact products, to well within one rounding of its bfloat16 result.

    The split is exact to about 2^-17 relatively where ``|g| >= 2^-110`` (about 8e-34). Below, ``lo``
    is a bfloat16 subnormal: the error is at most 2^-134 absolutely (the float32 path's own
    float32 gradient is subnormal below 2^-126). A product of a part with the weight below
    float32's smallest normal (2^-126) may be flushed to zero by the matmul, as the float32 path's
    own products may: at most 2^-126 per product (a gradient of ~1e-35 came out one bfloat16 ulp
    off)."""
    top = torch.finfo(torch.bfloat16).max
    hi = torch.where(g.isinf(), g, g.clamp(-top, top)).to(torch.bfloat16)
    lo = (g - hi.float()).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0).to(torch.bfloat16)
    return torch.cat([hi, lo], dim=-1)


class _Float32Linear(torch.autograd.Function):
    """``x @ weight.T (+ bias)`` in float32; saves ``x`` and ``weight`` in their own dtypes.

    On the half-precision kernels (:func:`routelab._float32_out.half_kernels`) the forward is one
    ``out_dtype`` matmul.
    The backward of a bfloat16 ``x`` splits the float32 gradient into two bfloat16 parts
    (:func:`_split_bfloat16`), so that both gradients are again tensor-core matmuls: ``grad_x`` is
    written in bfloat16 directly (summed in float32 and rounded once, as the float32 path rounds
    its float32 result, where cuBLAS does not split the ``2 * d_out``-long sums: with
    ``torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction`` a split sum may be added
    in bfloat16), ``grad_w`` in float32 and summed over the two parts. A float16 ``x`` (whose range
    cannot hold the parts) and a backward that builds a graph (double backward; ``torch.func.grad``
    and ``jacrev``, whose forward may take the kernels) take the float32 path.

    Written with ``setup_context`` and a generated vmap rule (and, eagerly, a ``jvp``:
    :class:`_Float32LinearForwardMode`), so ``torch.func`` transforms (``grad``, ``vmap``,
    ``jacrev``, ``jvp``, ``jacfwd``) work through it as through ``F.linear``.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:  # type: ignore[override]
        if _float32_out.half_kernels(x, weight):
            out = _float32_out.mm_f32(x.reshape(-1, x.shape[-1]), weight.t()).view(*x.shape[:-1], weight.shape[0])
            return out if bias is None else out + bias.float()
        return F.linear(x.float(), weight.float(), None if bias is None else bias.float())

    @staticmethod
    def setup_context(ctx, inputs: tuple[Tensor, Tensor, Tensor | None], output: Tensor) -> None:
        x, weight, bias = inputs
        ctx.save_for_backward(x, weight)
        ctx.bias_dtype = None if bias is None else bias.dtype

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:  # type: ignore[override]
        # Differentiable operations only (no once_differentiable): double backward works.
        x, weight = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        flat_grad = grad.reshape(-1, grad.shape[-1])
        if x.dtype == torch.bfloat16 and not torch.is_grad_enabled() and _float32_out.half_kernels(x, weight):
            parts = _split_bfloat16(flat_grad.float())  # [tokens, 2 * d_out]
            if ctx.needs_input_grad[0]:
                grad_x = (parts @ torch.cat([weight, weight])).view(x.shape)
            if ctx.needs_input_grad[1]:
                both = _float32_out.mm_f32(parts.t(), x.reshape(-1, x.shape[-1]))  # [2 * d_out, d_in]
                grad_w = (both[: weight.shape[0]] + both[weight.shape[0]:]).to(weight.dtype)
            if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
                grad_b = flat_grad.sum(0).to(ctx.bias_dtype)
            return grad_x, grad_w, grad_b
        if ctx.needs_input_grad[0]:
            grad_x = (grad @ weight.float()).to(x.dtype)
        if ctx.needs_input_grad[1]:
            grad_w = (flat_grad.T @ x.reshape(-1, x.shape[-1]).float()).to(weight.dtype)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            grad_b = flat_grad.sum(0).to(ctx.bias_dtype)
        return grad_x, grad_w, grad_b


class _Float32LinearForwardMode(_Float32Linear):
    """:class:`_Float32Linear` with its ``jvp``, for eager calls (Dynamo cannot trace a Function
    that defines one: traced calls take the class above)."""

    @staticmethod
    def setup_context(ctx, inputs: tuple[Tensor, Tensor, Tensor | None], output: Tensor) -> None:
        _Float32Linear.setup_context(ctx, inputs, output)
        ctx.save_for_forward(inputs[0], inputs[1])

    @staticmethod
    def jvp(ctx, x_t: Tensor | None, weight_t: Tensor | None, bias_t: Tensor | None) -> Tensor | None:
        """The float32 tangent ``x_t W^T + x W_t^T + b_t`` (bilinear, as F.linear's)."""
        x, weight = ctx.saved_tensors
        terms = [t for t in (None if x_t is None else F.linear(x_t.float(), weight.float()),
                             None if weight_t is None else F.linear(x.float(), weight_t.float()),
                             None if bias_t is None else bias_t.float().expand(*x.shape[:-1], weight.shape[0]))
                 if t is not None]
        return sum(terms[1:], terms[0]) if terms else None


def float32_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x @ weight.T + bias`` computed in float32, with autocast off.

    The values and gradients of ``F.linear(x.float(), weight.float(), bias.float())``; for an ``x``
    that is not float32 the backward keeps ``x`` itself, not its float32 copy (half the memory for
    bfloat16 inputs). Supports double backward and ``torch.compile``.

    Args:
        x: ``[..., d_in]``, any floating dtype.
        weight: ``[d_out, d_in]``.
        bias: ``[d_out]`` or ``None``.

    Returns:
        ``[..., d_out]`` float32.
    """
    with full_precision(x.device):
        if x.dtype == torch.float32 and weight.dtype == torch.float32:
            return F.linear(x, weight, None if bias is None else bias.float())
        fn = _Float32Linear if torch.compiler.is_compiling() else _Float32LinearForwardMode
        return _autograd.apply(fn, x, weight, bias)
