"""patch_moe's default k is the model's own: read from the gate, its rule, the config, or the gate's
class name (NLLB-MoE's top-2 router says it nowhere else; a review found it patched as top-1)."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import routelab
from routelab.integrations.hf import _model_k


def test_the_models_k_comes_from_the_gate_the_rule_the_config_or_the_class_name() -> None:
    class Top2Router(nn.Module):
        pass

    class Router(nn.Module):
        pass

    no_k = SimpleNamespace(k=None)
    model = nn.Module()
    assert _model_k(Top2Router(), no_k, model) == 2
    assert _model_k(Router(), no_k, model) is None
    assert _model_k(Router(), SimpleNamespace(k=3), model) == 3
    model.config = SimpleNamespace(num_experts_per_tok=4)
    assert _model_k(Router(), no_k, model) == 4
    gate = Router()
    gate.top_k = 1
    assert _model_k(gate, SimpleNamespace(k=3), model) == 1


def test_nllb_moe_is_patched_at_its_top_2() -> None:
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "NllbMoeConfig"):
        pytest.skip("this transformers has no NLLB-MoE")
    cfg = transformers.NllbMoeConfig(
        vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, num_experts=4, expert_capacity=100,
        encoder_sparse_step=1, decoder_sparse_step=1, pad_token_id=1, decoder_start_token_id=2, eos_token_id=2,
        bos_token_id=0, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.NllbMoeForConditionalGeneration(cfg).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (its gate's own padding_mask input is not used: warned)
        routelab.patch_moe(model, "topk")
    ids = torch.randint(3, 64, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids, decoder_input_ids=ids[:, :3])
    counts = {name: int(s["tokens_per_expert"].sum()) for name, s in routelab.routing_stats(model).items()}
    assert counts and all(c == 2 * (6 if "encoder" in name else 3) for name, c in counts.items()), counts
