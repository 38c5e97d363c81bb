"""Contracts of routelab.integrations.hf_blocks pinned by mutation testing.

Each test guards one rule of the module that the other tests left unchecked: which child of a
block routes, what counts as a gate's scoring matrix, why a block is refused, how a scale is read
from a gate's weights, and that probing a gate leaves the gate (its buffers) and the global random
state alone. Oracles are hand-built gates whose rule is known by construction, or hand-computed values.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from routelab.integrations.hf_blocks import (
    GateRule,
    _own_rule_scale,
    _probe_inputs,
    _scale_of,
    _scaling_attribute,
    block_problem,
    gate_scorer,
    probe_gate,
    replaced_rule,
    routing_child,
    scorer_key,
    sparse_moe_blocks,
)

D, E = 6, 4


class _SoftmaxGate(nn.Module):
    """Mixtral's rule on a weight of its own: softmax top-k, renormalised or not."""

    def __init__(self, d: int = D, num_experts: int = E, k: int = 2, renormalize: bool = True) -> None:
        super().__init__()
        self.top_k, self.renormalize = k, renormalize
        self.weight = nn.Parameter(torch.randn(num_experts, d))

    def forward(self, hidden_states):
        logits = nn.functional.linear(hidden_states, self.weight)
        weights, experts = logits.softmax(-1).topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        return logits, weights, experts


class _Experts(nn.Module):
    """Fused experts of the contract: ``forward(hidden_states, top_k_index, top_k_weights)``."""

    def __init__(self, num_experts: int = E) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.proj = nn.Parameter(torch.randn(num_experts, D, D))

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return hidden_states


class _Block(nn.Module):
    def __init__(self, gate: nn.Module, experts: nn.Module | None = None) -> None:
        super().__init__()
        self.gate, self.experts = gate, _Experts() if experts is None else experts


def test_routing_child_prefers_the_child_that_scores_with_a_matrix():
    """routing_child: of ``gate`` and ``router``, the one with a scoring ``weight [E, d]`` routes, even when
    ``gate`` comes first in ROUTING_CHILDREN; with no such child, the first one found."""
    block = nn.Module()
    block.gate = nn.Identity()  # no parameters: an activation, not the scorer
    block.router = _SoftmaxGate()
    assert routing_child(block) == ("router", block.router)
    plain = nn.Module()
    plain.gate, plain.router = nn.Identity(), nn.ReLU()
    assert routing_child(plain) == ("gate", plain.gate)


def test_a_one_dimensional_weight_is_not_a_scoring_matrix():
    """gate_scorer: only a 2-D ``weight`` scores the experts; a 1-D ``weight`` (a norm's scale) is none."""

    class NormGate(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(D))

    assert gate_scorer(NormGate()) is None
    gate = _SoftmaxGate()
    assert gate_scorer(gate) == ("", gate)


def test_a_gate_with_two_parametrised_children_has_no_scorer():
    """gate_scorer: a gate with several children holding parameters (an MLP router) has no one scoring
    matrix, even when its first child is a Linear of the right shape."""
    gate = nn.Module()
    gate.first = nn.Linear(D, E, bias=False)
    gate.second = nn.Linear(E, E, bias=False)
    assert gate_scorer(gate) is None
    alone = nn.Module()
    alone.wg = nn.Linear(D, E, bias=False)
    alone.act = nn.ReLU()  # no parameters: does not count
    assert gate_scorer(alone) == ("wg", alone.wg)


def test_the_scorer_key_of_a_linear_child_is_qualified():
    """scorer_key: the child's name prefixes the parameter's (``wg.weight``); the gate's own is bare."""
    gate = nn.Module()
    gate.wg = nn.Linear(D, E, bias=True)
    assert scorer_key(gate, "weight") == "wg.weight"
    assert scorer_key(gate, "bias") == "wg.bias"
    assert scorer_key(_SoftmaxGate(), "weight") == "weight"


@pytest.mark.parametrize("held", [E + 2, E - 1])
def test_a_block_whose_experts_are_more_or_fewer_than_the_gates_rows_is_refused(held):
    """block_problem: the gate's rows must be one per routed expert: more experts than rows (shared
    experts?) is refused as well as fewer."""
    problem = block_problem(_Block(_SoftmaxGate(), _Experts(held)))
    assert problem is not None and f"scores {E} experts but its experts (_Experts) hold {held}" in problem
    assert block_problem(_Block(_SoftmaxGate(), _Experts(E))) is None


def test_experts_that_take_two_inputs_are_refused():
    """block_problem: experts must take ``(hidden_states, top_k_index, top_k_weights)``; two inputs are a
    contract of the block's own."""

    class TwoInputExperts(_Experts):
        def forward(self, hidden_states, routing):  # noqa: D102
            return hidden_states

    problem = block_problem(_Block(_SoftmaxGate(), TwoInputExperts()))
    assert problem is not None and "['hidden_states', 'routing']" in problem
    assert "routes by a contract of its own" in problem


def test_scale_of_is_a_proportionality_test():
    """_scale_of: ``c`` with ``weights == c * reference`` only when the two are proportional."""
    reference = torch.tensor([[0.5, 0.25], [0.2, 0.1]])
    assert _scale_of(2.5 * reference, reference) == pytest.approx(2.5)
    assert _scale_of(torch.tensor([[1.0, 2.0], [0.2, 0.1]]), reference) is None


def test_a_gate_with_non_softmax_weights_is_not_read_as_softmax_top_k():
    """probe_gate: weights that are the softmax top-k plus a constant are not softmax top-k, renormalised
    or not: renormalize is None and the gate's rule is named."""

    class OffsetGate(_SoftmaxGate):
        def forward(self, hidden_states):
            logits, weights, experts = super().forward(hidden_states)
            return logits, weights + 0.1, experts

    rule = probe_gate(OffsetGate())
    assert rule.renormalize is None and rule.differs is not None and "weights are not the softmax" in rule.differs


def test_a_constant_per_token_sum_of_the_weights_is_the_scale():
    """_own_rule_scale: weights with the same sum 2.5 on every token (DeepSeek-V3's renormalised
    scores times 2.5), not proportional to the softmax or sigmoid of the logits, give the scale 2.5."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(8, E, generator=g)
    experts = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(8)])
    raw = torch.rand(8, 2, generator=g) + 0.1
    weights = 2.5 * raw / raw.sum(-1, keepdim=True)
    assert _own_rule_scale(nn.Module(), logits, weights, experts) == pytest.approx(2.5)


def test_a_boolean_routed_scaling_factor_is_no_scale():
    """_scaling_attribute: a bool (``True``) is not a scale, though ``isinstance(True, int)``; a positive
    number is, an infinite or negative one is not."""
    gate = nn.Module()
    gate.routed_scaling_factor = True
    assert _scaling_attribute(gate) is None
    gate.routed_scaling_factor = 16
    assert _scaling_attribute(gate) == 16.0
    for bad in (float("inf"), -1.0, 0):
        gate.routed_scaling_factor = bad
        assert _scaling_attribute(gate) is None


def test_probing_a_gate_that_updates_a_buffer_leaves_the_gates_buffer_alone():
    """_fresh_copy/_buffer_copy: the probe runs on copies of the gate's buffers, so a gate that counts its
    routed tokens in a float32 buffer (a load statistic) is not counted by the probe."""

    class CountingGate(_SoftmaxGate):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("counts", torch.zeros(E))

        def forward(self, hidden_states):
            logits, weights, experts = super().forward(hidden_states)
            self.counts += torch.bincount(experts.flatten(), minlength=E).float()
            return logits, weights, experts

    gate = CountingGate()
    rule = probe_gate(gate)
    assert (rule.k, rule.renormalize) == (2, True)
    assert torch.equal(gate.counts, torch.zeros(E))


def test_the_probes_hidden_states_have_variance_one_over_d():
    """_probe_inputs: variance ``1 / d``, so fresh N(0, 1) weights give logits of order 1 at any size."""
    d = 1024
    x = _probe_inputs(4096, d, torch.Generator().manual_seed(0))
    assert x.shape == (4096, d)
    assert x.var().item() == pytest.approx(1 / d, rel=0.05)


def test_a_wide_gate_that_does_not_renormalise_is_read_as_such():
    """probe_gate at a large hidden size (Qwen2-MoE's 2048): a softmax top-k gate without renormalisation
    is read as not renormalising (inputs of variance 1 gave a one-hot softmax that hid the difference)."""
    assert probe_gate(_SoftmaxGate(d=2048, num_experts=8, renormalize=False)).renormalize is False
    assert probe_gate(_SoftmaxGate(d=2048, num_experts=8, renormalize=True)).renormalize is True


def test_probing_leaves_the_global_random_state_alone():
    """probe_gate (_training_difference seeds the global generator for the train-mode run): the global
    random state is the same before and after."""
    gate = _SoftmaxGate()
    state = torch.random.get_rng_state()
    probe_gate(gate)
    assert torch.equal(torch.random.get_rng_state(), state)


def test_a_gate_in_training_mode_is_probed_in_eval_mode():
    """_fresh_copy: the probe copy runs in eval mode whatever the gate's mode, so a gate that adds noise
    to its logits in training only is read as softmax top-k (its training noise named apart)."""

    class NoisyGate(_SoftmaxGate):
        def forward(self, hidden_states):
            logits = nn.functional.linear(hidden_states, self.weight)
            if self.training:
                logits = logits + torch.randn_like(logits)
            weights, experts = logits.softmax(-1).topk(self.top_k, dim=-1)
            return logits, weights / weights.sum(-1, keepdim=True), experts

    gate = NoisyGate().train()
    rule = probe_gate(gate)
    assert (rule.k, rule.renormalize, rule.differs) == (2, True, None)
    assert rule.training is not None and "routes otherwise than in eval" in rule.training
    assert gate.training  # the gate itself is untouched


def test_a_bias_the_logits_do_not_carry_is_not_added():
    """probe_gate: a gate holding a ``bias [E]`` its logits do not carry is read with logit_bias False,
    as plain softmax top-k; one whose logits carry it, with logit_bias True."""

    class BiasGate(_SoftmaxGate):
        def __init__(self, uses_bias: bool) -> None:
            super().__init__()
            self.uses_bias = uses_bias
            self.bias = nn.Parameter(torch.randn(E))

        def forward(self, hidden_states):
            logits = nn.functional.linear(hidden_states, self.weight, self.bias if self.uses_bias else None)
            weights, experts = logits.softmax(-1).topk(self.top_k, dim=-1)
            return logits, weights / weights.sum(-1, keepdim=True), experts

    unused = probe_gate(BiasGate(uses_bias=False))
    assert (unused.logit_bias, unused.renormalize, unused.differs) == (False, True, None)
    used = probe_gate(BiasGate(uses_bias=True))
    assert (used.logit_bias, used.renormalize, used.differs) == (True, True, None)


def test_the_warning_says_when_the_scale_could_not_be_read():
    """replaced_rule: a gate with a rule of its own whose scale was not read is warned about, saying the
    weights are used unscaled; a read scale is said kept."""
    unread = replaced_rule(GateRule(differs="its own", scale_unread=True), [])
    assert unread is not None and "the scale of its weights could not be read" in unread
    kept = replaced_rule(GateRule(differs="its own", scale=2.5), [])
    assert kept is not None and "the scale 2.5 of its weights is kept" in kept
    assert replaced_rule(GateRule(), []) is None


def test_a_block_whose_experts_are_not_a_module_is_not_a_candidate():
    """sparse_moe_blocks: a block is a candidate only when its ``experts`` is a module."""
    good = _Block(_SoftmaxGate())
    odd = nn.Module()
    odd.gate = _SoftmaxGate()
    odd.experts = nn.Parameter(torch.randn(E, D))  # a tensor, not a module
    model = nn.ModuleDict({"good": good, "odd": odd})
    assert sparse_moe_blocks(model) == [("good", good)]


def test_with_k_equal_to_e_the_logits_are_read_by_value_not_position():
    """_roles: with ``k = E`` both float outputs are ``[tokens, E]``; a gate answering (weights, logits,
    experts) has its logits read as the second output, the one equal to ``hidden_states @ weight.T``."""

    class WeightsFirstGate(_SoftmaxGate):
        def __init__(self) -> None:
            super().__init__(k=E)

        def forward(self, hidden_states):
            logits, weights, experts = super().forward(hidden_states)
            return weights, logits, experts

    rule = probe_gate(WeightsFirstGate())
    assert rule.outputs == ("weights", "logits", "experts")
    assert (rule.k, rule.renormalize, rule.differs, rule.contract) == (E, True, None, None)
