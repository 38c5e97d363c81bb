"""The MAE gate is causal wherever the queries attend causally (issue 13, part 3).

Oracle: the gate output (and the layer output) at query position ``t`` is unchanged when the
queries after ``t`` change; and the causal gate at ``t`` equals the gate of the mean of the
queries ``0 .. t`` computed by hand. The same check with the causal gate switched off shows the
leak the fix removes, so the property tests can fail.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from routelab.layers import MixtureOfAttentiveExperts

torch.set_num_threads(1)

D, H = 8, 4


def _mae(seed: int, drop_heads: int = 1) -> MixtureOfAttentiveExperts:
    torch.manual_seed(seed)
    mae = MixtureOfAttentiveExperts(D, H, drop_heads=drop_heads, batch_first=True).eval()
    with torch.no_grad():  # a gate far from uniform, so every position's gate matters
        mae.gate.out.weight.normal_(0, 3.0)
        mae.gate.out.bias.normal_(0, 1.0)
    return mae


def _causal_mask(length: int, kind: str, batch: int) -> torch.Tensor:
    future = torch.triu(torch.ones(length, length, dtype=torch.bool), diagonal=1)
    if kind == "bool":
        return future
    if kind == "float":
        return torch.zeros(length, length).masked_fill(future, float("-inf"))
    if kind == "finfo_min":  # transformers' convention
        return torch.zeros(length, length).masked_fill(future, torch.finfo(torch.float32).min)
    if kind == "minus_1e9":
        return torch.zeros(length, length).masked_fill(future, -1e9)
    return future.expand(batch * H, length, length).clone()  # [N*h, L, S]


@settings(max_examples=25, deadline=None, derandomize=True)
@given(seed=st.integers(0, 10_000), length=st.integers(2, 7), batch=st.integers(1, 3),
       kind=st.sampled_from(["bool", "float", "finfo_min", "minus_1e9", "3d"]), drop=st.sampled_from([1, 2]),
       data=st.data())
def test_self_attention_gate_at_t_ignores_later_positions(seed, length, batch, kind, drop, data) -> None:
    t = data.draw(st.integers(0, length - 2), label="t")
    mae = _mae(seed, drop)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, length, D, generator=g)
    y = x.clone()
    y[:, t + 1:] = 10.0 * torch.randn(batch, length - t - 1, D, generator=g)  # change every later position
    mask = _causal_mask(length, kind, batch)
    with torch.no_grad():
        out_x, r_x = mae(x, x, x, attn_mask=mask)
        out_y, r_y = mae(y, y, y, attn_mask=mask)
        _, leak = mae(y, y, y, attn_mask=mask, causal_gate=False)
        _, r_whole = mae(x, x, x, attn_mask=mask, causal_gate=False)
    assert r_x.shape == (batch, length, mae.num_experts)  # one gate per position
    torch.testing.assert_close(r_y[:, : t + 1], r_x[:, : t + 1])
    torch.testing.assert_close(out_y[:, : t + 1], out_x[:, : t + 1])
    # without the causal gate, one gate per instance from the whole sequence: the future leaks in
    assert leak.shape == (batch, mae.num_experts)
    assert (leak - r_whole).abs().max() > 1e-4


def test_causal_gate_equals_the_gate_of_the_prefix_mean() -> None:
    mae = _mae(3)
    x = torch.randn(2, 6, D, generator=torch.Generator().manual_seed(1))
    pad = torch.tensor([[False] * 6, [False, False, True, False, True, False]])
    mask = _causal_mask(6, "bool", 2)
    with torch.no_grad():
        _, r = mae(x, x, x, attn_mask=mask)
        _, r_pad = mae(x, x, x, attn_mask=mask, key_padding_mask=pad)
        for b in range(2):
            for t in range(6):
                want = mae.gate(x[b, : t + 1].mean(0))  # brute force: the mean of the prefix
                torch.testing.assert_close(r[b, t], want)
                keep = [i for i in range(t + 1) if not pad[b, i]]  # padding is not averaged
                torch.testing.assert_close(r_pad[b, t], mae.gate(x[b, keep].mean(0)))


def test_cross_attention_of_a_decoder_takes_causal_gate_true() -> None:
    """A translation decoder's cross-attention has no attn_mask, but its queries are target
    positions under teacher forcing: causal_gate=True keeps their gates causal."""
    mae = _mae(5)
    g = torch.Generator().manual_seed(2)
    memory = torch.randn(2, 9, D, generator=g)  # the encoder output (any length)
    q = torch.randn(2, 5, D, generator=g)
    q2 = q.clone()
    q2[:, 3:] += 5.0
    with torch.no_grad():
        out, r = mae(q, memory, memory, causal_gate=True)
        out2, r2 = mae(q2, memory, memory, causal_gate=True)
        _, r_default = mae(q, memory, memory)
    torch.testing.assert_close(r2[:, :3], r[:, :3])
    torch.testing.assert_close(out2[:, :3], out[:, :3])
    assert r_default.shape == (2, mae.num_experts)  # an encoder-style gate unless asked


def test_non_causal_masks_keep_one_gate_per_instance() -> None:
    mae = _mae(0)
    x = torch.randn(2, 5, D)
    banded = torch.triu(torch.ones(5, 5, dtype=torch.bool), diagonal=2)  # allows key t + 1
    with torch.no_grad():
        assert mae(x, x, x)[1].shape == (2, mae.num_experts)
        assert mae(x, x, x, attn_mask=banded)[1].shape == (2, mae.num_experts)


def test_routings_other_than_the_gate_follow_the_causal_shape() -> None:
    mae = _mae(1)
    mae.generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, D)
    mask = _causal_mask(4, "bool", 3)
    for routing in ("sample", "top1", "uniform", "uniform_sample"):
        mae.routing = routing
        with torch.no_grad():
            _, r = mae(x, x, x, attn_mask=mask)
        assert r.shape == (3, 4, mae.num_experts) and torch.allclose(r.sum(-1), torch.ones(3, 4))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_causal_gate_in_half_precision(dtype: torch.dtype) -> None:
    mae = _mae(2).to(dtype)
    # prefix sums of 64 values near 3e4 overflow float16 (max 65504); their means do not
    x = 3e4 + 1e3 * torch.randn(2, 64, D, generator=torch.Generator().manual_seed(0))
    got = mae.gate_summary(x.to(dtype), causal=True)
    want = torch.cumsum(x.double(), 1) / torch.arange(1, 65, dtype=torch.float64).view(1, -1, 1)
    assert got.dtype == dtype and torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), want, rtol=1e-2, atol=0)
    y = torch.randn(2, 6, D).to(dtype)
    with torch.no_grad():
        out, r = mae(y, y, y, attn_mask=_causal_mask(6, "bool", 2))
    assert out.dtype == dtype and torch.isfinite(out).all() and torch.isfinite(r).all()
    torch.testing.assert_close(r.float().sum(-1), torch.ones(2, 6), atol=1e-2, rtol=0)


def test_bad_causal_gate_is_a_type_error() -> None:
    mae = _mae(0)
    x = torch.randn(1, 3, D)
    with pytest.raises(TypeError, match="causal_gate"):
        mae(x, x, x, causal_gate="yes")


@pytest.mark.parametrize("routing", ["gate", "top1", "uniform"])
def test_route_summary_is_what_the_forward_routes(routing: str) -> None:
    """responsibilities = route_summary(gate_summary(query)): a caller keeping the summary itself (incremental
    decoding) gets the forward's routing."""
    torch.manual_seed(0)
    mae = MixtureOfAttentiveExperts(16, 4, batch_first=True, gate_hidden=8)
    torch.nn.init.normal_(mae.gate.out.weight)
    mae.routing = routing
    x = torch.randn(3, 5, 16)
    mask = torch.triu(torch.ones(5, 5, dtype=torch.bool), diagonal=1)
    out, r = mae(x, x, x, attn_mask=mask)
    torch.testing.assert_close(mae.route_summary(mae.gate_summary(x, causal=True)), r)
    out2, _ = mae(x, x, x, attn_mask=mask, responsibilities=mae.route_summary(mae.gate_summary(x, causal=True)))
    torch.testing.assert_close(out2, out)
    mae.routing = "bogus"
    with pytest.raises(ValueError, match="routing"):
        mae.route_summary(torch.zeros(2, 16))


def test_attend_over_projected_keys_values_equals_the_forward() -> None:
    """attend(query, *project_keys_values(key, value), r) == forward(query, key, value, responsibilities=r);
    a cache grown along S by concatenation is the same as projecting the whole key sequence."""
    torch.manual_seed(1)
    mae = MixtureOfAttentiveExperts(16, 4, batch_first=True)
    q, kv = torch.randn(2, 3, 16), torch.randn(2, 6, 16)
    pad = torch.tensor([[False] * 6, [False] * 4 + [True] * 2])
    r = torch.softmax(torch.randn(2, 3, 4), -1)
    want, _ = mae(q, kv, kv, key_padding_mask=pad, responsibilities=r)
    k, v = mae.project_keys_values(kv, kv)
    torch.testing.assert_close(mae.attend(q, k, v, r, key_padding_mask=pad), want)
    k1, v1 = mae.project_keys_values(kv[:, :2], kv[:, :2])
    k2, v2 = mae.project_keys_values(kv[:, 2:], kv[:, 2:])
    torch.testing.assert_close(torch.cat([k1, k2], 2), k)
    torch.testing.assert_close(torch.cat([v1, v2], 2), v)
    with pytest.raises(ValueError, match="project_keys_values"):
        mae.attend(q, kv, kv, r)
    with pytest.raises(ValueError, match="key and value"):
        mae.project_keys_values(kv, kv[:, :2])


@pytest.mark.parametrize("kind", ["finfo_min", "minus_1e9"])
def test_a_finite_causal_mask_routes_as_the_minus_inf_one(kind: str) -> None:
    """transformers writes forbidden keys as ``finfo(dtype).min``, older code as ``-1e9``: both
    forbid the key (its softmax weight is exactly 0), so the gate is causal as with ``-inf``."""
    mae = _mae(3)
    x = torch.randn(2, 6, D, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out, r = mae(x, x, x, attn_mask=_causal_mask(6, kind, 2))
        out_inf, r_inf = mae(x, x, x, attn_mask=_causal_mask(6, "float", 2))
    assert r.shape == (2, 6, mae.num_experts)
    torch.testing.assert_close(r, r_inf)
    torch.testing.assert_close(out, out_inf)


def test_a_mildly_negative_bias_is_not_taken_for_a_causal_mask() -> None:
    mae = _mae(0)
    x = torch.randn(2, 5, D)
    bias = torch.zeros(5, 5).masked_fill(torch.triu(torch.ones(5, 5, dtype=torch.bool), 1), -50.0)
    with torch.no_grad():
        assert mae(x, x, x, attn_mask=bias)[1].shape == (2, mae.num_experts)


@pytest.mark.parametrize("how", ["padding", "mask"])
def test_a_query_with_no_key_gets_zero_heads_and_finite_gradients(how: str) -> None:
    """Every key padded (or forbidden) for some queries: those queries' head outputs are zero (as
    torch's scaled_dot_product_attention gives), the others are as if computed alone, and the
    gradients are finite (a softmax over -inf alone was NaN in value and gradient)."""
    torch.manual_seed(0)
    mae = MixtureOfAttentiveExperts(D, H, batch_first=True).eval()
    with torch.no_grad():
        mae.out_proj.bias.normal_()
    x = torch.randn(2, 5, D, requires_grad=True)
    if how == "padding":
        kwargs = {"key_padding_mask": torch.tensor([[True] * 5, [False, False, True, True, True]])}
        blind = (slice(0, 1), slice(None))  # batch 0, every query
    else:
        forbid = torch.zeros(5, 5, dtype=torch.bool)
        forbid[1] = True  # query 1 may attend to no key
        kwargs = {"attn_mask": forbid}
        blind = (slice(None), slice(1, 2))
    out, _ = mae(x, x, x, **kwargs)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[blind], mae.out_proj.bias.expand_as(out[blind]))  # zero heads: the bias alone
    out.square().sum().backward()
    assert torch.isfinite(x.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in mae.parameters() if p.grad is not None)
    if how == "padding":  # batch 1 equals itself computed alone
        alone, _ = mae(x[1:], x[1:], x[1:], key_padding_mask=kwargs["key_padding_mask"][1:])
        torch.testing.assert_close(out[1:], alone)


def test_a_causal_f_step_draws_one_expert_per_instance_from_its_whole_instance_gate() -> None:
    """Review finding: with a per-position gate (causal, or gate_context) the "sample" routing drew
    an expert at every position, so an F step was per-token head dropout, not Alg. 2's one expert
    per instance. Now (sample_per="instance") one draw per instance, at every position, distributed
    as the gate of its last unpadded position (for a causal gate: the mean of the whole instance,
    the paper's g(X)); a Monte Carlo frequency checks the distribution, and the heads the expert
    drops get no gradient. sample_per="position" keeps one draw per position."""
    mae = _mae(0).train()
    seq, n = 6, 3000
    x = torch.randn(1, seq, D).expand(n, seq, D).clone()
    padding = torch.zeros(n, seq, dtype=torch.bool)
    padding[:, -2:] = True  # the last real position is 3
    mask = _causal_mask(seq, "bool", n)
    mae.routing = "gate"
    probs = mae(x[:1], x[:1], x[:1], key_padding_mask=padding[:1], attn_mask=mask)[1][0, 3]
    mae.routing = "sample"
    mae.generator = torch.Generator().manual_seed(0)
    resp = mae(x, x, x, key_padding_mask=padding, attn_mask=mask)[1]  # [n, seq, E]
    assert resp.shape == (n, seq, mae.num_experts)
    assert torch.equal(resp, resp[:, :1].expand_as(resp))  # one expert at every position
    freq = resp[:, 0].mean(0)
    sigma = (probs * (1 - probs) / n).sqrt()
    assert ((freq - probs).abs() <= 4 * sigma + 1e-3).all(), (freq, probs)
    # one instance: gradient only for the heads its expert keeps
    mae.zero_grad()
    out, r = mae(x[:1], x[:1], x[:1], attn_mask=mask)
    out.square().sum().backward()
    e = int(r[0, 0].argmax())
    grad = mae.in_proj_weight.grad[:D].view(H, D // H, D).abs().sum((1, 2))  # the queries' rows per head
    for head in range(H):
        assert (grad[head] == 0) == (head in mae.dropped_heads[e]), (e, head, grad)
    mae.sample_per = "position"
    resp = mae(x[:20], x[:20], x[:20], attn_mask=mask)[1]
    assert not torch.equal(resp, resp[:, :1].expand_as(resp))  # (20 x 6 draws from a gate far from one-hot)
    with pytest.raises(ValueError, match="sample_per must be one of"):
        MixtureOfAttentiveExperts(D, H, sample_per="token")
