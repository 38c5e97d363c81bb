"""A small decoder-only transformer language model whose self-attention layers are MAE layers.

Pre-LayerNorm blocks (nanoGPT style), tied input/output embeddings, learned positions. Every
self-attention is a :class:`~routelab.layers.MixtureOfAttentiveExperts` with a causal mask and
a causal gate (``gate_context``), so a position's gate never sees a future token. With uniform
routing the model is a plain transformer (BASE), by eq. 5.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from routelab.layers import MixtureOfAttentiveExperts

__all__ = ["LMConfig", "TransformerLM", "lm_loss"]


@dataclass(frozen=True)
class LMConfig:
    """Size of the language model.

    Attributes:
        vocab: vocabulary size (ids ``0 .. vocab-1``).
        dim, heads, layers, ffn: transformer sizes.
        seq: window length (tokens per instance).
        drop_heads: heads each expert drops (1: MAE-7 for 8 heads, 2: MAE-6).
        gate_hidden: hidden size of each gate's tanh MLP.
        gate_context: the gate at position t averages the last ``gate_context`` positions.
        dropout: dropout on embeddings and residual branches.
    """

    vocab: int
    dim: int = 64
    heads: int = 8
    layers: int = 2
    ffn: int = 256
    seq: int = 64
    drop_heads: int = 1
    gate_hidden: int = 64
    gate_context: int = 32
    dropout: float = 0.1


class Block(nn.Module):
    """``x + MAE(LN(x))``, then ``x + FFN(LN(x))``; ``[batch, seq, dim]`` -> same."""

    def __init__(self, cfg: LMConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.attn = MixtureOfAttentiveExperts(
            cfg.dim,
            cfg.heads,
            drop_heads=cfg.drop_heads,
            batch_first=True,
            gate_hidden=cfg.gate_hidden,
            gate_context=cfg.gate_context,
            # a language model's instance is a token position (its own window gate; the report's
            # setup): an F step draws an expert per position
            sample_per="position",
        )
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.ffn = nn.Sequential(nn.Linear(cfg.dim, cfg.ffn), nn.GELU(), nn.Linear(cfg.ffn, cfg.dim))
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        h = self.ln1(x)
        a, resp = self.attn(h, h, h, attn_mask=mask)
        x = x + self.drop(a)
        x = x + self.drop(self.ffn(self.ln2(x)))
        return x, resp


class TransformerLM(nn.Module):
    """Decoder-only LM: ``[batch, seq]`` token ids -> ``[batch, seq, vocab]`` logits.

    ``forward(ids, return_gates=True)`` also returns each layer's responsibilities,
    ``[batch, seq, experts]`` per layer.
    """

    def __init__(self, cfg: LMConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Embedding(cfg.seq, cfg.dim)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln = nn.LayerNorm(cfg.dim)
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.02)
        mask = torch.triu(torch.ones(cfg.seq, cfg.seq, dtype=torch.bool), diagonal=1)
        self.register_buffer("causal", mask, persistent=False)

    def forward(self, ids: Tensor, return_gates: bool = False) -> Tensor | tuple[Tensor, list[Tensor]]:
        length = ids.shape[1]
        if length > self.cfg.seq:
            raise ValueError(f"ids has {length} positions, more than cfg.seq={self.cfg.seq}.")
        x = self.drop(self.tok(ids) + self.pos.weight[:length])
        mask = self.causal[:length, :length]
        gates = []
        for block in self.blocks:
            x, resp = block(x, mask)
            gates.append(resp)
        logits = self.ln(x) @ self.tok.weight.T
        return (logits, gates) if return_gates else logits


def lm_loss(model: nn.Module, batch: Tensor) -> Tensor:
    """Mean next-token cross-entropy of ``batch`` ``[batch, seq + 1]`` (inputs, shifted targets)."""
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
