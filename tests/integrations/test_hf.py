"""routelab.integrations.hf.patch_moe on tiny random-init transformers MoE models.

Independent truths: the unpatched model (logits, generated tokens, transformers' own
load-balancing loss), the routes' own statistics, the model without activation checkpointing.
"""

from __future__ import annotations

import copy
import functools
import gc
import os
import pickle
import subprocess
import sys
import warnings
import weakref
from pathlib import Path

import pytest
import torch

import routelab
from routelab.integrations.hf import (
    RoutedExperts,
    RoutedGate,
    patch_moe,
    probe_gate,
    routing_child,
    sparse_moe_blocks,
)
from routelab.routers import TopKRouter

tf = pytest.importorskip("transformers")

SRC = Path(__file__).resolve().parents[2] / "src"

VOCAB = 64


def _common(**kw):
    return dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=64, **kw)


#: Tiny configs of the families whose sparse block follows the gate/experts contract.
FAMILIES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(intermediate_size=48, moe_intermediate_size=24, shared_expert_intermediate_size=40,
                       num_experts=4, num_experts_per_tok=2)),
    "qwen2_moe_norm": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                       dict(intermediate_size=48, moe_intermediate_size=24, shared_expert_intermediate_size=40,
                            num_experts=4, num_experts_per_tok=2, norm_topk_prob=True)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(intermediate_size=48, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
                       head_dim=8)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(intermediate_size=24, num_experts=4, num_experts_per_tok=2)),
    "minimax": ("MiniMaxConfig", "MiniMaxForCausalLM",
                dict(intermediate_size=24, num_local_experts=4, num_experts_per_tok=2, head_dim=8)),
    # Blocks whose routing child is called ``router`` (GPT-OSS's also has a bias; Jamba does not renormalise).
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(intermediate_size=24, num_local_experts=4, num_experts_per_tok=2, head_dim=8,
                     layer_types=["sliding_attention", "full_attention"])),
    "jamba": ("JambaConfig", "JambaForCausalLM",
              dict(intermediate_size=24, num_experts=4, num_experts_per_tok=2, attn_layer_period=2, attn_layer_offset=1,
                   expert_layer_period=1, expert_layer_offset=0, mamba_d_state=4, mamba_expand=2, mamba_dt_rank=4)),
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM",
                   dict(intermediate_size=24, num_local_experts=4, num_experts_per_tok=2)),
    # Its gate scores in bfloat16 but returns float32 logits, and rounds its weights to bfloat16.
    "granitemoeshared": ("GraniteMoeSharedConfig", "GraniteMoeSharedForCausalLM",
                         dict(intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
                              shared_intermediate_size=24)),
    # Hybrid linear attention, and multi-head latent attention with shared experts.
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM",
                   dict(intermediate_size=48, moe_intermediate_size=24, shared_expert_intermediate_size=40,
                        num_experts=4, num_experts_per_tok=2, layer_types=["linear_attention", "full_attention"],
                        head_dim=8, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
                        linear_value_head_dim=8)),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM",
                    dict(intermediate_size=48, moe_intermediate_size=24, n_routed_experts=4, num_experts_per_tok=2,
                         n_shared_experts=1, kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4,
                         v_head_dim=8, first_k_dense_replace=0, n_group=1, topk_group=1)),
    # Its gate scores with a Linear child (``wg``), not a weight of its own.
    "hunyuan_v1_moe": ("HunYuanMoEV1Config", "HunYuanMoEV1ForCausalLM",
                       dict(intermediate_size=48, head_dim=8, num_experts=4, moe_topk=2, pad_token_id=0)),
    # DeepSeek-V2's weights carry its routed_scaling_factor (16 in the released model).
    "deepseek_v2_scaled": ("DeepseekV2Config", "DeepseekV2ForCausalLM",
                           dict(intermediate_size=48, moe_intermediate_size=24, n_routed_experts=4,
                                num_experts_per_tok=2, n_shared_experts=1, kv_lora_rank=8, q_lora_rank=8,
                                qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, first_k_dense_replace=0,
                                n_group=1, topk_group=1, routed_scaling_factor=16.0)),
}

#: Families whose block follows the contract but whose gate has a routing rule of its own, and what
#: patch_moe's warning names.
OWN_RULE = {
    "phimoe": ("PhimoeConfig", "PhimoeForCausalLM",
               dict(intermediate_size=24, num_local_experts=4, num_experts_per_tok=2), "does not route by softmax"),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(intermediate_size=48, moe_intermediate_size=24, n_routed_experts=4, num_experts_per_tok=2,
                         n_shared_experts=1, kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4,
                         v_head_dim=8, first_k_dense_replace=0, n_group=2, topk_group=1),
                    "e_score_correction_bias"),
    "minimax_m2": ("MiniMaxM2Config", "MiniMaxM2ForCausalLM",
                   dict(intermediate_size=24, num_local_experts=4, num_experts_per_tok=2, head_dim=8),
                   "inputs of its own"),
}
#: Families whose block routes by another contract, and what patch_moe's refusal names.
OTHER_CONTRACT = {
    "llama4": ("Llama4TextConfig", "Llama4ForCausalLM",
               dict(intermediate_size=24, intermediate_size_mlp=48, num_local_experts=4, num_experts_per_tok=1,
                    head_dim=8), "Llama4TextExperts"),
}


def gate_of(block: torch.nn.Module) -> torch.nn.Module:
    """The block's routing module (``gate`` or ``router``)."""
    return routing_child(block)[1]


def tiny(family: str = "mixtral", seed: int = 0, **overrides) -> torch.nn.Module:
    """A tiny random-init model whose router weights are large enough to make routing non-trivial."""
    config_name, model_name, kw = FAMILIES.get(family) or {**OWN_RULE, **OTHER_CONTRACT}[family][:3]
    if not (hasattr(tf, config_name) and hasattr(tf, model_name)):  # an older transformers (the GPU image's)
        pytest.skip(f"transformers {tf.__version__} has no {model_name}")
    torch.manual_seed(seed)
    model = getattr(tf, model_name)(getattr(tf, config_name)(**_common(**{**kw, **overrides})))
    with torch.no_grad():
        for _, block in sparse_moe_blocks(model):
            for p in gate_of(block).parameters():
                p.normal_()
    return model


def ids(batch: int = 2, seq: int = 8, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _patch(model, router="topk", **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # routers that keep their own k say so
        return patch_moe(model, router, **options)


def probe_block(model: torch.nn.Module):
    """probe_gate of the model's first sparse MoE block's gate, with its block (as patch_moe probes)."""
    block = sparse_moe_blocks(model)[0][1]
    return probe_gate(gate_of(block), block=block)


def _skip_another_contract(family: str, rule) -> None:
    """Skip a family whose gate, in this transformers version, answers its block in a way patch_moe
    cannot read (patch_moe refuses those blocks: test_a_gate_of_another_contract_is_refused). The
    older contracts of transformers 5.17 (the GPU image's) are read: GraniteMoE's reordered outputs,
    Jamba's logits-only gate routed by its block's route_tokens_to_experts."""
    if rule.contract is not None:
        pytest.skip(f"transformers {tf.__version__}: the {family} gate {rule.contract}")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_topk_defaults_reproduce_the_unpatched_model(family):
    model = tiny(family)
    rule = probe_block(model)
    _skip_another_contract(family, rule)
    if rule.differs is not None:
        pytest.skip(f"transformers {tf.__version__}: the {family} gate {rule.differs}")
    with torch.no_grad():  # experts large enough that a routing difference shows in the logits
        for _, block in sparse_moe_blocks(model):
            for p in block.experts.parameters():
                p.mul_(20)
    control = copy.deepcopy(model)
    x = ids()
    reference = {}
    for mode in ("train", "eval"):
        getattr(model, mode)()
        reference[mode] = model(x).logits.detach()
    blocks = patch_moe(model, "topk")
    assert len(blocks) == 2 and all(isinstance(gate_of(b), RoutedGate) for b in blocks)
    for mode in ("train", "eval"):
        getattr(model, mode)()
        out = model(x).logits.detach()
        assert (out - reference[mode]).abs().max() <= 1e-5, (family, mode)
    # The check can fail: the other top-k normalisation gives other logits.
    patch_moe(control, "topk", renormalize=not gate_of(blocks[0]).router.renormalize)
    assert (control.eval()(x).logits.detach() - reference["eval"]).abs().max() > 1e-3, family


def test_patched_blocks_keep_the_models_parameters_and_share_the_router_weight():
    model = tiny()
    before = {name: p for name, p in model.named_parameters()}
    blocks = patch_moe(model, "noisy_topk")
    after = dict(model.named_parameters())
    for name, p in before.items():
        assert after[name] is p  # same Parameter objects: experts and router weight kept
    for block in blocks:
        assert block.gate.router.proj.weight is block.gate.weight
        assert type(block.gate).__name__ == "MixtralTopKRouter"
    extra = set(after) - set(before)
    assert extra and all(".gate.router.noise." in name for name in extra)  # noisy top-k's own W_noise


def test_generate_matches_the_unpatched_model():
    model = tiny().eval()
    x = ids(2, 5)
    mask = torch.ones_like(x)
    expected = model.generate(x, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    patch_moe(model, "topk")
    got = model.generate(x, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(got, expected)


def test_output_router_logits_loss_equals_the_unpatched_model():
    model = tiny().train()
    x = ids()
    ref = model(x, labels=x, output_router_logits=True)
    patch_moe(model, "topk")
    out = model(x, labels=x, output_router_logits=True)
    assert torch.isfinite(out.loss) and torch.isfinite(out.aux_loss)
    assert len(out.router_logits) == len(ref.router_logits) == 2
    assert abs(float(out.aux_loss.detach()) - float(ref.aux_loss.detach())) <= 1e-5
    assert abs(float(out.loss.detach()) - float(ref.loss.detach())) <= 1e-5


ROUTERS = ["topk", "switch", "noisy_topk", "softmax", "batchwise", "base", "sinkhorn", "gumbel_matching"]


def _spy_experts(monkeypatch, model) -> list[torch.Tensor]:
    """Record the expert index tensor of every call of the model's experts' own implementation."""
    seen: list[torch.Tensor] = []
    mro = type(sparse_moe_blocks(model)[0][1].experts).__mro__
    cls = mro[mro.index(RoutedExperts) + 1]  # transformers' experts class, under routelab's subclass
    original = cls.forward

    def spy(self, hidden_states, top_k_index, top_k_weights):
        assert hidden_states.shape[0] == top_k_index.shape[0] == top_k_weights.shape[0]
        seen.append(top_k_index.detach().clone())
        return original(self, hidden_states, top_k_index, top_k_weights)

    monkeypatch.setattr(cls, "forward", spy)
    return seen


@pytest.mark.parametrize("router", ROUTERS)
def test_every_router_trains_and_the_experts_see_only_routed_pairs(router, monkeypatch):
    model = tiny().train()
    E = 4
    options = {"k": 1} if router == "switch" else {}
    blocks = _patch(model, router, generator=torch.Generator().manual_seed(0), **options)
    seen = _spy_experts(monkeypatch, model)  # after patching: the spy sits under the routelab subclass
    x = ids()
    out = model(x, labels=x)
    loss = out.loss + routelab.aux_loss(model)
    loss.backward()
    assert torch.isfinite(loss)
    for block in blocks:
        grad = block.gate.weight.grad
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0, router
    stats = routelab.routing_stats(model)
    assert len(stats) == 2 and len(seen) == 2
    for index, layer in zip(seen, stats.values(), strict=True):
        # Every pair handed to the experts is a routed one (no sentinel, no zero-weight padding slot)
        # and there are exactly as many as the routing kept.
        assert bool((index >= 0).all() and (index < E).all()), router
        assert index.numel() == int(layer["tokens_per_expert"].sum()), router
        assert torch.equal(torch.bincount(index.reshape(-1), minlength=E), layer["tokens_per_expert"]), router
    if router == "batchwise":  # E slots per token in routelab, k * n pairs at the experts
        assert seen[0].numel() == 2 * x.numel()
    hf_aux = model(x, labels=x, output_router_logits=True).aux_loss  # transformers' loss on routelab's logits
    assert torch.isfinite(hf_aux) and float(hf_aux.detach()) > 0
    model.eval()
    with torch.no_grad():
        assert torch.isfinite(model(x).logits).all()
        gen = model.generate(x[:, :4], attention_mask=torch.ones_like(x[:, :4]), max_new_tokens=2, do_sample=False,
                             pad_token_id=0)
    assert gen.shape == (2, 6)


@pytest.mark.parametrize("implementation", ["eager", "grouped_mm", "batched_mm"])
def test_compaction_works_with_every_experts_implementation(implementation):
    model = tiny().train()
    try:
        model.set_experts_implementation(implementation)
    except (ValueError, ImportError) as error:  # pragma: no cover - depends on the torch build
        pytest.skip(f"{implementation} unavailable: {error}")
    reference = copy.deepcopy(model)
    reference.set_experts_implementation("eager")
    x = ids()
    patch_moe(model, "topk", capacity_factor=0.5)
    patch_moe(reference, "topk", capacity_factor=0.5)
    got, expected = model(x).logits, reference(x).logits
    stats = routelab.routing_stats(model)
    assert any(float(s["dropped_fraction"]) > 0 for s in stats.values())  # the compacted path ran
    assert (got - expected).abs().max() <= 1e-5


def test_capacity_drops_pairs_and_eval_capacity_is_separate():
    model = tiny().train()
    patch_moe(model, "topk", capacity_factor=0.5, eval_capacity_factor=None)
    x = ids(2, 8)
    model(x)
    for layer in routelab.routing_stats(model).values():
        assert int(layer["capacity"]) == 4  # ceil(0.5 * 16 * 2 / 4)
        assert int(layer["tokens_per_expert"].max()) <= 4
    model.eval()
    with torch.no_grad():
        model(x)
    for layer in routelab.routing_stats(model).values():
        assert int(layer["capacity"]) == 16 and float(layer["dropped_fraction"]) == 0.0
        assert int(layer["tokens_per_expert"].sum()) == 32


def test_padding_takes_no_capacity_and_gets_no_expert_output():
    model = tiny().eval()
    blocks = patch_moe(model, "topk")
    x = ids(2, 8)
    mask = torch.ones_like(x)
    mask[1, :3] = 0  # left padding of the second sequence
    outputs = []
    handles = [b.register_forward_hook(lambda m, a, out: outputs.append(out.detach())) for b in blocks]
    with torch.no_grad():
        model(x, attention_mask=mask)
    for h in handles:
        h.remove()
    for layer in routelab.routing_stats(model).values():
        assert int(layer["tokens_per_expert"].sum()) == 2 * int(mask.sum())
    with torch.no_grad():
        model(x, mask)  # the mask by position
    for layer in routelab.routing_stats(model).values():
        assert int(layer["tokens_per_expert"].sum()) == 2 * int(mask.sum())
    for out in outputs:
        assert torch.equal(out[1, :3], torch.zeros_like(out[1, :3]))
        assert (out[0].abs().sum(-1) > 0).all()


class _MaskSpy(TopKRouter):
    """A router with the token-mask interface that records the masks it is given."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.masks: list[torch.Tensor | None] = []

    def forward(self, x, capacity=None, *, mask=None):
        self.masks.append(None if mask is None else mask.clone())
        return super().forward(x, capacity)


def test_attention_mask_reaches_routers_that_take_a_mask():
    model = tiny().eval()
    blocks = patch_moe(model, lambda d, e, k: _MaskSpy(d, e, k, renormalize=True))
    x = ids(2, 6)
    mask = torch.ones_like(x)
    mask[0, :2] = 0
    with torch.no_grad():
        model(x, attention_mask=mask)
        model(x)  # no attention_mask: no token mask
        model.generate(x, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0)
    for block in blocks:
        masks = block.gate.router.masks
        assert torch.equal(masks[0], mask.reshape(-1).bool())
        assert masks[1] is None
        assert torch.equal(masks[2], mask.reshape(-1).bool())  # prefill of generate
        assert torch.equal(masks[3], torch.ones(2, dtype=torch.bool))  # one new token per sequence


def test_gradient_checkpointing_gives_the_same_gradients():
    base = tiny().train()
    grads = []
    for checkpointing in (False, True):
        model = copy.deepcopy(base)
        patch_moe(model, "topk", capacity_factor=1.0)
        if checkpointing:
            enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
            enable()  # transformers' default: non-reentrant torch.utils.checkpoint around every decoder layer
        x = ids()
        loss = model(x, labels=x).loss + routelab.aux_loss(model)
        loss.backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        assert torch.allclose(grads[0][name], grads[1][name], atol=1e-6, rtol=1e-5), name


def test_aux_loss_sums_the_weighted_router_losses_of_every_block():
    model = tiny().train()
    blocks = patch_moe(model, "topk", router_kwargs={"balance_coef": 0.5}, aux_coef=2.0)
    assert float(routelab.aux_loss(model)) == 0.0  # nothing recorded yet
    inputs = []
    for b in blocks:
        b.gate.register_forward_pre_hook(lambda m, args: inputs.append(args[0].detach()))
    model(ids())
    # The routers' own balance loss on the blocks' inputs, times aux_coef, summed over the blocks.
    expected = sum(2.0 * b.gate.router(h.reshape(-1, 32)).aux["balance"] for b, h in zip(blocks, inputs, strict=True))
    assert torch.allclose(routelab.aux_loss(model), expected)
    assert float(routelab.aux_loss(model).detach()) > 0


def test_a_patched_gate_releases_its_last_record_before_it_routes_again():
    """As MoE (tests/routing/test_record.py): no autograd node lives on from one step to the next."""
    model = tiny().train()
    blocks = patch_moe(model, "topk", router_kwargs={"balance_coef": 0.5})
    model(ids()).logits.sum().backward()
    previous = [weakref.ref(b.gate.last_aux["balance"]) for b in blocks]
    gc.collect()
    assert all(ref() is not None for ref in previous)
    released = []
    for b, ref in zip(blocks, previous, strict=True):
        b.gate.router.register_forward_pre_hook(lambda module, args, ref=ref: released.append(ref() is None))
    model(ids())
    assert released == [True] * len(blocks)


def _routelab_syncs(model, mask=None):
    """routelab's own host syncs (tests/host_syncs.py) in one training step, after a warm-up step;
    transformers' own code (its masks, its experts) is not counted."""
    from host_syncs import record_host_syncs

    model.train()
    model(ids(), attention_mask=mask).logits.sum().backward()
    with record_host_syncs() as found:
        model(ids(), attention_mask=mask).logits.sum().backward()
    return [s for s in found if s.where.startswith("routelab/")]


def test_an_unchecked_dropless_patched_model_routes_without_a_host_sync():
    """check_finite=False: no finite check, no capacity index check, and the experts learn from the
    gate (not from the data) that every slot names an expert."""
    model = tiny()
    _patch(model, "topk", check_finite=False)
    assert _routelab_syncs(model) == []
    checked = tiny()
    _patch(checked, "topk")
    # the default checks: the finite check of the scores; the routes' value check is skipped for a
    # built-in router (its experts are in range by construction) unless the drop policy ranks by gates
    assert len(_routelab_syncs(checked)) == len(sparse_moe_blocks(checked))
    by_score = tiny()
    _patch(by_score, "topk", drop_policy="score")
    assert len(_routelab_syncs(by_score)) == 2 * len(sparse_moe_blocks(by_score))
    with pytest.raises(TypeError, match="check_finite must be True or False"):
        patch_moe(tiny(), "topk", check_finite="no")


def test_a_patched_block_that_may_drop_still_looks_at_its_slots():
    """Capacity or batchwise gating can leave a slot without an expert: the experts then check (one
    sync) and run on the kept pairs only, as before."""
    for router, options in (("topk", {"capacity_factor": 0.5}), ("batchwise", {})):
        model = tiny()
        _patch(model, router, check_finite=False, **options)
        syncs = _routelab_syncs(model)
        assert syncs and all(s.where.startswith("routelab/integrations/hf.py") for s in syncs), syncs
        # the README's count: one (was any pair left out), two when one was (which), per block
        assert len(syncs) == 2 * len(sparse_moe_blocks(model)), syncs


def test_a_padding_mask_adds_two_host_syncs_per_block():
    """The README's count: a padding mask adds two syncs per block (the real tokens' count, the
    router's selection of them) to the experts' two (padded slots are left out), and the finite
    check of check_finite comes on top."""
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, :3] = 0
    for check_finite, per_block in ((False, 4), (True, 5)):
        model = tiny()
        _patch(model, "topk", check_finite=check_finite)
        syncs = _routelab_syncs(model, mask)
        assert len(syncs) == per_block * len(sparse_moe_blocks(model)), syncs


def test_experts_trust_the_gate_only_for_the_indices_it_just_returned():
    """The sync-free path is for the gate's own tensor, once: experts called on other indices (a
    direct call, an experts-only recomputation after another forward) still look at them and run
    on the routed pairs only (batched_mm would index out of range at the sentinel)."""
    model = tiny().train()
    try:
        model.set_experts_implementation("batched_mm")
    except (ValueError, ImportError) as error:  # pragma: no cover - depends on the torch build
        pytest.skip(f"batched_mm unavailable: {error}")
    blocks = _patch(model, "topk", check_finite=False)
    model(ids())  # a dropless forward: the gate told its experts every slot was routed
    experts = blocks[0].experts
    torch.manual_seed(3)
    hidden = torch.randn(6, 32)
    index = torch.randint(0, 4, (6, 2))
    index[1, 0] = index[4, 1] = 4  # the sentinel: no expert
    weights = torch.rand(6, 2)
    got = experts(hidden, index, weights)
    routed = index < 4
    expected = experts(hidden, torch.where(routed, index, 0), torch.where(routed, weights, 0.0))
    assert torch.allclose(got, expected, atol=1e-6)


def test_a_router_that_may_skip_tokens_is_not_told_fully_routed():
    """Gumbel-Matching with a skip estimator leaves tokens out in training, without capacity."""
    model = tiny().train()
    try:
        model.set_experts_implementation("batched_mm")
    except (ValueError, ImportError) as error:  # pragma: no cover - depends on the torch build
        pytest.skip(f"batched_mm unavailable: {error}")
    _patch(model, "gumbel_matching", router_kwargs={"method": "sample_skip_iw"}, check_finite=False,
           generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(model(ids(seq=16)).logits).all()


def test_a_gate_hook_that_edits_the_indices_in_place_is_seen():
    """A forward hook that masks experts in place (as expert parallelism might) keeps the tensor's
    identity: the experts must notice the edit, not trust the gate's earlier promise."""
    model = tiny().train()
    try:
        model.set_experts_implementation("batched_mm")
    except (ValueError, ImportError) as error:  # pragma: no cover - depends on the torch build
        pytest.skip(f"batched_mm unavailable: {error}")
    reference = copy.deepcopy(model)
    blocks = _patch(model, "topk", check_finite=False)
    _patch(reference, "topk", check_finite=False, capacity_factor=None)

    def keep_experts_below_two(module, args, out):
        out[2].masked_fill_(out[2] >= 2, module.router.num_experts)  # same tensor, edited

    def weights_of_kept(module, args, out):  # the reference: the same edit, out of place
        index = torch.where(out[2] >= 2, module.router.num_experts, out[2])
        return out[0], out[1], index

    for b in blocks:
        b.gate.register_forward_hook(keep_experts_below_two)
    for b in sparse_moe_blocks(reference):
        gate_of(b[1]).register_forward_hook(weights_of_kept)
    x = ids()
    assert torch.allclose(model(x).logits, reference(x).logits, atol=1e-5)


def test_a_patched_model_compiles_whole_with_fullgraph():
    """No graph break in a patched block (the checks are skipped while tracing; the gate's backward
    query is not traced): torch.compile(fullgraph=True) runs and equals eager."""
    model = tiny().train()
    _patch(model, "topk", check_finite=False)
    x = ids()
    expected = model(x).logits
    torch._dynamo.reset()
    got = torch.compile(model, fullgraph=True, backend="eager")(x).logits
    assert torch.allclose(got, expected, atol=1e-6)
    # With a padding mask the blocks read the real tokens on the host: graph breaks, still eager's result.
    mask = torch.ones_like(x)
    mask[1, :3] = 0
    expected = model(x, attention_mask=mask).logits
    torch._dynamo.reset()
    got = torch.compile(model, backend="eager")(x, attention_mask=mask).logits
    assert torch.allclose(got, expected, atol=1e-6)


def _compiled_step(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The logits of ``torch.compile(model, fullgraph=True, backend="aot_eager")`` on ``x``, after the
    backward of their mean square (the gradients land in ``model``)."""
    torch._dynamo.reset()
    got = torch.compile(model, fullgraph=True, backend="aot_eager")(x).logits
    got.square().mean().backward()
    return got


@functools.cache
def _hf_experts_compile(implementation: str | None) -> bool:
    """Whether the unpatched tiny model, with transformers' experts ``implementation`` (None: its
    default), compiles whole with backward. In transformers 5.17 (the GPU machine's) the default
    grouped_mm's fallback reads its offsets on the host in backward (``offs.tolist()``), which
    fullgraph cannot trace, patched or not; 5.24 traces it, and batched_mm traces in both."""
    model = tiny().train()
    if implementation is not None:
        model.set_experts_implementation(implementation)
    try:
        _compiled_step(model, ids(batch=4))
    except torch._dynamo.exc.BackendCompilerFailed:
        return False
    return True


@pytest.mark.parametrize("router, options", [("topk", dict(capacity_factor=1.0)), ("batchwise", {})])
def test_routers_that_leave_slots_out_compile_whole_and_equal_eager(router, options):
    """A router that may leave a slot empty made the experts find the kept pairs by a host read: a
    graph break per block. While tracing every slot runs, a left-out one at weight 0: fullgraph=True
    traces, and the logits and every gradient equal eager's (which runs the kept pairs alone).
    On transformers' default experts, or on batched_mm where its default does not compile unpatched."""
    implementation = None
    if not _hf_experts_compile(None):
        implementation = "batched_mm"
        if not hasattr(tiny(), "set_experts_implementation") or not _hf_experts_compile(implementation):
            pytest.skip(f"transformers {tf.__version__}: its own experts do not compile whole with backward")
    model = tiny().train()
    if implementation is not None:
        model.set_experts_implementation(implementation)
    blocks = _patch(model, router, check_finite=False, **options)
    compiled_model = copy.deepcopy(model)
    left_out = []  # Mixtral's gate answers (logits, weights, experts); E marks a slot left out
    hooks = [b.gate.register_forward_hook(lambda m, a, out: left_out.append(bool((out[2] == 4).any())))
             for b in blocks]
    x = ids(batch=4)
    expected = model(x).logits
    for hook in hooks:
        hook.remove()
    assert any(left_out), "the case must leave slots out"
    expected.square().mean().backward()
    got = _compiled_step(compiled_model, x)
    assert torch.allclose(got, expected, atol=1e-5)
    for (name, p), q in zip(model.named_parameters(), compiled_model.parameters()):
        eager_grad, compiled_grad = (torch.zeros_like(p) if g is None else g for g in (p.grad, q.grad))
        assert torch.allclose(eager_grad, compiled_grad, atol=1e-6, rtol=1e-4), name  # (None: zero)


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="no sparse MoE block"):
        patch_moe(torch.nn.Sequential(torch.nn.Linear(4, 4)), "topk")
    with pytest.raises(ValueError, match="unknown router"):
        patch_moe(tiny(), "nope")
    with pytest.raises(ValueError, match="k=5"):
        patch_moe(tiny(), "topk", k=5)
    with pytest.raises(ValueError, match="factory"):
        patch_moe(tiny(), TopKRouter(32, 4, 2))
    with pytest.raises(ValueError, match="capacity_factor"):
        patch_moe(tiny(), "topk", capacity_factor=0)
    with pytest.raises(ValueError, match="eval_capacity_factor"):
        patch_moe(tiny(), "topk", eval_capacity_factor=-1.0)
    with pytest.raises(ValueError, match="drop_policy"):
        patch_moe(tiny(), "topk", drop_policy="later")
    with pytest.raises(TypeError, match="generator"):
        patch_moe(tiny(), "topk", generator=0)
    with pytest.raises(ValueError, match="got k=2 but supports k=None or k=1"):
        patch_moe(tiny(), "gumbel_matching", k=2)  # an explicit k the router cannot take
    with pytest.raises(ValueError, match="capacity_factor >= 1"):  # at patch time, not at the first forward
        patch_moe(tiny(), "base", capacity_factor=0.5)
    model = tiny()
    patch_moe(model, "topk")
    with pytest.raises(ValueError, match="already patched.*copy.deepcopy of the model taken before patching"):
        patch_moe(model, "topk")


def test_options_are_flags_and_numbers_of_any_numeric_type():
    """A review case: ``bool("False")`` turned importance weighting on, ``aux_coef=inf`` made the aux
    loss infinite, and NumPy integers and float32 numbers were refused."""
    import numpy as np

    with pytest.raises(TypeError, match="importance_weighting must be True or False"):
        patch_moe(tiny(), "topk", importance_weighting="False")
    with pytest.raises(TypeError, match="renormalize must be True or False"):
        patch_moe(tiny(), "topk", renormalize="no")
    with pytest.raises(ValueError, match="aux_coef must be a finite number"):
        patch_moe(tiny(), "topk", aux_coef=float("inf"))
    blocks = patch_moe(tiny(), "topk", k=np.int64(1), capacity_factor=np.float32(1.25), aux_coef=np.float32(0.5),
                       importance_weighting=np.bool_(False))
    assert all(type(b.gate.router.k) is int and b.gate.router.k == 1 for b in blocks)


def test_tokens_dropped_counts_real_tokens_only():
    """A review case: padding, which takes no expert, counted as dropped tokens (0.133 dropless).
    Oracle: the real tokens left with no expert, counted from the routes the blocks returned."""
    x = ids(2, 8)
    mask = torch.ones_like(x)
    mask[1, :3] = 0
    for factor, expect_zero in ((None, True), (0.5, False)):
        model = tiny()
        blocks = patch_moe(model, "topk", capacity_factor=factor)
        seen = []
        handles = [gate_of(b).register_forward_hook(lambda m, a, out: seen.append(out[2].detach())) for b in blocks]
        with torch.no_grad():
            model(x, attention_mask=mask)
        for h in handles:
            h.remove()
        real = mask.reshape(-1).bool()
        for experts, layer in zip(seen, routelab.routing_stats(model).values(), strict=True):
            without = (experts == 4).all(-1)  # every slot at the sentinel E: no expert
            expected = float((without & real).sum()) / float(real.sum())
            assert float(layer["tokens_dropped"]) == pytest.approx(expected)
            assert (expected == 0.0) == expect_zero


def test_a_gate_with_tensors_of_its_own_is_replaced_and_says_so():
    model = tiny()
    gate = sparse_moe_blocks(model)[0][1].gate
    gate.register_buffer("bias_correction", torch.zeros(4))  # as DeepSeek-V3's e_score_correction_bias
    with pytest.warns(UserWarning, match=r"holds \['bias_correction'\], which the routelab router does not use"):
        patch_moe(model, "topk")
    assert isinstance(gate, RoutedGate) and torch.equal(gate.bias_correction, torch.zeros(4))  # kept, unused


def test_a_router_that_cannot_take_the_models_k_says_so():
    with pytest.warns(UserWarning, match="cannot route to the model's k=2"):
        blocks = patch_moe(tiny(), "gumbel_matching")
    assert all(b.gate.router.slots == 1 for b in blocks)


@pytest.mark.parametrize("router", ["topk", "batchwise", "gumbel_matching"])
def test_half_precision_models_route_and_generate(router):
    model = tiny().to(torch.bfloat16).train()
    _patch(model, router, generator=torch.Generator().manual_seed(0))
    x = ids()
    loss = model(x, labels=x).loss + routelab.aux_loss(model)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    model.eval()
    with torch.no_grad():
        assert torch.isfinite(model(x).logits.float()).all()
        model.generate(x[:, :4], attention_mask=torch.ones_like(x[:, :4]), max_new_tokens=2, do_sample=False,
                       pad_token_id=0)


def test_a_batch_of_padding_runs_no_expert(monkeypatch):
    model = tiny().eval()
    patch_moe(model, "topk")
    seen = _spy_experts(monkeypatch, model)
    x = ids(2, 4)
    with torch.no_grad():
        out = model(x, attention_mask=torch.zeros_like(x)).logits
    assert torch.isfinite(out).all() and seen == []
    for layer in routelab.routing_stats(model).values():
        assert int(layer["tokens_per_expert"].sum()) == 0


@pytest.mark.parametrize(("family", "k", "renormalize"), [
    ("mixtral", 2, True), ("qwen2_moe", 2, False), ("qwen2_moe_norm", 2, True), ("olmoe", 2, False),
    ("jamba", 2, False), ("gpt_oss", 2, True), ("granitemoe", 2, True),
])
def test_probing_a_gate_reads_its_k_and_normalisation(family, k, renormalize):
    model = tiny(family)
    gate = gate_of(sparse_moe_blocks(model)[0][1])
    before = {name: p.detach().clone() for name, p in gate.named_parameters()}
    rule = probe_block(model)
    assert all(torch.equal(p, before[name]) for name, p in gate.named_parameters())  # the gate is untouched
    _skip_another_contract(family, rule)
    assert (rule.k, rule.renormalize, rule.differs, rule.contract) == (k, renormalize, None, None)
    assert all(torch.equal(p, before[name]) for name, p in gate.named_parameters())  # the gate is untouched


def test_probing_reads_a_gate_whose_weights_are_still_on_the_meta_device():
    config_name, model_name, kw = FAMILIES["qwen2_moe"]
    with torch.device("meta"):
        model = getattr(tf, model_name)(getattr(tf, config_name)(**_common(**kw)))
    gate = gate_of(sparse_moe_blocks(model)[0][1])
    assert gate.weight.is_meta
    assert probe_gate(gate) == probe_gate(gate_of(sparse_moe_blocks(tiny("qwen2_moe"))[0][1]))


@pytest.mark.parametrize("family", sorted(OWN_RULE))
def test_a_gate_with_a_rule_of_its_own_is_replaced_with_a_warning(family, monkeypatch):
    model = tiny(family).train()
    with pytest.warns(UserWarning, match=OWN_RULE[family][3]):
        blocks = patch_moe(model, "base")
    seen = _spy_experts(monkeypatch, model)
    x = ids()
    (model(x, labels=x).loss + routelab.aux_loss(model)).backward()
    for block, layer in zip(blocks, routelab.routing_stats(model).values(), strict=True):
        assert torch.isfinite(gate_of(block).weight.grad).all() and gate_of(block).weight.grad.abs().sum() > 0
        assert layer["tokens_per_expert"].tolist() == [8, 8, 8, 8]  # BASE: k n / E pairs per expert
    assert all(bool((index < 4).all()) for index in seen) and len(seen) == 2
    model.eval()
    with torch.no_grad():
        gen = model.generate(x[:, :4], attention_mask=torch.ones_like(x[:, :4]), max_new_tokens=2, do_sample=False,
                             pad_token_id=0)
    assert gen.shape == (2, 6)


def test_probing_reads_rules_other_than_softmax_top_k():
    phimoe = probe_gate(gate_of(sparse_moe_blocks(tiny("phimoe"))[0][1]))
    assert phimoe.k == 2 and phimoe.renormalize is None and "weights" in phimoe.differs  # sparsemixer
    deepseek = probe_gate(gate_of(sparse_moe_blocks(tiny("deepseek_v3"))[0][1]))
    assert deepseek.k == 2 and deepseek.differs  # sigmoid scores, grouped and bias-corrected choice
    assert deepseek.scale == pytest.approx(2.5)  # its weights sum to routed_scaling_factor
    assert probe_gate(gate_of(sparse_moe_blocks(tiny("minimax_m2"))[0][1])).inputs == ("e_score_correction_bias",)
    scaled = probe_gate(gate_of(sparse_moe_blocks(tiny("deepseek_v2_scaled"))[0][1]))
    assert (scaled.k, scaled.renormalize, scaled.differs) == (2, False, None) and scaled.scale == pytest.approx(16)


def test_the_scale_of_a_gate_with_a_rule_of_its_own_is_read_on_the_experts_it_chose():
    """A review case: the scale was read only where a gate's weights sum to a constant, so
    DeepSeek-V2 as released (group-limited softmax top-k, not renormalised, times 16) and a sigmoid
    top-k without normalisation (times 2.5) were patched with combine_scale 1: routed outputs 16x
    too small. Read on the gate's own choice (its weights / its softmax or sigmoid scores there)."""
    grouped = tiny("deepseek_v2_scaled", n_group=2, topk_group=1, topk_method="group_limited_greedy")
    rule = probe_gate(gate_of(sparse_moe_blocks(grouped)[0][1]))
    assert rule.differs and rule.scale == pytest.approx(16) and not rule.scale_unread
    sigmoid = tiny("deepseek_v3", norm_topk_prob=False, routed_scaling_factor=2.5)
    gate = gate_of(sparse_moe_blocks(sigmoid)[0][1])
    with torch.no_grad():
        gate.e_score_correction_bias.normal_()  # the choice differs from the scores' top-k
    rule = probe_gate(gate)
    assert rule.differs and rule.scale == pytest.approx(2.5) and not rule.scale_unread
    with pytest.warns(UserWarning, match=r"the scale 16 of its weights is kept"):
        blocks = patch_moe(grouped, "topk")
    assert all(gate_of(b).combine_scale == pytest.approx(16) for b in blocks)


def test_a_gate_whose_scale_cannot_be_read_uses_its_routed_scaling_factor_or_says_so():
    from routelab.integrations.hf_blocks import GateRule, _roles_with_block_inputs, replaced_rule

    class HashGate(torch.nn.Module):  # DeepSeek-V4's hash router: an input the probe cannot make up
        def __init__(self, scale=None):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(4, 8))
            if scale is not None:
                self.routed_scaling_factor = scale

        def forward(self, hidden_states, input_ids):
            raise AssertionError("not run")

    assert _roles_with_block_inputs(HashGate(1.5), None, ("input_ids",), 4, 0) == (None, 1.5)
    assert _roles_with_block_inputs(HashGate(), None, ("input_ids",), 4, 0) == (None, None)
    unread = GateRule(k=2, differs="its own", scale_unread=True)
    assert "could not be read" in replaced_rule(unread, [])


def test_a_gate_bias_is_shared_with_the_router_and_trained():
    model = tiny("gpt_oss").train()
    blocks = patch_moe(model, "topk")
    for block in blocks:
        gate = gate_of(block)
        assert gate.router.proj.weight is gate.weight and gate.router.proj.bias is gate.bias
    x = ids()
    model(x, labels=x).loss.backward()
    assert all(gate_of(b).bias.grad is not None and gate_of(b).bias.grad.abs().sum() > 0 for b in blocks)


@pytest.mark.parametrize("family", sorted(OTHER_CONTRACT))
def test_a_block_with_another_contract_is_refused_before_anything_is_patched(family):
    model = tiny(family)
    with pytest.raises(ValueError, match=OTHER_CONTRACT[family][3]):
        patch_moe(model, "topk")
    assert not any(isinstance(gate_of(b), RoutedGate) or isinstance(b.experts, RoutedExperts)
                   for _, b in sparse_moe_blocks(model))


def test_a_model_that_routes_without_an_experts_child_is_refused_naming_its_modules():
    """JetMoE routes with a ``router`` child and holds its experts as ``input_linear``/``output_linear``
    (a sweep of transformers 5.24's MoE families, tools/hf_family_sweep.py): the refusal names those
    modules instead of only saying what it looked for."""
    if not hasattr(tf, "JetMoeForCausalLM"):
        pytest.skip(f"transformers {tf.__version__} has no JetMoE")
    model = tf.JetMoeForCausalLM(tf.JetMoeConfig(**_common(intermediate_size=24, num_local_experts=4,
                                                           num_experts_per_tok=2, kv_channels=8)))
    with pytest.raises(ValueError, match=r"no sparse MoE block.*JetMoeMoE \(model\.layers\.0\.mlp, child 'router'\)"):
        patch_moe(model, "topk")


class _LogitsOnlyGate(torch.nn.Module):
    """A gate of the older contract (transformers <= 5.17's Jamba and GraniteMoE): logits only."""

    def __init__(self, d: int, E: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(E, d))

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight)


class _FusedExperts(torch.nn.Module):
    def __init__(self, d: int, E: int) -> None:
        super().__init__()
        self.num_experts = E
        self.gate_up_proj = torch.nn.Parameter(torch.randn(E, 8, d))
        self.down_proj = torch.nn.Parameter(torch.randn(E, d, 4))

    def forward(self, hidden_states, top_k_index, top_k_weights):  # the contract's signature; never called here
        raise AssertionError("not reached")


def test_a_gate_of_another_contract_is_refused():
    """A gate whose output is not (router_logits, weights, experts) (its block reads other things
    from it) is refused with the reason, before anything is patched; it crashed in forward before."""
    block = torch.nn.Module()
    block.gate, block.experts = _LogitsOnlyGate(6, 4), _FusedExperts(6, 4)
    model = torch.nn.Sequential(block)
    with pytest.raises(ValueError, match=r"_LogitsOnlyGate\): it returns its logits alone, and its block has no "
                                         r"route_tokens_to_experts"):
        patch_moe(model, "topk")
    assert isinstance(block.gate, _LogitsOnlyGate)
    assert probe_gate(block.gate).contract is not None and probe_gate(block.gate).differs is None


# --- the older contracts of transformers 5.17, rebuilt here so that every transformers version tests them


class _LoopExperts(torch.nn.Module):
    """Fused SwiGLU experts called as transformers' are: ``(hidden [n, d], index [n, k], weights [n, k])``,
    skipping the sentinel index ``E``."""

    def __init__(self, d: int, E: int, inner: int = 8) -> None:
        super().__init__()
        self.num_experts = E
        self.gate_up_proj = torch.nn.Parameter(torch.randn(E, 2 * inner, d) * 0.5)
        self.down_proj = torch.nn.Parameter(torch.randn(E, d, inner) * 0.5)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for e in range(self.num_experts):
            token, slot = (top_k_index == e).nonzero(as_tuple=True)
            gate, up = (hidden_states[token] @ self.gate_up_proj[e].T).chunk(2, -1)
            y = (torch.nn.functional.silu(gate) * up) @ self.down_proj[e].T
            out = out.index_add(0, token, y * top_k_weights[token, slot, None].to(y.dtype))
        return out


class _ReorderedGate(torch.nn.Module):
    """GraniteMoE's router in transformers 5.17: ``(top_k_index, top_k_weights, router_logits)``."""

    def __init__(self, d: int, E: int, k: int) -> None:
        super().__init__()
        self.top_k = k
        self.weight = torch.nn.Parameter(torch.randn(E, d))

    def forward(self, hidden_states):
        logits = torch.nn.functional.linear(hidden_states, self.weight).float()
        top, index = logits.topk(self.top_k, dim=-1)
        return index, top.softmax(-1).type_as(hidden_states), logits


class _ReorderedBlock(torch.nn.Module):
    def __init__(self, d: int = 6, E: int = 4, k: int = 2) -> None:
        super().__init__()
        self.router, self.experts = _ReorderedGate(d, E, k), _LoopExperts(d, E)

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        index, weights, _ = self.router(flat)
        return self.experts(flat, index, weights).view_as(x)


class _RoutingBlock(torch.nn.Module):
    """Jamba's sparse block in transformers 5.17: a logits-only ``nn.Linear`` router, routed by the
    block's own ``route_tokens_to_experts`` (softmax top-k, not renormalised)."""

    def __init__(self, d: int = 6, E: int = 4, k: int = 2) -> None:
        super().__init__()
        self.top_k = k
        self.router = torch.nn.Linear(d, E, bias=False)
        torch.nn.init.normal_(self.router.weight)
        self.experts = _LoopExperts(d, E)

    def route_tokens_to_experts(self, hidden_states, router_logits):
        weights = router_logits.softmax(-1, dtype=torch.float)
        top, index = weights.topk(self.top_k, dim=-1)
        return index, top.to(hidden_states.dtype)

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        logits = self.router(flat)
        index, weights = self.route_tokens_to_experts(flat, logits)
        return self.experts(flat, index, weights).view_as(x)


@pytest.mark.parametrize("make", [_ReorderedBlock, _RoutingBlock], ids=["reordered-outputs", "logits-only"])
def test_the_older_gate_contracts_are_read_and_reproduced(make):
    """The gates of transformers 5.17's GraniteMoE (outputs reordered) and Jamba (logits alone, the
    block routing them) are patched: router='topk' computes what the unpatched block does, and a
    balanced router routes through the block's own code."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(make())
    block = model[0]
    rule = probe_gate(gate_of(block), block=block)
    assert rule.contract is None and rule.k == 2
    assert rule.renormalize is (make is _ReorderedBlock)
    x = torch.randn(3, 8, 6)
    expected = model(x)
    patch_moe(model, "topk")
    torch.testing.assert_close(model(x), expected)
    balanced = torch.nn.Sequential(make())
    patch_moe(balanced, "base")
    y = balanced(x)
    assert y.shape == x.shape and torch.isfinite(y).all()
    (stats,) = routelab.routing_stats(balanced).values()
    assert stats["tokens_per_expert"].tolist() == [12, 12, 12, 12]  # 24 tokens x the model's k = 2, balanced


class _BiasedGate(torch.nn.Module):
    """A gate that takes an input of its own, as MiniMax-M2's: ``gate(hidden, e_score_correction_bias)``,
    its selection biased; it answers in ``order`` (a permutation of the contract, or four outputs)."""

    def __init__(self, d: int, E: int, k: int, order: str) -> None:
        super().__init__()
        self.top_k, self.order = k, order
        self.weight = torch.nn.Parameter(torch.randn(E, d))

    def forward(self, hidden_states, e_score_correction_bias):
        logits = torch.nn.functional.linear(hidden_states, self.weight).float()
        index = (logits + e_score_correction_bias).topk(self.top_k, dim=-1).indices
        weights = logits.softmax(-1).gather(-1, index)
        if self.order == "reordered":
            return index, weights, logits
        if self.order == "four":
            return logits, weights, index, logits.sigmoid()
        return logits, weights, index


class _BiasedBlock(torch.nn.Module):
    def __init__(self, order: str, d: int = 6, E: int = 4, k: int = 2) -> None:
        super().__init__()
        self.gate, self.experts = _BiasedGate(d, E, k, order), _LoopExperts(d, E)
        self.register_buffer("e_score_correction_bias", torch.zeros(E))
        self.order = order

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        out = self.gate(flat, self.e_score_correction_bias)
        index, weights = (out[0], out[1]) if self.order == "reordered" else (out[2], out[1])
        return self.experts(flat, index, weights).view_as(x)


@pytest.mark.parametrize("order", ["contract", "reordered"])
def test_a_gate_with_inputs_of_its_own_is_read_in_its_output_order(order):
    """A gate that takes inputs of its own is patched with the warning (its rule is replaced), and
    its outputs are read by their roles on the block's tensors of those names (they used to be
    assumed in the contract's order): the patched gate answers its block in the gate's order. With a
    zero bias the gate is softmax top-k, so router='topk' reproduces the block."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(_BiasedBlock(order))
    block = model[0]
    rule = probe_gate(block.gate, block=block)
    assert rule.contract is None and rule.inputs == ("e_score_correction_bias",)
    assert rule.outputs == (("experts", "weights", "logits") if order == "reordered" else
                            ("logits", "weights", "experts"))
    x = torch.randn(2, 5, 6)
    expected = model(x)
    with pytest.warns(UserWarning, match="inputs of its own"):
        patch_moe(model, "topk", renormalize=False)
    torch.testing.assert_close(model(x), expected)


def test_a_gate_with_inputs_of_its_own_and_another_contract_is_refused():
    model = torch.nn.Sequential(_BiasedBlock("four"))
    with pytest.raises(ValueError, match=r"takes inputs of its own \(e_score_correction_bias\) and it returns neither"):
        patch_moe(model, "topk")
    assert isinstance(model[0].gate, _BiasedGate)


def test_a_deep_copy_of_a_patched_logits_only_block_routes_with_its_own_gate():
    model = torch.nn.Sequential(_RoutingBlock(), _RoutingBlock())
    patch_moe(model, "topk")
    twin = copy.deepcopy(model)
    x = torch.randn(2, 5, 6)
    torch.testing.assert_close(twin(x), model(x))
    with torch.no_grad():
        twin[1].router.weight.mul_(-1)  # the copy's own gate decides its routing
    assert not torch.allclose(twin(x), model(x))
    assert twin[0].route_tokens_to_experts.block is twin[0]


def test_a_pickled_logits_only_block_routes_with_its_own_gate():
    """Pickle finds a patched module's class by its mixin and original class (the class made at
    patch time has no importable name), and the block's route method goes with its block."""
    model = torch.nn.Sequential(_RoutingBlock(), _RoutingBlock())
    patch_moe(model, "sinkhorn", capacity_factor=1.0)
    x = torch.randn(2, 5, 6)
    twin = pickle.loads(pickle.dumps(model))
    assert type(twin[0].router) is type(model[0].router)  # the same patched class, made once
    torch.testing.assert_close(twin(x), model(x))
    assert twin[0].route_tokens_to_experts.block is twin[0]
    assert twin[0].router.router.proj.weight is twin[0].router.weight  # still one parameter
    with torch.no_grad():
        twin[1].router.weight.mul_(-1)
    assert not torch.allclose(twin(x), model(x))


_FRESH_PROCESS_LOAD = """
import sys, torch, routelab
torch.set_num_threads(int(sys.argv[4]))  # the parent's: the same reductions, bit for bit
model = torch.load(sys.argv[1], weights_only=False)
model.eval()
with torch.no_grad():
    torch.save(model(torch.load(sys.argv[2])).logits, sys.argv[3])
model.train()
out = model(torch.load(sys.argv[2]), labels=torch.load(sys.argv[2]))
(out.loss + routelab.aux_loss(model)).backward()
assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
"""


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_a_patched_model_saves_whole_and_loads_in_a_fresh_process(family, tmp_path):
    """``torch.save(model)`` of a patched model, after a training step: loaded in a new Python
    process, it computes the same logits and trains (before, pickle could not find the patched
    classes by name)."""
    model = tiny(family)
    patch_moe(model, "batchwise", k=2, capacity_factor=1.25, generator=torch.Generator().manual_seed(0))
    out = model(ids(), labels=ids())
    (out.loss + routelab.aux_loss(model)).backward()
    torch.save(model, tmp_path / "model.pt")
    torch.save(ids(seed=2), tmp_path / "ids.pt")
    model.eval()
    with torch.no_grad():
        expected = model(ids(seed=2)).logits
    # The child computes with the parent's thread count: a CPU matmul split over another number of
    # threads may round differently (it did with 1 against 2), and the logits are compared exactly.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": str(torch.get_num_threads())}
    done = subprocess.run([sys.executable, "-c", _FRESH_PROCESS_LOAD, str(tmp_path / "model.pt"),
                           str(tmp_path / "ids.pt"), str(tmp_path / "logits.pt"), str(torch.get_num_threads())],
                          capture_output=True, text=True, env=env, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), expected, rtol=0, atol=0)


@pytest.mark.parametrize("router", ["batchwise", "noisy_topk"])
def test_routers_own_state_survives_save_pretrained_and_from_pretrained(router, tmp_path):
    """A review case: ``from_pretrained`` of a saved patched model drops the routers' own state
    (App. F's learned thresholds, noisy top-k's W_noise) as unexpected keys, and Mixtral saves them
    under legacy names, so eval logits moved by 0.24. ``router_state_dict`` /
    ``load_router_state_dict`` keep them under the patched model's block names. Oracle: the saved
    model's own eval logits."""
    from routelab.integrations.hf import load_router_state_dict, router_state_dict

    model = tiny()
    patch_moe(model, router, k=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(3):
        loss = model(ids(), labels=ids()).loss + routelab.aux_loss(model)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        expected = model(ids(seed=3)).logits
    model.save_pretrained(tmp_path / "model")
    state = router_state_dict(model)
    assert state and all(".router." in key for key in state)
    torch.save(state, tmp_path / "routers.pt")

    loaded = type(model).from_pretrained(tmp_path / "model")
    patch_moe(loaded, router, k=2)
    loaded.eval()
    lost = router_state_dict(loaded)
    assert lost.keys() == state.keys() and any(not torch.equal(lost[key], state[key]) for key in state)
    load_router_state_dict(loaded, torch.load(tmp_path / "routers.pt"))
    for key, value in router_state_dict(loaded).items():
        assert torch.equal(value, state[key]), key
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids(seed=3)).logits, expected, rtol=0, atol=1e-6)
    other = tiny()
    patch_moe(other, "topk")
    with pytest.raises(ValueError, match="does not fit this model's routers"):
        load_router_state_dict(other, state)
    with pytest.raises(ValueError, match="no block patched by routelab"):
        router_state_dict(tiny())


def test_a_deep_copy_after_a_training_step_is_independent_and_keeps_its_ties():
    model = tiny("mixtral")
    patch_moe(model, "sinkhorn")
    model(ids(), labels=ids()).loss.backward()
    twin = copy.deepcopy(model)
    for (_, block), (_, twin_block) in zip(sparse_moe_blocks(model), sparse_moe_blocks(twin), strict=True):
        gate, twin_gate = gate_of(block), gate_of(twin_block)
        assert twin_gate.router.proj.weight is twin_gate.weight and twin_gate.weight is not gate.weight
        assert twin_gate._routelab_state is twin_block.experts._routelab_state  # the block's own channel
    model.eval()
    twin.eval()
    with torch.no_grad():
        torch.testing.assert_close(twin(ids()).logits, model(ids()).logits, rtol=0, atol=0)
        for _, block in sparse_moe_blocks(twin):
            gate_of(block).weight.mul_(-1)
        assert not torch.allclose(twin(ids()).logits, model(ids()).logits)


def test_a_logits_only_gates_block_routes_only_after_its_gate():
    model = torch.nn.Sequential(_RoutingBlock())
    patch_moe(model, "topk")
    with pytest.raises(RuntimeError, match="without its gate routing first"):
        model[0].route_tokens_to_experts(torch.randn(4, 6), torch.randn(4, 4))


def test_routelab_layers_are_not_taken_for_transformers_blocks():
    from routelab.layers import MoE

    model = torch.nn.Sequential(MoE(8, 16, 4, router="topk", k=2))  # it has a router and experts of its own
    assert sparse_moe_blocks(model) == []
    with pytest.raises(ValueError, match="no sparse MoE block"):
        patch_moe(model, "base")


@pytest.mark.parametrize("family", ["gpt_oss", "jamba", "granitemoe", "qwen3_next", "deepseek_v2"])
def test_a_balanced_router_trains_and_generates_in_every_family(family, monkeypatch):
    model = tiny(family).train()
    _skip_another_contract(family, probe_block(model))
    blocks = patch_moe(model, "base")
    seen = _spy_experts(monkeypatch, model)
    x = ids()
    (model(x, labels=x).loss + routelab.aux_loss(model)).backward()
    stats = routelab.routing_stats(model)
    assert len(stats) == len(blocks) == len(seen) == 2
    for block, index, layer in zip(blocks, seen, stats.values(), strict=True):
        grad = gate_of(block).weight.grad
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0
        assert layer["tokens_per_expert"].tolist() == [8, 8, 8, 8]  # every expert k n / E pairs
        assert bool((index < 4).all()) and torch.equal(torch.bincount(index.reshape(-1), minlength=4),
                                                       layer["tokens_per_expert"])
    model.eval()
    with torch.no_grad():
        gen = model.generate(x[:, :4], attention_mask=torch.ones_like(x[:, :4]), max_new_tokens=3, do_sample=False,
                             pad_token_id=0)
    assert gen.shape == (2, 7)


# ---------------------------------------------------------------- audit findings (each failed before its fix)


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _max_gap(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def test_checkpointing_recomputes_each_call_under_its_own_padding_mask():
    """Two calls, one backward (a summed loss, DPO pairs): the recomputation once used the last call's mask."""
    base = tiny().train()
    a, b = ids(2, 8, seed=1), ids(2, 8, seed=2)
    mask_a, mask_b = torch.ones_like(a), torch.ones_like(b)
    mask_a[1, :5] = 0
    mask_b[0, :5] = 0
    grads = []
    for checkpointing in (False, True):
        model = copy.deepcopy(base)
        patch_moe(model, "topk")
        if checkpointing:
            model.gradient_checkpointing_enable()
        loss = model(a, attention_mask=mask_a, labels=a).loss + model(b, attention_mask=mask_b, labels=b).loss
        loss.backward()
        grads.append(_grads(model))
    assert _max_gap(*grads) <= 1e-6


def _padded_pair():
    a, b = ids(2, 8, seed=1), ids(2, 8, seed=2)
    mask_a, mask_b = torch.ones_like(a), torch.ones_like(b)
    mask_a[1, :5] = 0
    mask_b[0, :5] = 0
    return (a, mask_a), (b, mask_b)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("scenario", ["pair", "eval-forward-between", "earlier-forward"])
@pytest.mark.parametrize("router", ["topk", "base"])
def test_checkpointing_recomputes_under_the_mask_of_the_forward_it_recomputes(reentrant, scenario, router):
    """Review cases: the recomputation took its padding mask from a per-gate stack that every
    forward with gradients pushed to (an evaluation forward without no_grad, before or between)
    and reentrant checkpointing's forwards did not, so it routed under another call's mask: a
    gradient error of 1.8e-2 (largest gradient 0.27). Now each recomputation finds the call of
    its own forward by its checkpointed inputs. Oracle: the same steps without checkpointing."""
    base = tiny().train()
    (a, mask_a), (b, mask_b) = _padded_pair()
    grads = []
    for checkpointing in (False, True):
        model = copy.deepcopy(base)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # reentrant checkpointing's aux-loss warning
            patch_moe(model, router)
            if scenario == "earlier-forward":  # an evaluation pass with gradients on, before training
                model.eval()
                model(b, attention_mask=mask_b)
                model.train()
            if checkpointing:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
            loss = model(a, attention_mask=mask_a, labels=a).loss
            if scenario == "pair":  # two calls, one backward (DPO's chosen and rejected)
                loss = loss + model(b, attention_mask=mask_b, labels=b).loss
            elif scenario == "eval-forward-between":  # a metric forward between forward and backward
                model.eval()
                model(b, attention_mask=mask_b)
                model.train()
            loss.backward()
        grads.append(_grads(model))
    assert _max_gap(*grads) <= 1e-6


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("order", ["a+b", "b+a", "separate", "retain-graph"])
def test_one_input_tensor_in_two_padded_calls_recomputes_each_under_its_mask(reentrant, order):
    """Review cases: the same inputs_embeds tensor in two calls with different masks: the
    recomputation of the first call found the second call's record (the same live tensor) and
    routed under its mask (gradient gap 8.9e-3); a fix that took the calls latest first failed on
    separate backward passes and on a graph recomputed twice. Every tensor input of a carrier is
    recorded, and one seen in a single call decides (the layer's per-call attention mask and
    position embeddings). Oracle: the same steps without checkpointing."""
    base = tiny().train()
    (a, mask_a), (_, mask_b) = _padded_pair()
    embeds = base.model.embed_tokens(a).detach()
    grads = []
    for checkpointing in (False, True):
        model = copy.deepcopy(base)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            patch_moe(model, "topk")
            if checkpointing:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
            x = embeds.clone().requires_grad_(True)
            first = model(inputs_embeds=x, attention_mask=mask_a, labels=a).loss
            second = model(inputs_embeds=x, attention_mask=mask_b, labels=a).loss
            if order == "separate":
                first.backward()
                second.backward()
            elif order == "retain-graph":  # the second call's layers recomputed twice
                second.backward(retain_graph=True)
                second.backward()
                first.backward()
            else:
                (first + second if order == "a+b" else second + first).backward()
        grads.append(_grads(model))
    assert _max_gap(*grads) <= 1e-6


def test_a_checkpoint_around_the_whole_model_and_evaluation_calls_in_between():
    """Review cases: a user's checkpoint around the whole model, called twice on the same input_ids
    with two masks, recomputed under a record instead of the call it re-runs (gap 4.2e-2); and
    evaluation calls under no_grad between forward and backward filled the records and pushed out
    those checkpointing needed (no_grad calls in eval mode are no longer recorded). Oracle: the
    same steps without checkpointing."""
    from torch.utils.checkpoint import checkpoint

    import routelab.integrations.hf_masks as hf_masks

    base = tiny().train()
    (a, mask_a), (b, mask_b) = _padded_pair()
    grads = []
    for checkpointing in (False, True):
        model = copy.deepcopy(base)
        patch_moe(model, "topk")

        def loss_of(ids_, mask_):
            return model(ids_, attention_mask=mask_, labels=ids_).loss

        if checkpointing:
            first = checkpoint(loss_of, a, mask_a, use_reentrant=False)
            second = checkpoint(loss_of, a, mask_b, use_reentrant=False)
        else:
            first, second = loss_of(a, mask_a), loss_of(a, mask_b)
        grads.append(_grads_after(first + second, model))
    assert _max_gap(*grads) <= 1e-6

    grads = []
    for checkpointing in (False, True):
        model = copy.deepcopy(base)
        patch_moe(model, "topk")
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        loss = model(a, attention_mask=mask_a, labels=a).loss
        model.eval()
        with torch.no_grad():
            for length in range(2, 2 + hf_masks.MAX_RECORDS // 8):  # calls of other shapes, many records each
                model(ids(2, length % 16 + 1, seed=length))
        model.train()
        grads.append(_grads_after(loss, model))
    assert _max_gap(*grads) <= 1e-6


def _grads_after(loss, model):
    loss.backward()
    return _grads(model)


def test_the_mask_is_the_calls_own_whichever_module_is_called():
    """Review cases: the mask came from a pre-hook on the patched model alone and was kept until
    its next call, so a call of the base model (``model.model``) after a padded call reused the old
    mask, a wrapper calling ``model.forward`` (PEFT's way) routed padding, and a wrapper's
    ``forward(*args, **kwargs)`` lost a keyword mask. Oracle: the unpatched model."""
    (a, mask_a), (b, mask_b) = _padded_pair()
    plain = tiny().eval()
    model = copy.deepcopy(plain)
    patch_moe(model, "topk")

    def same(got, want, mask=None):  # at the real tokens (padding gets no expert output, patched)
        keep = (slice(None),) if mask is None else (mask.bool(),)
        torch.testing.assert_close(got[keep], want[keep], rtol=1e-5, atol=1e-5)

    with torch.no_grad():
        model(a, attention_mask=mask_a)
        same(model.model(b).last_hidden_state, plain.model(b).last_hidden_state)  # no mask: every token
        same(model.forward(b, attention_mask=mask_b).logits, plain(b, attention_mask=mask_b).logits, mask_b)

        class Wrapper(torch.nn.Module):  # a PEFT-like wrapper, calling the model's forward directly
            def __init__(self, inner):
                super().__init__()
                self.inner = inner

            def forward(self, *args, **kwargs):
                return self.inner.forward(*args, **kwargs)

        real = mask_b.reshape(-1).bool()
        for wrapped in (Wrapper(model), model):
            wrapped(b, attention_mask=mask_b)
            for layer in routelab.routing_stats(model).values():
                assert int(layer["tokens_per_expert"].sum()) == 2 * int(real.sum())  # padding routed nowhere
        wrapper = Wrapper(copy.deepcopy(plain))
        patch_moe(wrapper, "topk")  # the patched module's forward takes (*args, **kwargs)
        same(wrapper(b, attention_mask=mask_b).logits, plain(b, attention_mask=mask_b).logits, mask_b)


def test_patching_blocks_alone_warns_that_padding_is_routed():
    model = tiny()
    with pytest.warns(UserWarning, match="no module of the patched model .* takes an attention_mask"):
        patch_moe(sparse_moe_blocks(model)[0][1], "topk")


def test_checkpointing_replays_random_drops_drawn_from_a_generator():
    base = tiny().train()
    x = ids()
    grads = []
    for checkpointing in (False, True):
        model = copy.deepcopy(base)
        patch_moe(model, "topk", capacity_factor=0.5, drop_policy="random", generator=torch.Generator().manual_seed(3))
        if checkpointing:
            model.gradient_checkpointing_enable()
        model(x, labels=x).loss.backward()
        grads.append(_grads(model))
    assert _max_gap(*grads) == 0.0


def test_padding_does_not_enlarge_the_capacity():
    model = tiny().train()
    patch_moe(model, "topk", capacity_factor=1.0)
    x = ids(2, 8)
    mask = torch.ones_like(x)
    mask[1] = 0  # the second sequence is all padding
    with torch.no_grad():
        padded = model(x, attention_mask=mask).logits[0]
        with_padding = {k: int(v["capacity"]) for k, v in routelab.routing_stats(model).items()}
        alone = model(x[:1], attention_mask=mask[:1]).logits[0]
    assert set(with_padding.values()) == {4}  # ceil(1.0 * 8 real tokens * 2 / 4)
    assert (padded - alone).abs().max() <= 1e-6


def test_a_model_patched_on_the_meta_device_materialises_and_loads_a_checkpoint():
    checkpoint = tiny().eval()
    config_name, model_name, kw = FAMILIES["mixtral"]
    with torch.device("meta"):
        model = getattr(tf, model_name)(getattr(tf, config_name)(**_common(**kw)))
    patch_moe(model, "topk")
    model.to_empty(device="cpu")
    gate = model.model.layers[0].mlp.gate
    assert gate.router.proj.weight is gate.weight
    model.load_state_dict(checkpoint.state_dict(), strict=True)  # the unpatched model's keys
    with torch.no_grad():
        for buffer, reference in zip(model.buffers(), checkpoint.buffers(), strict=True):
            buffer.copy_(reference)  # rotary inv_freq: not in a state_dict, garbage after to_empty
        x = ids()
        assert (model.eval()(x).logits - checkpoint(x).logits).abs().max() <= 1e-5


def test_probing_leaves_the_gates_buffers_alone():
    model = tiny()
    gate = gate_of(sparse_moe_blocks(model)[0][1])
    original = type(gate).forward

    class Counting(type(gate)):
        def forward(self, hidden_states):
            out = original(self, hidden_states)
            with torch.no_grad():
                self.load += torch.bincount(out[2].reshape(-1), minlength=4).float()
            return out

    gate.__class__ = Counting
    gate.register_buffer("load", torch.zeros(4))
    assert probe_gate(gate).renormalize is True
    assert torch.equal(gate.load, torch.zeros(4))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_bfloat16_models_are_reproduced_bit_for_bit(family):
    """A bfloat16 model's own rounding is reproduced: logits scored in bfloat16 (or float32, as
    DeepSeek's gate does), combine weights returned in bfloat16 (Qwen3-MoE, Granite) or float32
    (Mixtral)."""
    model = tiny(family).to(torch.bfloat16).eval()
    _skip_another_contract(family, probe_block(model))
    reference = copy.deepcopy(model)
    _patch(model, "topk")
    x = ids()
    with torch.no_grad():
        assert torch.equal(model(x).logits, reference(x).logits)


def test_router_kwargs_that_clash_with_patch_moes_own_arguments_are_refused():
    with pytest.raises(ValueError, match=r"router_kwargs may not set \['k'\]"):
        patch_moe(tiny(), "topk", router_kwargs={"k": 1})
    with pytest.raises(ValueError, match="disagree"):
        patch_moe(tiny(), "topk", renormalize=True, router_kwargs={"renormalize": False})


def test_a_block_that_sees_a_subset_of_the_tokens_routes_them_without_the_mask():
    """A block run on part of the call's tokens (Ernie 4.5 VL's text and vision experts) cannot map
    the attention mask to its tokens: it routes them all, with a warning, instead of applying
    another position's mask (which silently dropped real tokens)."""
    from routelab.integrations.hf_masks import CallMasks

    masks = CallMasks()
    attention = torch.ones(2, 8, dtype=torch.long)
    attention[0, 6:] = 0
    model = torch.nn.Module()

    def call(**kwargs):
        masks.calls.clear()
        masks.enter_call(model, (), {"attention_mask": attention, **kwargs})

    call(input_ids=torch.zeros(2, 8, dtype=torch.long))
    assert torch.equal(masks.tokens(16), attention.reshape(-1).bool())
    with pytest.warns(UserWarning, match="sees 8 tokens, not the call's 2 x 8 tokens"):
        assert masks.tokens(8) is None
    # Generation with a cache: one new position per row, the mask covers past + new positions.
    call(input_ids=torch.zeros(2, 1, dtype=torch.long))
    assert torch.equal(masks.tokens(2), attention[:, -1:].reshape(-1).bool())
    call(inputs_embeds=torch.zeros(2, 3, 4))
    assert torch.equal(masks.tokens(6), attention[:, -3:].reshape(-1).bool())


def test_ernie_vl_padding_does_not_reach_real_tokens():
    """End to end on Ernie 4.5 VL (text and vision experts on token subsets): right padding cannot
    change earlier positions under causal attention, patched or not."""
    modeling = pytest.importorskip("transformers.models.ernie4_5_vl_moe.modeling_ernie4_5_vl_moe")
    configuration = pytest.importorskip("transformers.models.ernie4_5_vl_moe.configuration_ernie4_5_vl_moe")
    torch.manual_seed(0)
    config = configuration.Ernie4_5_VLMoeTextConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        intermediate_size=48, moe_intermediate_size=[24, 24], moe_num_experts=4, moe_k=2, moe_num_shared_experts=1,
        mlp_layer_types=["sparse", "sparse"],
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default", "mrope_section": [1, 1, 2]})
    model = modeling.Ernie4_5_VLMoeTextModel(config).eval()
    with torch.no_grad():
        for _, block in sparse_moe_blocks(model):
            gate_of(block).weight.normal_()
            for p in block.experts.parameters():
                p.mul_(20)
    x = ids()
    types = torch.zeros(2, 8, dtype=torch.long)
    types[:, 4:] = 1  # positions 4-7: vision tokens
    full = torch.ones(2, 8, dtype=torch.long)
    padded = full.clone()
    padded[0, 6:] = 0
    _patch(model, "topk")

    def run(mask):
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return model(input_ids=x, attention_mask=mask, moe_mm_token_type_ids=types).last_hidden_state

    torch.testing.assert_close(run(padded)[0, :6], run(full)[0, :6], rtol=1e-5, atol=1e-5)


def test_a_gate_that_scores_more_experts_than_the_block_holds_is_refused_by_count():
    """A gate whose rows include experts the block does not route (shared ones scored with the
    routed ones) is refused with both counts, not as experts that do not say how many they hold."""
    from routelab.integrations.hf_blocks import block_problem

    class Experts(torch.nn.Module):
        num_experts = 4

        def forward(self, hidden_states, top_k_index, top_k_weights):
            return hidden_states

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = torch.nn.Linear(8, 5, bias=False)
            self.experts = Experts()

    why = block_problem(Block())
    assert "scores 5 experts but its experts (Experts) hold 4" in why


def test_patch_moe_is_reachable_from_the_package_root():
    """``routelab.patch_moe`` and ``from routelab import patch_moe`` (imported on first use, so
    ``import routelab`` does not load the integration)."""
    import routelab
    from routelab import patch_moe as from_root
    from routelab.integrations.hf import patch_moe as from_module

    assert routelab.patch_moe is from_module and from_root is from_module and "patch_moe" in routelab.__all__
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        routelab.no_such_name  # noqa: B018


@pytest.mark.parametrize("sequence", [["a", "b"], ["a", "b", "a"]])
def test_a_tensor_of_several_masked_calls_decides_nothing_and_says_so(sequence):
    """A review case (the call masks' records alone): a tensor that reached a carrier under masks
    a, b and a again kept only the last, so in b's recomputation it decided a's mask, silently.
    Every distinct mask is kept: such a tensor decides nothing, and a recomputation with nothing
    else to go by warns."""
    from routelab.integrations.hf_masks import CallMasks

    class Source(torch.nn.Module):
        def forward(self, input_ids=None, inputs_embeds=None, attention_mask=None):
            return None

    masks, source, carrier = CallMasks(), Source(), torch.nn.Linear(4, 4)
    x = torch.randn(2, 3, 4, requires_grad=True)
    by_name = {"a": torch.tensor([[0, 1, 1], [1, 1, 1]]), "b": torch.tensor([[1, 1, 0], [1, 1, 1]])}
    for name in sequence:
        masks.enter_call(source, (), {"inputs_embeds": x, "attention_mask": by_name[name].clone()})
        masks.enter_carrier(carrier, (x,), {})
        masks.leave_call(source, (), None)
    (record,) = masks.records.values()
    assert len(record.calls) == 2

    class Recompute(torch.autograd.Function):  # a backward in which the carrier runs again
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, grad):
            masks.enter_carrier(carrier, (x.detach(),), {})
            with pytest.warns(UserWarning, match="several calls under different padding masks"):
                masks.tokens(6)
            return grad

    Recompute.apply(torch.ones(1, requires_grad=True)).sum().backward()
