"""The analyses of Sec. 5.1 / App. C on a trained language model: gate entropy, attribution of
instances to experts, and the tokens most indicative of each expert by PMI.

An *instance* here is a token position: the LM's gates are causal, one per position (the gate
of position t averages the last ``gate_context`` inputs up to t). A position is attributed to
the expert that maximises its gate.
"""

from __future__ import annotations

import math
from collections import Counter

import torch
from torch import Tensor, nn

from routelab.layers.mae import set_routing

__all__ = ["attribution_shares", "collect_gates", "mean_entropy", "pmi_tokens"]


@torch.no_grad()
def collect_gates(model: nn.Module, windows: Tensor, *, batch: int = 64) -> tuple[Tensor, list[Tensor]]:
    """Gate values of every MAE layer under the learned gate (``routing="gate"``).

    Args:
        model: a :class:`~.model.TransformerLM`.
        windows: ``[n, seq + 1]``; the inputs are ``windows[:, :-1]``.

    Returns:
        ``(tokens, gates)``: tokens ``[n, seq]`` (the input token at each position) and, per
        layer, gates ``[n, seq, experts]``.
    """
    was = model.training
    model.eval()
    set_routing(model, "gate")
    per_layer: list[list[Tensor]] = []
    for i in range(0, windows.shape[0], batch):
        _, gates = model(windows[i: i + batch, :-1], return_gates=True)
        if not per_layer:
            per_layer = [[] for _ in gates]
        for store, g in zip(per_layer, gates):
            store.append(g)
    model.train(was)
    return windows[:, :-1], [torch.cat(g) for g in per_layer]


def mean_entropy(gates: list[Tensor]) -> tuple[float, list[float]]:
    """``H(g) = -sum_i g_i log g_i`` averaged over positions, per layer and over layers.

    Args:
        gates: per layer ``[..., experts]``.

    Returns:
        ``(mean over layers, [mean per layer])`` in nats.
    """
    per_layer = [float(-(g * g.clamp_min(1e-12).log()).sum(-1).mean()) for g in gates]
    return sum(per_layer) / len(per_layer), per_layer


def attribution_shares(gates: Tensor) -> list[float]:
    """Percent of positions whose gate is maximised by each expert; ``gates`` ``[..., E]``."""
    e = gates.shape[-1]
    counts = torch.bincount(gates.argmax(-1).reshape(-1), minlength=e).double()
    return (100.0 * counts / counts.sum()).tolist()


def pmi_tokens(
    tokens: Tensor, gates: Tensor, itos: list[str], *, min_count: int = 20, top: int = 6
) -> list[list[tuple[str, float, int]]]:
    """The tokens most indicative of each expert, by ``PMI = log p(tok, e) / (p(tok) p(e))``.

    Each position is attributed to its argmax expert (Sec. 5.1).

    Args:
        tokens: ``[...]`` token ids; gates: ``[..., E]``.
        itos: id -> token string.
        min_count: ignore tokens seen fewer times (PMI of rare tokens is noise).
        top: tokens per expert.

    Returns:
        per expert, up to ``top`` ``(token, pmi, joint count)`` sorted by PMI, descending.
    """
    experts = gates.argmax(-1).reshape(-1).tolist()
    toks = tokens.reshape(-1).tolist()
    n = len(toks)
    tok_count = Counter(toks)
    exp_count = Counter(experts)
    joint = Counter(zip(toks, experts))
    out: list[list[tuple[str, float, int]]] = []
    for e in range(gates.shape[-1]):
        rows = []
        for (t, ee), c in joint.items():
            if ee != e or tok_count[t] < min_count:
                continue
            pmi = math.log(c * n / (tok_count[t] * exp_count[e]))
            rows.append((itos[t], pmi, c))
        rows.sort(key=lambda r: (-r[1], r[0]))
        out.append(rows[:top])
    return out
