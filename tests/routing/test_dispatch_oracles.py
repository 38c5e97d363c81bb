"""Dispatch, records and statistics against independent oracles: tests a mutation review asked for (mutants of
``_gather.combine_rows``, ``DispatchPlan.build``, ``record`` and ``load_stats`` that the suite did not notice)."""

from __future__ import annotations

import pytest
import torch

import routelab
from routelab.layers import MoE
from routelab.routing import DispatchPlan, apply_capacity, load_stats
from routelab.routing._gather import combine_rows


@pytest.mark.parametrize("adjoint", [False, True])
@pytest.mark.parametrize("slots", [1, 2, 3])
def test_combine_rows_is_the_weighted_per_token_sum(adjoint, slots):
    """Oracle: a loop over tokens and slots (values and gradients); a sentinel row reads zero. With one slot
    the adjoint path ignoring the weight survived the suite."""
    g = torch.Generator().manual_seed(slots)
    n, d = 5, 4
    R = n * slots
    rows = torch.randn(R, d, generator=g, dtype=torch.float64, requires_grad=True)
    perm = torch.randperm(R, generator=g)
    row_of_slot = perm.view(n, slots).clone()
    row_of_slot[1, 0] = R  # a dropped pair: the sentinel
    token_of_row = torch.empty(R, dtype=torch.long)
    for t in range(n):
        for s in range(slots):
            if row_of_slot[t, s] < R:
                token_of_row[row_of_slot[t, s]] = t
    token_of_row[perm.view(n, slots)[1, 0]] = n  # that row belongs to no pair
    weight = torch.rand(n, slots, generator=g, dtype=torch.float64).masked_fill(row_of_slot == R, 0.0)
    weight.requires_grad_()
    got = combine_rows(rows, weight, row_of_slot, token_of_row, adjoint=adjoint)
    want = torch.stack([sum((weight[t, s] * rows[row_of_slot[t, s]] for s in range(slots) if row_of_slot[t, s] < R),
                            torch.zeros(d, dtype=torch.float64)) for t in range(n)])
    torch.testing.assert_close(got, want)
    up = torch.randn(n, d, generator=g, dtype=torch.float64)
    g_got = torch.autograd.grad((got * up).sum(), (rows, weight))
    g_want = torch.autograd.grad((want * up).sum(), (rows, weight))
    for a, b in zip(g_got, g_want, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("expert_of_token0", [0, 1])
def test_a_kept_position_equal_to_the_capacity_is_refused(expert_of_token0):
    """One past the buffer (a middle and the last expert): it would land in the next expert's rows, or
    nowhere. The boundary ``position == capacity`` passing the check survived the suite."""
    expert = torch.tensor([[expert_of_token0], [2]])
    keep = torch.tensor([[True], [False]])
    with pytest.raises(ValueError, match="outside the expert's buffer"):
        DispatchPlan.build(expert, keep, torch.tensor([[1], [0]]), num_experts=3, capacity=1)
    DispatchPlan.build(expert, keep, torch.tensor([[0], [0]]), num_experts=3, capacity=1)  # the last row is fine


def test_aux_loss_after_a_backward_counts_only_the_records_made_since():
    """A layer that ran again before the backward has a fresh record; the other layer's record, consumed by
    the backward, must not be counted again (a backward hook consuming later records survived the suite)."""
    torch.manual_seed(0)
    a, b = MoE(8, 16, 4, router="topk", k=1), MoE(8, 16, 4, router="topk", k=1)
    model = torch.nn.ModuleList([a, b])
    x = torch.randn(12, 8)
    a(x)
    b(x)
    loss = routelab.aux_loss(model)
    a(x)  # the next micro-batch runs a only, before the backward
    loss.backward()
    fresh = sum(v.sum() for v in a.last_aux.values())
    torch.testing.assert_close(routelab.aux_loss(model), fresh)


def test_load_stats_exact_values():
    """Hand-counted: 4 proposed pairs (one slot of two per token), capacity 2 on 2 experts; padding is never a
    token without an expert. Catches counting over all slots, the unbiased std and padding counted as dropped."""
    expert = torch.tensor([[0, 1], [0, 1], [0, 1], [1, 0], [1, 0]])
    proposed = torch.tensor([[True, False]] * 4 + [[False, False]])  # token 4 is padding: nothing proposed
    d = apply_capacity(expert, proposed, 2, 2)
    s = load_stats(proposed, d, 2, tokens=torch.tensor([True, True, True, True, False]))
    assert d.kept.tolist() == [2, 1]  # expert 0 keeps 2 of its 3
    torch.testing.assert_close(s["dropped_fraction"], torch.tensor(1 / 4))
    torch.testing.assert_close(s["load_cv"], torch.tensor(0.5 / 1.5))  # population std of [2, 1] over its mean
    torch.testing.assert_close(s["tokens_dropped"], torch.tensor(1 / 4))  # of the 4 real tokens, token 2
