"""Fuzz tests of the routing rules (routelab.routing: softmax_routes, topk_routes,
noisy_topk_routes, batchwise_routes, balanced_routes, sinkhorn_routes; routelab.estimators:
gumbel_matching_routes) and of the gate protocol (routelab.gates.GateOutput).

Oracles: the router classes that call the rules (same bits for the same logits, options and
generator), the definitions (top-k of the logits, balanced loads, the batchwise mask's m per
expert), and the protocol's promise that ``gate`` stores nothing.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import routelab.estimators as E
import routelab.gates as G
import routelab.routing as R
from fuzz_strategies import call, fresh, fuzz, guarded, same_bits, seeds
from routelab import Routes
from routelab.routers import ROUTERS

COVERED_ROUTING_RULES = {"softmax_routes", "topk_routes", "noisy_topk_routes", "batchwise_routes", "balanced_routes",
                         "sinkhorn_routes"}
COVERED_ESTIMATOR_RULES = {"gumbel_matching_routes"}
COVERED_GATES = {"GateOutput"}

FIELDS = ("expert", "gate", "keep", "weight", "log_prob")


def _same_routes(a: Routes, b: Routes, what: str) -> None:
    for f in FIELDS:
        assert same_bits(getattr(a, f), getattr(b, f)), f"{what}: {f} differs"
    assert a.aux.keys() == b.aux.keys() and all(same_bits(a.aux[k], b.aux[k]) for k in a.aux), f"{what}: aux differs"


@fuzz(80)
@given(
    name=st.sampled_from(("softmax", "topk", "noisy_topk", "batchwise", "base", "sinkhorn", "gumbel_matching")),
    n=st.sampled_from((0, 1, 4, 8, 12)),
    E_=st.integers(1, 5),
    k=st.integers(1, 3),
    training=st.booleans(),
    seed=seeds,
)
def test_routers_are_their_rules(name, n, E_, k, training, seed) -> None:
    """A router's route() is its rule on the same scores: same bits, same aux."""
    k = min(k, E_)
    if name == "batchwise" and training and (k * n) % E_:
        n = E_  # the batchwise mask needs k * n divisible by E
    kw = {} if name in ("softmax", "base", "gumbel_matching") else {"k": k}
    torch.manual_seed(seed % 1000)
    router = ROUTERS[name](6, E_, **kw)
    router.train(training)
    g = fresh(seed)
    feats = torch.randn(n, router.features(torch.zeros(1, 6)).shape[-1], generator=g)
    if name == "noisy_topk":
        feats[:, E_:] = feats[:, E_:].abs() + 0.1
    # one slot per token: n / E; batchwise's k slots need App. F's quota ceil(k n / E) (it refuses less)
    capacity = max(-(-(k if name == "batchwise" else 1) * n // E_), 1)
    router.generator = fresh(seed + 1)
    got = guarded(router.route, feats, capacity, what=f"{name}.route")
    gen = fresh(seed + 1)
    if name == "softmax":
        want = R.softmax_routes(feats, importance_coef=router.importance_coef)
    elif name == "topk":
        want = R.topk_routes(feats, k, renormalize=router.renormalize, balance_coef=router.balance_coef)
    elif name == "noisy_topk":
        want = R.noisy_topk_routes(feats[:, :E_], feats[:, E_:], k, training=training, generator=gen,
                                   importance_coef=router.importance_coef, load_coef=router.load_coef)
    elif name == "batchwise":
        want = R.batchwise_routes(feats, k, router.thresholds, training=training, inference=router.inference,
                                  threshold_coef=router.threshold_coef)
    elif name == "base":
        want = R.balanced_routes(feats, capacity, balanced=training or router.eval_balanced)
    elif name == "sinkhorn":
        want = R.sinkhorn_routes(feats, k, sweeps=router.sweeps, balanced=training or router.eval_balanced)
    else:
        want = E.gumbel_matching_routes(feats, capacity, training=training, generator=gen)
    _same_routes(got, want, name)
    assert got.expert.shape[0] == n and got.expert.dim() == 2
    if name in ("base", "gumbel_matching") and n and (training or router.eval_balanced):
        load = torch.bincount(got.expert[:, 0], minlength=E_)
        assert int(load.max()) <= capacity, "a balanced rule exceeded the capacity"
    if name == "topk" and n:
        assert torch.equal(got.expert, feats.topk(k, dim=-1).indices), "top-k did not take the largest logits"


@pytest.mark.parametrize("rule, args", [
    (R.topk_routes, (torch.zeros(4, 3), 4)),
    (R.topk_routes, (torch.zeros(4), 1)),
    (R.softmax_routes, (torch.zeros(4, 3, dtype=torch.long),)),
    (R.sinkhorn_routes, (torch.zeros(4, 3), 0)),
    (R.batchwise_routes, (torch.zeros(4, 3), 5, torch.zeros(3))),
    (R.noisy_topk_routes, (torch.zeros(4, 3), torch.ones(4, 2), 1)),
    (R.balanced_routes, ([[0.0]],)),
])
def test_rules_name_bad_arguments(rule, args) -> None:
    call(rule, *args, names=("logits", "k", "noise_std", "sweeps"), valid=False)


def test_gumbel_matching_routes_names_bad_arguments() -> None:
    call(E.gumbel_matching_routes, torch.zeros(4, 2), names=("method",), valid=False, method="nope")
    call(E.gumbel_matching_routes, torch.zeros(4, 2), names=("tau",), valid=False, tau=0.0)
    call(E.gumbel_matching_routes, torch.zeros(4, 2), 1, names=("capacity", "capacity_factor"), valid=False)


@fuzz(40)
@given(
    which=st.sampled_from(("DSelectK", "SoftmaxGate", "TopKGate", "GumbelSoftmaxGate", "SoftmaxSelectorGate")),
    per_example=st.booleans(),
    batch=st.integers(1, 5),
    seed=seeds,
)
def test_gate_protocol(which, per_example, batch, seed) -> None:
    """gate(x) returns the weights forward(x) returns, with the same penalties, and stores nothing."""
    n, p = 5, 3
    torch.manual_seed(seed % 1000)
    if which == "DSelectK":
        gate = G.DSelectK(n, 2, per_example=per_example, input_dim=p, entropy_reg=0.1)
    elif which == "SoftmaxGate":
        gate = G.SoftmaxGate(n, per_example=per_example, input_dim=p)
    elif which == "TopKGate":
        gate = G.TopKGate(n, 2, per_example=per_example, input_dim=p)
    elif which == "GumbelSoftmaxGate":
        gate = G.GumbelSoftmaxGate(n, sparsity_reg=0.1, seed=seed % 1000)
        gate.eval()  # its training-mode noise advances its own generator
    else:
        gate = G.SoftmaxSelectorGate(n, 2, entropy_reg=0.1)
    x = torch.randn(batch, p, generator=fresh(seed))
    before = gate.regularization()
    assert before.device == next(gate.parameters()).device and float(before) == 0.0
    out = guarded(gate.gate, x, what=f"{which}.gate")
    assert isinstance(out, G.GateOutput) and out.scores.shape == (batch, n)
    assert gate.aux == {} and float(gate.regularization()) == 0.0, "gate() stored its output on the module"
    weights = gate(x)
    assert same_bits(weights, out.scores), "forward and gate disagree"
    assert gate.aux.keys() == out.aux.keys()
    assert same_bits(gate.regularization().detach(), out.regularization().detach()), "regularization differs"


COVERED_LAYERS = {"MoEConfig"}


@fuzz(60)
@given(
    d_model=st.sampled_from((4, 0, -1, 2.0, True)),
    num_experts=st.sampled_from((1, 3, 4, 0)),
    router=st.sampled_from(("topk", "Top-K", "base", "switch", "nope", 3)),
    k=st.sampled_from((None, 1, 2)),
    capacity_factor=st.sampled_from((1.0, None, 0.0, float("nan"), 2)),
    drop_policy=st.sampled_from(("position", "random", "lifo")),
    activation=st.sampled_from(("gelu", "relu", "swish", torch.tanh)),
    seed=seeds,
)
def test_moe_config(d_model, num_experts, router, k, capacity_factor, drop_policy, activation, seed) -> None:
    """MoEConfig validates every field (ValueError naming it); MoE.from_config(config) is the layer
    MoE(**fields) builds, bit for bit, and its .config describes it."""
    from routelab.layers import MoE, MoEConfig

    fields = dict(router=router, capacity_factor=capacity_factor, k=k, drop_policy=drop_policy, activation=activation)
    names = ("d_model", "num_experts", "router", "capacity_factor", "drop_policy", "activation", "k")
    ok, config = call(MoEConfig, d_model, 8, num_experts, names=names, valid=None, what="MoEConfig", **fields)
    if not ok:
        return
    torch.manual_seed(seed % 1000)
    ok, layer = call(MoE.from_config, config, names=names, valid=None, what="MoE.from_config")
    if not ok:  # a k the router cannot use is found when the router is built
        return
    torch.manual_seed(seed % 1000)
    ref = MoE(d_model, 8, num_experts, **fields)
    for (name, p), (_, q) in zip(layer.named_parameters(), ref.named_parameters()):
        assert same_bits(p, q), f"from_config and the constructor initialise {name} differently"
    described = layer.config
    assert described == config  # a router built by name is described by its name, k and options
    assert (described.capacity_factor, described.drop_policy, described.activation) == (capacity_factor, drop_policy,
                                                                                        activation)
    again = MoE.from_config(described)
    assert again.router is not layer.router and type(again.router) is type(layer.router)
    assert again.router.slots == layer.router.slots and again.capacity_factor == capacity_factor


def test_layer_signatures_default_to_the_config() -> None:
    """MoE's and ExpertParallelMoE's keyword defaults are MoEConfig's (one set of defaults)."""
    import dataclasses
    import inspect

    from routelab.layers import MoE, MoEConfig
    from routelab.parallel import ExpertParallelMoE

    defaults = {f.name: f.default for f in dataclasses.fields(MoEConfig) if f.default is not dataclasses.MISSING}
    for cls in (MoE, ExpertParallelMoE):
        params = inspect.signature(cls.__init__).parameters
        for name, value in defaults.items():
            assert params[name].default == value, f"{cls.__name__}({name}=...) defaults to {params[name].default!r}"
