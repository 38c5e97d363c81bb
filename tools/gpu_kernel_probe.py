"""Times candidate forms of the MoE layer's largest non-expert operations on a GPU, side by side.

usage: PYTHONPATH=src python tools/gpu_kernel_probe.py [--tokens N] [--d-model N] [--experts E] [--reps N]

At d_model 4096 and 64k bfloat16 tokens (the defaults) the layer's time outside its experts is
memory traffic and float32 matmuls (docs/gpu-profile-h200.md). For each operation this prints the
median time of each form, with the largest difference between the forms' results, so that a form
is only adopted where it computes the same thing:

* the router's float32 logits: ``F.linear`` on float32 copies against ``mm(out_dtype=float32)``,
  also compiled (whether inductor takes ``out_dtype``), and its input gradient;
* the router's top-2 of ``[tokens, E]`` float32 logits: ``topk`` (the layer's: a radix select per
  row, then a sort of the two, 0.29 ms a step at 64k x 64 in the fifth session's kernel table)
  against a sort of each row and its first two columns, and two ``max`` passes (the experts only,
  compared as sorted pairs: ties may come out in another order);
* a zero row appended to ``[tokens, d]``: ``F.pad`` (fills, then copies) against ``cat``;
* the combine's weighted sum over two slots: float32 products (the layer's) against a batched
  ``1 x 2 x d`` matmul (products exact, summed in float32, rounded once, as the layer's);
* the combine's per-row dots in float32: ``addcmul`` into float32 + ``sum`` against a batched
  ``1 x d x 1`` matmul with ``out_dtype=float32``;
* the four gathers of dispatch and combine at top-2 (maps of a random assignment, 1/16 of the
  pairs dropped), forward and backward: the PyTorch operators of ``routelab.routing._gather``
  against its fused Triton kernels (``routelab.routing._gather_triton``), and the combine's kernel
  under other column blocks and warp counts;
* the experts' bias in the buffers layout (``[E, C, d] @ [E, d, h] + b [E, 1, h]``, top-2 at capacity
  factor 1): ``baddbmm`` with the bias (the layer's: torch expands the bias into the output, a copy
  by a generic strided kernel, 1.24 ms a call at d_model 4096 in the fifth session's kernel table)
  against ``bmm`` then the bias added in place (rounded twice), and the matmul alone.

Without CUDA it runs tiny sizes on the CPU (a smoke test: the ``out_dtype`` forms are CUDA-only).
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from routelab.routing import _gather, _gather_triton

#: Timed calls per form (after min(3, REPS) warm-up calls); --reps sets it.
REPS = 20


def median_ms(fn: Callable[[], torch.Tensor]) -> float:
    """Median wall time of ``fn`` in ms over REPS calls, synchronised (after warm-up calls)."""
    cuda = torch.cuda.is_available()
    for _ in range(min(3, REPS)):
        fn()
    times = []
    for _ in range(REPS):
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def compare(title: str, forms: dict[str, Callable[[], torch.Tensor]]) -> None:
    """Print each form's median time and its largest difference from the first form's result."""
    print(f"\n{title}")
    first = None
    for name, fn in forms.items():
        try:
            out = fn().float()
            diff = 0.0 if first is None else float((out - first).abs().max())
            first = out if first is None else first
            print(f"  {name:48s} {median_ms(fn):8.3f} ms   max |difference| from the first {diff:.3g}")
        except Exception as e:  # noqa: BLE001 (a form this torch or device lacks: say so, go on)
            first_line = (str(e).splitlines() or [""])[0]
            print(f"  {name:48s} failed: {type(e).__name__}: {first_line[:200]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cuda = torch.cuda.is_available()
    p.add_argument("--tokens", type=int, default=65536 if cuda else 512)
    p.add_argument("--d-model", type=int, default=4096 if cuda else 64)
    p.add_argument("--experts", type=int, default=64 if cuda else 8)
    p.add_argument("--reps", type=int, default=20 if cuda else 2,
                   help="timed calls per form (the CPU's default is 2: there Triton runs in its interpreter)")
    a = p.parse_args()
    global REPS
    REPS = a.reps
    dev, dt = ("cuda" if cuda else "cpu"), torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(a.tokens, a.d_model, device=dev, generator=gen).to(dt)
    g = torch.randn(a.tokens, a.d_model, device=dev, generator=gen).to(dt)
    w = (torch.randn(a.experts, a.d_model, device=dev, generator=gen) * a.d_model ** -0.5).to(dt)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name() if cuda else 'CPU'}, bfloat16, "
          f"tokens {a.tokens}, d_model {a.d_model}, E {a.experts}")
    compare("router logits [tokens, E] float32", {
        "F.linear(x.float(), w.float())": lambda: F.linear(x.float(), w.float()),
        "torch.mm(x, w.t(), out_dtype=float32)": lambda: torch.mm(x, w.t(), out_dtype=torch.float32),
    })
    grad_logits = torch.randn(a.tokens, a.experts, device=dev, generator=gen)
    compiled = torch.compile(lambda a, b: torch.mm(a, b.t(), out_dtype=torch.float32), fullgraph=True)
    compare("router logits under torch.compile (fullgraph)", {
        "F.linear(x.float(), w.float())": lambda: F.linear(x.float(), w.float()),
        "compiled torch.mm(x, w.t(), out_dtype=float32)": lambda: compiled(x, w),
    })
    logits = torch.randn(a.tokens, a.experts, device=dev, generator=gen)

    def max_twice() -> torch.Tensor:
        first = logits.max(-1, keepdim=True).indices
        second = logits.scatter(-1, first, float("-inf")).max(-1, keepdim=True).indices
        return torch.cat([first, second], -1)

    compare(f"router top-2 experts of [tokens, {a.experts}] float32 (as sorted pairs)", {
        "logits.topk(2) (the layer's)": lambda: logits.topk(2, -1).indices.sort(-1).values,
        "logits.sort(-1, descending=True)[:, :2]": lambda: logits.sort(-1, descending=True).indices[:, :2].sort(
            -1).values,
        "max, mask the first, max again": lambda: max_twice().sort(-1).values,
    })
    compare("router input gradient [tokens, d] bfloat16", {
        "(g @ w.float()).to(bfloat16)": lambda: (grad_logits @ w.float()).to(dt),
        "[hi, lo] @ [w; w] (bfloat16 split)": lambda: torch.cat(
            [grad_logits.to(dt), (grad_logits - grad_logits.to(dt).float()).to(dt)], -1) @ torch.cat([w, w]),
    })
    compare("a zero row appended [tokens + 1, d]", {
        "F.pad(x, (0, 0, 0, 1))": lambda: F.pad(x, (0, 0, 0, 1)),
        "torch.cat([x, zeros(1, d)])": lambda: torch.cat([x, x.new_zeros(1, a.d_model)]),
    })
    picked = torch.stack([x, g], 1)  # [tokens, 2, d]: two slots' rows
    slot_w = torch.rand(a.tokens, 2, device=dev, generator=gen).to(dt)

    def addcmul_slots() -> torch.Tensor:  # routing/_gather.py's _weighted_slot_sum at k = 2
        wide = slot_w.float()
        return torch.addcmul(picked[:, 0] * wide[:, 0:1], picked[:, 1], wide[:, 1:2]).to(dt)

    compare("combine's weighted sum over 2 slots [tokens, d] bfloat16", {
        "float32 mul + addcmul + cast (the layer's)": addcmul_slots,
        "bmm(w[:, None], picked) (bfloat16 out)": lambda: torch.bmm(slot_w.unsqueeze(1), picked).squeeze(1),
    })
    zero = x.new_zeros(1, 1, dtype=torch.float32)
    compare("per-row dots [tokens] float32", {
        "addcmul(zero32, x, g).sum(-1)": lambda: torch.addcmul(zero, x, g).sum(-1),
        "bmm(x[:, None], g[:, :, None], out_dtype=float32)": lambda: torch.bmm(
            x.unsqueeze(1), g.unsqueeze(2), out_dtype=torch.float32).view(-1),
        "(x.float() * g.float()).sum(-1)": lambda: (x.float() * g.float()).sum(-1),
    })
    probe_gathers(x, g, gen)
    probe_expert_bias(a.tokens, a.d_model, a.experts, dev, dt, gen)


def probe_expert_bias(tokens: int, d: int, experts: int, dev: str, dt: torch.dtype, gen: torch.Generator) -> None:
    """The first expert matmul with its bias on ``[E, C, d]`` buffers (C = 2 tokens / E, d_hidden = d_model):
    ``baddbmm`` (routelab.layers.experts) against ``bmm`` + in-place bias, and the matmul alone."""
    C = max(1, 2 * tokens // experts)
    try:
        buffers = torch.randn(experts, C, d, device=dev, generator=gen).to(dt)
        w = (torch.randn(experts, d, d, device=dev, generator=gen) * d ** -0.5).to(dt)
        b = torch.randn(experts, 1, d, device=dev, generator=gen).to(dt)
    except torch.OutOfMemoryError:
        print(f"\nexpert bias: buffers [{experts}, {C}, {d}] do not fit in memory")
        return
    compare(f"expert matmul + bias [E={experts}, C={C}, {d}] @ [E, {d}, {d}]", {
        "baddbmm(b, x, w) (the layer's)": lambda: torch.baddbmm(b, buffers, w),
        "bmm(x, w).add_(b) (rounded twice)": lambda: torch.bmm(buffers, w).add_(b),
    })
    compare("  the matmul alone, for the bias's share", {"bmm(x, w)": lambda: torch.bmm(buffers, w)})


def _maps(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``row_of_slot [n, 2]`` and ``token_of_row [2n]`` of a random top-2 assignment, every 16th
    token's second pair dropped (its row then belongs to no pair)."""
    R = 2 * n
    row_of_slot = torch.randperm(R, device=gen.device, generator=gen).view(n, 2)
    row_of_slot[::16, 1] = R
    kept = row_of_slot < R
    token_of_row = torch.full((R,), n, device=gen.device)
    token_of_row[row_of_slot[kept]] = torch.arange(n, device=gen.device).unsqueeze(1).expand(n, 2)[kept]
    return row_of_slot, token_of_row


def probe_gathers(x: torch.Tensor, g: torch.Tensor, gen: torch.Generator) -> None:
    """The gathers of dispatch and combine, PyTorch operators against the fused Triton kernels."""
    if _gather_triton.triton is None:
        print("\ngathers of dispatch and combine: Triton is not installed")
        return
    n, d = x.shape
    row_of_slot, token_of_row = _maps(n, gen)
    rows = torch.cat([x, g])  # [2n, d]
    weight = torch.rand(n, 2, device=x.device, generator=gen).to(x.dtype).masked_fill(row_of_slot == 2 * n, 0)
    weight_of_row = weight.new_zeros(2 * n + 1).scatter(0, row_of_slot.reshape(-1), weight.reshape(-1))[:-1]

    def torch_combine_backward() -> torch.Tensor:
        grad_of_row = _gather._with_zero_row(g).index_select(0, token_of_row)
        return grad_of_row * weight_of_row.unsqueeze(-1), _gather._row_dots(rows, grad_of_row)

    compare("dispatch forward: rows [2 tokens, d] = x[token_of_row]", {
        "cat zero row + index_select": lambda: _gather._with_zero_row(x).index_select(0, token_of_row),
        "Triton gather_rows": lambda: _gather_triton.gather_rows(x, token_of_row),
    })
    compare("combine forward: y [tokens, d] = sum_s w * rows[row_of_slot]", {
        "cat + index_select + float32 mul/addcmul + cast": lambda: _gather._weighted_slot_sum(
            _gather._slot_rows(rows, row_of_slot), weight),
        "Triton slot_sum": lambda: _gather_triton.slot_sum(rows, row_of_slot, weight),
    })
    compare("dispatch backward: grad_x [tokens, d] = sum_s grad_rows[row_of_slot]", {
        "cat + index_select + sum": lambda: _gather._sum_slots(_gather._slot_rows(rows, row_of_slot)),
        "Triton slot_sum (no weights)": lambda: _gather_triton.slot_sum(rows, row_of_slot),
    })
    with torch.no_grad():
        compare("combine backward: grad_rows [2 tokens, d] and the rows' dots [2 tokens] (first output)", {
            "cat + index_select + mul, and the float32-out dots": lambda: torch_combine_backward()[0],
            "Triton combine_backward": lambda: _gather_triton.combine_backward(
                rows, g, token_of_row, weight_of_row, True)[0],
        })
        compare("  the same, second output (the dots)", {
            "cat + index_select, float32-out dots": lambda: torch_combine_backward()[1],
            "Triton combine_backward": lambda: _gather_triton.combine_backward(
                rows, g, token_of_row, weight_of_row, True)[1],
        })
    forms = {}
    for block, warps in ((512, 4), (1024, 4), (1024, 8), (2048, 8), (4096, 8)):
        def run(block: int = block, warps: int = warps) -> torch.Tensor:
            saved = _gather_triton._MAX_BLOCK, _gather_triton._NUM_WARPS
            _gather_triton._MAX_BLOCK, _gather_triton._NUM_WARPS = block, warps
            try:
                return _gather_triton.slot_sum(rows, row_of_slot, weight)
            finally:
                _gather_triton._MAX_BLOCK, _gather_triton._NUM_WARPS = saved
        forms[f"Triton slot_sum, column block {block}, {warps} warps"] = run
    compare("combine forward under other launch settings", forms)


if __name__ == "__main__":
    main()
