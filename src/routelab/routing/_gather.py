"""The gathers of dispatch and combine, with backward passes that gather too: speed machinery,
fenced off from the plans in :mod:`routelab.routing.dispatch`.

A plan maps pairs to rows both ways: ``token_of_row [R]`` (``n`` for a row of no pair) and
``row_of_slot [n, s]`` (``R`` for a dropped pair), inverse to each other on the kept pairs. So
the adjoint of each gather is again a gather, by the other map:

* dispatch ``rows[r] = x[token_of_row[r]]`` has the adjoint ``grad_x[t] = sum_s
  grad_rows[row_of_slot[t, s]]``;
* combine ``y[t] = sum_s w[t, s] * rows[row_of_slot[t, s]]`` has the adjoints ``grad_rows[r] =
  w[pair of r] * grad_y[token_of_row[r]]`` and ``grad_w[t, s] = <rows[row_of_slot[t, s]], grad_y[t]>``,
  i.e. the dot of row ``r`` with the same gathered ``grad_y[token_of_row[r]]``, read by its slot.

Autograd's own backward of an index is an ``index_put`` with accumulation: a sort of the
indices and a serialised sum on CUDA, and many small host-side operations. The adjoint gathers
need neither, sum every token's slots in a fixed order (deterministic on every device) and
never read a row of no pair (grouped matmuls leave those uninitialised). The sentinels read a
zero row appended to the gathered tensor. On the CPU the plain formulation (``index_select``,
whose backward is a serial ``index_add``, and ``bmm``) is faster and is the default there.

On CUDA, outside tracing and double backward, each of the four gathers is one fused Triton kernel
(:mod:`routelab.routing._gather_triton`: one pass over memory where the operators below take
three to five); the operators below define what the kernels compute and run everywhere else.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _autograd, _float32_out
from . import _gather_triton

__all__ = ["dispatch_rows", "combine_rows"]


def _with_zero_row(t: Tensor) -> Tensor:
    """``t [m, d]`` with a zero row appended (``[m + 1, d]``), read by the sentinel indices.

    A ``cat`` with one zero row: eagerly, ``F.pad`` fills its whole output with zeros before it
    copies ``t`` in, one more write of ``[m + 1, d]`` (0.5 GiB a pad for 64k bfloat16 tokens of
    width 4096, four pads per forward + backward). Compiled, either fuses into its gather."""
    return torch.cat([t, t.new_zeros(1, *t.shape[1:])])


def _slot_rows(rows: Tensor, row_of_slot: Tensor) -> Tensor:
    """``rows[row_of_slot]`` as ``[n, s, d]``, a sentinel ``R`` reading zeros."""
    n, s = row_of_slot.shape
    return _with_zero_row(rows).index_select(0, row_of_slot.reshape(-1)).view(n, s, rows.shape[-1])


def _sum_slots(t: Tensor) -> Tensor:
    """``t [n, s, d]`` summed over the slots (no copy for one slot)."""
    return t[:, 0] if t.shape[1] == 1 else t.sum(1)


class _Dispatch(torch.autograd.Function):
    # setup_context form with a generated vmap rule: torch.func transforms work through it.
    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, token_of_row: Tensor, row_of_slot: Tensor) -> Tensor:
        if _gather_triton.usable(x, indices=(token_of_row,)):
            return _gather_triton.gather_rows(x, token_of_row)  # one pass, no zero row appended
        return _with_zero_row(x).index_select(0, token_of_row)

    @staticmethod
    def setup_context(ctx, inputs: tuple[Tensor, Tensor, Tensor], output: Tensor) -> None:
        ctx.save_for_backward(inputs[2])

    @staticmethod
    def backward(ctx, grad_rows: Tensor) -> tuple[Tensor, None, None]:
        (row_of_slot,) = ctx.saved_tensors
        if not torch.is_grad_enabled() and _gather_triton.usable(grad_rows, indices=(row_of_slot,)):
            return _gather_triton.slot_sum(grad_rows, row_of_slot), None, None
        return _sum_slots(_slot_rows(grad_rows, row_of_slot)), None, None


def _wide(dtype: torch.dtype) -> torch.dtype:
    """float32 for the half-precision dtypes, else the dtype itself (where products are formed
    before they are summed, so that half precision rounds once, as a matmul would)."""
    return torch.promote_types(dtype, torch.float32)


def _weighted_slot_sum(picked: Tensor, weight: Tensor) -> Tensor:
    """``sum_s weight[:, s] * picked[:, s]`` (``[n, s, d]``, ``[n, s]`` -> ``[n, d]``), the products
    and their sum in float32 or wider, rounded once to ``picked``'s dtype.

    Slot by slot, in a fixed order: the float32 operand is the ``[n, 1]`` weight column, so the
    half-precision rows are widened inside each elementwise kernel (on a GPU) rather than copied to
    a float32 ``[n, s, d]`` tensor first: one float32 ``[n, d]`` accumulator in all. In half
    precision each product is exact in float32, so a fused multiply-add (``addcmul``) gives the
    same sums with one pass less; in float32 and float64 a product and its addition are rounded
    apart, bit for bit the plain path's and the compiled one's.
    """
    n, s, d = picked.shape
    if s == 0:
        return picked.new_zeros(n, d)
    wide_weight = weight.to(_wide(picked.dtype))
    exact_products = picked.dtype in (torch.float16, torch.bfloat16)
    total = picked[:, 0] * wide_weight[:, 0:1]
    for j in range(1, s):
        if exact_products:
            total = torch.addcmul(total, picked[:, j], wide_weight[:, j:j + 1])
        else:
            total = total + picked[:, j] * wide_weight[:, j:j + 1]
    return total.to(picked.dtype)


def _row_dots(rows: Tensor, grad_of_row: Tensor) -> Tensor:
    """``<rows[r], grad_of_row[r]>`` per row (``[R, d]``, ``[R, d]`` -> ``[R]``), the products and
    their sum in float32 or wider.

    The products are formed by ``addcmul`` onto a ``[1, 1]`` zero of the wide dtype: type promotion
    widens both half-precision operands inside the kernel (on a GPU), so neither is copied to a
    float32 tensor first, and each product is exact there (half-precision significands multiply
    exactly in float32). In float32 and float64, ``0 + a * b`` is the plain product's rounding.
    Outside a double backward, half-precision CUDA rows take a batched ``1 x d x 1`` matmul with a
    float32 result instead (:func:`routelab._float32_out.row_dots_f32`: the products exact, summed
    in float32; 1.00 against 1.76 ms at 64k x 4096 on an H200), which writes no ``[R, d]`` float32
    products.
    """
    if not torch.is_grad_enabled() and _float32_out.half_kernels(rows, grad_of_row):
        return _float32_out.row_dots_f32(rows, grad_of_row)  # the same sums, one tensor-core kernel on CUDA
    zero = rows.new_zeros(1, 1, dtype=_wide(rows.dtype))
    return torch.addcmul(zero, rows, grad_of_row).sum(-1)


class _Combine(torch.autograd.Function):
    # The inputs themselves are saved (not the gathered rows) and gathered again in backward, so
    # that second derivatives see the rows' dependence (double backward through this function).
    # Products that are summed are formed in float32 or wider: in half precision each would
    # otherwise be rounded (or underflow) before the sum.
    generate_vmap_rule = True

    @staticmethod
    def forward(rows: Tensor, weight: Tensor, row_of_slot: Tensor, token_of_row: Tensor) -> Tensor:
        if _gather_triton.usable(rows, weight, indices=(row_of_slot,)):
            return _gather_triton.slot_sum(rows, row_of_slot, weight)  # the same sums in one pass
        picked = _slot_rows(rows, row_of_slot)
        if picked.shape[1] == 1:  # one product, rounded once
            return picked[:, 0] * weight
        return _weighted_slot_sum(picked, weight)

    @staticmethod
    def setup_context(ctx, inputs: tuple[Tensor, Tensor, Tensor, Tensor], output: Tensor) -> None:
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, grad_y: Tensor) -> tuple[Tensor | None, Tensor | None, None, None]:
        rows, weight, row_of_slot, token_of_row = ctx.saved_tensors
        grad_rows = grad_weight = None
        num_rows = token_of_row.shape[0]
        if not torch.is_grad_enabled() and _gather_triton.usable(rows, grad_y, weight,
                                                                   indices=(row_of_slot, token_of_row)):
            # Both adjoints in one pass over the rows (no double backward: the kernel has no graph).
            weight_of_row = None
            if ctx.needs_input_grad[0]:
                weight_of_row = weight.new_zeros(num_rows + 1).scatter(0, row_of_slot.reshape(-1), weight.reshape(-1))
            grad_rows, dots = _gather_triton.combine_backward(
                rows, grad_y, token_of_row, None if weight_of_row is None else weight_of_row[:num_rows],
                dots=ctx.needs_input_grad[1])
            if dots is not None:
                grad_weight = _dots_by_slot(dots, row_of_slot).to(weight.dtype)
            return grad_rows, grad_weight, None, None
        # Every row's token's gradient (zeros for a row of no pair): both adjoints read it.
        grad_of_row = _with_zero_row(grad_y).index_select(0, token_of_row)
        if ctx.needs_input_grad[0]:
            # The weight of every row's pair; the dropped pairs (weight 0) all land on the sentinel.
            weight_of_row = weight.new_zeros(num_rows + 1).scatter(0, row_of_slot.reshape(-1), weight.reshape(-1))
            grad_rows = grad_of_row * weight_of_row[:num_rows].unsqueeze(-1)
        if ctx.needs_input_grad[1]:
            # grad_weight[t, s] = <rows[r], grad_y[t]> for r = row_of_slot[t, s]: one dot per row,
            # read by the slots (a dropped pair's sentinel reads the appended 0). The rows of no
            # pair (uninitialised after a grouped matmul) give dots that no slot reads.
            grad_weight = _dots_by_slot(_row_dots(rows, grad_of_row), row_of_slot).to(weight.dtype)
        return grad_rows, grad_weight, None, None


# Forward mode. Dynamo cannot trace an autograd.Function that defines ``jvp`` (a graph break, an error
# under fullgraph=True), so the eager calls take these subclasses, which add it, and traced calls
# the classes above (forward-mode AD through a compiled layer is not supported by torch either).


class _DispatchForwardMode(_Dispatch):
    @staticmethod
    def setup_context(ctx, inputs: tuple[Tensor, Tensor, Tensor], output: Tensor) -> None:
        _Dispatch.setup_context(ctx, inputs, output)
        ctx.save_for_forward(inputs[1], inputs[2])

    @staticmethod
    def jvp(ctx, x_t: Tensor | None, *_: None) -> Tensor | None:
        """``torch.func.jvp``, ``forward_ad``: dispatch is linear in ``x``."""
        token_of_row, row_of_slot = ctx.saved_tensors
        return None if x_t is None else _Dispatch.forward(x_t, token_of_row, row_of_slot)


class _CombineForwardMode(_Combine):
    @staticmethod
    def setup_context(ctx, inputs: tuple[Tensor, Tensor, Tensor, Tensor], output: Tensor) -> None:
        _Combine.setup_context(ctx, inputs, output)
        ctx.save_for_forward(*inputs)

    @staticmethod
    def jvp(ctx, rows_t: Tensor | None, weight_t: Tensor | None, *_: None) -> Tensor | None:
        """Combine is bilinear in ``(rows, weight)``: its tangent is ``combine(rows_t, weight) +
        combine(rows, weight_t)``."""
        rows, weight, row_of_slot, token_of_row = ctx.saved_tensors
        terms = []
        if rows_t is not None:
            terms.append(_Combine.forward(rows_t, weight, row_of_slot, token_of_row))
        if weight_t is not None:
            terms.append(_Combine.forward(rows, weight_t, row_of_slot, token_of_row))
        return None if not terms else terms[0] if len(terms) == 1 else terms[0] + terms[1]


def _dots_by_slot(dots: Tensor, row_of_slot: Tensor) -> Tensor:
    """``dots [R]`` read by the slots (``row_of_slot [n, s]`` -> ``[n, s]``), 0 for a sentinel ``R``."""
    return F.pad(dots, (0, 1)).index_select(0, row_of_slot.reshape(-1)).view(row_of_slot.shape)


def _adjoint_by_default(t: Tensor) -> bool:
    """Whether the gathers take the adjoint-gather backward on ``t``'s device by default.

    On a GPU, yes: autograd's ``index_put`` backward sorts and serialises there, and a batched
    ``1 x slots`` matmul for the combine ran cuBLAS's slowest kernel (0.25 ms a call on an H200,
    docs/gpu-profile-h200.md). On the CPU, no: its ``index_add`` backward is one serial pass and
    ``bmm`` is fast, so the plain autograd formulation was measured faster there (dispatch +
    combine + backward at 8192 tokens, d 512, k 2, one thread: 192 against 254 ms,
    ``tools/gather_paths_bench.py``).
    """
    return t.device.type != "cpu"


def dispatch_rows(x: Tensor, token_of_row: Tensor, row_of_slot: Tensor, *, adjoint: bool | None = None) -> Tensor:
    """``rows[r] = x[token_of_row[r]]`` (zeros where ``token_of_row[r] = n``).

    Args:
        x: ``[n, d]``.
        token_of_row: ``LongTensor [R]`` in ``[0, n]``.
        row_of_slot: ``LongTensor [n, s]`` in ``[0, R]``, the inverse map (``R``: no row): every
            row ``r < R`` with ``token_of_row[r] = t < n`` is ``row_of_slot[t, s]`` for exactly one
            slot ``s``, and only those.
        adjoint: backward by the gather-and-sum through ``row_of_slot`` (``True``) or by
            autograd's scatter-add (``False``); ``None``: by the device (:func:`_adjoint_by_default`).
            Both give the same gradients.

    Returns:
        ``[R, d]``.
    """
    if adjoint if adjoint is not None else _adjoint_by_default(x):
        fn = _Dispatch if torch.compiler.is_compiling() else _DispatchForwardMode
        return _autograd.apply(fn, x, token_of_row, row_of_slot)
    return _with_zero_row(x).index_select(0, token_of_row)


def combine_rows(rows: Tensor, weight: Tensor, row_of_slot: Tensor, token_of_row: Tensor, *,
                 adjoint: bool | None = None) -> Tensor:
    """``y[t] = sum_s weight[t, s] * rows[row_of_slot[t, s]]`` (a sentinel ``R`` reads zeros).

    Args:
        rows: ``[R, d]``.
        weight: ``[n, s]`` in ``rows``' dtype, **zero** for every pair whose row is the sentinel ``R``.
        row_of_slot, token_of_row: the plan's two maps, as in :func:`dispatch_rows`.
        adjoint: as in :func:`dispatch_rows` (``True``: the products and sums of this module;
            ``False``: a ``bmm`` and autograd's backward).

    Returns:
        ``[n, d]`` in ``rows``' dtype; in half precision the slots' products are summed in
        float32 and rounded once, on both paths.
    """
    if adjoint if adjoint is not None else _adjoint_by_default(rows):
        fn = _Combine if torch.compiler.is_compiling() else _CombineForwardMode
        return _autograd.apply(fn, rows, weight, row_of_slot, token_of_row)
    return torch.bmm(weight.unsqueeze(1), _slot_rows(rows, row_of_slot)).squeeze(1)
