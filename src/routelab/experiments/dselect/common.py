"""Helpers shared by the DSelect-k experiments: the gates compared, the minibatch loop, progress
lines, results.csv, per-run summaries. (Statistics, tables and provenance come from the kit,
:mod:`routelab.experiments.kit`.)"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from routelab.gates import (
    DSelectK,
    GumbelSoftmaxGate,
    MTLGate,
    SoftmaxGate,
    TopKGate,
    ablation_annealing,
    ablation_entropy,
)

from ..kit.store import atomic_write_text

__all__ = [
    "GATE_LABELS",
    "PAPER",
    "minibatches",
    "steps_per_epoch",
    "make_gate",
    "log",
    "Timer",
    "weights_matrix",
    "write_csv",
    "experts_per_run",
    "binary_step_percent",
]

#: The paper whose claims the DSelect-k experiments check (the scoreboard's paper column).
PAPER = "Hazimeh et al. 2021 (DSelect-k)"

#: The models of the real-data multi-task experiments (Tables 1-2): every gate, and shared bottom.
MTL_MODELS = ("dselect_static", "topk_static", "gumbel_static", "dselect_per_example", "topk_per_example",
              "softmax", "shared_bottom")

GATE_LABELS: dict[str, str] = {
    "dselect_static": "DSelect-k (static)",
    "topk_static": "Top-k (static)",
    "gumbel_static": "Gumbel-softmax (static)",
    "dselect_per_example": "DSelect-k (per-example)",
    "topk_per_example": "Top-k (per-example)",
    "softmax": "Softmax MoE",
    "shared_bottom": "Shared bottom",
    "ablation_annealing": "Ablation (annealing)",
    "ablation_entropy": "Ablation (entropy)",
}


def make_gate(kind: str, num_experts: int, *, k: int, input_dim: int | None, seed: int,
              gamma: float = 1.0, entropy_reg: float = 0.0, gumbel_reg: float = 0.0,
              anneal: tuple[float, float] = (1.0, 1e-3), ablation_entropy_reg: float = 0.01,
              entropy_reduction: str = "sum", selector_init: str = "official") -> MTLGate:
    """Build one gate of the comparison by name (see :data:`GATE_LABELS`). ``entropy_reduction`` and
    ``selector_init`` are DSelect-k's (:class:`routelab.gates.DSelectK`); other gates ignore them."""
    g = torch.Generator().manual_seed(seed)
    dsel = dict(gamma=gamma, entropy_reg=entropy_reg, generator=g, entropy_reduction=entropy_reduction,
                selector_init=selector_init)
    if kind == "dselect_static":
        return DSelectK(num_experts, k, **dsel)
    if kind == "dselect_per_example":
        return DSelectK(num_experts, k, per_example=True, input_dim=input_dim, **dsel)
    if kind == "topk_static":
        return TopKGate(num_experts, k, generator=g)
    if kind == "topk_per_example":
        return TopKGate(num_experts, k, per_example=True, input_dim=input_dim, generator=g)
    if kind == "softmax":
        return SoftmaxGate(num_experts, generator=g)
    if kind == "gumbel_static":
        return GumbelSoftmaxGate(num_experts, sparsity_reg=gumbel_reg, seed=seed + 7919, generator=g)
    if kind == "ablation_annealing":
        return ablation_annealing(num_experts, k, temperature=anneal[0], final_temperature=anneal[1], generator=g)
    if kind == "ablation_entropy":
        return ablation_entropy(num_experts, k, entropy_reg=ablation_entropy_reg, generator=g)
    raise ValueError(f"unknown gate kind {kind!r}; one of {sorted(GATE_LABELS)}.")


def log(msg: str) -> None:
    """Progress line with a timestamp, flushed."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Timer:
    """Wall-clock seconds since creation: ``Timer()()``."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def __call__(self) -> float:
        return time.perf_counter() - self.t0


def steps_per_epoch(n: int, batch: int, *, drop_last: bool = True) -> int:
    """Minibatches per epoch over ``n`` examples (the last partial one counted unless
    ``drop_last``)."""
    return n // batch if drop_last else -(-n // batch)


def minibatches(
    n: int, batch: int, epochs: int, generator: torch.Generator, *, drop_last: bool = True
) -> Iterator[tuple[int, int, torch.Tensor]]:
    """``(epoch, step, indices)`` of every training step: each epoch draws one fresh permutation
    of the ``n`` examples from ``generator`` (when its first step is asked for) and cuts it into
    batches of ``batch``; ``step`` counts from 0 over all epochs (total
    ``epochs * steps_per_epoch(n, batch, drop_last=drop_last)``)."""
    per_epoch = steps_per_epoch(n, batch, drop_last=drop_last)
    step = 0
    for epoch in range(epochs):
        perm = torch.randperm(n, generator=generator)
        for i in range(per_epoch):
            yield epoch, step, perm[i * batch:(i + 1) * batch]
            step += 1


def weights_matrix(gates: Sequence[MTLGate]) -> list[list[float]]:
    """The static weights of each gate (one forward with batch size 1) as nested lists."""
    with torch.no_grad():
        return [g(1)[0].tolist() for g in gates]


def write_csv(path: Path, records: Sequence[dict[str, Any]], cols: Sequence[str]) -> Path:
    """``cols`` of every record as a CSV file (commas inside a value, as in lists, become ``;``)."""
    lines = [",".join(cols)] + [",".join(str(r[c]).replace(",", ";") for c in cols) for r in records]
    return atomic_write_text(path, "\n".join(lines) + "\n")


def experts_per_run(records: Iterable[dict[str, Any]]) -> list[float]:
    """Per run with a gated model, the experts selected per example averaged over the tasks
    (``record["experts"]`` is one number per task, None for the shared bottom)."""
    return [sum(r["experts"]) / len(r["experts"]) for r in records if r["experts"]]


def binary_step_percent(records: Iterable[dict[str, Any]]) -> list[float]:
    """Per run whose DSelect-k S(Z) became binary, the percentage of training steps until then."""
    return [100 * r["binary_step"] / r["steps"] for r in records if r["binary_step"] is not None]
