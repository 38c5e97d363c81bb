"""An encoder-decoder transformer whose every attention is an MAE layer (Peng et al. 2020, Sec. 4.1).

Pre-LayerNorm blocks, learned positions, separate source and target embeddings, the target
embedding tied to the output layer. The three kinds of attention route as the paper's
translation models do (its App. A: "we average all the input vectors in the machine translation
as the inputs to g"):

* encoder self-attention: one gate per sentence, from the mean of its unpadded positions;
* decoder self-attention: causal, so one gate per target position from the mean of the prefix
  ``0 .. t`` (the gate of position ``t`` never sees a later target piece);
* decoder cross-attention: its queries are target positions, so the same causal prefix gate
  (``causal_gate=True``).

With uniform routing the model is a plain transformer (BASE), by eq. 5.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from routelab.layers import MixtureOfAttentiveExperts

from .corpus import PAD, split_batch

__all__ = ["DecoderState", "Seq2SeqConfig", "TranslationLoss", "TranslationModel"]


@dataclass(frozen=True)
class Seq2SeqConfig:
    """Size of the translation model.

    Attributes:
        src_vocab, tgt_vocab: vocabulary sizes (ids ``0 .. vocab - 1``; :data:`~.corpus.PAD` is 0).
        dim, heads, layers, ffn: transformer sizes (``layers`` encoder and ``layers`` decoder blocks).
        max_len: the most positions of a source or a target row (BOS / EOS included).
        drop_heads: heads each expert drops (1: MAE-7 for 8 heads, 2: MAE-6).
        gate_hidden: hidden size of each gate's tanh MLP.
        dropout: dropout on embeddings, residual branches and attention weights.
    """

    src_vocab: int
    tgt_vocab: int
    dim: int = 128
    heads: int = 8
    layers: int = 2
    ffn: int = 512
    max_len: int = 130
    drop_heads: int = 1
    gate_hidden: int = 64
    dropout: float = 0.1


def _mae(cfg: Seq2SeqConfig) -> MixtureOfAttentiveExperts:
    return MixtureOfAttentiveExperts(cfg.dim, cfg.heads, drop_heads=cfg.drop_heads, batch_first=True,
                                     gate_hidden=cfg.gate_hidden, dropout=cfg.dropout)


def _ffn(cfg: Seq2SeqConfig) -> nn.Sequential:
    return nn.Sequential(nn.Linear(cfg.dim, cfg.ffn), nn.GELU(), nn.Dropout(cfg.dropout), nn.Linear(cfg.ffn, cfg.dim))


class EncoderBlock(nn.Module):
    """``x + MAE(LN(x))`` (gate per sentence), then ``x + FFN(LN(x))``; ``[B, S, d]`` -> same."""

    def __init__(self, cfg: Seq2SeqConfig) -> None:
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(cfg.dim), _mae(cfg)
        self.ln2, self.ffn = nn.LayerNorm(cfg.dim), _ffn(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor, pad: Tensor) -> Tensor:
        h = self.ln1(x)
        a, _ = self.attn(h, h, h, key_padding_mask=pad)
        x = x + self.drop(a)
        return x + self.drop(self.ffn(self.ln2(x)))


@dataclass
class DecoderState:
    """What incremental decoding keeps between steps; one row per hypothesis.

    Attributes:
        src_pad: the source padding ``[N, S]``.
        cross_kv: per decoder block, its cross-attention's keys and values of the encoder output,
            ``[N, h, S, head_dim]`` each, projected once.
        self_kv: per decoder block, its self-attention's keys and values of the positions so far,
            ``[N, h, t, head_dim]`` each (None before the first step).
        self_sums, cross_sums: per block, the running sums ``[N, d]`` (float32) of the queries of its
            self- and cross-attention: their means are the causal gates' inputs (eq. 6, the prefix mean).
        length: positions decoded so far (``t``).
    """

    src_pad: Tensor
    cross_kv: list[tuple[Tensor, Tensor]]
    self_kv: list[tuple[Tensor, Tensor] | None] = field(default_factory=list)
    self_sums: list[Tensor | float] = field(default_factory=list)
    cross_sums: list[Tensor | float] = field(default_factory=list)
    length: int = 0

    def reorder(self, rows: Tensor) -> None:
        """Keep the hypotheses ``rows`` ``[N]`` (beam search's survivors, with repeats).

        ``src_pad`` and ``cross_kv`` stay: every row is taken from the beam of its own sentence,
        whose rows share them."""
        self.self_kv = [(k[rows], v[rows]) for k, v in self.self_kv]  # type: ignore[misc]
        self.self_sums = [x[rows] for x in self.self_sums]  # type: ignore[index]
        self.cross_sums = [x[rows] for x in self.cross_sums]  # type: ignore[index]


def _prefix_gate(attn: MixtureOfAttentiveExperts, sums: Tensor, count: int, dtype: torch.dtype) -> Tensor:
    """The responsibilities ``[N, 1, E]`` of the newest position from its query prefix's running sum."""
    return attn.route_summary((sums / count).to(dtype)).unsqueeze(1)


class DecoderBlock(nn.Module):
    """Causal self-attention, cross-attention to the encoder output, FFN; ``[B, T, d]`` -> same."""

    def __init__(self, cfg: Seq2SeqConfig) -> None:
        super().__init__()
        self.ln1, self.self_attn = nn.LayerNorm(cfg.dim), _mae(cfg)
        self.ln2, self.cross_attn = nn.LayerNorm(cfg.dim), _mae(cfg)
        self.ln3, self.ffn = nn.LayerNorm(cfg.dim), _ffn(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, y: Tensor, causal: Tensor, memory: Tensor, src_pad: Tensor) -> Tensor:
        h = self.ln1(y)
        a, _ = self.self_attn(h, h, h, attn_mask=causal, causal_gate=True)  # said, not detected: no host sync
        y = y + self.drop(a)
        h = self.ln2(y)
        a, _ = self.cross_attn(h, memory, memory, key_padding_mask=src_pad, causal_gate=True)
        y = y + self.drop(a)
        return y + self.drop(self.ffn(self.ln3(y)))

    def step(self, y: Tensor, state: DecoderState, i: int) -> Tensor:
        """:meth:`forward` of the newest position only, ``[N, 1, d]`` -> same, as block ``i`` of ``state``.

        Its self-attention attends to the cached keys and values and its own; each gate routes the
        running mean of its queries, which is what the causal gate of :meth:`forward` computes for the
        last position. Nothing already decoded is projected again."""
        h = self.ln1(y)
        k, v = self.self_attn.project_keys_values(h, h)
        cached = state.self_kv[i]
        if cached is not None:
            k, v = torch.cat([cached[0], k], dim=2), torch.cat([cached[1], v], dim=2)
        state.self_kv[i] = (k, v)
        count = k.shape[2]
        state.self_sums[i] = state.self_sums[i] + h[:, 0].float()
        r = _prefix_gate(self.self_attn, state.self_sums[i], count, h.dtype)  # type: ignore[arg-type]
        y = y + self.drop(self.self_attn.attend(h, k, v, r))
        h = self.ln2(y)
        state.cross_sums[i] = state.cross_sums[i] + h[:, 0].float()
        r = _prefix_gate(self.cross_attn, state.cross_sums[i], count, h.dtype)  # type: ignore[arg-type]
        y = y + self.drop(self.cross_attn.attend(h, *state.cross_kv[i], r, key_padding_mask=state.src_pad))
        return y + self.drop(self.ffn(self.ln3(y)))


class TranslationModel(nn.Module):
    """``forward(src [B, S], tgt_in [B, T]) -> logits [B, T, tgt_vocab]`` (teacher forcing).

    :meth:`encode` and :meth:`decode` split it for decoding: ``decode(tgt_prefix, memory, src_pad)``
    gives the logits of every prefix position; since every attention and gate of the decoder is
    causal, the logits of position ``t`` do not depend on later positions.
    """

    def __init__(self, cfg: Seq2SeqConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.src_tok = nn.Embedding(cfg.src_vocab, cfg.dim)
        self.tgt_tok = nn.Embedding(cfg.tgt_vocab, cfg.dim)
        self.src_pos = nn.Embedding(cfg.max_len, cfg.dim)
        self.tgt_pos = nn.Embedding(cfg.max_len, cfg.dim)
        for emb in (self.src_tok, self.tgt_tok, self.src_pos, self.tgt_pos):
            nn.init.normal_(emb.weight, std=0.02)
        self.drop = nn.Dropout(cfg.dropout)
        self.encoder = nn.ModuleList(EncoderBlock(cfg) for _ in range(cfg.layers))
        self.decoder = nn.ModuleList(DecoderBlock(cfg) for _ in range(cfg.layers))
        self.enc_ln, self.dec_ln = nn.LayerNorm(cfg.dim), nn.LayerNorm(cfg.dim)
        mask = torch.triu(torch.ones(cfg.max_len, cfg.max_len, dtype=torch.bool), diagonal=1)
        self.register_buffer("causal", mask, persistent=False)

    def _check_len(self, name: str, ids: Tensor) -> None:
        if ids.dim() != 2 or ids.shape[1] > self.cfg.max_len:
            raise ValueError(f"{name} must be [batch, length] with length <= cfg.max_len={self.cfg.max_len}, "
                             f"got shape {tuple(ids.shape)}.")

    def encode(self, src: Tensor) -> tuple[Tensor, Tensor]:
        """``src [B, S]`` -> ``(memory [B, S, d], src_pad [B, S] bool, True at padding)``."""
        self._check_len("src", src)
        pad = src == PAD
        x = self.drop(self.src_tok(src) + self.src_pos.weight[: src.shape[1]])
        for block in self.encoder:
            x = block(x, pad)
        return self.enc_ln(x), pad

    def decode(self, tgt: Tensor, memory: Tensor, src_pad: Tensor) -> Tensor:
        """``tgt [B, T]`` (BOS first) -> ``logits [B, T, tgt_vocab]``, position ``t`` predicting piece ``t + 1``."""
        self._check_len("tgt", tgt)
        length = tgt.shape[1]
        y = self.drop(self.tgt_tok(tgt) + self.tgt_pos.weight[:length])
        causal = self.causal[:length, :length]
        for block in self.decoder:
            y = block(y, causal, memory, src_pad)
        return self.dec_ln(y) @ self.tgt_tok.weight.T

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        memory, pad = self.encode(src)
        return self.decode(tgt_in, memory, pad)

    def start(self, memory: Tensor, src_pad: Tensor) -> DecoderState:
        """An empty :class:`DecoderState` for incremental decoding over ``memory`` (from :meth:`encode`)."""
        n = len(self.decoder)
        cross = [block.cross_attn.project_keys_values(memory, memory) for block in self.decoder]
        return DecoderState(src_pad, cross, [None] * n, [0.0] * n, [0.0] * n)

    def step(self, state: DecoderState, tokens: Tensor) -> Tensor:
        """Feed piece ``tokens`` ``[N]`` at position ``state.length``; the logits ``[N, tgt_vocab]`` of the
        next piece. Equals ``decode(prefix, ...)[:, -1]`` for the prefix fed so far, at O(t) per step."""
        t = state.length
        if t >= self.cfg.max_len:
            raise ValueError(f"the decoder state is full: {t} positions of cfg.max_len={self.cfg.max_len}.")
        y = self.drop(self.tgt_tok(tokens).unsqueeze(1) + self.tgt_pos.weight[t])
        for i, block in enumerate(self.decoder):
            y = block.step(y, state, i)
        state.length = t + 1
        return (self.dec_ln(y) @ self.tgt_tok.weight.T)[:, 0]


class TranslationLoss:
    """``loss(model, batch) -> scalar``: label-smoothed cross-entropy per target piece.

    ``batch`` is ``[B, src_len + tgt_len]`` rows of :class:`~.corpus.TranslationCorpus` data; the
    mean is over the non-padding target pieces (EOS included). ``targets(batch)`` is their count.

    Args:
        src_len: the corpus's source columns.
        label_smoothing: as in ``F.cross_entropy`` (the paper's fairseq setup: 0.1); :meth:`nll`
            is the plain cross-entropy that dev scores use.
    """

    def __init__(self, src_len: int, label_smoothing: float = 0.1) -> None:
        self.src_len = src_len
        self.label_smoothing = label_smoothing

    def _loss(self, model: nn.Module, batch: Tensor, smoothing: float) -> Tensor:
        src, tgt = split_batch(batch, self.src_len)
        logits = model(src, tgt[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tgt[:, 1:].reshape(-1),
                               ignore_index=PAD, label_smoothing=smoothing)

    def __call__(self, model: nn.Module, batch: Tensor) -> Tensor:
        return self._loss(model, batch, self.label_smoothing)

    def nll(self, model: nn.Module, batch: Tensor) -> Tensor:
        """Mean cross-entropy (nats per target piece), no smoothing."""
        return self._loss(model, batch, 0.0)

    def targets(self, batch: Tensor) -> int:
        """Target pieces predicted in ``batch`` (BOS is not predicted; EOS is)."""
        return int((batch[:, self.src_len + 1:] != PAD).sum())
