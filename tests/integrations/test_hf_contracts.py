"""Contracts of routelab.integrations (patch_moe, probe_gate, the call masks, the routers' state) that
the other integration tests left unchecked, found by a mutation review of hf.py, hf_blocks.py,
hf_masks.py and hf_state.py (each test here fails on a mutant the rest of the suite let through).

* Padding is never routed: by a router from a factory that takes no ``mask=``, under a mask passed
  to the base model by position, and a padded call's mask ends with the call.
* The patched gate's weights: importance weighting is the gate times the skip correction
  ``n_z / min(n_z, C)`` (Kool et al. 2021, eq. 3), and a slot the capacity dropped has weight 0.
* A logits-only gate's routing is handed to its block's ``route_tokens_to_experts`` once.
* ``patch_moe``'s options: the fallback top-k normalisation of a gate with a rule of its own, the
  generator of stochastic routers, a negative ``aux_coef`` refused.
* ``probe_gate``: the scale of a sigmoid top-k gate's weights and of a gate with inputs of its own,
  and which float output is the logits when ``k = E``.
* A checkpointed function entered below the hooked modules recomputes under the latest call's mask.
* ``load_router_state_dict(strict=True)`` refuses a state that lacks some routers' keys.

Independent truths: the unpatched model or block, the paper's formula, the docstrings' contracts,
determinism under an explicit generator, and gates whose rule and scale are known by construction.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import routelab
from routelab.integrations.hf import (
    load_router_state_dict,
    patch_moe,
    probe_gate,
    router_state_dict,
    routing_child,
    sparse_moe_blocks,
)
from routelab.routers import TopKRouter

tf = pytest.importorskip("transformers")

VOCAB, D, E, K = 64, 32, 4, 2


def mixtral(seed: int = 0) -> nn.Module:
    """A tiny random-init Mixtral (2 layers, 4 experts, top-2) with N(0, 1) gate weights, so routing is
    not trivial."""
    torch.manual_seed(seed)
    config = tf.MixtralConfig(vocab_size=VOCAB, hidden_size=D, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, max_position_embeddings=64, intermediate_size=48,
                              num_local_experts=E, num_experts_per_tok=K)
    model = tf.MixtralForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_()
    return model


def ids(batch: int = 2, seq: int = 8, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def left_padded(x: torch.Tensor, pad: int = 3) -> torch.Tensor:
    """An attention mask for ``x [2, seq]`` whose second row starts with ``pad`` padding positions."""
    mask = torch.ones_like(x)
    mask[1, :pad] = 0
    return mask


def routed_pairs(model: nn.Module) -> dict[str, int]:
    """The (token, expert) pairs each patched block routed in the last call."""
    return {name: int(stats["tokens_per_expert"].sum()) for name, stats in routelab.routing_stats(model).items()}


class _LoopExperts(nn.Module):
    """Fused linear experts called as transformers' are, ``(hidden [n, d], index [n, k], weights [n, k])``,
    skipping the sentinel index ``E``."""

    def __init__(self, d: int, E: int) -> None:
        super().__init__()
        self.num_experts = E
        self.down_proj = nn.Parameter(torch.randn(E, d, d) * 0.5)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for e in range(self.num_experts):
            token, slot = (top_k_index == e).nonzero(as_tuple=True)
            y = hidden_states[token] @ self.down_proj[e].T
            out = out.index_add(0, token, y * top_k_weights[token, slot, None].to(y.dtype))
        return out


class _Block(nn.Module):
    """A sparse block of the contract around ``gate``: ``gate(x) -> (logits, weights, experts)`` in
    ``order`` (the gate's output roles)."""

    def __init__(self, gate: nn.Module, order: tuple[str, ...] = ("logits", "weights", "experts"), d: int = 8):
        super().__init__()
        self.gate, self.experts, self.order = gate, _LoopExperts(d, gate.weight.shape[0]), order

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        found = dict(zip(self.order, self.gate(flat), strict=True))
        return self.experts(flat, found["experts"], found["weights"]).view_as(x)


def patch_alone(model: nn.Module, router: str = "topk", **options) -> list[nn.Module]:
    """patch_moe on synthetic blocks in an ``nn.Sequential``, which no attention mask reaches (patch_moe
    says so: that warning alone is filtered)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "no module of the patched model", UserWarning)
        return patch_moe(model, router, **options)


# -- padding is never routed ------------------------------------------------------------------------


class _MasklessTopK(TopKRouter):
    """A user's router whose ``forward`` has no ``mask=`` keyword."""

    def forward(self, x, capacity=None):
        return super().forward(x, capacity)


def test_a_router_without_a_mask_keyword_routes_no_padding_token():
    """The hf module docstring: weight 0 and the sentinel in every slot the router did not propose or
    the capacity dropped; padding is left out of the routing even when the router (here a factory's,
    without ``mask=``) proposes experts for it. Oracle: k pairs per real token, and the block's output
    at the padded positions is 0 (no expert ran on them)."""
    model = mixtral().eval()
    blocks = patch_moe(model, lambda d, e, k: _MasklessTopK(d, e, k, renormalize=True))
    assert not any(b.gate._routelab_takes_mask for b in blocks)
    outputs = []
    for block in blocks:
        block.register_forward_hook(lambda module, args, out: outputs.append(out.detach()))
    x = ids()
    mask = left_padded(x)
    with torch.no_grad():
        model(x, attention_mask=mask)
    assert routed_pairs(model) == {f"model.layers.{i}.mlp.gate": K * int(mask.sum()) for i in range(2)}
    assert len(outputs) == 2
    for out in outputs:
        assert (out[1, :3] == 0).all()  # the padding reached no expert
        assert (out[1, 3:] != 0).any(dim=-1).all() and (out[0] != 0).any(dim=-1).all()  # real tokens did


def test_a_mask_passed_to_the_base_model_by_position_reaches_the_gates():
    """A source called as ``base(input_ids, attention_mask)`` has its positional mask bound to the
    signature (hf_masks.CallMasks.enter_call). The base model is patched itself, so it is the only
    source (a ``*ForCausalLM`` would pass the mask on by keyword). Oracle: k pairs per real token."""
    base = mixtral().model.eval()
    patch_moe(base, "topk")
    x = ids()
    mask = left_padded(x)
    with torch.no_grad():
        base(x, mask)
    assert routed_pairs(base) == {f"layers.{i}.mlp.gate": K * int(mask.sum()) for i in range(2)}
    with torch.no_grad():
        base(x)  # and without a mask every token is routed
    assert routed_pairs(base) == {f"layers.{i}.mlp.gate": K * x.numel() for i in range(2)}


def test_a_padded_calls_mask_ends_with_the_call():
    """hf_masks: a call that passes no source (a block called alone) routes every token, so a padded
    model call that has returned leaves no mask behind. Oracle: the unpatched block on the same input."""
    model = mixtral().eval()
    reference = copy.deepcopy(model.model.layers[0].mlp)
    patch_moe(model, "topk")
    x = ids()
    h = torch.randn(2, 8, D, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(x, attention_mask=left_padded(x))
        alone = model.model.layers[0].mlp(h)
        expected = reference(h)
    torch.testing.assert_close(alone, expected)
    assert routed_pairs(model)["model.layers.0.mlp.gate"] == K * 16  # every token of h


# -- the patched gate's weights ---------------------------------------------------------------------


def _gate_outputs(importance_weighting: bool, h: torch.Tensor):
    model = mixtral().train()
    gate = patch_moe(model, "topk", capacity_factor=0.5, importance_weighting=importance_weighting)[0].gate
    with torch.no_grad():
        logits, weights, experts = gate(h)
    capacity = int(routelab.routing_stats(model)["model.layers.0.mlp.gate"]["capacity"])
    return logits, weights, experts, capacity


def test_importance_weighting_multiplies_the_kept_weights_by_the_skip_correction():
    """Kool et al. 2021, eq. 3: with importance weighting the combine weight of a kept pair is the gate
    times ``n_z / min(n_z, C)``, ``n_z`` the pairs proposed to expert ``z`` (the logits' top-k counts)
    and ``C`` the capacity. Oracle: the same gate without importance weighting, times that factor."""
    h = torch.randn(16, D, generator=torch.Generator().manual_seed(0))
    logits, plain, experts, capacity = _gate_outputs(False, h)
    _, weighted, experts_iw, _ = _gate_outputs(True, h)
    assert capacity == 4  # ceil(0.5 * 16 * 2 / 4)
    torch.testing.assert_close(experts_iw, experts)  # the weighting changes no choice
    proposed = torch.bincount(logits.topk(K, -1).indices.reshape(-1), minlength=E).float()
    correction = proposed / proposed.clamp(max=capacity)
    assert (correction > 1).any()  # some expert is over capacity: the check can fail
    kept = experts < E
    oracle = torch.where(kept, plain * correction[experts.clamp(max=E - 1)], torch.zeros(()))
    torch.testing.assert_close(weighted, oracle)


def test_a_slot_the_capacity_dropped_has_weight_zero():
    """The hf module docstring's contract: the sentinel ``E`` and weight 0 in every slot the capacity
    dropped (what a hook on the gate, or block code reading the weights, sees)."""
    h = torch.randn(16, D, generator=torch.Generator().manual_seed(0))
    _, weights, experts, _ = _gate_outputs(False, h)
    dropped = experts == E
    assert dropped.any() and (weights[dropped] == 0).all()
    assert (weights[~dropped] > 0).all()


# -- a logits-only gate's block -----------------------------------------------------------------------


class _RoutingBlock(nn.Module):
    """Jamba's sparse block in transformers 5.17: a logits-only ``nn.Linear`` router, routed by the
    block's own ``route_tokens_to_experts`` (softmax top-k, not renormalised)."""

    def __init__(self, d: int = 6, E: int = 4, k: int = 2) -> None:
        super().__init__()
        self.top_k = k
        self.router = nn.Linear(d, E, bias=False)
        nn.init.normal_(self.router.weight)
        self.experts = _LoopExperts(d, E)

    def route_tokens_to_experts(self, hidden_states, router_logits):
        top, index = router_logits.softmax(-1, dtype=torch.float).topk(self.top_k, dim=-1)
        return index, top.to(hidden_states.dtype)

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        index, weights = self.route_tokens_to_experts(flat, self.router(flat))
        return self.experts(flat, index, weights).view_as(x)


def test_a_logits_only_gates_routing_is_handed_to_its_block_once():
    """The patched block's route method returns the routing its gate just computed and clears it: called
    again after a forward (without the gate routing anew) it raises instead of returning the last
    batch's routing, of another number of tokens."""
    torch.manual_seed(0)
    model = nn.Sequential(_RoutingBlock())
    expected = model(torch.randn(3, 6))
    patch_alone(model)
    assert model(torch.randn(3, 6)).shape == expected.shape
    with pytest.raises(RuntimeError, match="without its gate routing first"):
        model[0].route_tokens_to_experts(torch.randn(4, 6), torch.randn(4, 4))
    assert model(torch.randn(5, 6)).shape == (5, 6)  # a new forward routes again


# -- patch_moe's options ------------------------------------------------------------------------------


def _phimoe(**overrides) -> nn.Module:
    torch.manual_seed(0)
    config = tf.PhimoeConfig(vocab_size=VOCAB, hidden_size=D, num_hidden_layers=1, num_attention_heads=4,
                             num_key_value_heads=2, max_position_embeddings=64, intermediate_size=24,
                             num_local_experts=E, num_experts_per_tok=K, **overrides)
    return tf.PhimoeForCausalLM(config)


@pytest.mark.parametrize(("overrides", "expected"), [({}, True), ({"norm_topk_prob": False}, False)],
                         ids=["no-norm_topk_prob", "config-norm_topk_prob-False"])
def test_a_gate_with_a_rule_of_its_own_gets_the_models_top_k_normalisation(overrides, expected):
    """PhiMoE's sparsemixer is not softmax top-k, so its probe gives no normalisation: patch_moe falls
    back on the gate's or the config's ``norm_topk_prob`` and, with neither, renormalises
    (``_model_norm_topk``: Mixtral always normalises)."""
    model = _phimoe(**overrides)
    gate = routing_child(sparse_moe_blocks(model)[0][1])[1]
    assert probe_gate(gate).renormalize is None and getattr(gate, "norm_topk_prob", None) is None
    with pytest.warns(UserWarning, match="does not route by softmax"):
        blocks = patch_moe(model, "topk")
    assert routing_child(blocks[0])[1].router.renormalize is expected


def test_a_stochastic_router_draws_from_the_generator_given():
    """patch_moe(generator=): the randomness of stochastic routers. Two copies patched with equally
    seeded generators route alike whatever the global random state; other seeds route otherwise
    (the noise matters, so the check can fail)."""
    base = mixtral().train()
    x = ids()

    def logits(generator_seed: int, global_seed: int) -> torch.Tensor:
        model = copy.deepcopy(base)
        patch_moe(model, "noisy_topk", generator=torch.Generator().manual_seed(generator_seed))
        torch.manual_seed(global_seed)
        with torch.no_grad():
            return model(x).logits

    first = logits(0, 123)
    torch.testing.assert_close(logits(0, 456), first, rtol=0, atol=0)
    assert not torch.equal(logits(1, 123), first)


@pytest.mark.parametrize("aux_coef", [-1.0, -1e-3, -1])
def test_a_negative_aux_coef_is_refused(aux_coef):
    """The patch_moe docstring: aux_coef is a finite number >= 0 (a negative one makes
    ``loss + routelab.aux_loss(model)`` reward imbalance). Nothing is patched."""
    model = mixtral()
    with pytest.raises(ValueError, match="aux_coef must be a finite number >= 0"):
        patch_moe(model, "topk", aux_coef=aux_coef)
    assert not hasattr(model.model.layers[0].mlp.gate, "router")
    patch_moe(model, "topk", aux_coef=0)  # 0 disables routelab's aux losses


# -- probe_gate: scale and roles ----------------------------------------------------------------------


class _SigmoidGate(nn.Module):
    """A sigmoid top-k gate, not normalised: ``weights = scale * sigmoid(logits)`` at its top-k."""

    def __init__(self, scale: float, attribute: float | None, d: int = 8, E: int = 4, k: int = 2) -> None:
        super().__init__()
        self.top_k, self.scale = k, scale
        self.weight = nn.Parameter(torch.randn(E, d))
        if attribute is not None:
            self.routed_scaling_factor = attribute

    def forward(self, hidden_states):
        logits = nn.functional.linear(hidden_states, self.weight)
        weights, index = logits.sigmoid().topk(self.top_k, -1)
        return logits, self.scale * weights, index


@pytest.mark.parametrize("attribute", [None, 2.5], ids=["no-attribute", "another-attribute"])
def test_the_scale_of_a_sigmoid_top_k_gates_weights_is_read_from_its_outputs(attribute):
    """hf_blocks._own_rule_scale: a gate's weights that are ``c`` times the sigmoid of its logits at the
    experts it chose carry the scale ``c``, read from its outputs, before any ``routed_scaling_factor``
    attribute (absent, or another number here). Oracle: c = 3 by construction."""
    torch.manual_seed(0)
    gate = _SigmoidGate(3.0, attribute)
    rule = probe_gate(gate)
    assert rule.differs is not None and rule.renormalize is None  # not softmax top-k: a rule of its own
    assert rule.scale == pytest.approx(3.0) and not rule.scale_unread
    with pytest.warns(UserWarning, match="the scale 3 of its weights is kept"):
        (block,) = patch_alone(nn.Sequential(_Block(gate)))
    assert block.gate.combine_scale == pytest.approx(3.0)


class _AllExpertsGate(nn.Module):
    """Softmax top-k with ``k = E`` (both float outputs are ``[tokens, E]``), renormalised (trivially),
    answering in ``order``."""

    def __init__(self, order: tuple[str, ...], d: int = 8, E: int = 4) -> None:
        super().__init__()
        self.top_k, self.order = E, order
        self.weight = nn.Parameter(torch.randn(E, d))

    def forward(self, hidden_states):
        logits = nn.functional.linear(hidden_states, self.weight)
        weights, index = logits.softmax(-1).topk(self.top_k, -1)
        found = {"logits": logits, "weights": weights, "experts": index}
        return tuple(found[role] for role in self.order)


@pytest.mark.parametrize("order", [("logits", "weights", "experts"), ("experts", "weights", "logits")],
                         ids=["contract", "granitemoe-5.17"])
def test_with_k_equal_to_e_the_logits_are_the_output_the_gates_weight_gives(order):
    """hf_blocks._roles: when k = E both float outputs have the logits' shape; the logits are the one
    equal to ``hidden_states @ weight.T``, first or last. Oracle: the gate's order by construction,
    and the patched block computes what the unpatched one does."""
    torch.manual_seed(0)
    model = nn.Sequential(_Block(_AllExpertsGate(order), order))
    rule = probe_gate(model[0].gate, block=model[0])
    assert rule.outputs == order
    assert (rule.k, rule.renormalize, rule.differs, rule.contract) == (E, True, None, None)
    x = torch.randn(2, 5, 8)
    with torch.no_grad():
        expected = model(x)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a gate read as softmax top-k is patched without a warning of its rule
            patch_alone(model)
        torch.testing.assert_close(model(x), expected)


class _OwnInputGate(nn.Module):
    """MiniMax-M2's gate shape: ``gate(hidden, e_score_correction_bias)``, its choice biased, its weights
    ``scale * softmax(logits)`` at the experts it chose (not renormalised)."""

    def __init__(self, scale: float, d: int = 8, E: int = 4, k: int = 2) -> None:
        super().__init__()
        self.top_k, self.scale = k, scale
        self.weight = nn.Parameter(torch.randn(E, d))

    def forward(self, hidden_states, e_score_correction_bias):
        logits = nn.functional.linear(hidden_states, self.weight)
        index = (logits + e_score_correction_bias).topk(self.top_k, -1).indices
        return logits, self.scale * logits.softmax(-1).gather(-1, index), index


class _OwnInputBlock(nn.Module):
    def __init__(self, scale: float, d: int = 8, E: int = 4) -> None:
        super().__init__()
        self.gate, self.experts = _OwnInputGate(scale, d, E), _LoopExperts(d, E)
        self.register_buffer("e_score_correction_bias", torch.zeros(E))

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        _, weights, index = self.gate(flat, self.e_score_correction_bias)
        return self.experts(flat, index, weights).view_as(x)


def test_the_scale_of_a_gate_with_inputs_of_its_own_is_read_and_kept():
    """probe_gate of a gate that takes inputs of its own reads the scale of its weights on the block's
    tensors of those names, and patch_moe keeps it as the patched gate's ``combine_scale``. Oracle:
    the scale 2.5 by construction; with a zero bias the gate is softmax top-k (not renormalised) times
    2.5, so router='topk' reproduces the unpatched block."""
    torch.manual_seed(0)
    model = nn.Sequential(_OwnInputBlock(2.5))
    rule = probe_gate(model[0].gate, block=model[0])
    assert rule.inputs == ("e_score_correction_bias",) and rule.contract is None
    assert rule.scale == pytest.approx(2.5) and not rule.scale_unread
    x = torch.randn(2, 5, 8)
    with torch.no_grad():
        expected = model(x)
        with pytest.warns(UserWarning, match=r"inputs of its own.*the scale 2.5 of its weights is kept"):
            patch_alone(model, renormalize=False)
        assert model[0].gate.combine_scale == pytest.approx(2.5)
        torch.testing.assert_close(model(x), expected)


# -- activation checkpointing below the hooked modules ------------------------------------------------


class _Checkpointed(nn.Module):
    """Runs ``block`` under a non-reentrant checkpoint on a fresh tensor (``t * 1.0``), which no carrier
    recorded: the recomputation matches no recorded forward."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, hidden_states):
        return checkpoint(lambda t: self.block(t * 1.0), hidden_states, use_reentrant=False)


def test_a_recomputation_no_record_matches_routes_under_the_latest_calls_mask():
    """hf_masks: a recomputation without a record (a checkpointed function entered below every
    carrier) falls back on the latest call's mask, with a warning where that mask pads. Oracle: the
    same model without the checkpoint gives the same gradients."""
    x = ids()
    mask = left_padded(x)
    grads = []
    for checkpointed in (False, True):
        model = mixtral().train()
        patch_moe(model, "topk", capacity_factor=1.0)
        gate = model.model.layers[0].mlp.gate
        if checkpointed:
            for layer in model.model.layers:
                layer.mlp = _Checkpointed(layer.mlp)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model(x, attention_mask=mask, labels=x).loss.backward()
        unmatched = [w for w in caught if "no recorded forward matches" in str(w.message)]
        assert len(unmatched) == (1 if checkpointed else 0)
        grads.append(gate.weight.grad)
    assert grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[1], grads[0])


# -- the routers' own state ---------------------------------------------------------------------------


def test_a_strict_load_refuses_a_router_state_that_lacks_some_routers_keys():
    """load_router_state_dict's docstring: with ``strict``, routers' keys the state lacks are a
    ValueError (else a router would keep its fresh state silently); without it, the keys present are
    loaded and the others left as they are."""
    model = mixtral()
    patch_moe(model, "batchwise")
    state = router_state_dict(model)
    assert any("layers.0." in key for key in state) and any("layers.1." in key for key in state)
    before = {key: value.clone() for key, value in state.items()}
    partial = {key: value + 1 for key, value in state.items() if "layers.1." not in key}
    with pytest.raises(ValueError, match=r"missing keys \['model\.layers\.1\.mlp\.router\."):
        load_router_state_dict(model, partial)
    assert all(torch.equal(router_state_dict(model)[key], value) for key, value in before.items())
    load_router_state_dict(model, partial, strict=False)
    after = router_state_dict(model)
    for key, value in before.items():
        torch.testing.assert_close(after[key], partial.get(key, value), rtol=0, atol=0)
