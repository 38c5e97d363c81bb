"""routelab.routing.dropless: the dropless decision and grouped plan from one sort equal the general
steps (apply_capacity at a limit of every pair, then GroupedPlan.build), field for field."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from routelab.layers import MoE
from routelab.routing import GroupedPlan, apply_capacity
from routelab.routing.dropless import decide_and_plan_dropless


@st.composite
def pairs(draw):
    """Random ``(expert [n, s], candidate [n, s], E)``: any loads (experts left empty, one expert
    taking everything), a token naming an expert twice, candidates dropped anywhere, n = 0."""
    n = draw(st.integers(0, 40))
    s = draw(st.integers(1, 4))
    E = draw(st.integers(1, 9))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    hot = draw(st.integers(1, E))  # experts in use: few -> heavy loads
    expert = torch.randint(0, hot, (n, s), generator=gen)
    p_cand = draw(st.sampled_from([1.0, 0.7, 0.0]))
    candidate = torch.rand(n, s, generator=gen) < p_cand
    return expert, candidate, E


@settings(max_examples=300, deadline=None)
@given(case=pairs(), policy=st.sampled_from(["position", "random"]))
def test_one_sort_equals_apply_capacity_then_build(case, policy) -> None:
    expert, candidate, E = case
    general = apply_capacity(expert, candidate, expert.numel(), E, policy=policy,
                             generator=torch.Generator().manual_seed(0))
    plan = GroupedPlan.build(expert, general.keep, general.position, general.kept, E)
    decision, fast = decide_and_plan_dropless(expert, candidate, E)
    for name in ("keep", "load", "kept", "skip_weight"):
        got, want = getattr(decision, name), getattr(general, name)
        assert got.dtype == want.dtype and torch.equal(got, want), name
    # position: the same on every candidate; elsewhere "undefined but in range [0, tokens * slots)"
    assert torch.equal(decision.position[candidate], general.position[candidate])
    assert bool(((decision.position >= 0) & (decision.position < max(expert.numel(), 1))).all())
    assert fast.num_experts == plan.num_experts
    for name in ("offsets", "token_of_row", "expert_of_row", "row_of_slot"):
        got, want = getattr(fast, name), getattr(plan, name)
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want), name
        assert got.is_contiguous(), name


def test_it_checks_as_apply_capacity_does() -> None:
    expert = torch.tensor([[0, 3]])
    with pytest.raises(ValueError, match=r"expert must hold expert indices in \[0, num_experts=3\)"):
        decide_and_plan_dropless(expert, torch.ones(1, 2, dtype=torch.bool), 3)
    with pytest.raises(ValueError, match="candidate"):
        decide_and_plan_dropless(expert, torch.ones(2, 2, dtype=torch.bool), 4)
    with pytest.raises(ValueError, match="num_experts"):
        decide_and_plan_dropless(expert, torch.ones(1, 2, dtype=torch.bool), 0)
    decide_and_plan_dropless(expert, torch.ones(1, 2, dtype=torch.bool), 3, check=False)  # (unchecked: no error)


def _step_ops(moe: MoE, x: torch.Tensor) -> int:
    """The operators (not views) one forward + backward issues."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            if not func.is_view and func is not torch.ops.aten.detach.default:
                Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        moe(x)[0].sum().backward()
    return Count.n


@pytest.mark.parametrize("k", [1, 2])
def test_a_dropless_grouped_layer_takes_it_and_computes_the_same(k, monkeypatch) -> None:
    """The layer (dropless, grouped) routes through the one-sort path: outputs, gradients, routes and
    statistics equal the general steps' bit for bit, in fewer operators."""
    import routelab.layers.moe as moe_module

    torch.manual_seed(0)
    moe = MoE(16, 32, 6, router="topk", k=k, capacity_factor=None, dispatch="grouped", check_finite=False)
    if not moe.uses_grouped(k, torch.device("cpu")):
        pytest.skip("grouped matmuls do not run on this CPU")
    x = torch.randn(50, 16, requires_grad=True)

    def run():
        x.grad = None
        moe.zero_grad()
        y, routes = moe(x)
        y.backward(torch.ones_like(y))
        return y, routes, x.grad.clone(), [p.grad.clone() for p in moe.parameters()]

    calls = []
    real = moe_module.decide_and_plan_dropless
    monkeypatch.setattr(moe_module, "decide_and_plan_dropless", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    fast = run()
    fast_ops = _step_ops(moe, x)
    assert calls
    monkeypatch.setattr(moe_module, "decide_and_plan_dropless", _general_steps)
    slow = run()
    slow_ops = _step_ops(moe, x)
    assert torch.equal(fast[0], slow[0]) and torch.equal(fast[2], slow[2])
    for a, b in zip(fast[3], slow[3]):
        assert torch.equal(a, b)
    for key, value in fast[1].stats.items():
        assert torch.equal(value, slow[1].stats[key]), key
    assert torch.equal(fast[1].keep, slow[1].keep) and torch.equal(fast[1].weight, slow[1].weight)
    assert fast_ops < slow_ops - 15, (fast_ops, slow_ops)


def _general_steps(expert, candidate, num_experts, *, check=True):
    """apply_capacity at a limit of every pair, then GroupedPlan.build (what the layer did before)."""
    decision = apply_capacity(expert, candidate, expert.numel(), num_experts, check=check)
    return decision, GroupedPlan.build(expert, decision.keep, decision.position, decision.kept, num_experts)
