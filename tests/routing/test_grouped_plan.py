"""routelab.routing.GroupedPlan against explicit loops and against the buffer layout.

Oracles: the plan's rows read back as per-expert groups must be exactly the tokens a loop over
(token, slot) pairs sends to each expert, in the order of their positions; the rows past the
kept ones must be zero inputs that no pair reads; combine must equal the loop ``y_t = sum_s
keep * weight * f_e(x_t)`` and :class:`~routelab.routing.DispatchPlan`'s combine on the same
decision; gradients are checked with ``torch.autograd.gradcheck`` (finite differences). Layouts
come from :func:`~routelab.routing.apply_capacity` under every drop policy (the plan's documented
input), with capacities from 0 to dropless.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from routelab.routing import DispatchPlan, GroupedPlan, apply_capacity

FAST = settings(max_examples=40, deadline=None)


def decision_for(seed: int, n: int, s: int, E: int, C: int, policy: str, keep_p: float):
    """(expert, candidate, decision) of apply_capacity on random proposals."""
    g = torch.Generator().manual_seed(seed)
    expert = torch.randint(0, E, (n, s), generator=g)
    candidate = torch.rand(n, s, generator=g) < keep_p
    score = torch.rand(n, s, generator=g)
    decision = apply_capacity(expert, candidate, C, E, policy=policy, score=score,
                              generator=torch.Generator().manual_seed(seed + 1))
    return expert, candidate, decision


@FAST
@given(n=st.integers(0, 9), s=st.integers(1, 3), E=st.integers(1, 5), C=st.integers(0, 12),
       policy=st.sampled_from(["position", "score", "random"]), keep_p=st.sampled_from([0.0, 0.6, 1.0]),
       seed=st.integers(0, 10_000))
def test_rows_hold_each_experts_tokens_in_position_order(n, s, E, C, policy, keep_p, seed) -> None:
    expert, _, decision = decision_for(seed, n, s, E, C, policy, keep_p)
    plan = GroupedPlan.build(expert, decision.keep, decision.position, decision.kept, E)
    assert plan.num_rows == n * s and plan.offsets.dtype == torch.int32
    ends = plan.offsets.long().tolist()
    starts = [0, *ends[:-1]]
    for e in range(E):
        # The loop: expert e's kept pairs, ordered by their position in the expert.
        pairs = sorted((int(decision.position[t, j]), t) for t in range(n) for j in range(s)
                       if decision.keep[t, j] and expert[t, j] == e)
        assert [p for p, _ in pairs] == list(range(len(pairs)))  # apply_capacity's positions are dense
        assert plan.token_of_row[starts[e]:ends[e]].tolist() == [t for _, t in pairs]
        assert (plan.expert_of_row[starts[e]:ends[e]] == e).all()
    total = ends[-1] if E else 0
    assert (plan.token_of_row[total:] == n).all() and (plan.expert_of_row[total:] == E).all()
    # Every kept pair reads its own row, every dropped pair the extra zero row R.
    for t in range(n):
        for j in range(s):
            row = int(plan.row_of_slot[t, j])
            if decision.keep[t, j]:
                assert row < total and int(plan.token_of_row[row]) == t
            else:
                assert row == n * s


@FAST
@given(n=st.integers(0, 8), s=st.integers(1, 3), E=st.integers(1, 4), C=st.integers(0, 10), d=st.integers(1, 3),
       policy=st.sampled_from(["position", "score", "random"]), seed=st.integers(0, 10_000))
def test_dispatch_and_combine_equal_the_loop_and_the_buffer_plan(n, s, E, C, d, policy, seed) -> None:
    expert, _, decision = decision_for(seed, n, s, E, C, policy, 0.8)
    g = torch.Generator().manual_seed(seed + 2)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    scale = torch.randn(E + 1, d, generator=g, dtype=torch.float64)  # expert e: x -> x * scale[e]
    weight = torch.randn(n, s, generator=g, dtype=torch.float64)
    weight[~decision.keep] = float("nan")  # a dropped pair's weight must not matter
    grouped = GroupedPlan.build(expert, decision.keep, decision.position, decision.kept, E)
    rows = grouped.dispatch(x)
    total = int(grouped.offsets[-1])
    assert (rows[total:] == 0).all()
    out = rows * scale[grouped.expert_of_row]
    out[total:] = float("nan")  # rows of no expert: never read
    y = grouped.combine(out, weight)
    loop = torch.zeros(n, d, dtype=torch.float64)
    for t in range(n):
        for j in range(s):
            if decision.keep[t, j]:
                loop[t] += weight[t, j] * x[t] * scale[expert[t, j]]
    torch.testing.assert_close(y, loop)
    buffers = DispatchPlan.build(expert, decision.keep, decision.position, E, C)
    buf_out = buffers.dispatch(x) * scale[:E, None, :]
    torch.testing.assert_close(y, buffers.combine(buf_out, weight))


@pytest.mark.parametrize("seed", range(3))
def test_gradcheck(seed) -> None:
    expert, _, decision = decision_for(seed, 6, 2, 3, 3, "position", 0.9)
    plan = GroupedPlan.build(expert, decision.keep, decision.position, decision.kept, 3)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(6, 2, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(6, 2, generator=g, dtype=torch.float64, requires_grad=True)
    scale = torch.randn(4, 2, generator=g, dtype=torch.float64)

    def f(x, weight):
        return plan.combine(plan.dispatch(x).sin() * scale[plan.expert_of_row], weight)

    assert torch.autograd.gradcheck(f, (x, weight))


def test_build_and_calls_reject_bad_arguments() -> None:
    expert, _, decision = decision_for(0, 4, 2, 3, 2, "position", 1.0)
    with pytest.raises(TypeError, match="kept"):
        GroupedPlan.build(expert, decision.keep, decision.position, decision.kept.float(), 3)
    with pytest.raises(ValueError, match="kept must have shape"):
        GroupedPlan.build(expert, decision.keep, decision.position, decision.kept[:2], 3)
    with pytest.raises(ValueError, match="position"):
        GroupedPlan.build(expert, decision.keep, decision.position[:, :1], decision.kept, 3)
    plan = GroupedPlan.build(expert, decision.keep, decision.position, decision.kept, 3)
    with pytest.raises(ValueError, match=r"tokens=4"):
        plan.dispatch(torch.randn(5, 2))
    with pytest.raises(ValueError, match=r"R=8"):
        plan.combine(torch.randn(7, 2), torch.ones(4, 2))
    with pytest.raises(ValueError, match="weight"):
        plan.combine(torch.randn(8, 2), torch.ones(4, 3))
