"""routelab.routing.DispatchPlan against explicit per-token loops.

Oracles: a loop that copies token ``t`` into row ``(expert, position)`` of every kept pair
(zero rows elsewhere), a loop ``y_t = sum_s keep * weight * out[expert, position]`` for
combine, the transposed loops for the gradients (and ``torch.autograd.gradcheck`` in float64,
i.e. finite differences), and the build-time validation of the buffer rows. Plans are built
from arbitrary valid layouts (not only apply_capacity's), including dropped slots, empty rows,
and a token that sends two slots to the same expert row.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from routelab.routing import DispatchPlan, apply_capacity

FAST = settings(max_examples=40, deadline=None)


def random_layout(seed: int, n: int, s: int, E: int, C: int, keep_p: float):
    """(expert, keep, position): kept pairs of different tokens in distinct rows, in a random
    (not arrival) order; rows left over stay empty; dropped pairs get arbitrary positions."""
    g = torch.Generator().manual_seed(seed)
    expert = torch.randint(0, E, (n, s), generator=g)
    keep = torch.rand(n, s, generator=g) < keep_p
    position = torch.randint(-3, 3 * C + 3, (n, s), generator=g)  # junk where dropped
    free = {e: torch.randperm(C, generator=g).tolist() for e in range(E)}
    for t in range(n):
        for j in range(s):
            if keep[t, j]:
                e = int(expert[t, j])
                if free[e]:
                    position[t, j] = free[e].pop()
                else:
                    keep[t, j] = False
    return expert, keep, position


def loop_dispatch(x, expert, keep, position, E, C):
    buf = torch.zeros(E, C, x.shape[1], dtype=x.dtype)
    for t in range(x.shape[0]):
        for j in range(expert.shape[1]):
            if keep[t, j]:
                buf[expert[t, j], position[t, j]] = x[t]
    return buf


def loop_combine(out, weight, expert, keep, position):
    n, s = expert.shape
    y = torch.zeros(n, out.shape[-1], dtype=out.dtype)
    for t in range(n):
        for j in range(s):
            if keep[t, j]:
                y[t] += weight[t, j] * out[expert[t, j], position[t, j]]
    return y


@FAST
@given(n=st.integers(0, 8), s=st.integers(1, 3), E=st.integers(1, 4), C=st.integers(0, 4), d=st.integers(1, 3),
       keep_p=st.sampled_from((1.0, 0.6, 0.0)), seed=st.integers(0, 2**31 - 1))
def test_dispatch_and_combine_equal_loops(n, s, E, C, d, keep_p, seed) -> None:
    expert, keep, position = random_layout(seed, n, s, E, C, keep_p)
    plan = DispatchPlan.build(expert, keep, position, E, C)
    assert plan.num_tokens == n and plan.num_experts == E and plan.capacity == C
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    torch.testing.assert_close(plan.dispatch(x), loop_dispatch(x, expert, keep, position, E, C), rtol=0, atol=0)
    out = torch.randn(E, C, d, generator=g, dtype=torch.float64)
    w = torch.randn(n, s, generator=g, dtype=torch.float64) * 3  # dropped pairs' weights are ignored
    torch.testing.assert_close(plan.combine(out, w), loop_combine(out, w, expert, keep, position),
                               rtol=1e-12, atol=1e-12)
    # The same plan laid out from its rows (expert parallelism's constructor) is the same plan.
    again = DispatchPlan.from_rows(plan.row_of_slot, E, C)
    assert torch.equal(again.token_of_row, plan.token_of_row) and torch.equal(again.row_of_slot, plan.row_of_slot)


@FAST
@given(n=st.integers(1, 6), s=st.integers(1, 2), E=st.integers(1, 3), C=st.integers(1, 3),
       seed=st.integers(0, 2**31 - 1))
def test_gradients_equal_transposed_loops(n, s, E, C, seed) -> None:
    """d/dx of <G, dispatch(x)> is the sum of G over x's rows; d/d(out, w) of <H, combine> is
    w * H scattered to the rows, and <H, out[row]> on kept pairs (0 on dropped ones)."""
    expert, keep, position = random_layout(seed, n, s, E, C, 0.7)
    plan = DispatchPlan.build(expert, keep, position, E, C)
    g = torch.Generator().manual_seed(seed + 2)
    d = 2
    x = torch.randn(n, d, generator=g, dtype=torch.float64, requires_grad=True)
    G = torch.randn(E, C, d, generator=g, dtype=torch.float64)
    (gx,) = torch.autograd.grad((plan.dispatch(x) * G).sum(), x)
    want_gx = torch.zeros(n, d, dtype=torch.float64)
    for t in range(n):
        for j in range(s):
            if keep[t, j]:
                want_gx[t] += G[expert[t, j], position[t, j]]
    torch.testing.assert_close(gx, want_gx, rtol=1e-12, atol=1e-12)

    out = torch.randn(E, C, d, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(n, s, generator=g, dtype=torch.float64, requires_grad=True)
    H = torch.randn(n, d, generator=g, dtype=torch.float64)
    gout, gw = torch.autograd.grad((plan.combine(out, w) * H).sum(), (out, w))
    want_gout = torch.zeros(E, C, d, dtype=torch.float64)
    want_gw = torch.zeros(n, s, dtype=torch.float64)
    for t in range(n):
        for j in range(s):
            if keep[t, j]:
                e, p = expert[t, j], position[t, j]
                want_gout[e, p] += w[t, j].detach() * H[t]
                want_gw[t, j] = (out[e, p].detach() * H[t]).sum()
    torch.testing.assert_close(gout, want_gout, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gw, want_gw, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gradcheck_dispatch_and_combine(seed) -> None:
    """Finite differences in float64 (first and second order) on a layout with drops."""
    n, s, E, C, d = 5, 2, 3, 2, 3
    expert, keep, position = random_layout(seed, n, s, E, C, 0.8)
    assert bool((~keep).any()), "the layout should drop something"
    plan = DispatchPlan.build(expert, keep, position, E, C)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=torch.float64, requires_grad=True)
    out = torch.randn(E, C, d, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(n, s, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(plan.dispatch, (x,))
    assert torch.autograd.gradcheck(plan.combine, (out, w))
    assert torch.autograd.gradgradcheck(plan.combine, (out, w))
    # The whole round trip, expert = identity: y_t = sum over kept slots of w * x_t.
    assert torch.autograd.gradcheck(lambda x_, w_: plan.combine(plan.dispatch(x_), w_), (x, w))
    y = plan.combine(plan.dispatch(x), w)
    torch.testing.assert_close(y, (w * keep).sum(-1, keepdim=True) * x, rtol=1e-12, atol=1e-12)


def test_same_token_twice_in_one_row_is_rejected() -> None:
    """Two slots of *one* token may not share a row either (they were allowed, and read once per
    slot by the plain gathers; the adjoint gathers, CUDA's default, keep one weight per row and
    counted the token's gradient twice: a review case, 1.0 instead of 0.8)."""
    expert = torch.tensor([[1, 1], [0, 1]])
    keep = torch.tensor([[True, True], [True, True]])
    position = torch.tensor([[0, 0], [0, 1]])
    with pytest.raises(ValueError, match=r"kept pair \(0, 0\) in the \(expert, position\) = \(1, 0\) buffer row"):
        DispatchPlan.build(expert, keep, position, 2, 2)
    plan = DispatchPlan.build(expert, keep, torch.tensor([[0, 1], [0, 2]]), 2, 3)  # distinct rows: fine
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    w = torch.tensor([[0.25, 0.5], [1.0, 2.0]])
    torch.testing.assert_close(plan.combine(plan.dispatch(x), w), torch.tensor([[0.75, 1.5], [9.0, 12.0]]))


def test_build_rejects_two_tokens_in_one_row_and_rows_outside_the_buffer() -> None:
    expert = torch.tensor([[0], [0], [1]])
    keep = torch.ones(3, 1, dtype=torch.bool)
    with pytest.raises(ValueError, match="same"):
        DispatchPlan.build(expert, keep, torch.tensor([[1], [1], [0]]), 2, 2)
    with pytest.raises(ValueError, match="position"):
        DispatchPlan.build(expert, keep, torch.tensor([[0], [2], [0]]), 2, 2)
    with pytest.raises(ValueError, match="expert"):
        DispatchPlan.build(torch.tensor([[0], [2], [1]]), keep, torch.tensor([[0], [1], [0]]), 2, 2)
    # Dropped pairs are not checked: anything goes there.
    keep = torch.tensor([[True], [False], [True]])
    plan = DispatchPlan.build(torch.tensor([[0], [7], [1]]), keep, torch.tensor([[0], [-5], [0]]), 2, 2)
    y = plan.combine(torch.ones(2, 2, 1), torch.ones(3, 1))
    assert y[:, 0].tolist() == [1.0, 0.0, 1.0]


def test_plan_from_apply_capacity_matches_the_layer_loop() -> None:
    """apply_capacity + DispatchPlan + an expert function = the per-token reference of an MoE
    layer (dropped pairs contribute nothing)."""
    g = torch.Generator().manual_seed(0)
    n, s, E, C, d = 12, 2, 3, 3, 4
    expert = torch.randint(0, E, (n, s), generator=g)
    dec = apply_capacity(expert, torch.ones(n, s, dtype=torch.bool), C, E)
    assert bool((~dec.keep).any())
    plan = DispatchPlan.build(expert, dec.keep, dec.position, E, C)
    W = torch.randn(E, d, d, generator=g, dtype=torch.float64)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    gate = torch.rand(n, s, generator=g, dtype=torch.float64)
    y = plan.combine(torch.einsum("ecd,edf->ecf", plan.dispatch(x), W), gate)
    ref = torch.zeros(n, d, dtype=torch.float64)
    for t in range(n):
        for j in range(s):
            if dec.keep[t, j]:
                ref[t] += gate[t, j] * (x[t] @ W[expert[t, j]])
    torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-12)


def test_dropped_weight_really_does_not_matter() -> None:
    """A dropped pair's weight is ignored, inf and NaN included (it once computed 0 * inf = NaN)."""
    expert = torch.tensor([[0, 1]])
    plan = DispatchPlan.build(expert, torch.tensor([[True, False]]), torch.tensor([[0, 0]]), 2, 1)
    out = torch.ones(2, 1, 1)
    for bad in (float("inf"), float("nan"), -float("inf")):
        y = plan.combine(out, torch.tensor([[0.5, bad]]))
        assert y.tolist() == [[0.5]]
