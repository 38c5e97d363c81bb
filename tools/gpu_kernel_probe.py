"""Times candidate forms of the MoE layer's largest non-expert operations on a GPU, side by side.

usage: PYTHONPATH=src python tools/gpu_kernel_probe.py [--tokens N] [--d-model N] [--experts E]

At d_model 4096 and 64k bfloat16 tokens (the defaults) the layer's time outside its experts is
memory traffic and float32 matmuls (docs/gpu-profile-h200.md). For each operation this prints the
median time of each form, with the largest difference between the forms' results, so that a form
is only adopted where it computes the same thing:

* the router's float32 logits: ``F.linear`` on float32 copies against ``mm(out_dtype=float32)``,
  also compiled (whether inductor takes ``out_dtype``), and its input gradient;
* a zero row appended to ``[tokens, d]``: ``F.pad`` (fills, then copies) against ``cat``;
* the combine's weighted sum over two slots: float32 products (the layer's) against a batched
  ``1 x 2 x d`` matmul (products exact, summed in float32, rounded once, as the layer's);
* the combine's per-row dots in float32: ``addcmul`` into float32 + ``sum`` against a batched
  ``1 x d x 1`` matmul with ``out_dtype=float32``.

Without CUDA it runs tiny sizes on the CPU (a smoke test: the ``out_dtype`` forms are CUDA-only).
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F


def median_ms(fn: Callable[[], torch.Tensor], reps: int = 20) -> float:
    """Median wall time of ``fn`` in ms, synchronised (after 3 warm-up calls)."""
    cuda = torch.cuda.is_available()
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
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
    a = p.parse_args()
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


if __name__ == "__main__":
    main()
