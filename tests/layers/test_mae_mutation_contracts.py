"""Contracts of routelab.layers.MixtureOfAttentiveExperts found untested by mutation testing.

Each test guards one behaviour a deliberate bug in ``src/routelab/layers/mae.py`` changed without
any existing test noticing. Oracles are independent of the code under test where possible:
``torch.nn.MultiheadAttention`` (eq. 5, uniform responsibilities), the gate of eq. 6 applied to a
mean computed by hand, the draws of a seeded generator replayed by hand, and the documented
argument checks and dtype policy.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from routelab.layers import MixtureOfAttentiveExperts

torch.set_num_threads(1)

D, H = 8, 4


def _peaked_mae(seed: int, **kwargs) -> MixtureOfAttentiveExperts:
    """A batch-first MAE whose gate is far from uniform (so that the gate's input matters)."""
    torch.manual_seed(seed)
    mae = MixtureOfAttentiveExperts(D, H, batch_first=True, **kwargs).eval()
    with torch.no_grad():
        mae.gate.out.weight.normal_(0, 3.0)
        mae.gate.out.bias.normal_(0, 1.0)
    return mae


def _causal(length: int) -> torch.Tensor:
    return torch.triu(torch.ones(length, length, dtype=torch.bool), diagonal=1)


# ------------------------------------------------------------------ the per-instance draw (Alg. 2, UNI-MAE)


def test_uniform_sample_under_a_causal_gate_draws_one_expert_per_instance() -> None:
    """Guards: ``routing="uniform_sample"`` with a per-position (causal) gate and the default
    ``sample_per="instance"`` draws one expert per instance (UNI-MAE training, Alg. 2), used at every
    position, not one per position. Oracle: ``torch.randint(E, (batch,))`` of the same seeded generator."""
    mae = _peaked_mae(1)
    assert mae.sample_per == "instance"
    x = torch.randn(16, 6, D)
    mae.routing = "uniform_sample"
    mae.generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        _, resp = mae(x, x, x, attn_mask=_causal(6))
    want = torch.randint(mae.num_experts, (16,), generator=torch.Generator().manual_seed(3))
    one_hot = nn.functional.one_hot(want, mae.num_experts).float()
    torch.testing.assert_close(resp, one_hot[:, None].expand(16, 6, mae.num_experts), rtol=0, atol=0)


# ------------------------------------------------------------------ masks


def test_a_float_key_padding_entry_of_exactly_forbidding_is_padding_for_the_gate() -> None:
    """Guards: a float key-padding entry *at* :data:`FORBIDDING` (the classic ``-1e4``) removes its
    position from the gate's mean, as the docstring says ("at most FORBIDDING"), just like ``True``
    in a bool mask. Oracle: the same call with the equivalent bool mask, and the gate of the mean of
    the real positions by hand."""
    from routelab.layers.mae import FORBIDDING

    mae = _peaked_mae(2)
    x = torch.randn(3, 5, D, generator=torch.Generator().manual_seed(0))
    pad = torch.zeros(3, 5, dtype=torch.bool)
    pad[0, 3:] = True
    pad[2, 1] = True
    float_pad = torch.zeros(3, 5).masked_fill(pad, FORBIDDING)
    with torch.no_grad():
        out_f, r_f = mae(x, x, x, key_padding_mask=float_pad)
        out_b, r_b = mae(x, x, x, key_padding_mask=pad)
        for b in range(3):
            torch.testing.assert_close(r_f[b], mae.gate(x[b][~pad[b]].mean(0)))
    torch.testing.assert_close(r_f, r_b)
    torch.testing.assert_close(out_f, out_b)


def test_a_three_d_attn_mask_is_batch_major_as_in_multihead_attention() -> None:
    """Guards: an ``attn_mask`` of shape ``[N * h, L, S]`` is indexed ``n * h + head`` (batch-major),
    as in ``nn.MultiheadAttention``. Oracle: MHA with a mask that differs per instance and per head,
    under uniform responsibilities (eq. 5)."""
    torch.manual_seed(0)
    n, length, src = 3, 4, 5
    mha = nn.MultiheadAttention(D, H, batch_first=True).eval()
    mae = MixtureOfAttentiveExperts.from_multihead_attention(mha).eval()
    g = torch.Generator().manual_seed(4)
    q = torch.randn(n, length, D, generator=g)
    kv = torch.randn(n, src, D, generator=g)
    forbid = torch.rand(n * H, length, src, generator=g) < 0.5
    forbid[..., 0] = False  # every query keeps a key (MHA would give NaN otherwise)
    additive = torch.randn(n * H, length, src, generator=g)  # and a float mask, also per head
    uniform = torch.full((n, mae.num_experts), 1.0 / mae.num_experts)
    for mask in (forbid, additive):
        want = mha(q, kv, kv, attn_mask=mask, need_weights=False)[0]
        got = mae(q, kv, kv, attn_mask=mask, responsibilities=uniform)[0]
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_in_cross_attention_the_key_padding_does_not_touch_the_gate() -> None:
    """Guards: the key padding mask removes positions from the gate's mean only in self-attention
    (``query is key``); in cross-attention (even with ``L == S``) the gate is the mean of every query.
    Oracle: the gate of the plain query mean, by hand."""
    mae = _peaked_mae(3)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 5, D, generator=g)
    memory = torch.randn(2, 5, D, generator=g)
    pad = torch.tensor([[False, False, False, True, True], [False] * 5])
    with torch.no_grad():
        _, r = mae(q, memory, memory, key_padding_mask=pad)
        torch.testing.assert_close(r, mae.gate(q.mean(1)))


# ------------------------------------------------------------------ construction


@pytest.mark.parametrize("training", [False, True])
def test_from_multihead_attention_copies_dropout_and_the_training_mode(training: bool) -> None:
    """Guards: ``from_multihead_attention`` takes ``mha``'s dropout and its train/eval mode. An eval
    MHA with dropout gives a deterministic MAE equal to it (eq. 5); a training one gives a MAE that
    drops attention weights (its output differs from its own eval output)."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(D, H, dropout=0.5, batch_first=True).train(training)
    mae = MixtureOfAttentiveExperts.from_multihead_attention(mha)
    assert mae.training is training
    assert mae.dropout == 0.5
    x = torch.randn(2, 6, D)
    with torch.no_grad():
        out = mae(x, x, x)[0]
        if not training:
            torch.testing.assert_close(out, mha(x, x, x, need_weights=False)[0], atol=1e-6, rtol=1e-5)
        else:
            eval_out = mae.eval()(x, x, x)[0]
            assert (out - eval_out).abs().max() > 1e-3


@pytest.mark.parametrize("gate_hidden", [0, -1, 2.0, True])
def test_a_bad_gate_hidden_is_refused(gate_hidden) -> None:
    """Guards: ``gate_hidden`` must be a positive int; 0 is not silently the default ``embed_dim``."""
    with pytest.raises(ValueError, match="gate_hidden"):
        MixtureOfAttentiveExperts(D, H, gate_hidden=gate_hidden)


def test_attend_refuses_an_integer_key_padding_mask() -> None:
    """Guards: :meth:`attend` checks its mask as :meth:`forward` does: a 0/1 integer mask (which would
    be added to the scores, +1 at the keys it means to remove) is a ValueError."""
    mae = MixtureOfAttentiveExperts(D, H, batch_first=True)
    q, kv = torch.randn(2, 3, D), torch.randn(2, 4, D)
    k, v = mae.project_keys_values(kv, kv)
    r = torch.full((2, H), 1.0 / H)
    with pytest.raises(ValueError, match="key_padding_mask must be bool"):
        mae.attend(q, k, v, r, key_padding_mask=torch.zeros(2, 4, dtype=torch.long))
    bad = torch.zeros(2, 4)
    bad[0, 1] = float("nan")
    with pytest.raises(ValueError, match="not finite"):
        mae.attend(q, k, v, r, key_padding_mask=bad)


# ------------------------------------------------------------------ dtypes


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16])
def test_output_and_responsibilities_come_back_in_the_querys_dtype(dtype: torch.dtype) -> None:
    """Guards the class's dtype policy: the module computes in its parameters' dtype (float32 here)
    and returns the output *and* the responsibilities in the query's dtype, under the gate and under
    given responsibilities."""
    mae = _peaked_mae(4)
    x = torch.randn(2, 5, D).to(dtype)
    with torch.no_grad():
        out, r = mae(x, x, x)
        out_given, r_given = mae(x, x, x, responsibilities=torch.full((2, H), 1.0 / H))
        out_causal, r_causal = mae(x, x, x, attn_mask=_causal(5))
    for t in (out, r, out_given, r_given, out_causal, r_causal):
        assert t.dtype == dtype
    torch.testing.assert_close(r.float(), mae.gate(x.float().mean(1)), atol=1e-3, rtol=1e-3)


def test_a_sample_per_set_after_construction_is_checked_at_the_next_forward() -> None:
    """``sample_per`` is an attribute like ``routing``, and checked like it on every forward: a value
    set since construction that is neither "instance" nor "position" is an error naming it (it acted
    as "position", a different expert at each position, silently; found by the mutation review)."""
    mae = MixtureOfAttentiveExperts(D, H, batch_first=True)
    x = torch.randn(2, 5, D)
    mae.routing = "sample"
    mae.sample_per = "token"
    with pytest.raises(ValueError, match=r"sample_per must be one of \('instance', 'position'\), got 'token'"):
        mae(x, x, x, attn_mask=_causal(5), causal_gate=True)
    mae.sample_per = "position"
    mae(x, x, x, attn_mask=_causal(5), causal_gate=True)
