"""Mixture of attentive experts (MAE), Peng et al. (2020), eq. 4-6.

Multi-head attention with ``h`` heads is a uniform mixture of experts (eq. 5): with
``H~_i = H_i W_i`` the output of head ``i`` projected by its slice of the output matrix,

    Z = sum_i H~_i + b = sum_e (1/E) * f_e(X) + b,   f_e = h/(h - t) * sum_{i not in D_e} H~_i,

where expert ``e`` drops the heads ``D_e`` (``t = |D_e|`` heads; ``E = C(h, t)`` experts). MAE
replaces the uniform ``1/E`` by an input-dependent gate ``g(X)`` (eq. 6): a softmax over a
two-layer tanh MLP of the mean of ``X`` over the sequence.

The mixture is computed from the ``h`` head outputs once: ``sum_e g_e f_e`` is linear in the
heads, so it equals ``sum_i w_i H~_i`` with per-head weights ``w = h/(h - t) * g @ K`` (``K``
the ``[E, h]`` 0/1 matrix of the heads each expert keeps). The heads are scaled by ``w`` before
the output projection; no expert is run separately. With uniform ``g``, ``w = 1`` for every
head and the module is exactly :class:`torch.nn.MultiheadAttention`.

How a module routes when no ``responsibilities`` are passed is its :attr:`routing` attribute,
set by the block coordinate descent trainer (:mod:`routelab.layers.bcd`) or :func:`set_routing`:

* ``"gate"`` (default): the learned mixture ``g(X)`` (eq. 6; G steps, test time);
* ``"sample"``: one expert per instance drawn from ``g(X)`` without gradient (F steps, Alg. 2;
  ``sample_per="position"``: one per position where the gate is per position);
* ``"top1"``: the expert maximising ``g(X)`` (Sec. 5.1, Table 5);
* ``"uniform"``: uniform responsibilities (eq. 5: plain multi-head attention; BASE, UNI-MAE
  at test time);
* ``"uniform_sample"``: one expert drawn uniformly per instance (UNI-MAE training).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._checks import (
    ArgumentTypeError,
    GeneratorAttribute,
    check_finite,
    check_flag,
    check_generator,
    check_positive_int,
    checks_run,
    floating_input,
    to_device,
)
from ..replay import NoiseReplay

__all__ = [
    "ROUTINGS",
    "SAMPLE_PER",
    "MAEGate",
    "MixtureOfAttentiveExperts",
    "expert_head_mask",
    "head_weights",
    "mae_modules",
    "set_routing",
]

ROUTINGS: tuple[str, ...] = ("gate", "sample", "top1", "uniform", "uniform_sample")
#: What one draw of the ``*sample`` routings covers where the gate is one per position (a causal
#: gate, or ``gate_context``): the whole instance (Alg. 2: ``i ~ Cat(g(X))``, then ``f_i`` at every
#: position) or each position on its own.
SAMPLE_PER: tuple[str, ...] = ("instance", "position")
"""The values :attr:`MixtureOfAttentiveExperts.routing` may take (see the module docstring)."""

_SUM_TOL = 1e-4  # how far responsibilities may sum from 1


def expert_head_mask(num_heads: int, drop_heads: int) -> tuple[Tensor, tuple[tuple[int, ...], ...]]:
    """The heads each expert keeps.

    Args:
        num_heads: ``h``.
        drop_heads: ``t``, heads each expert drops, ``1 <= t < h``.

    Returns:
        ``(keep, dropped)``: ``keep`` is a float ``[C(h, t), h]`` 0/1 matrix (row ``e`` marks the
        heads expert ``e`` keeps); ``dropped[e]`` is the tuple of heads expert ``e`` drops, in
        :func:`itertools.combinations` order (drop 1: expert ``i`` drops head ``i``).
    """
    # Every expert keeps at least one head (drop_heads=1 gives MAE-7-style experts of h - 1 heads).
    check_positive_int("drop_heads", drop_heads, upper=num_heads - 1, upper_name="num_heads - 1")
    dropped = tuple(itertools.combinations(range(num_heads), drop_heads))
    keep = torch.ones(len(dropped), num_heads)
    for e, heads in enumerate(dropped):
        keep[e, list(heads)] = 0.0
    return keep, dropped


def head_weights(responsibilities: Tensor, keep: Tensor) -> Tensor:
    """Per-head weights ``w = h/(h - t) * g @ keep`` of the mixture ``sum_e g_e f_e`` (eq. 6).

    Args:
        responsibilities: ``[..., E]``, rows summing to 1.
        keep: ``[E, h]`` from :func:`expert_head_mask`.

    Returns:
        ``[..., h]``; all ones for uniform responsibilities (eq. 5).
    """
    num_heads = keep.shape[1]
    kept = keep[0].sum().to(responsibilities.dtype)  # h - t, on the device (no host sync)
    return (responsibilities @ keep.to(responsibilities.dtype)) * num_heads / kept


class MAEGate(nn.Module):
    """The gate of eq. 6: ``softmax(W2 tanh(W1 x + b1) + b2)`` over ``E`` experts.

    The last layer starts at zero, so a fresh gate is uniform and a fresh MAE is exactly
    multi-head attention.

    Args:
        embed_dim: input size ``d``.
        hidden: hidden size of the tanh layer.
        num_experts: ``E``.
    """

    def __init__(self, embed_dim: int, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.hidden = nn.Linear(embed_dim, hidden)
        self.out = nn.Linear(hidden, num_experts)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    def forward(self, summary: Tensor) -> Tensor:
        """``[..., d]`` summary of the input -> ``[..., E]`` responsibilities (rows sum to 1)."""
        return torch.softmax(self.out(torch.tanh(self.hidden(summary))), dim=-1)


class MixtureOfAttentiveExperts(nn.Module):
    """Multi-head attention as a learned mixture of experts of ``h - t`` heads (eq. 5-6).

    Args:
        embed_dim: model dimension ``d`` (query, key and value all have it).
        num_heads: ``h``; must divide ``embed_dim``.
        drop_heads: ``t``, heads each expert drops: 1 gives ``h`` experts (MAE-7 for
            ``h = 8``), 2 gives ``C(h, 2)`` experts (MAE-6). ``1 <= t < h``.
        batch_first: inputs and outputs are ``[batch, seq, d]`` if True, else
            ``[seq, batch, d]`` (as :class:`torch.nn.MultiheadAttention`).
        gate_hidden: hidden size of the gate's tanh MLP (default ``embed_dim``).
        gate_context: ``None``: one gate per instance, from the mean of the query over its
            (unpadded) positions (translation encoder), or, where the queries attend causally
            (see ``causal_gate`` in :meth:`forward`), one gate per position from the mean of the
            query prefix ``0 .. t`` (translation decoder). An integer ``c``: one gate per
            position, from the mean of the ``c`` most recent query vectors up to and including
            that position (language modelling; causal, so the gate never sees future tokens).
        dropout: dropout on the attention weights (as in MHA), in training mode only.
        bias: whether the input and output projections have biases (as in MHA).
        check_finite: check query, key and value for NaN/inf on every call (one host sync);
            ``False`` drops the check (as ``MoE(check_finite=False)``). Also an attribute.
        sample_per: where the gate is one per position, whether the ``"sample"`` and
            ``"uniform_sample"`` routings draw one expert per instance (default, Alg. 2), from
            the gate of the instance's last position (its last unpadded query in self-attention:
            for a causal gate the mean of the whole instance, the paper's ``g(X)``; with
            ``gate_context`` its last window), or one per position (each position's own gate;
            an F step then trains a different expert at each position). Also an attribute
            (:data:`SAMPLE_PER`). A gate of one per instance draws once per instance either way.

    Attributes:
        in_proj_weight ``[3d, d]``, in_proj_bias ``[3d]``, out_proj (``Linear(d, d)``): the MHA
            parameters, same layout as :class:`torch.nn.MultiheadAttention`.
        gate: the :class:`MAEGate` (its parameters are the ``phi`` of the paper).
        keep: buffer ``[E, h]``, the heads each expert keeps; ``dropped_heads[e]`` the ones it drops.
        routing: how the forward routes when no responsibilities are given (:data:`ROUTINGS`).
        generator: optional :class:`torch.Generator` for the ``*sample`` routings (anything
            else is a TypeError).

    Dtypes: query, key and value may be any floating dtype; the module computes in its
    parameters' dtype and returns the output and the responsibilities in the query's dtype (the
    same policy as :class:`~routelab.layers.MoE`). Integer inputs and inputs with NaN/inf raise a
    ValueError (the latter unless ``check_finite=False``).
    """

    generator = GeneratorAttribute(
        "The :class:`torch.Generator` of the ``*sample`` routings (``None``: torch's global one).")

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        drop_heads: int = 1,
        batch_first: bool = False,
        gate_hidden: int | None = None,
        gate_context: int | None = None,
        dropout: float = 0.0,
        bias: bool = True,
        check_finite: bool = True,
        sample_per: str = "instance",
    ) -> None:
        super().__init__()
        check_positive_int("embed_dim", embed_dim)
        check_finite = check_flag("check_finite", check_finite)
        if sample_per not in SAMPLE_PER:
            raise ValueError(f"sample_per must be one of {SAMPLE_PER}, got {sample_per!r}.")
        batch_first = check_flag("batch_first", batch_first)
        bias = check_flag("bias", bias)
        check_positive_int("num_heads", num_heads)
        if embed_dim % num_heads:
            raise ValueError(
                f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})."
            )
        keep, dropped = expert_head_mask(num_heads, drop_heads)  # validates drop_heads
        if gate_hidden is not None:
            check_positive_int("gate_hidden", gate_hidden)
        if gate_context is not None:  # None: the mean over the sequence
            check_positive_int("gate_context", gate_context)
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}.")
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.drop_heads = drop_heads
        self.batch_first = batch_first
        self.gate_context = gate_context
        self.dropout = dropout
        self.check_finite = check_finite
        self.sample_per = sample_per

        self.in_proj_weight = nn.Parameter(torch.empty(3 * embed_dim, embed_dim))
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * embed_dim)) if bias else None
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        nn.init.xavier_uniform_(self.in_proj_weight)
        if bias:
            nn.init.zeros_(self.out_proj.bias)

        self.register_buffer("keep", keep)
        self.dropped_heads: tuple[tuple[int, ...], ...] = dropped
        self.gate = MAEGate(embed_dim, gate_hidden or embed_dim, len(dropped))
        self.routing: str = "gate"
        self.generator = None
        self._replay = NoiseReplay()

    # ------------------------------------------------------------------ construction

    @property
    def num_experts(self) -> int:
        """``E = C(h, t)``."""
        return len(self.dropped_heads)

    @classmethod
    def from_multihead_attention(
        cls,
        mha: nn.MultiheadAttention,
        drop_heads: int = 1,
        *,
        gate_hidden: int | None = None,
        gate_context: int | None = None,
    ) -> MixtureOfAttentiveExperts:
        """An MAE with ``mha``'s weights (copied), ``batch_first`` and dropout.

        With uniform responsibilities (``routing="uniform"``, or a fresh gate, which starts
        uniform) its output equals ``mha``'s (eq. 5).

        Raises:
            ValueError: if ``mha`` has ``kdim``/``vdim`` other than ``embed_dim``, or
                ``add_bias_kv`` / ``add_zero_attn`` (not part of eq. 2-4).
        """
        if not isinstance(mha, nn.MultiheadAttention):
            raise ValueError(f"mha must be a torch.nn.MultiheadAttention, got {type(mha).__name__}.")
        if not mha._qkv_same_embed_dim:
            raise ValueError(
                "mha has kdim/vdim different from embed_dim; MixtureOfAttentiveExperts needs "
                "query, key and value of size embed_dim."
            )
        if mha.bias_k is not None or mha.add_zero_attn:
            raise ValueError(
                "mha uses add_bias_kv or add_zero_attn, which MixtureOfAttentiveExperts does not "
                "support; build it with add_bias_kv=False, add_zero_attn=False."
            )
        ref = mha.in_proj_weight
        new = cls(
            mha.embed_dim,
            mha.num_heads,
            drop_heads=drop_heads,
            batch_first=mha.batch_first,
            gate_hidden=gate_hidden,
            gate_context=gate_context,
            dropout=mha.dropout,
            bias=mha.in_proj_bias is not None,
        ).to(device=ref.device, dtype=ref.dtype)
        with torch.no_grad():
            new.in_proj_weight.copy_(mha.in_proj_weight)
            new.out_proj.weight.copy_(mha.out_proj.weight)
            if mha.in_proj_bias is not None:
                new.in_proj_bias.copy_(mha.in_proj_bias)
                new.out_proj.bias.copy_(mha.out_proj.bias)
        new.train(mha.training)
        return new

    def gate_parameters(self) -> Iterator[nn.Parameter]:
        """The gate's parameters (``phi``)."""
        return self.gate.parameters()

    def expert_parameters(self) -> Iterator[nn.Parameter]:
        """The attention parameters shared by the experts (``theta``): in/out projections."""
        yield self.in_proj_weight
        if self.in_proj_bias is not None:
            yield self.in_proj_bias
        yield from self.out_proj.parameters()

    # ------------------------------------------------------------------ gate

    def per_position_gate(self, causal: bool) -> bool:
        """Whether the gate is one per position (``[batch, seq, E]``) rather than one per
        instance (``[batch, E]``): with ``gate_context``, or when the queries attend causally."""
        return self.gate_context is not None or causal

    def gate_summary(
        self, query: Tensor, query_padding_mask: Tensor | None = None, *, causal: bool = False
    ) -> Tensor:
        """The gate's input: mean of the query over the sequence, its prefix, or a causal window.

        Args:
            query: ``[batch, seq, d]`` (batch first).
            query_padding_mask: ``[batch, seq]`` bool, True at padding (excluded from the mean).
            causal: the queries attend causally: with ``gate_context`` None, position ``t``
                averages the (unpadded) positions ``0 .. t`` only, so its gate never depends on a
                later position (a translation decoder under teacher forcing).

        Returns:
            ``[batch, d]`` if ``gate_context`` is None and not ``causal``; else ``[batch, seq, d]``
            (position ``t`` averages positions ``max(0, t - c + 1) .. t``, or ``0 .. t``).
        """
        # Running sums accumulate in float32 for half-precision queries (a prefix sum of fp16 values
        # overflows long before their mean does); the summary is returned in the query's dtype.
        out_dtype = query.dtype
        if query.dtype in (torch.float16, torch.bfloat16):
            query = query.float()
        if self.gate_context is None:
            valid = None if query_padding_mask is None else (~query_padding_mask).to(query.dtype).unsqueeze(-1)
            if causal:
                if valid is None:
                    count = torch.arange(1, query.shape[1] + 1, device=query.device, dtype=query.dtype)
                    out = torch.cumsum(query, dim=1) / count.view(1, -1, 1)
                else:
                    out = torch.cumsum(query * valid, dim=1) / torch.cumsum(valid, dim=1).clamp_min(1.0)
            elif valid is None:  # (the mean of no queries is the zero summary, not 0 / 0)
                out = query.sum(dim=1) / max(query.shape[1], 1)
            else:
                out = (query * valid).sum(1) / valid.sum(1).clamp_min(1.0)
            return out.to(out_dtype)
        # The window of position t, positions max(0, t - c + 1) .. t: differences of prefix sums,
        # accumulated in float64 (float32 prefix sums lose eps * t / c of the mean: 1 % at t = 1e5,
        # c = 1), the unpadded positions only. A window of padding alone is the zero summary.
        c = self.gate_context
        wide = torch.float32 if query.device.type == "mps" else torch.float64  # (MPS has no float64)
        valid = None if query_padding_mask is None else (~query_padding_mask).to(wide).unsqueeze(-1)
        total = _window_sums(query.to(wide) if valid is None else query.to(wide) * valid, c)
        if valid is None:
            count = torch.arange(1, query.shape[1] + 1, device=query.device, dtype=wide).clamp_max(c).view(1, -1, 1)
        else:
            count = _window_sums(valid, c).clamp_min(1.0)
        return (total / count).to(out_dtype)

    def route_summary(self, summary: Tensor) -> Tensor:
        """Responsibilities under the current :attr:`routing` for the gate inputs ``summary``.

        The forward pass computes ``summary`` with :meth:`gate_summary`; a caller that keeps the
        summary itself (incremental decoding: the running mean of a decoder's queries, one position
        at a time) routes it here and passes the result as ``responsibilities=``.

        Args:
            summary: ``[..., d]``, the gate's input per instance or per position.

        Returns:
            ``[..., E]`` in ``summary``'s dtype: the gate mixture (``"gate"``), a one-hot
            ``[..., E]`` (``"top1"``, ``"sample"``, ``"uniform_sample"``; no gate gradient), or
            ``1/E`` everywhere (``"uniform"``, which ignores the values of ``summary``).
        """
        routing = self.routing
        if routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}.")
        if self.sample_per not in SAMPLE_PER:  # (an attribute: it may have been set since construction)
            raise ValueError(f"sample_per must be one of {SAMPLE_PER}, got {self.sample_per!r}.")
        lead = tuple(summary.shape[:-1])
        n = self.num_experts
        if routing == "uniform":
            return summary.new_full((*lead, n), 1.0 / n)
        if routing == "uniform_sample":
            with self._replay.draw(self.generator):  # checkpointing's recomputation redraws the same experts
                idx = to_device(torch.randint(n, lead, generator=self.generator, device="cpu"), summary.device)
            return F.one_hot(idx, n).to(summary.dtype)
        if routing == "gate":
            return self.gate(summary)
        with torch.no_grad():  # sample / top1: non-differentiable choice, never a gate gradient
            probs = self.gate(summary)
            if routing == "top1":
                idx = probs.argmax(-1)
            else:
                flat = probs.reshape(-1, n).float().cpu()
                with self._replay.draw(self.generator):
                    idx = torch.multinomial(flat, 1, generator=self.generator).view(lead)
                idx = idx.to(summary.device)
        return F.one_hot(idx, n).to(summary.dtype)

    def _responsibilities(self, query: Tensor, query_padding_mask: Tensor | None, causal: bool) -> Tensor:
        """Responsibilities for the current :attr:`routing`: ``[batch, E]`` or ``[batch, seq, E]``."""
        per_position = self.per_position_gate(causal)
        if per_position and self.sample_per == "instance" and self.routing in ("sample", "uniform_sample"):
            # One draw per instance (Alg. 2), from the gate of its last (unpadded) position, at
            # every position.
            batch, seq = query.shape[:2]
            if self.routing == "uniform_sample":
                one = self.route_summary(query.new_empty((batch, 0)))
            else:
                last = torch.full((batch,), seq - 1, dtype=torch.long, device=query.device)
                if query_padding_mask is not None:
                    position = torch.arange(seq, device=query.device).expand(batch, seq)
                    last = position.masked_fill(query_padding_mask, -1).amax(-1).clamp_min(0)
                summary = self.gate_summary(query, query_padding_mask, causal=causal)  # [batch, seq, d]
                one = self.route_summary(summary[torch.arange(batch, device=query.device), last])
            return one.unsqueeze(1).expand(batch, seq, one.shape[-1])
        if self.routing in ("uniform", "uniform_sample"):  # the gate's input is not needed, only its shape
            lead = tuple(query.shape[:2]) if per_position else (query.shape[0],)
            return self.route_summary(query.new_empty((*lead, 0)))
        return self.route_summary(self.gate_summary(query, query_padding_mask, causal=causal))

    def _check_responsibilities(self, r: Tensor, batch: int, seq: int) -> Tensor:
        n = self.num_experts
        shapes = [(batch, n), (batch, seq, n)]
        if not isinstance(r, Tensor) or tuple(r.shape) not in shapes:
            got = tuple(r.shape) if isinstance(r, Tensor) else type(r).__name__
            raise ValueError(
                f"responsibilities must have shape [batch, num_experts] = {shapes[0]} (or "
                f"[batch, seq, num_experts] = {shapes[1]} for one mixture per position), got "
                f"{got}."
            )
        sums = r.sum(-1)
        valid = (torch.isfinite(r) & (r >= 0)).all()
        off = (sums - 1).abs().amax() if sums.numel() else sums.new_zeros(())
        valid, worst = torch.stack([valid.to(off.dtype), off]).tolist()  # one host sync for both checks
        if not valid:
            raise ValueError("responsibilities must be finite and non-negative.")
        if not worst <= _SUM_TOL:
            raise ValueError(
                f"responsibilities must sum to 1 over the experts (last dim); off by up to "
                f"{worst:.3g}. Normalise them, e.g. r / r.sum(-1, keepdim=True)."
            )
        return r

    # ------------------------------------------------------------------ forward

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None = None,
        attn_mask: Tensor | None = None,
        responsibilities: Tensor | None = None,
        causal_gate: bool | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Mixture of attentive experts ``sum_e g_e f_e(X)`` (eq. 6).

        Args:
            query: ``[L, N, d]`` (``[N, L, d]`` if ``batch_first``), or unbatched ``[L, d]``.
            key, value: ``[S, N, d]`` (``[N, S, d]`` if ``batch_first``), or ``[S, d]``.
            key_padding_mask: ``[N, S]`` (``[S]`` unbatched); bool True = ignore that key, or
                float added to the scores (MHA semantics). When ``query is key`` (self-attention)
                it also removes the padded positions from the gate's mean (True, or a float
                entry at ``-inf`` or at most :data:`FORBIDDING`). A query left with no
                key to attend to (all padded or forbidden by True or ``-inf`` entries) gets zero
                head outputs, as torch's ``scaled_dot_product_attention`` gives, not NaN; finite
                entries (``finfo.min``, ``-1e9``) leave finite scores, so such a query averages
                the values, as in ``nn.MultiheadAttention``.
            attn_mask: ``[L, S]`` or ``[N * h, L, S]``; bool True = not allowed, or float added
                (MHA semantics; e.g. ``nn.Transformer.generate_square_subsequent_mask``).
            responsibilities: ``[N, E]`` (or ``[N, L, E]``), rows summing to 1; overrides the
                gate and :attr:`routing` (uniform: MHA; one-hot: a single expert).
            causal_gate: whether the queries attend causally, so that the gate of query ``t``
                must not depend on later queries. ``None`` (default): causal exactly when
                ``attn_mask`` forbids every key after its query (``L == S``, e.g. a decoder's
                self-attention with ``generate_square_subsequent_mask``; a float entry forbids
                its key at ``-inf`` or at most :data:`FORBIDDING`, such as transformers'
                ``torch.finfo(dtype).min``). Pass True for a causal
                decoder's cross-attention (its queries are target positions under teacher
                forcing, but its ``attn_mask`` is None), False to force one gate per instance.
                With ``gate_context`` set the gate is causal anyway. A causal gate is one per
                position: the mean of the query prefix ``0 .. t`` (see :meth:`gate_summary`).

        Returns:
            ``(attn_output, responsibilities)``: ``attn_output`` has the query's shape (as
            ``nn.MultiheadAttention(...)[0]``); ``responsibilities`` are the expert weights used,
            ``[N, E]`` (``[N, L, E]`` with ``gate_context`` or a causal gate; ``[E]`` / ``[L, E]``
            unbatched),
            differentiable w.r.t. the gate only under ``routing="gate"``.

        Raises:
            TypeError: on a query, key or value that is not a tensor (also a ValueError).
            ValueError: on inputs of the wrong rank or size, or bad ``responsibilities``.
        """
        for name, t in (("query", query), ("key", key), ("value", value)):
            if not isinstance(t, Tensor):
                raise ArgumentTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}; convert it with "
                                        "torch.as_tensor(...)")
        if query.dim() not in (2, 3) or key.dim() != query.dim() or value.dim() != query.dim():
            raise ValueError(
                f"query, key and value must all be 3-D (batched) or 2-D (unbatched), got "
                f"{query.dim()}-D, {key.dim()}-D, {value.dim()}-D."
            )
        unbatched = query.dim() == 2
        self_attention = query is key
        out_dtype = query.dtype
        query, key, value = self._compute_inputs(query, key, value)
        if unbatched:
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
            if responsibilities is not None:
                responsibilities = responsibilities.unsqueeze(0)
        elif not self.batch_first:
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        batch, seq, d = query.shape
        src = key.shape[1]
        if d != self.embed_dim or key.shape[-1] != d or value.shape[-1] != d:
            raise ValueError(
                f"query, key and value must have last dim embed_dim={self.embed_dim}, got "
                f"{d}, {key.shape[-1]}, {value.shape[-1]}."
            )
        if key.shape[:2] != value.shape[:2] or key.shape[0] != batch:
            raise ValueError(
                f"key and value must share [batch, src] with batch = query's ({batch}); got "
                f"{tuple(key.shape[:2])} and {tuple(value.shape[:2])} (batch first)."
            )
        if key_padding_mask is not None and tuple(key_padding_mask.shape) != (batch, src):
            raise ValueError(
                f"key_padding_mask must be [batch, src] = {(batch, src)}, got "
                f"{tuple(key_padding_mask.shape)}."
            )
        self._check_masks(key_padding_mask, attn_mask)

        if causal_gate is None:
            if attn_mask is not None and not checks_run():
                raise ValueError("under torch.compile the causal_gate cannot be read from attn_mask's values (a "
                                 "host read): pass causal_gate=True (causal queries) or False")
            causal_gate = _forbids_future(attn_mask, seq, src)
        elif not isinstance(causal_gate, bool):
            raise TypeError(f"causal_gate must be None, True or False, got {type(causal_gate).__name__}.")
        if responsibilities is None:
            qpm = None  # in self-attention the padded keys are the padded queries: out of the gate's mean
            if self_attention and key_padding_mask is not None:
                qpm = _padding(key_padding_mask)
            resp = self._responsibilities(query, qpm, causal_gate)
        else:
            resp = self._check_responsibilities(responsibilities, batch, seq).to(query.dtype)
        k, v = self._project_kv(key, value)
        out = self._mix(self._attend(query, k, v, key_padding_mask, attn_mask), resp)

        out, resp = out.to(out_dtype), resp.to(out_dtype)
        if unbatched:
            return out.squeeze(0), resp.squeeze(0)
        if not self.batch_first:
            out = out.transpose(0, 1)
        return out, resp

    def _compute_inputs(self, query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """query, key, value in the parameters' dtype (the same object stays the same object),
        checked floating and finite (one host sync for all three)."""
        dtype = self.in_proj_weight.dtype
        q = floating_input(query, "query", dtype)
        k = q if key is query else floating_input(key, "key", dtype)
        v = q if value is query else k if value is key else floating_input(value, "value", dtype)
        distinct: list[Tensor] = []
        for t in (q, k, v):
            if all(t is not u for u in distinct):
                distinct.append(t)
        if self.check_finite:
            check_finite(distinct, "query/key/value",
                         "the input contains NaN/inf; check the previous layer (or the padding values)")
        return q, k, v

    def _check_masks(self, key_padding_mask: Tensor | None, attn_mask: Tensor | None) -> None:
        """ValueError for a mask that is neither bool nor floating (a 0/1 integer mask would be
        added to the scores: +1 at the keys it means to remove, as ``nn.MultiheadAttention``
        refuses it too) and, under :attr:`check_finite`, for NaN or +inf in a float mask (``-inf``
        forbids a key; one host sync per float mask)."""
        for name, mask in (("key_padding_mask", key_padding_mask), ("attn_mask", attn_mask)):
            if mask is None:
                continue
            if not isinstance(mask, Tensor):
                raise TypeError(f"{name} must be a torch.Tensor or None, got {type(mask).__name__}")
            if mask.dtype == torch.bool:
                continue
            if not mask.is_floating_point():
                raise ValueError(f"{name} must be bool (True = not allowed) or floating (added to the scores), got "
                                 f"{mask.dtype}; for a 0/1 mask pass {name}.bool() (1 = masked) or "
                                 f"{name} == 0 (1 = kept)")
            if self.check_finite:
                check_finite(mask.detach().clamp(min=0.0), f"{name}'s entries",  # (-inf: a forbidden key)
                             "an additive mask may hold -inf or finite values, not NaN or +inf")

    # ------------------------------------------------------------------ cached keys and values

    def project_keys_values(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        """Every head's keys and values, for :meth:`attend` (a decoder's cache).

        Args:
            key, value: ``[N, S, d]`` (batch first, whatever :attr:`batch_first` says).

        Returns:
            ``(k, v)``, each ``[N, h, S, head_dim]`` in the parameters' dtype; a cache grows along ``S``
            (``torch.cat(..., dim=2)``).
        """
        if key.dim() != 3 or key.shape != value.shape or key.shape[-1] != self.embed_dim:
            raise ValueError(f"key and value must both be [N, S, embed_dim={self.embed_dim}], got "
                             f"{tuple(key.shape)} and {tuple(value.shape)}.")
        _, key, value = self._compute_inputs(key, key, value)
        return self._project_kv(key, value)

    def attend(
        self,
        query: Tensor,
        keys: Tensor,
        values: Tensor,
        responsibilities: Tensor,
        key_padding_mask: Tensor | None = None,
    ) -> Tensor:
        """:meth:`forward` over keys and values projected once by :meth:`project_keys_values`.

        Incremental decoding calls it with the newest position's query, the cached keys and values of
        the positions so far (or of the encoder output) and the responsibilities from
        :meth:`route_summary`, so no key or value is projected twice. Equal to ``forward(query, key,
        value, key_padding_mask, responsibilities=responsibilities)[0]`` for the keys and values it
        was given.

        Args:
            query: ``[N, L, d]`` (batch first).
            keys, values: ``[N, h, S, head_dim]``.
            responsibilities: ``[N, E]`` or ``[N, L, E]``, rows summing to 1.
            key_padding_mask: ``[N, S]``, as in :meth:`forward`.

        Returns:
            ``[N, L, d]`` in the query's dtype.
        """
        if query.dim() != 3 or query.shape[-1] != self.embed_dim:
            raise ValueError(f"query must be [N, L, embed_dim={self.embed_dim}], got {tuple(query.shape)}.")
        batch, seq, _ = query.shape
        want = (batch, self.num_heads, keys.shape[2] if keys.dim() == 4 else -1, self.head_dim)
        if keys.dim() != 4 or tuple(keys.shape) != want or keys.shape != values.shape:
            raise ValueError(f"keys and values must both be [N, h, S, head_dim] = {want} (from "
                             f"project_keys_values), got {tuple(keys.shape)} and {tuple(values.shape)}.")
        if key_padding_mask is not None and tuple(key_padding_mask.shape) != (batch, keys.shape[2]):
            raise ValueError(f"key_padding_mask must be [N, S] = {(batch, keys.shape[2])}, got "
                             f"{tuple(key_padding_mask.shape)}.")
        self._check_masks(key_padding_mask, None)
        out_dtype = query.dtype
        query = self._compute_inputs(query, query, query)[0]
        resp = self._check_responsibilities(responsibilities, batch, seq).to(query.dtype)
        return self._mix(self._attend(query, keys, values, key_padding_mask, None), resp).to(out_dtype)

    # ------------------------------------------------------------------ heads

    def _project_kv(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values per head, ``[N, h, S, head_dim]`` each (batch-first inputs)."""
        batch, src, _ = key.shape
        h, hd = self.num_heads, self.head_dim
        _, w_k, w_v = self.in_proj_weight.chunk(3)
        b_k = b_v = None
        if self.in_proj_bias is not None:
            _, b_k, b_v = self.in_proj_bias.chunk(3)
        k = F.linear(key, w_k, b_k).view(batch, src, h, hd).transpose(1, 2)
        v = F.linear(value, w_v, b_v).view(batch, src, h, hd).transpose(1, 2)
        return k, v

    def _attend(
        self,
        query: Tensor,
        k: Tensor,
        v: Tensor,
        key_padding_mask: Tensor | None,
        attn_mask: Tensor | None,
    ) -> Tensor:
        """Per-head attention outputs ``H_i`` (eq. 2), ``[N, h, L, head_dim]``, for batch-first queries
        and projected keys and values ``[N, h, S, head_dim]``."""
        batch, seq, _ = query.shape
        src = k.shape[2]
        h, hd = self.num_heads, self.head_dim
        w_q = self.in_proj_weight.chunk(3)[0]
        b_q = None if self.in_proj_bias is None else self.in_proj_bias.chunk(3)[0]
        q = F.linear(query, w_q, b_q).view(batch, seq, h, hd).transpose(1, 2)
        # Scores and softmax of half-precision heads in float32, as torch's attention computes them:
        # q k^T of float16 heads passes 65504 (inf, then NaN) at inputs where nn.MultiheadAttention
        # stays finite. q is scaled before the product, as there.
        work = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
        mask = _additive_mask(key_padding_mask, attn_mask, batch, h, seq, src, work)
        scores = (q.to(work) * (1.0 / math.sqrt(hd))) @ k.to(work).transpose(-2, -1)
        blind = None
        if mask is not None:
            # A query that may attend to no key (every key padded or forbidden) gets zero heads, as
            # torch's scaled_dot_product_attention gives it; a softmax over -inf alone is NaN, in
            # value and in gradient. Those rows are found and cleared on the mask (smaller than the
            # scores; finite queries and keys give the same rows), softmaxed as finite, and their
            # heads zeroed: one pass over [N, h, L, head_dim], no host read.
            blind = torch.isneginf(mask).all(-1, keepdim=True)
            mask = mask.masked_fill(blind, 0.0)
            scores = scores + mask
        attn = torch.softmax(scores, dim=-1).to(v.dtype)
        if self.training and self.dropout > 0:
            attn = F.dropout(attn, p=self.dropout)
        heads = attn @ v
        return heads if blind is None else heads.masked_fill(blind, 0.0)

    def _mix(self, heads: Tensor, resp: Tensor) -> Tensor:
        """``sum_e g_e f_e`` (eq. 6) from the head outputs ``[N, h, L, hd]``: heads weighted by
        :func:`head_weights`, then the output projection; ``[N, L, d]``."""
        batch, _, seq, _ = heads.shape
        w = head_weights(resp, self.keep)  # [N, h] or [N, L, h]
        if w.dim() == 2:
            heads = heads * w[:, :, None, None]
        else:
            heads = heads * w.transpose(1, 2).unsqueeze(-1)
        return self.out_proj(heads.transpose(1, 2).reshape(batch, seq, self.embed_dim))

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, drop_heads={self.drop_heads}, "
            f"num_experts={self.num_experts}, batch_first={self.batch_first}, "
            f"gate_context={self.gate_context}, sample_per={self.sample_per!r}"
        )


#: An additive attention-mask entry at or below this forbids its key: ``-inf`` (torch's masks),
#: ``torch.finfo(dtype).min`` (transformers') and the classic ``-1e4`` and ``-1e9`` all do. The
#: key's softmax weight ``exp(score + entry - max)`` is then exactly 0 in float32 and in half
#: precision unless the scores spread over more than ~9900.
FORBIDDING = -1e4


def _window_sums(x: Tensor, c: int) -> Tensor:
    """``[batch, seq, d]``: the sum of ``x [batch, seq, d]`` over positions ``max(0, t - c + 1) .. t``
    of every position ``t`` (differences of prefix sums)."""
    csum = torch.cumsum(x, dim=1)
    if x.shape[1] <= c:
        return csum
    return torch.cat([csum[:, :c], csum[:, c:] - csum[:, :-c]], dim=1)


def _padding(key_padding_mask: Tensor) -> Tensor:
    """``[N, S]`` bool, True at the keys ``key_padding_mask`` removes: True in a bool mask, ``-inf``
    or at most :data:`FORBIDDING` in a float (additive) one, as the attention treats them."""
    if key_padding_mask.dtype == torch.bool:
        return key_padding_mask
    return key_padding_mask <= FORBIDDING


def _forbids_future(attn_mask: Tensor | None, seq: int, src: int) -> bool:
    """Whether ``attn_mask`` (MHA semantics, ``[L, S]`` or ``[N*h, L, S]``) forbids every key
    ``s > t`` to query ``t`` (True in a boolean mask, at most :data:`FORBIDDING` in a float one):
    the queries attend causally. Needs ``L == S``; a mask of the wrong shape is left to
    :func:`_additive_mask` to reject."""
    if attn_mask is None or seq != src or seq < 2 or attn_mask.shape[-2:] != (seq, src):
        return False
    future = torch.triu(torch.ones(seq, src, dtype=torch.bool, device=attn_mask.device), diagonal=1)
    blocked = attn_mask if attn_mask.dtype == torch.bool else attn_mask <= FORBIDDING
    return bool((blocked | ~future).all())  # one host sync (a boolean index would add a second)


def _additive_mask(
    key_padding_mask: Tensor | None,
    attn_mask: Tensor | None,
    batch: int,
    heads: int,
    seq: int,
    src: int,
    dtype: torch.dtype,
) -> Tensor | None:
    """MHA's two masks as one additive float mask broadcastable to ``[N, h, L, S]``."""

    def to_float(m: Tensor) -> Tensor:
        if m.dtype == torch.bool:
            return torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill(m, float("-inf"))
        return m.to(dtype)

    mask: Tensor | None = None
    if attn_mask is not None:
        if attn_mask.dim() == 2:
            if tuple(attn_mask.shape) != (seq, src):
                raise ValueError(
                    f"attn_mask must be [L, S] = {(seq, src)} or [N*h, L, S], got "
                    f"{tuple(attn_mask.shape)}."
                )
            mask = to_float(attn_mask).view(1, 1, seq, src)
        elif attn_mask.dim() == 3 and tuple(attn_mask.shape) == (batch * heads, seq, src):
            mask = to_float(attn_mask).view(batch, heads, seq, src)
        else:
            raise ValueError(
                f"attn_mask must be [L, S] = {(seq, src)} or [N*h, L, S] = "
                f"{(batch * heads, seq, src)}, got {tuple(attn_mask.shape)}."
            )
    if key_padding_mask is not None:
        kpm = to_float(key_padding_mask).view(batch, 1, 1, src)
        mask = kpm if mask is None else mask + kpm
    return mask


def mae_modules(model: nn.Module) -> list[MixtureOfAttentiveExperts]:
    """All :class:`MixtureOfAttentiveExperts` inside ``model``, in module order."""
    return [m for m in model.modules() if isinstance(m, MixtureOfAttentiveExperts)]


def set_routing(
    model: nn.Module, routing: str, generator: torch.Generator | None = None
) -> list[MixtureOfAttentiveExperts]:
    """Set :attr:`~MixtureOfAttentiveExperts.routing` (and the sampling generator) everywhere.

    Args:
        model: a model containing MAE layers (or one MAE layer).
        routing: one of :data:`ROUTINGS`.
        generator: used by the ``"sample"`` / ``"uniform_sample"`` routings (None: global RNG).

    Returns:
        The MAE modules touched.
    """
    if routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}.")
    check_generator(generator)
    mods = mae_modules(model)
    for m in mods:
        m.routing = routing
        m.generator = generator
    return mods
