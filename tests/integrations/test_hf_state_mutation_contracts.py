"""Contracts of routelab.integrations.hf_state (``router_state_dict`` / ``load_router_state_dict``) that
the rest of the suite left unchecked, found by a mutation review of hf_state.py (each test here fails on
a mutant the other tests let through).

* A model that is itself the patched block (block name ``""``) saves under ``router.<name>`` and loads back.
* Loading into a model with no patched block is refused, as saving from one is.
* A strict refusal lists up to four of the unexpected keys, sorted, as it does the missing ones.

Independent truths: the docstrings' contracts and values set by hand before the round trip.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from routelab.integrations.hf import load_router_state_dict, patch_moe, router_state_dict

tf = pytest.importorskip("transformers")


def mixtral(seed: int = 0) -> nn.Module:
    """A tiny random-init Mixtral (2 layers, 4 experts, top-2)."""
    torch.manual_seed(seed)
    config = tf.MixtralConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, max_position_embeddings=64, intermediate_size=48,
                              num_local_experts=4, num_experts_per_tok=2)
    return tf.MixtralForCausalLM(config)


def test_a_patched_block_as_the_whole_model_saves_and_loads_under_router_names():
    """A patched bare MoE block (the model is the block: its name is ``""``) keeps its router's state under
    ``router.<name>``, not ``.router.<name>``, and ``load_router_state_dict`` loads it back there."""
    block = mixtral().model.layers[0].mlp
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the block takes no attention mask: a warning says padding is routed)
        patch_moe(block, "batchwise")
    state = router_state_dict(block)
    assert set(state) == {"router.thresholds"}
    wanted = torch.arange(1.0, 1.0 + state["router.thresholds"].numel())
    load_router_state_dict(block, {"router.thresholds": wanted.clone()})
    torch.testing.assert_close(router_state_dict(block)["router.thresholds"], wanted, rtol=0, atol=0)


def test_loading_into_a_model_with_no_patched_block_is_refused():
    """load_router_state_dict's docstring: ``model`` has no patched block is a ValueError (else the state
    would be dropped silently, with ``strict`` or not)."""
    with pytest.raises(ValueError, match="no block patched by routelab"):
        load_router_state_dict(mixtral(), {})
    with pytest.raises(ValueError, match="no block patched by routelab"):
        load_router_state_dict(mixtral(), {"model.layers.0.mlp.router.thresholds": torch.zeros(4)}, strict=False)


def test_a_strict_refusal_lists_the_first_four_unexpected_keys():
    """load_router_state_dict's docstring: the keys no router holds are listed (the first four, sorted, as
    the missing keys are), so the user sees which model or router the state was saved from."""
    model = mixtral()
    patch_moe(model, "batchwise")
    state = router_state_dict(model)
    extra = {f"model.layers.9.mlp.router.k{i}": torch.zeros(1) for i in range(6)}
    with pytest.raises(ValueError, match="does not fit this model's routers") as refused:
        load_router_state_dict(model, {**state, **extra})
    message = str(refused.value)
    assert f"unexpected keys {sorted(extra)[:4]}" in message
    assert "missing keys []" in message and sorted(extra)[4] not in message
