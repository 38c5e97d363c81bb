"""Gated (SwiGLU) stacked experts, transformers' fused layout, and MoE(experts=...) (the experts protocol)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from routelab.layers import MoE, MoEConfig, StackedExperts


def _reference(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """SwiGLU by its definition, expert by expert: (silu(x Wg) * (x Wu)) Wd, float64."""
    x, gate, up, down = (t.double() for t in (x, gate, up, down))
    return torch.stack([(F.silu(x[e] @ gate[e]) * (x[e] @ up[e])) @ down[e] for e in range(x.shape[0])])


@settings(max_examples=25, deadline=None, derandomize=True)
@given(E=st.integers(1, 4), C=st.integers(0, 5), d=st.integers(1, 6), hidden=st.integers(1, 7),
       seed=st.integers(0, 2**16))
def test_gated_experts_compute_swiglu(E, C, d, hidden, seed):
    torch.manual_seed(seed)
    experts = StackedExperts(d, hidden, E, activation="swiglu", bias=False)
    assert experts.gated and experts.w3 is not None
    x = torch.randn(E, C, d)
    expected = _reference(x, experts.w1, experts.w3, experts.w2)
    assert torch.allclose(experts(x).double(), expected, atol=1e-5, rtol=1e-4)
    for e in range(E):
        assert torch.allclose(experts.expert(e, x[e]).double(), expected[e], atol=1e-5, rtol=1e-4)


def test_gated_with_biases_and_gated_flag():
    torch.manual_seed(0)
    experts = StackedExperts(5, 7, 3, activation="gelu", gated=True)  # GeGLU with biases
    x = torch.randn(3, 4, 5)
    h = F.gelu(x @ experts.w1 + experts.b1) * (x @ experts.w3 + experts.b3)
    assert torch.allclose(experts(x), h @ experts.w2 + experts.b2, atol=1e-6)
    assert sum(p.numel() for p in experts.parameters()) == 3 * (5 * 7 * 3 + 7 + 7 + 5)


def test_from_hf_fused_reproduces_transformers_experts():
    tf = pytest.importorskip("transformers")
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    config = tf.MixtralConfig(hidden_size=16, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    hf = MixtralExperts(config)
    torch.nn.init.normal_(hf.gate_up_proj, std=0.2)
    torch.nn.init.normal_(hf.down_proj, std=0.2)
    ours = StackedExperts.from_hf_fused(hf.gate_up_proj.detach(), hf.down_proj.detach())
    assert (ours.num_experts, ours.d_model, ours.d_hidden, ours.gated) == (4, 16, 24, True)
    x = torch.randn(30, 16)
    index = torch.stack([torch.randperm(4)[:2] for _ in range(30)])
    weight = torch.rand(30, 2)
    with torch.no_grad():
        expected = hf(x, index, weight)
        got = sum(weight[:, s:s + 1] * torch.stack([ours.expert(int(e), x[t:t + 1])[0] for t, e in
                                                    enumerate(index[:, s])]) for s in range(2))
    assert torch.allclose(got, expected, atol=1e-6, rtol=1e-5)
    # The weights are copies: changing the layer does not change transformers' tensors.
    with torch.no_grad():
        ours.w1.zero_()
    assert hf.gate_up_proj.abs().sum() > 0


def test_from_hf_fused_rejects_wrong_shapes():
    with pytest.raises(ValueError, match="down_proj"):
        StackedExperts.from_hf_fused(torch.randn(4, 10, 8), torch.randn(4, 8, 4))
    with pytest.raises(ValueError, match="gate_up_proj"):
        StackedExperts.from_hf_fused(torch.randn(4, 9, 8), torch.randn(4, 8, 4))
    with pytest.raises(ValueError, match="gate_up_proj"):
        StackedExperts.from_hf_fused(torch.randn(10, 8), torch.randn(4, 8, 5))


def test_moe_with_hf_experts_equals_the_mixtral_block():
    """MoE(router="topk", k=2, renormalize, dropless, experts=from_hf_fused) is transformers' Mixtral block."""
    tf = pytest.importorskip("transformers")
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = tf.MixtralConfig(hidden_size=16, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    block = MixtralSparseMoeBlock(config)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.3)
    experts = StackedExperts.from_hf_fused(block.experts.gate_up_proj.detach(), block.experts.down_proj.detach())
    moe = MoE(16, 24, 4, router="topk", k=2, router_kwargs={"renormalize": True}, capacity_factor=None,
              experts=experts)
    with torch.no_grad():
        moe.router.proj.weight.copy_(block.gate.weight)
        x = torch.randn(3, 7, 16)
        y, _ = moe(x)
        assert (y - block(x)).abs().max() <= 1e-5


class _Doubler(torch.nn.Module):
    """A user's experts module: expert e multiplies by (e + 1)."""

    def __init__(self, num_experts: int) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.arange(1.0, num_experts + 1.0))

    def forward(self, buffers: torch.Tensor) -> torch.Tensor:
        return buffers * self.scale[:, None, None]


def test_moe_takes_any_module_with_the_experts_protocol():
    moe = MoE(6, 1, 3, router="topk", k=1, capacity_factor=None, experts=_Doubler(3))
    x = torch.randn(10, 6)
    y, routes = moe(x)
    expected = x * (routes.expert[:, 0] + 1).unsqueeze(-1).float() * routes.gate
    assert torch.allclose(y, expected, atol=1e-6)
    y.sum().backward()
    assert moe.experts.scale.grad is not None
    assert moe.config.experts is moe.experts
    assert MoE.from_config(moe.config).experts is moe.experts


def test_experts_of_the_wrong_shape_are_a_clear_error():
    class Bad(torch.nn.Module):
        def forward(self, buffers):
            return buffers[..., :2]

    moe = MoE(6, 4, 3, experts=Bad())
    with pytest.raises(ValueError, match=r"experts \(Bad\) must map buffers"):
        moe(torch.randn(5, 6))
    with pytest.raises(ValueError, match="experts must be an nn.Module"):
        MoE(6, 4, 3, experts=lambda b: b)


def test_config_describes_gated_experts():
    moe = MoE(8, 16, 4, activation="swiglu", bias=False)
    assert moe.experts.gated and moe.config.gated
    again = MoE.from_config(moe.config)
    assert again.experts.gated
    assert sum(p.numel() for p in again.parameters()) == sum(p.numel() for p in moe.parameters())
    assert MoEConfig(8, 16, 4, gated=True).gated
    with pytest.raises(ValueError, match="unknown activation"):
        MoEConfig(8, 16, 4, activation="swigloo")
