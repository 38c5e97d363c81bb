"""Sweep routelab's ``patch_moe`` over every MoE family of the installed transformers.

For each family it builds a tiny random-init model (hidden 32, or ``--hidden D`` below; 2 layers,
4 experts, top-2, vocab 64; the exact config kwargs are in :data:`FAMILIES`, print them with
``--configs``; a few extra rows try other routing options of a family: jitter, k = E, scaling factors,
grouped routing, sigmoid scoring), sets the routing weights to N(0, 1) (N(0, 1/D) at ``--hidden D``)
and scales the experts by 20 (as tests/integrations/test_hf.py does, so that a routing difference
shows), then:

1. counts the blocks ``routelab.integrations.hf.sparse_moe_blocks`` finds, and, independently, the
   MoE-looking modules (an ``experts`` child, or a child whose class looks like a router), so that a
   family whose MoE blocks routelab misses shows;
2. records the unpatched model's output (logits, else the last hidden state) and every MoE block's
   own output on a fixed input, in ``train()`` and ``eval()`` mode, under the same
   ``torch.manual_seed`` before each call; and how much the output moves when the routing weights'
   rows are rolled (the "sens" column: an "equal" means something only if that is large);
3. calls ``patch_moe(model, "topk")`` and records success, the UserWarning, the ValueError or any
   other exception (with its traceback tail); after a refusal it checks that nothing was patched;
4. if patched, compares the outputs and the blocks' outputs with the unpatched ones (max abs diff;
   the blocks' relative to their scale, which a final norm cannot hide), checks that every block
   routed through routelab, compares the real tokens' outputs under left padding (an
   ``attention_mask``), runs one backward pass with ``routelab.aux_loss(model)``; and patches a
   fresh copy with a non-top-k router (``--router``, default ``"base"``, BASE layers' balanced
   assignment) and checks that its forward and backward are finite.

``--hidden D`` (default 32) builds every model at hidden size D, so that what depends on the hidden
size shows: ``probe_gate`` read gates from N(0, 1) inputs, whose logits of spread ``sqrt(d)`` were a
one-hot softmax at real sizes (2048-4096) but not at 32 (fixed 2026-11-27). Every other size stays as
at 32: layers, experts, vocabulary, intermediate sizes, and the head sizes the kwargs give (where a
config derives the head size as ``hidden / heads``, it grows with D). A model that cannot be built or
run that way (it needs ``hidden = heads * head_dim``, an M-RoPE section must fit ``hidden / heads``,
Mamba heads must fill ``expand * hidden``) is rebuilt with every head count (every integer kwarg named
``...heads``) times D / 32, so that each head has its size at hidden 32; footnotes under the table
name those families and the first try's error (for D a multiple of 32; otherwise it is BUILD FAILED).
At D other than 32 the routing matrices are N(0, 1/D) instead of N(0, 1): the gate's input is
normalised (entries of order 1), so its logits are of order 1, as in a trained model; N(0, 1) would
give logits of spread ``sqrt(D)``, a one-hot softmax under which the unpatched model routes top-1 with
weight 1 and a misread normalisation or scale barely moves the output (an "equal" that says little).
The gate's vectors (biases, per-expert scales, score corrections) stay N(0, 1) and the experts are
still scaled by 20. ``--router-std S`` sets the routing matrices' std at any D (default 1 at hidden 32,
the sweep as it always ran, else ``1/sqrt(D)``); ``--hidden 32 --router-std 0.177`` runs the small
models with logits of order 1, which tells a change due to D from one due to the logits' scale.

Every family runs in a subprocess of its own with a time limit, so one hang or crash does not stop
the sweep. One table row per family::

    OMP_NUM_THREADS=1 python tools/hf_family_sweep.py [--family NAME ...] [--jobs 2] [--timeout 300]
    OMP_NUM_THREADS=1 python tools/hf_family_sweep.py --hidden 2048   # every model at hidden 2048
    python tools/hf_family_sweep.py --configs          # the tiny-config kwargs of every family
    python tools/hf_family_sweep.py --one mixtral      # one family in this process, JSON + details
    python tools/hf_family_sweep.py --details out.json # every result, traces included

Outcomes: ``equal`` (logits within 1e-5, blocks within 1e-5 of their scale), ``DIFFERS``, ``warned:``
(patch_moe's UserWarning: the gate has a rule of its own, so no equality is expected), ``refused:``
(patch_moe's ValueError), ``CRASH:`` (any other exception), ``VACUOUS equal`` (equal, but the output
does not depend on the routing). A family whose tiny model cannot be built is listed as ``BUILD
FAILED`` with why: a limitation of the sweep (its config), not of routelab.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import os
import re
import subprocess
import sys
import time
import traceback
import warnings
from concurrent.futures import ThreadPoolExecutor

VOCAB = 64
HIDDEN = 32  # the default hidden size (--hidden)
HIDDEN_KEYS = ("hidden_size", "d_model")  # the hidden size's names in the configs
EXPERTS = 4
TOPK = 2
EXPERT_SCALE = 20.0  # experts large enough that a routing difference shows in the output (as tests/integrations)
TOL = 1e-5  # on the output (logits)
BLOCK_TOL = 1e-5  # on each MoE block's output, relative to its largest entry

#: Set where the config's constructor takes them (the family's own kwargs override them).
GENERIC = dict(
    vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=64, intermediate_size=48, moe_intermediate_size=24, head_dim=8,
    # experts and experts per token, under each family's name
    num_experts=EXPERTS, num_local_experts=EXPERTS, n_routed_experts=EXPERTS, moe_num_experts=EXPERTS,
    num_experts_per_tok=TOPK, moe_topk=TOPK, moe_k=TOPK, top_k_experts=TOPK,
    # every layer sparse
    first_k_dense_replace=0, num_dense_layers=0, decoder_sparse_step=1, mlp_only_layers=[],
    mlp_layer_types=["sparse", "sparse"],
    # shared experts, small
    shared_expert_intermediate_size=40, shared_intermediate_size=24, n_shared_experts=1,
    # DeepSeek-style multi-head latent attention and grouped routing
    kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, n_group=1, topk_group=1,
    # linear attention, sparse-attention indexers
    linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
    linear_head_dim=8, linear_num_heads=4, index_n_heads=2, index_head_dim=8, index_topk=4,
    pad_token_id=0,  # inside the tiny vocabulary
)

#: Controls: the 17 families of tests/integrations/test_hf.py, with its kwargs (FAMILIES, OWN_RULE, OTHER_CONTRACT).
_TEST_COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=64)

#: family -> (config class, model class, kwargs, use GENERIC, tested in tests/integrations/test_hf.py)
FAMILIES: dict[str, tuple[str, str, dict, bool, bool]] = {}


def _family(name: str, config: str, model: str, generic: bool = True, tested: bool = False, **kwargs) -> None:
    FAMILIES[name] = (config, model, kwargs, generic, tested)


def _variant(name: str, base: str, tested: bool = False, **changes) -> None:
    """Family ``base`` with some config kwargs changed (another routing option of the same model)."""
    config, model, kwargs, generic, _ = FAMILIES[base]
    FAMILIES[name] = (config, model, {**kwargs, **changes}, generic, tested)


# ---- the 17 tested families (controls), kwargs as in tests/integrations/test_hf.py
_family("mixtral", "MixtralConfig", "MixtralForCausalLM", False, True, **_TEST_COMMON,
        intermediate_size=48, num_local_experts=4, num_experts_per_tok=2)
_family("qwen2_moe", "Qwen2MoeConfig", "Qwen2MoeForCausalLM", False, True, **_TEST_COMMON,
        intermediate_size=48, moe_intermediate_size=24, shared_expert_intermediate_size=40, num_experts=4,
        num_experts_per_tok=2)
_variant("qwen2_moe_norm", "qwen2_moe", True, norm_topk_prob=True)
_family("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", False, True, **_TEST_COMMON,
        intermediate_size=48, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2, head_dim=8)
_family("olmoe", "OlmoeConfig", "OlmoeForCausalLM", False, True, **_TEST_COMMON,
        intermediate_size=24, num_experts=4, num_experts_per_tok=2)
_family("minimax", "MiniMaxConfig", "MiniMaxForCausalLM", False, True, **_TEST_COMMON,
        intermediate_size=24, num_local_experts=4, num_experts_per_tok=2, head_dim=8)
_family("gpt_oss", "GptOssConfig", "GptOssForCausalLM", False, True, **_TEST_COMMON,
        intermediate_size=24, num_local_experts=4, num_experts_per_tok=2, head_dim=8,
        layer_types=["sliding_attention", "full_attention"])
_family("jamba", "JambaConfig", "JambaForCausalLM", False, True, **_TEST_COMMON,
        intermediate_size=24, num_experts=4, num_experts_per_tok=2, attn_layer_period=2, attn_layer_offset=1,
        expert_layer_period=1, expert_layer_offset=0, mamba_d_state=4, mamba_expand=2, mamba_dt_rank=4)
_family("granitemoe", "GraniteMoeConfig", "GraniteMoeForCausalLM", False, True, **_TEST_COMMON,
        intermediate_size=24, num_local_experts=4, num_experts_per_tok=2)
_family("granitemoeshared", "GraniteMoeSharedConfig", "GraniteMoeSharedForCausalLM", False, True, **_TEST_COMMON,
        intermediate_size=24, num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=24)
_family("qwen3_next", "Qwen3NextConfig", "Qwen3NextForCausalLM", False, True, **_TEST_COMMON,
        intermediate_size=48, moe_intermediate_size=24, shared_expert_intermediate_size=40, num_experts=4,
        num_experts_per_tok=2, layer_types=["linear_attention", "full_attention"], head_dim=8,
        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8)
_family("deepseek_v2", "DeepseekV2Config", "DeepseekV2ForCausalLM", False, True, **_TEST_COMMON,
        intermediate_size=48, moe_intermediate_size=24, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
        first_k_dense_replace=0, n_group=1, topk_group=1)
_variant("deepseek_v2_scaled", "deepseek_v2", True, routed_scaling_factor=16.0)
_family("hunyuan_v1_moe", "HunYuanMoEV1Config", "HunYuanMoEV1ForCausalLM", False, True, **_TEST_COMMON,
        intermediate_size=48, head_dim=8, num_experts=4, moe_topk=2, pad_token_id=0)
_family("phimoe", "PhimoeConfig", "PhimoeForCausalLM", False, True, **_TEST_COMMON,
        intermediate_size=24, num_local_experts=4, num_experts_per_tok=2)
_family("deepseek_v3", "DeepseekV3Config", "DeepseekV3ForCausalLM", False, True, **_TEST_COMMON,
        intermediate_size=48, moe_intermediate_size=24, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
        first_k_dense_replace=0, n_group=2, topk_group=1)
_family("minimax_m2", "MiniMaxM2Config", "MiniMaxM2ForCausalLM", False, True, **_TEST_COMMON,
        intermediate_size=24, num_local_experts=4, num_experts_per_tok=2, head_dim=8)
_family("llama4", "Llama4TextConfig", "Llama4ForCausalLM", False, True, **_TEST_COMMON,
        intermediate_size=24, intermediate_size_mlp=48, num_local_experts=4, num_experts_per_tok=1, head_dim=8)

# ---- the other families (GENERIC kwargs where the config takes them, and these)
_family("afmoe", "AfmoeConfig", "AfmoeForCausalLM", num_shared_experts=1, global_attn_every_n_layers=2,
        sliding_window=8)
_family("aria", "AriaTextConfig", "AriaTextForCausalLM", intermediate_size=24, moe_num_shared_experts=1)
_family("axk1", "AXK1Config", "AXK1ForCausalLM")
_family("axk2", "AXK2Config", "AXK2ForCausalLM", gated_norm_rank=4, num_key_value_heads=4)
_family("bailing_hybrid", "BailingHybridConfig", "BailingHybridForCausalLM", layer_group_size=2, num_mtp_layers=0)
_family("beam", "BeamConfig", "BeamForCausalLM", sliding_window=8)
_family("cohere2_moe", "Cohere2MoeConfig", "Cohere2MoeForCausalLM", sliding_window=8, sliding_window_pattern=2)
_family("dbrx", "DbrxConfig", "DbrxForCausalLM", False, d_model=HIDDEN, n_heads=4, n_layers=2, max_seq_len=64,
        vocab_size=VOCAB,
        ffn_config={"ffn_hidden_size": 24, "moe_num_experts": EXPERTS, "moe_top_k": TOPK},
        attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0})  # DbrxAttention needs both
_family("deepseek_ocr2", "DeepseekOcr2TextConfig", "DeepseekOcr2TextModel")
_family("deepseek_v32", "DeepseekV32Config", "DeepseekV32ForCausalLM", num_key_value_heads=4)
_family("deepseek_v4", "DeepseekV4Config", "DeepseekV4ForCausalLM", mlp_layer_types=["hash_moe", "moe"],
        o_groups=2, o_lora_rank=8, hc_mult=2, sliding_window=8, num_nextn_predict_layers=0)
_family("diffusion_gemma", "DiffusionGemmaTextConfig", "DiffusionGemmaEncoderTextModel", sliding_window=8)
_family("dots1", "Dots1Config", "Dots1ForCausalLM")
_family("dots3_note", "Dots3NoteTextConfig", "Dots3NoteForCausalLM", shared_experts_intermediate_size=24,
        num_key_value_heads=4)
_family("ernie4_5_moe", "Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM", moe_layer_start_index=0,
        moe_num_shared_experts=1)
_family("ernie4_5_vl_moe", "Ernie4_5_VLMoeTextConfig", "Ernie4_5_VLMoeTextModel", moe_num_shared_experts=1,
        moe_intermediate_size=[24, 24],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]})
_family("exaone_moe", "ExaoneMoeConfig", "ExaoneMoeForCausalLM", num_shared_experts=1, sliding_window=8)
_family("flex_olmo", "FlexOlmoConfig", "FlexOlmoForCausalLM")
_family("flint", "FlintConfig", "FlintForCausalLM", sliding_window=8)
_family("gemma4", "Gemma4TextConfig", "Gemma4ForCausalLM", enable_moe_block=True, hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=VOCAB, sliding_window=8)
_family("glm4_moe", "Glm4MoeConfig", "Glm4MoeForCausalLM", num_mtp_layers=0)
_family("glm4_moe_lite", "Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM")
_family("glm4v_moe", "Glm4vMoeTextConfig", "Glm4vMoeTextModel",
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 0]})
_family("glm5_next", "Glm5NextTextConfig", "Glm5NextTextModel", hc_mult=2, num_key_value_heads=4, index_kpool=2,
        qk_rope_head_dim=0, qk_nope_head_dim=8, head_dim=0, layer_types=["linear_attention", "indexed_attention"])
_family("glm_moe_dsa", "GlmMoeDsaConfig", "GlmMoeDsaForCausalLM", num_key_value_heads=4)
_family("granitemoe_swa", "GraniteMoeSWAConfig", "GraniteMoeSWAForCausalLM", intermediate_size=24,
        sliding_window=8)
_family("granitemoehybrid", "GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", intermediate_size=24,
        layer_types=["mamba", "attention"], mamba_n_heads=4, mamba_d_state=4, mamba_d_head=16, mamba_chunk_size=8)
_family("hy_v3", "HYV3Config", "HYV3ForCausalLM", num_shared_experts=1)
_family("hy_v4", "HYV4Config", "HYV4ForCausalLM", hc_mult=2)
_family("hy_v4_vl", "HYV4VLTextConfig", "HYV4VLTextModel", hc_mult=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 0]})
_family("inkling", "InklingTextConfig", "InklingForCausalLM", swa_num_attention_heads=4, swa_num_key_value_heads=2,
        swa_head_dim=8, sliding_window_size=8, d_rel=4, rel_extent=16, unpadded_vocab_size=VOCAB)
_family("inkling2", "Inkling2TextConfig", "Inkling2ForCausalLM", swa_num_attention_heads=4,
        swa_num_key_value_heads=2, swa_head_dim=8, sliding_window_size=8, d_rel=4, rel_extent=16,
        unpadded_vocab_size=VOCAB, n_layers_per_attn_res_block=1)
_family("inkling2_loop", "Inkling2LoopTextConfig", "Inkling2LoopForCausalLM", swa_num_attention_heads=4,
        swa_num_key_value_heads=2, swa_head_dim=8, sliding_window_size=8, d_rel=4, rel_extent=16,
        unpadded_vocab_size=VOCAB, n_layers_per_attn_res_block=1, loop_layer_index_start=1, loop_layer_index_end=2,
        loop_num_passes=2, loop_gate_rank=4)
_family("jetmoe", "JetMoeConfig", "JetMoeForCausalLM", kv_channels=8, intermediate_size=24)
_family("kimi_linear", "KimiLinearConfig", "KimiLinearForCausalLM", layer_types=["linear_attention", "full_attention"])
_family("kolibri1", "Kolibri1Config", "Kolibri1ForCausalLM", sliding_window=8)
_family("laguna", "LagunaConfig", "LagunaForCausalLM", sliding_window=8)
_family("lara_mini", "LaraMiniConfig", "LaraMiniForCausalLM", sliding_window=8)
_family("lfm2_moe", "Lfm2MoeConfig", "Lfm2MoeForCausalLM", layer_types=["conv", "full_attention"])
_family("longcat_flash", "LongcatFlashConfig", "LongcatFlashForCausalLM", num_layers=2, ffn_hidden_size=48,
        expert_ffn_hidden_size=24, zero_expert_num=2, head_dim=4)
_family("mellum", "MellumConfig", "MellumForCausalLM", sliding_window=8)
_family("mimo_v2_flash", "MiMoV2FlashConfig", "MiMoV2FlashForCausalLM", sliding_window=8)
_family("minimax_m3_vl", "MiniMaxM3VLTextConfig", "MiniMaxM3VLForCausalLM", intermediate_size=24,
        dense_intermediate_size=48, rotary_dim=4)
_family("mistral4", "Mistral4Config", "Mistral4ForCausalLM")
_family("mistral_large4", "MistralLarge4TextConfig", "MistralLarge4TextModel", num_key_value_heads=4)
_family("muse_spark", "MuseSparkTextConfig", "MuseSparkTextModel", moe_hidden_size=24, sliding_window=8)
_family("nemotron_h", "NemotronHConfig", "NemotronHForCausalLM", layers_block_type=["moe", "full_attention"],
        mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=4, n_groups=1, chunk_size=8,
        moe_shared_expert_intermediate_size=24, use_mamba_kernels=False)
_family("nllb_moe", "NllbMoeConfig", "NllbMoeForConditionalGeneration", False, vocab_size=VOCAB, d_model=HIDDEN,
        encoder_layers=2, decoder_layers=2, encoder_ffn_dim=24, decoder_ffn_dim=24, encoder_attention_heads=4,
        decoder_attention_heads=4, num_experts=EXPERTS, encoder_sparse_step=1, decoder_sparse_step=1,
        expert_capacity=64, max_position_embeddings=64)
_family("openai_privacy_filter", "OpenAIPrivacyFilterConfig", "OpenAIPrivacyFilterModel", intermediate_size=24,
        sliding_window=8)
_family("qwen3_5_moe", "Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM",
        layer_types=["linear_attention", "full_attention"])
_family("qwen3_omni_moe", "Qwen3OmniMoeTextConfig", "Qwen3OmniMoeThinkerTextModel")
_family("qwen3_omni_moe_talker", "Qwen3OmniMoeTalkerTextConfig", "Qwen3OmniMoeTalkerModel",
        shared_expert_intermediate_size=40)  # read by its block, not in its config signature
_family("qwen3_vl_moe", "Qwen3VLMoeTextConfig", "Qwen3VLMoeTextModel")
_family("qwen4_exp", "Qwen4ExpTextConfig", "Qwen4ExpForCausalLM", hc_count=2, hc_lowrank=8, heads_per_ngram=2,
        ngram_vocab_size_base=256, make_ngram_vocab_size_divisible_by=8, split_ngram_parts=4,
        indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=8, indexer_compress_ratio=2,
        layer_types=["linear_attention", "full_attention"])
_family("solar_open", "SolarOpenConfig", "SolarOpenForCausalLM")
_family("step3p7", "Step3p7TextConfig", "Step3p7TextModel", share_expert_dim=24, sliding_window=8)
_family("switch_transformers", "SwitchTransformersConfig", "SwitchTransformersForConditionalGeneration", False,
        vocab_size=VOCAB, d_model=HIDDEN, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=2, num_heads=4,
        num_experts=EXPERTS, num_sparse_encoder_layers=2, num_sparse_decoder_layers=2, expert_capacity=64)
_family("unlimited_ocr", "UnlimitedOcrTextConfig", "UnlimitedOcrTextModel", sliding_window=8)
_family("vitpose_backbone", "VitPoseBackboneConfig", "VitPoseBackbone", False, hidden_size=HIDDEN,
        num_hidden_layers=2, num_attention_heads=4, intermediate_size=48, num_experts=EXPERTS,
        image_size=[32, 32], patch_size=[8, 8], part_features=8, out_indices=[2])
_family("zaya", "ZayaConfig", "ZayaForCausalLM", router_hidden_size=8, num_experts_per_tok=1)  # ZAYA: k=1 only

# ---- variants: other routing options of the families above
_variant("mixtral_jitter", "mixtral", router_jitter_noise=0.1)
_variant("minimax_jitter", "minimax", router_jitter_noise=0.1)
_variant("mixtral_k_eq_e", "mixtral", num_experts_per_tok=4)
_variant("olmoe_k_eq_e", "olmoe", num_experts_per_tok=4)
_family("cohere2_moe_sigmoid", "Cohere2MoeConfig", "Cohere2MoeForCausalLM", sliding_window=8, sliding_window_pattern=2,
        expert_selection_fn="sigmoid")
_family("flex_olmo_norm", "FlexOlmoConfig", "FlexOlmoForCausalLM", norm_topk_prob=True)
_family("mistral4_scaled", "Mistral4Config", "Mistral4ForCausalLM", routed_scaling_factor=2.5, norm_topk_prob=False)
_family("mistral4_grouped", "Mistral4Config", "Mistral4ForCausalLM", n_group=2, topk_group=1)
_family("deepseek_ocr2_scaled", "DeepseekOcr2TextConfig", "DeepseekOcr2TextModel", routed_scaling_factor=2.0)
_family("deepseek_ocr2_grouped", "DeepseekOcr2TextConfig", "DeepseekOcr2TextModel", n_group=2, topk_group=1,
        topk_method="group_limited_greedy")
_family("qwen3_omni_moe_nonorm", "Qwen3OmniMoeTextConfig", "Qwen3OmniMoeThinkerTextModel", norm_topk_prob=False)
# Ernie 4.5 VL with vision tokens: its text and vision experts each see a subset of the tokens
_family("ernie4_5_vl_moe_mixed", "Ernie4_5_VLMoeTextConfig", "Ernie4_5_VLMoeTextModel", moe_num_shared_experts=1,
        moe_intermediate_size=[24, 24],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]})


def config_kwargs(family: str, config_cls: type, hidden: int = HIDDEN, heads_scale: int = 1) -> dict:
    """The kwargs the tiny config of ``family`` is built with (GENERIC filtered by the signature, then the
    family's), at hidden size ``hidden`` (every other size as in :data:`FAMILIES`), with every head count
    (every integer kwarg whose name ends in ``heads``) times ``heads_scale``."""
    _, _, kwargs, generic, _ = FAMILIES[family]
    if generic:
        params = inspect.signature(config_cls).parameters
        generic_kwargs = {k: v for k, v in GENERIC.items() if k in params}
        if "kv_lora_rank" in params and "num_key_value_heads" in params:
            # multi-head latent attention: as many key/value heads as heads (SDPA with a padding mask needs it)
            generic_kwargs["num_key_value_heads"] = generic_kwargs["num_attention_heads"]
        kwargs = {**generic_kwargs, **kwargs}
    kwargs = {**kwargs, **{key: hidden for key in HIDDEN_KEYS if key in kwargs}}
    return {**kwargs, **{key: value * heads_scale for key, value in kwargs.items()
                         if key.endswith("heads") and isinstance(value, int) and not isinstance(value, bool)}}


def default_router_std(hidden: int) -> float:
    """The routing weights' standard deviation: 1 at the default hidden size (the sweep as it always ran,
    logits of spread ``sqrt(32)``), ``1/sqrt(hidden)`` at any other (logits of order 1)."""
    return 1.0 if hidden == HIDDEN else hidden**-0.5


# ------------------------------------------------------------------------------------------ one family


def _short(error: BaseException, width: int = 400) -> str:
    text = f"{type(error).__name__}: {error}".replace("\n", " ")
    return text if len(text) <= width else text[:width] + "..."


def _tail(error: BaseException, frames: int = 6) -> str:
    return "".join(traceback.format_exception(type(error), error, error.__traceback__)[-frames:])


def _build(family: str, hidden: int = HIDDEN, heads_scale: int = 1) -> tuple:
    """``(model, kwargs)``: the tiny model of ``family`` at hidden size ``hidden``, head counts x ``heads_scale``."""
    import torch
    import transformers as tf

    config_name, model_name, *_ = FAMILIES[family]
    config_cls, model_cls = getattr(tf, config_name, None), getattr(tf, model_name, None)
    if config_cls is None or model_cls is None:
        raise LookupError(f"transformers {tf.__version__} has no {config_name if config_cls is None else model_name}")
    kwargs = config_kwargs(family, config_cls, hidden, heads_scale)
    config = config_cls(**kwargs)
    torch.manual_seed(0)
    model = model_cls(config).float()
    return model, kwargs


def _build_at(family: str, hidden: int) -> tuple:
    """``(model, kwargs, note)``: :func:`_build` at ``hidden``; at a hidden size other than the default, where that
    model cannot be built or run (it needs ``hidden = heads * head_dim``, an M-RoPE section must fit
    ``hidden / heads``, Mamba heads must fill ``expand * hidden``), it is rebuilt with every head count times
    ``hidden / HIDDEN``, so that each head has its size at hidden 32; ``note`` says so and why (None where the
    first build ran)."""
    if hidden == HIDDEN:
        return (*_build(family, hidden), None)
    try:
        model, kwargs = _build(family, hidden)
        _smoke_run(model, family, hidden)
        return model, kwargs, None
    except Exception as error:  # noqa: BLE001 - retried with the heads scaled, else reported
        if hidden % HIDDEN:
            raise
        first = error
    scale = hidden // HIDDEN
    try:
        model, kwargs = _build(family, hidden, scale)
        _smoke_run(model, family, hidden)
    except Exception as error:  # noqa: BLE001 - both tries are said
        raise RuntimeError(f"{_short(first, 200)}; with every head count x{scale}: {_short(error, 200)}") from error
    note = f"every head count x{scale} (with the heads of hidden {HIDDEN}: {_short(first, 200)})"
    return model, kwargs, note


def _smoke_run(model, family: str, hidden: int) -> None:
    """One eval forward without gradients, the global random state left as it was (raises if the model cannot run)."""
    import torch

    with torch.random.fork_rng(), torch.no_grad():
        model.eval()
        model(**_inputs(model, family, hidden))


def _inputs(model, family: str, hidden: int = HIDDEN):
    import torch

    g = torch.Generator().manual_seed(1)
    if family == "vitpose_backbone":
        return {"pixel_values": torch.randn(2, 3, 32, 32, generator=g), "dataset_index": torch.tensor([0, 1])}
    ids = torch.randint(3, VOCAB, (2, 8), generator=g)
    inputs = {"input_ids": ids}
    if family == "qwen3_omni_moe_talker":  # the talker has no token embedding of its own: it takes embeddings
        return {"inputs_embeds": torch.randn(2, 8, hidden, generator=g)}
    if getattr(model.config, "is_encoder_decoder", False):
        inputs["decoder_input_ids"] = torch.randint(3, VOCAB, (2, 6), generator=g)
    if family == "ernie4_5_vl_moe_mixed":  # tokens 2..4 of each sequence are vision tokens
        kinds = torch.zeros_like(ids)
        kinds[:, 2:5] = 1
        inputs["moe_mm_token_type_ids"] = kinds
    return inputs


def _padded(inputs: dict) -> dict | None:
    """The inputs with the second sequence left-padded by 3 tokens (pad id 0, ``attention_mask`` 0 there), or None."""
    import torch

    ids = inputs.get("input_ids")
    if ids is None or "decoder_input_ids" in inputs:
        return None
    ids = ids.clone()
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0
    return {**inputs, "input_ids": ids, "attention_mask": mask}


def _output(out):
    import torch

    for name in ("logits", "last_hidden_state", "feature_maps"):
        value = getattr(out, name, None)
        if isinstance(value, (tuple, list)):
            value = value[-1]
        if isinstance(value, torch.Tensor):
            return value
    if isinstance(out, (tuple, list)):
        return out[0]
    return out


def _run(model, inputs, mode: str, grad: bool = False):
    import torch

    getattr(model, mode)()
    torch.manual_seed(1234)
    with torch.set_grad_enabled(grad):
        return _output(model(**inputs))


def _run_blocks(model, blocks, inputs, mode: str):
    """``(output, {block name: its output})``: the blocks' own outputs too, so that a difference in the
    routing shows even where a final norm would hide a per-token scale of the MoE output."""
    import torch

    seen: dict = {}

    def keep(name):
        def hook(module, args, out):
            first = out[0] if isinstance(out, (tuple, list)) else out
            if isinstance(first, torch.Tensor):
                seen[name] = first.detach().float().clone()
        return hook

    handles = [block.register_forward_hook(keep(name)) for name, block in blocks]
    try:
        return _run(model, inputs, mode).detach(), seen
    finally:
        for handle in handles:
            handle.remove()


def _block_gap(got: dict, expected: dict) -> float:
    """The largest difference between the blocks' outputs, relative to their scale (inf if they ran differently)."""
    if got.keys() != expected.keys():
        return float("inf")
    gaps = [float((got[n] - expected[n]).abs().max()) / max(float(expected[n].abs().max()), 1e-6) for n in got
            if got[n].shape == expected[n].shape]
    return max(gaps, default=0.0) if len(gaps) == len(got) else float("inf")


_ROUTER_CLASS = re.compile(r"Router|Gating|Top[Kk12]|TopkRouter|Mo[Ee]Gate$|\bGate$")
_NOT_A_ROUTER = re.compile(r"ForgetGate|MessageGate|ResidualGate|InputGate|OutputGate")


def _expert_holders(model) -> list[str]:
    """The MoE-looking modules, independent of routelab, as ``name: Class(children)``: those with an
    ``experts`` child (any kind) or with a child whose class looks like a router (``...Router``,
    ``...TopKGating``, ``...Gate``; not linear attention's forget gates)."""
    import torch

    found = []
    for name, module in model.named_modules():
        kids = dict(module.named_children())
        routerish = [n for n, c in kids.items()
                     if _ROUTER_CLASS.search(type(c).__name__) and not _NOT_A_ROUTER.search(type(c).__name__)]
        if isinstance(getattr(module, "experts", None), torch.nn.Module) or routerish:
            listing = ",".join(f"{n}:{type(c).__name__}" for n, c in kids.items())
            found.append(f"{name}: {type(module).__name__}({listing})")
    return found


def _patched_parts(model) -> list[str]:
    """Modules that routelab has touched: swapped classes and the model's forward pre-hooks."""
    from routelab.integrations.hf import RoutedExperts, RoutedGate

    parts = [name for name, m in model.named_modules() if isinstance(m, (RoutedGate, RoutedExperts))]
    return parts + [f"<{len(model._forward_pre_hooks)} forward pre-hooks>"] * bool(model._forward_pre_hooks)


def run_family(family: str, other_router: str = "base", hidden: int = HIDDEN, router_std: float | None = None) -> dict:
    """Everything the module docstring lists, for one family, as a JSON-able dict (``outcome`` is the table's cell).

    ``router_std``: the standard deviation of the routing matrices (default :func:`default_router_std`)."""
    import torch

    import routelab
    from routelab.integrations.hf import patch_moe, routing_child, sparse_moe_blocks
    from routelab.integrations.hf_blocks import scorer_parameter

    router_std = default_router_std(hidden) if router_std is None else router_std
    result: dict = {"family": family, "tested": FAMILIES[family][4], "hidden": hidden, "router_std": router_std}
    try:
        model, kwargs, note = _build_at(family, hidden)
        if note:
            result["heads_scaled"] = note
        inputs = _inputs(model, family, hidden)
        result["kwargs"] = repr(kwargs)
        blocks = sparse_moe_blocks(model)
        with torch.no_grad():
            for _, block in blocks:
                child = routing_child(block)[1]
                for p in child.parameters():  # its scoring Linear child's too (HunYuan's wg, DBRX's layer)
                    p.normal_(0.0, router_std if p.dim() > 1 else 1.0)  # matrices router_std, vectors (biases) 1
                for p in block.experts.parameters():
                    if p.dim() > 1 and float(p.abs().max()) < 1e-6:  # left uninitialised (torch.empty) by the model
                        p.normal_(0.0, 0.02)
                    p.mul_(EXPERT_SCALE)
        reference, reference_blocks = {}, {}
        for mode in ("train", "eval"):
            reference[mode], reference_blocks[mode] = _run_blocks(model, blocks, inputs, mode)
        # Sensitivity: how much the output moves when every routing weight's rows are rolled by one expert.
        # An "equal" below means something only if this is well above the tolerance.
        rolled, sensitivity = copy.deepcopy(model), None
        with torch.no_grad():
            for _, block in sparse_moe_blocks(rolled):
                weight = scorer_parameter(routing_child(block)[1], "weight")
                if isinstance(weight, torch.Tensor) and weight.dim() == 2:
                    weight.copy_(weight.roll(1, 0))
                    sensitivity = 0.0
        if sensitivity is not None:
            sensitivity = float((_run(rolled, inputs, "eval").detach() - reference["eval"]).abs().max())
        del rolled
        padded = _padded(inputs)
        try:
            padded_reference = None if padded is None else _run(model, padded, "eval").detach()
        except Exception as error:  # noqa: BLE001 - the unpatched model does not take this mask: not checked
            padded, padded_reference = None, None
            result["padding"] = "not checked: the unpatched model fails with a padding mask: " + _short(error, 150)
    except Exception as error:  # noqa: BLE001 - a sweep limitation, reported
        result.update(outcome="BUILD FAILED: " + _short(error), trace=_tail(error))
        return result
    result["blocks"] = len(blocks)
    result["sensitivity"] = sensitivity
    result["block_classes"] = sorted({f"{type(b).__name__}[{routing_child(b)[0]}={type(routing_child(b)[1]).__name__},"
                                      f"experts={type(b.experts).__name__}]" for _, b in blocks})
    result["expert_holders"] = _expert_holders(model)
    result["finite_reference"] = bool(all(torch.isfinite(r).all() for r in reference.values()))
    fresh = copy.deepcopy(model)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            patch_moe(model, "topk")
            patched = True
        except ValueError as error:
            result["outcome"] = "refused: " + str(error)
            patched = False
        except Exception as error:  # noqa: BLE001 - reported
            result["outcome"] = "CRASH: " + _short(error)
            result["trace"] = _tail(error)
            patched = False
    if not patched:  # nothing may have been patched: no swapped class, no hook, the same outputs
        touched = _patched_parts(model)
        try:
            same = float((_run(model, inputs, "eval").detach() - reference["eval"]).abs().max()) == 0.0
        except Exception as error:  # noqa: BLE001 - reported
            same, touched = False, touched + [f"forward after the refusal fails: {_short(error, 200)}"]
        if touched or not same:
            result["outcome"] += f" [PARTIALLY PATCHED: {touched[:4]}, outputs unchanged={same}]"
    said = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    if patched:
        try:
            diffs, block_gaps = {}, {}
            with warnings.catch_warnings(record=True) as run_caught:
                warnings.simplefilter("always")
                for mode in ("train", "eval"):
                    got, got_blocks = _run_blocks(model, blocks, inputs, mode)
                    diffs[mode] = float((got.float() - reference[mode].float()).abs().max())
                    block_gaps[mode] = _block_gap(got_blocks, reference_blocks[mode])
            # the blocks that routed through routelab in that forward, and their (token, expert) pairs
            stats = routelab.routing_stats(model)
            result["recorded"] = f"{len(stats)}/{len(blocks)} blocks routed by routelab, pairs " + str(
                [int(v["tokens_per_expert"].sum()) for v in stats.values()])
            scale = max(float(r.abs().max()) for r in reference.values())
            result["diff"] = diffs
            result["block_gap"] = block_gaps
            block_worst = max(block_gaps.values())
            result["ref_scale"] = scale
            result["run_warnings"] = sorted({str(w.message)[:200] for w in run_caught})
            worst = max(diffs.values())
            if said:
                outcome = f"warned (diff {worst:.2e}, blocks {block_worst:.0e} of their scale): " + said[0]
            elif block_worst > BLOCK_TOL:
                outcome = (f"DIFFERS: the MoE blocks' outputs differ by {block_worst:.1e} of their scale (train "
                           f"{block_gaps['train']:.1e}, eval {block_gaps['eval']:.1e}); logits by {worst:.1e}")
            elif worst <= TOL and (sensitivity or 0.0) <= 1e-3:
                outcome = (f"VACUOUS equal (max diff {worst:.1e}; rolling the gates' rows moves the output "
                           f"{sensitivity or 0.0:.1e})")
            elif worst <= TOL:
                outcome = f"equal (max diff {worst:.1e}; blocks {block_worst:.0e} of their scale)"
            elif worst <= TOL * max(scale, 1.0):
                outcome = f"equal within float noise (max diff {worst:.1e}, outputs up to {scale:.1e})"
            else:
                outcome = f"DIFFERS train {diffs['train']:.3e} eval {diffs['eval']:.3e} (outputs up to {scale:.1e})"
            result["outcome"] = outcome
        except Exception as error:  # noqa: BLE001 - reported
            result["outcome"] = "CRASH (patched forward): " + _short(error)
            result["trace"] = _tail(error)
            patched = False
        if patched and padded is not None:  # real tokens under left padding (padding itself gets no expert)
            try:
                with warnings.catch_warnings(record=True) as pad_caught:
                    warnings.simplefilter("always")
                    got = _run(model, padded, "eval").detach()
                real = padded["attention_mask"].bool()
                gap = float((got[real] - padded_reference[real]).abs().max())
                said_pad = sorted({str(w.message)[:160] for w in pad_caught if issubclass(w.category, UserWarning)})
                result["padding"] = (f"{'equal' if gap <= TOL else 'DIFFERS'} on the real tokens (max diff {gap:.1e})"
                                     + (f"; warned: {said_pad[0]}" if said_pad else ""))
            except Exception as error:  # noqa: BLE001 - reported
                result["padding"] = "CRASH: " + _short(error)
                result["padding_trace"] = _tail(error)
        if patched:
            try:
                out = _run(model, inputs, "train", grad=True)
                aux = routelab.aux_loss(model)
                loss = out.float().pow(2).mean() + aux
                loss.backward()
                grads = [p.grad for _, b in sparse_moe_blocks(model) for p in routing_child(b)[1].parameters()
                         if p.grad is not None]
                finite = all(bool(torch.isfinite(g).all()) for g in grads)
                result["backward"] = (f"ok (loss {float(loss.detach()):.3g}, aux {float(aux.detach()):.3g}, "
                                      f"gate grads {len(grads)} finite={finite})")
            except Exception as error:  # noqa: BLE001 - reported
                result["backward"] = "CRASH: " + _short(error)
                result["backward_trace"] = _tail(error)
    elif said:
        result["outcome"] += " [warned first: " + said[0] + "]"
    if said:
        result["warnings"] = said

    # a non-top-k router on a fresh copy
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            patch_moe(fresh, other_router, generator=torch.Generator().manual_seed(0))
            out = _run(fresh, inputs, "train", grad=True)
            aux = routelab.aux_loss(fresh)
            loss = out.float().pow(2).mean() + aux
            loss.backward()
            grads = [p.grad for _, b in sparse_moe_blocks(fresh) for p in routing_child(b)[1].parameters()
                     if p.grad is not None]
            finite = bool(torch.isfinite(out).all()) and bool(torch.isfinite(loss)) and all(
                bool(torch.isfinite(g).all()) for g in grads)
            with torch.no_grad():
                evaluated = _run(fresh, inputs, "eval")
            finite = finite and bool(torch.isfinite(evaluated).all())
        stats = routelab.routing_stats(fresh)
        moved = float((evaluated - reference["eval"]).abs().max())
        result["other"] = (f"{'ok' if finite else 'NON-FINITE'} (fwd+bwd, {len(grads)} gate grads, "
                           f"{len(stats)}/{len(blocks)} blocks routed, eval output moved {moved:.2g}"
                           f"{', warned' if any(issubclass(w.category, UserWarning) for w in caught) else ''})")
    except ValueError as error:
        result["other"] = "refused: " + str(error)
    except Exception as error:  # noqa: BLE001 - reported
        result["other"] = "CRASH: " + _short(error)
        result["other_trace"] = _tail(error)
    return result


# ------------------------------------------------------------------------------------------ the sweep


def _in_subprocess(family: str, timeout: float, other_router: str, hidden: int = HIDDEN,
                   router_std: float | None = None) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    command = [sys.executable, __file__, "--one", family, "--json", "--router", other_router, "--hidden", str(hidden)]
    if router_std is not None:
        command += ["--router-std", repr(router_std)]
    start = time.time()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"family": family, "outcome": f"TIMEOUT after {timeout:.0f} s", "tested": FAMILIES[family][4]}
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("{"):
            result = json.loads(line)
            result["seconds"] = round(time.time() - start, 1)
            return result
    return {"family": family, "tested": FAMILIES[family][4],
            "outcome": f"PROCESS DIED (rc {done.returncode}): " + done.stderr.strip()[-400:]}


def _cell(text: str, width: int) -> str:
    text = re.sub(r"\s+", " ", text or "")
    return text if len(text) <= width else text[: width - 3] + "..."


def print_table(results: list[dict], width: int = 150) -> None:
    print(f"{'family':<24} {'ctl':<3} {'blocks':>6} {'moe-like':>8} {'sens':>7}  {'topk outcome':<{width}}  "
          f"{'padding':<12}  other router")
    for r in results:
        holders = r.get("expert_holders")
        sens = r.get("sensitivity")
        pad = r.get("padding", "-")
        pad = (pad.split(" ")[0] + (" +warn" if "warned" in pad else "")) if pad != "-" else pad
        print(f"{r['family']:<24} {'yes' if r.get('tested') else '':<3} {str(r.get('blocks', '-')):>6} "
              f"{'-' if holders is None else len(holders):>8} {'-' if sens is None else f'{sens:.1e}':>7}  "
              f"{_cell(r.get('outcome', ''), width):<{width}}  {pad:<12}  {_cell(r.get('other', '-'), 90)}")
    for r in results:
        if r.get("heads_scaled"):
            print(f"{r['family']}: built with {r['heads_scaled']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", nargs="*", help="families to run (default all)")
    parser.add_argument("--one", help="run one family in this process")
    parser.add_argument("--json", action="store_true", help="with --one: print the result as one JSON line")
    parser.add_argument("--router", default="base", help="the non-top-k router to try (default base)")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per family")
    parser.add_argument("--configs", action="store_true", help="print each family's tiny-config kwargs")
    parser.add_argument("--details", metavar="FILE", help="write every result (traces included) as JSON here")
    parser.add_argument("--width", type=int, default=150, help="width of the outcome column")
    parser.add_argument("--hidden", type=int, default=HIDDEN, metavar="D",
                        help=f"the models' hidden size (default {HIDDEN}; every other size stays tiny)")
    parser.add_argument("--router-std", type=float, metavar="S",
                        help=f"std of the routing matrices (default 1 at hidden {HIDDEN}, else 1/sqrt(D))")
    args = parser.parse_args(argv)
    if args.hidden < 1 or (args.router_std is not None and args.router_std <= 0):
        parser.error("--hidden and --router-std must be positive")
    if args.configs:
        import transformers as tf

        for family, (config_name, model_name, *_rest) in FAMILIES.items():
            cls = getattr(tf, config_name, None)
            kwargs = config_kwargs(family, cls, args.hidden) if cls is not None else FAMILIES[family][2]
            print(f"{family}: {config_name} / {model_name}: {kwargs}")
        return 0
    if args.one:
        warnings.filterwarnings("ignore", category=FutureWarning)
        result = run_family(args.one, args.router, args.hidden, args.router_std)
        if args.json:
            print(json.dumps(result))
        else:
            print(json.dumps(result, indent=1))
        return 0
    families = args.family or list(FAMILIES)
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        parser.error(f"unknown families {unknown}; known: {', '.join(FAMILIES)}")
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = list(pool.map(
            lambda f: _in_subprocess(f, args.timeout, args.router, args.hidden, args.router_std), families))
    if args.hidden != HIDDEN or args.router_std is not None:
        std = default_router_std(args.hidden) if args.router_std is None else args.router_std
        print(f"hidden {args.hidden}, routing matrices N(0, {std:.3g}^2)")
    print_table(results, args.width)
    if args.details:
        with open(args.details, "w") as handle:
            json.dump(results, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
