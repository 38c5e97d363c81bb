"""The memory traffic of the MoE layer outside its experts, counted operator by operator on any device.

usage: python tools/layer_traffic.py [--d-model N] [--d-hidden N] [--tokens N] [--experts E] [--k K]
       [--dtype bfloat16|float32] [--layout auto|buffers|grouped] [--gather adjoint|plain] [--swiglu-dropless]
       [--top N]

At d_model 4096 and 64k tokens the layer's non-expert operations are memory-bound on a GPU: each is
worth about its bytes read plus written over the memory bandwidth. This tool counts those bytes
without a GPU: it runs one forward + backward of the layer (the benchmark's layer: ``topk`` router,
capacity factor 1, GELU experts with biases; or with --swiglu-dropless the layer that computes
transformers' Mixtral block) under a ``TorchDispatchMode`` that adds, per ATen operator, the bytes
of its tensor arguments (read) and of its outputs (written). Views and metadata operators move
nothing and are skipped. Operators that run inside the experts (between the hooks that the
benchmark's non-expert share uses) are counted apart.

It is an estimate, exact in what it counts and approximate in what it means:

* an operator is assumed to read every byte of every tensor argument (a gather reads only the rows
  it picks: at capacity factor 1 and top-1, about all of them);
* an in-place operator's output is counted as written, its argument as read; a factory such as
  ``new_zeros`` or ``zeros_like`` reads nothing;
* fused or cached reads on the device are not modelled.

--gather adjoint takes the GPU's paths on any device: the gathers' adjoint backward
(``routelab.routing._gather``'s autograd functions, the default on CUDA), their fused Triton kernels
(``routelab.routing._gather_triton``, where Triton is installed; each counted as one kernel that reads
the rows it picks) and the float32-out
half-precision matmuls of ``routelab._float32_out`` (the router's scores and the combine's weight
gradient on CUDA; each counted as the one kernel it is there, though its CPU stand-in goes through
float32 copies); plain takes the CPU's. The default sizes are small enough for the
CPU (8192 tokens, d_model 1024); the bytes scale with tokens x d_model, so the report also gives
them per token and per d_model-wide row.
"""
from __future__ import annotations

import argparse
import collections
import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten

from routelab.layers import MoE, StackedExperts
from routelab.routing import _gather

try:
    from routelab import _float32_out
except ImportError:  # a checkout from before the float32-out kernels (an A/B run through PYTHONPATH)
    _float32_out = None
try:
    from routelab.routing import _gather_triton
except ImportError:  # a checkout from before the fused Triton gathers
    _gather_triton = None

_FREE = {"aten::view", "aten::_unsafe_view", "aten::t", "aten::transpose", "aten::permute", "aten::expand",
         "aten::slice", "aten::select", "aten::unsqueeze", "aten::squeeze", "aten::as_strided", "aten::detach",
         "aten::alias", "aten::reshape", "aten::split", "aten::unbind", "aten::narrow", "aten::lift_fresh",
         "aten::_reshape_alias", "aten::split_with_sizes", "aten::chunk", "aten::empty", "aten::empty_like",
         "aten::new_empty", "aten::empty_strided", "aten::new_empty_strided", "aten::sym_size", "aten::is_same_size",
         "aten::_to_copy_noop", "aten::result_type"}


#: Factories that take a tensor for its dtype and device only: they read none of its data.
_NO_READ = {"aten::new_zeros", "aten::new_ones", "aten::new_full", "aten::zeros_like", "aten::ones_like",
            "aten::full_like", "aten::rand_like", "aten::randn_like"}


def _bytes(t: object) -> int:
    if not isinstance(t, torch.Tensor):
        return 0
    return t.numel() * t.element_size()


class Traffic(TorchDispatchMode):
    """Bytes read and written per operator, split by phase ("experts" or "rest")."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "rest"
        self.table: dict[tuple[str, str, str], list[int]] = collections.defaultdict(lambda: [0, 0, 0])
        self.trace: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._schema.name
        if name in _FREE or func.is_view:
            return out
        self.record(name, (args, kwargs or {}), out)
        return out

    def record(self, name: str, args: object, out: object) -> None:
        """Count one operator: the bytes of the tensors in ``args`` (read) and ``out`` (written)."""
        inputs, _ = tree_flatten(args)
        outputs, _ = tree_flatten(out)
        read = 0 if name in _NO_READ else sum(_bytes(t) for t in inputs)
        written = sum(_bytes(t) for t in outputs)
        shapes = "x".join(str(list(t.shape)) + str(t.dtype).replace("torch.", "")
                          for t in outputs if isinstance(t, torch.Tensor))
        self.trace.append(f"{self.phase:8s} {name} {shapes}")
        self.add(name, shapes, read, written)

    def add(self, name: str, shapes: str, read: int, written: int) -> None:
        """Count one operator that read and wrote these bytes."""
        row = self.table[(self.phase, name, shapes)]
        row[0] += 1
        row[1] += read
        row[2] += written


def _one_kernel(mode: Traffic, name: str, fn):  # noqa: ANN001, ANN202
    """``fn`` run uncounted and counted as the one CUDA kernel ``name`` it is on a GPU (its CPU
    stand-in goes through float32 copies)."""
    def counted(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        with _disable_current_modes():
            out = fn(a, b)
        mode.record(name, (a, b), out)
        return out
    return counted


def _padded(t: torch.Tensor) -> torch.Tensor:
    return torch.cat([t, t.new_zeros(1, t.shape[1])])


def _shape(t: torch.Tensor) -> str:
    return str(list(t.shape)) + str(t.dtype).replace("torch.", "")


def _triton_stand_ins(mode: Traffic) -> dict[str, object]:
    """The fused gathers of :mod:`routelab.routing._gather_triton`, computed uncounted by PyTorch
    operators and counted as the one kernel each is on a GPU, with the bytes it moves: the rows it
    picks (a sentinel reads nothing), its maps and weights, its output."""
    def gather_rows(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        with _disable_current_modes():
            out = _padded(src).index_select(0, index)
            picked = int((index < src.shape[0]).sum()) * src.shape[1] * src.element_size()
        mode.add("triton::gather_rows", _shape(out), picked + _bytes(index), _bytes(out))
        return out

    def slot_sum(src: torch.Tensor, index: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        with _disable_current_modes():
            n, slots = index.shape
            picked = _padded(src).index_select(0, index.reshape(-1)).view(n, slots, -1).float()
            if weight is not None:
                picked = picked * weight.float().unsqueeze(-1)
            out = picked.sum(1).to(src.dtype)
            read = int((index < src.shape[0]).sum()) * src.shape[1] * src.element_size()
        mode.add("triton::slot_sum", _shape(out), read + _bytes(index) + _bytes(weight), _bytes(out))
        return out

    def combine_backward(rows: torch.Tensor, grad_y: torch.Tensor, token_of_row: torch.Tensor,
                         weight_of_row: torch.Tensor | None, dots: bool):  # noqa: ANN202
        with _disable_current_modes():
            valid = token_of_row < grad_y.shape[0]
            gathered = _padded(grad_y).index_select(0, token_of_row).float()
            grad_rows = None if weight_of_row is None else (gathered * weight_of_row.float()[:, None]).to(rows.dtype)
            out_dots = (rows.float() * gathered).sum(-1).masked_fill(~valid, 0.0) if dots else None
            row_bytes = int(valid.sum()) * rows.shape[1] * rows.element_size()
        read = row_bytes * (1 + bool(dots)) + _bytes(token_of_row) + _bytes(weight_of_row)
        outs = [t for t in (grad_rows, out_dots) if t is not None]
        mode.add("triton::combine_backward", "x".join(_shape(t) for t in outs), read, sum(map(_bytes, outs)))
        return grad_rows, out_dots

    def usable(*tensors: torch.Tensor, indices: tuple[torch.Tensor, ...] = ()) -> bool:
        return (tensors[0].dtype in _gather_triton.DTYPES and all(t.dtype == tensors[0].dtype for t in tensors)
                and all(i.dtype == torch.int64 for i in indices))

    return {"usable": usable,
            "gather_rows": gather_rows, "slot_sum": slot_sum, "combine_backward": combine_backward}


@contextlib.contextmanager
def _triton_paths(mode: Traffic, on: bool):  # noqa: ANN202
    """The fused Triton gathers (the GPU's path) while ``on``, each counted as one kernel."""
    if _gather_triton is None or _gather_triton.triton is None or not on:
        yield
        return
    stand_ins = _triton_stand_ins(mode)
    saved = {name: getattr(_gather_triton, name) for name in stand_ins}
    for name, fn in stand_ins.items():
        setattr(_gather_triton, name, fn)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(_gather_triton, name, fn)


@contextlib.contextmanager
def _gpu_paths(mode: Traffic, on: bool):  # noqa: ANN202
    """The GPU's paths on any device while ``on``: the gathers' adjoint backward (the fused Triton
    gathers where Triton is installed) and the float32-out half-precision matmuls of
    :mod:`routelab._float32_out`, each of those counted as one kernel."""
    with _triton_paths(mode, on), _gpu_matmul_paths(mode, on):
        yield


@contextlib.contextmanager
def _gpu_matmul_paths(mode: Traffic, on: bool):  # noqa: ANN202
    if _float32_out is None:
        saved_gathers = _gather._adjoint_by_default
        _gather._adjoint_by_default = lambda t: on
        try:
            yield
        finally:
            _gather._adjoint_by_default = saved_gathers
        return
    saved = (_gather._adjoint_by_default, _float32_out.half_kernels, _float32_out.mm_f32,
             _float32_out.row_dots_f32)
    _gather._adjoint_by_default = lambda t: on
    if on:
        _float32_out.half_kernels = lambda *ts: (ts[0].dtype in _float32_out.HALF
                                                 and all(t.dtype == ts[0].dtype for t in ts))
        _float32_out.mm_f32 = _one_kernel(mode, "aten::mm(out_dtype=float32)", saved[2])
        _float32_out.row_dots_f32 = _one_kernel(mode, "aten::bmm(out_dtype=float32)", saved[3])
    try:
        yield
    finally:
        (_gather._adjoint_by_default, _float32_out.half_kernels, _float32_out.mm_f32,
         _float32_out.row_dots_f32) = saved


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--d-hidden", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--k", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--layout", default="auto", choices=["auto", "buffers", "grouped"])
    p.add_argument("--gather", default="adjoint", choices=["adjoint", "plain"])
    p.add_argument("--swiglu-dropless", action="store_true")
    p.add_argument("--hf", action="store_true",
                   help="count transformers' Mixtral sparse block instead (its experts module also dispatches and "
                        "combines, so only the whole block's total compares with the layer's)")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--trace", action="store_true", help="also print every operator in the order it ran")
    a = p.parse_args()
    dtype = getattr(torch, a.dtype)
    torch.manual_seed(0)
    if a.swiglu_dropless:
        gate_up = torch.randn(a.experts, 2 * a.d_hidden, a.d_model) * a.d_model ** -0.5
        down = torch.randn(a.experts, a.d_model, a.d_hidden) * a.d_hidden ** -0.5
        moe = MoE(a.d_model, a.d_hidden, a.experts, router="topk", k=a.k, router_kwargs={"renormalize": True},
                  capacity_factor=None, experts=StackedExperts.from_hf_fused(gate_up, down), check_finite=False,
                  dispatch=a.layout)
    else:
        moe = MoE(a.d_model, a.d_hidden, a.experts, router="topk", k=a.k, capacity_factor=1.0, dispatch=a.layout)
    moe = moe.to(dtype)
    forward = lambda: moe(x)[0]  # noqa: E731
    if a.hf:
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        config = MixtralConfig(hidden_size=a.d_model, intermediate_size=a.d_hidden, num_local_experts=a.experts,
                               num_experts_per_tok=a.k, num_hidden_layers=1, num_attention_heads=1,
                               num_key_value_heads=1, vocab_size=8)
        config._experts_implementation = "grouped_mm"
        moe = MixtralSparseMoeBlock(config).to(dtype).train()
        block = moe

        def forward():
            out = block(x.unsqueeze(0))
            return (out[0] if isinstance(out, tuple) else out).squeeze(0)
    x = torch.randn(a.tokens, a.d_model, dtype=dtype, requires_grad=True)
    g = torch.randn(a.tokens, a.d_model, dtype=dtype)
    mode = Traffic()
    with _gpu_paths(mode, a.gather == "adjoint"):
        _count(mode, moe, forward, x, g)
    _report(a, dtype, mode)


def _count(mode: Traffic, moe, forward, x, g) -> None:
    """One warm-up, then one counted forward + backward, split at the experts' hooks."""
    forward().backward(g)  # warm-up: probes, caches
    moe.zero_grad(set_to_none=True)
    x.grad = None
    mode.table.clear()
    mode.trace.clear()

    def to(phase):
        def hook(*_):
            mode.phase = phase
        return hook

    def pre(module, args):
        if args[0].requires_grad:
            args[0].register_hook(to("rest"))
        mode.phase = "experts"

    def post(module, args, out):
        mode.phase = "rest"
        if out.requires_grad:
            out.register_hook(to("experts"))

    handles = [moe.experts.register_forward_pre_hook(pre), moe.experts.register_forward_hook(post)]
    with mode:
        forward().backward(g)
    for h in handles:
        h.remove()


def _report(a: argparse.Namespace, dtype: torch.dtype, mode: Traffic) -> None:
    row_bytes = a.tokens * a.d_model * dtype.itemsize
    totals, calls = collections.Counter(), collections.Counter()
    for (phase, _, _), (c, r, w) in mode.table.items():
        totals[phase] += r + w
        calls[phase] += c
    print(f"MoE d_model {a.d_model} d_hidden {a.d_hidden} tokens {a.tokens} E {a.experts} k {a.k} {a.dtype} "
          f"layout {a.layout} gathers {a.gather}{' swiglu-dropless' if a.swiglu_dropless else ''}; "
          f"one forward + backward; unit = one [tokens, d_model] {a.dtype} tensor = {row_bytes / 2**20:.1f} MiB")
    print(f"  total: {sum(totals.values()) / 2**20:9.1f} MiB = {sum(totals.values()) / row_bytes:6.1f} units, "
          f"{sum(calls.values())} operators")
    for phase in ("experts", "rest"):
        print(f"  {phase}: {totals[phase] / 2**20:9.1f} MiB read+written = {totals[phase] / row_bytes:6.1f} units, "
              f"{calls[phase]} operators")
    if a.trace:
        print("\nEvery operator in order (phase, operator, outputs):")
        print("\n".join(mode.trace))
    print(f"\nThe non-expert operators, largest first (top {a.top}):")
    print(f"{'calls':>5} {'read MiB':>9} {'written MiB':>11} {'units':>6}  operator  outputs")
    rest = sorted(((v, k) for k, v in mode.table.items() if k[0] == "rest"), key=lambda t: -(t[0][1] + t[0][2]))
    for (calls, r, w), (_, name, shapes) in rest[:a.top]:
        print(f"{calls:5d} {r / 2**20:9.1f} {w / 2**20:11.1f} {(r + w) / row_bytes:6.2f}  {name}  {shapes}")


if __name__ == "__main__":
    main()
