"""Contracts of the lines commit b84378d rewrote to save operators, against independent truth.

The commit folded eq. 3's two clamps into one, replaced ``full_like`` fill tensors by scalars in
``torch.where`` (apply_capacity, the dropless plan, DispatchPlan.build), wrote ``expert * C +
position`` as ``position.add(expert, alpha=C)``, computed the load CV with one ``std_mean``, moved
the Switch loss's ``1 / n`` into its scalar and stopped detaching statistics that have no graph.
Each test here checks one of those against a hand-computed value, a brute-force loop, numpy or
the paper's formula in float64.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from routelab.routing import (
    DispatchPlan,
    RoutingRecord,
    apply_capacity,
    load_stats,
    routing_stats,
    skip_correction,
    switch_balance,
)
from routelab.routing.dropless import decide_and_plan_dropless

# --------------------------------------------------------------------------- brute-force references


def _eq3(n: float, c: int) -> float:
    """Kool et al. eq. 3 by hand: ``n / min(n, C)``, 0 where ``n = 0``."""
    if n == 0:
        return 0.0
    return n / min(n, c)


def _brute_capacity(expert: torch.Tensor, candidate: torch.Tensor, capacity: int, num_experts: int):
    """apply_capacity's "position" policy by a loop: pairs in (slot, token) order, first come first kept."""
    n, s = expert.shape
    load = [0] * num_experts
    for j in range(s):
        for t in range(n):
            if candidate[t, j]:
                load[int(expert[t, j])] += 1
    seen = [0] * num_experts
    keep = torch.zeros(n, s, dtype=torch.bool)
    position = torch.full((n, s), -1, dtype=torch.long)
    skip = torch.zeros(n, s, dtype=torch.float64)
    for j in range(s):
        for t in range(n):
            if not candidate[t, j]:
                continue
            e = int(expert[t, j])
            rank = seen[e]
            seen[e] += 1
            position[t, j] = rank
            if rank < capacity:
                keep[t, j] = True
                skip[t, j] = _eq3(load[e], capacity)
    kept = [min(x, capacity) for x in load]
    return keep, position, torch.tensor(load), torch.tensor(kept), skip


def _random_pairs(seed: int, n: int, s: int, num_experts: int, p_candidate: float = 0.7):
    g = torch.Generator().manual_seed(seed)
    expert = torch.stack([torch.randperm(num_experts, generator=g)[:s] for _ in range(n)]) if n else \
        torch.zeros(0, s, dtype=torch.long)
    candidate = torch.rand(n, s, generator=g) < p_candidate
    return expert, candidate


# --------------------------------------------------------------------------- skip_correction (eq. 3)


@pytest.mark.parametrize("capacity", [1, 2, 3, 7])
def test_skip_correction_is_eq3_by_hand(capacity):
    """Guards the single clamp ``load.clamp(min=1, max=max(C, 1))``: n_z / min(n_z, C), 0 at n_z = 0,
    for C = 1 (where a bound of max(C, 2) would halve the factor) and larger C."""
    loads = [0.0, 1.0, 2.0, 3.0, 5.0, 8.0]
    got = skip_correction(torch.tensor(loads, dtype=torch.float64), capacity)
    expected = torch.tensor([_eq3(x, capacity) for x in loads], dtype=torch.float64)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_skip_correction_hand_values_at_c1_and_c3():
    """Hand-computed table (eq. 3): C = 1 -> n_z; C = 3 -> 1, 1, 1, 4/3, 5/3; n_z = 0 -> 0 (not 0/0)."""
    loads = torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0, 5.0])
    torch.testing.assert_close(skip_correction(loads, 1), torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0, 5.0]))
    torch.testing.assert_close(skip_correction(loads, 3), torch.tensor([0.0, 1.0, 1.0, 1.0, 4 / 3, 5 / 3]))


def test_skip_correction_at_zero_capacity_is_finite_and_zero_where_nothing_was_proposed():
    """At C = 0 nothing is kept and eq. 3 is moot, but the factor must stay finite (apply_capacity multiplies it
    by keep = 0, and inf * 0 is NaN): the floor max(min(n_z, C), 1) = 1 gives n_z, and 0 at n_z = 0."""
    loads = torch.tensor([0.0, 1.0, 2.0, 6.0])
    got = skip_correction(loads, 0)
    assert torch.isfinite(got).all(), got
    torch.testing.assert_close(got, loads)


# --------------------------------------------------------------------------- apply_capacity


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("capacity", [0, 1, 2, 3, 1000])
def test_apply_capacity_matches_a_brute_force_loop(seed, capacity):
    """Guards the non-candidates' group (``torch.where(flat_cand, flat_expert, E)``: a group after every
    expert, counted in no expert's load) and the skip weights, against a first-come loop in (slot, token)
    order; C = 0 must give zero (not NaN) skip weights."""
    n, s, E = 9, 2, 4
    expert, candidate = _random_pairs(seed, n, s, E)
    d = apply_capacity(expert, candidate, capacity, E)
    keep, position, load, kept, skip = _brute_capacity(expert, candidate, capacity, E)
    assert torch.equal(d.load, load)
    assert torch.equal(d.kept, kept)
    assert torch.equal(d.keep, keep)
    assert torch.equal(d.position[keep], position[keep])
    assert torch.isfinite(d.skip_weight).all()
    torch.testing.assert_close(d.skip_weight.double(), skip)


def test_apply_capacity_non_candidates_do_not_load_the_last_expert():
    """Hand case: every pair of the last expert is a non-candidate, so its load is 0, not the count of the
    non-candidates (which a fill value of E - 1 would give)."""
    expert = torch.tensor([[0, 2], [1, 2], [0, 2]])
    candidate = torch.tensor([[True, False], [True, False], [True, False]])
    d = apply_capacity(expert, candidate, 1, 3)
    assert d.load.tolist() == [2, 1, 0]
    assert d.kept.tolist() == [1, 1, 0]
    assert d.keep.tolist() == [[True, False], [True, False], [False, False]]
    assert d.skip_weight.tolist() == [[2.0, 0.0], [1.0, 0.0], [0.0, 0.0]]


# --------------------------------------------------------------------------- dropless decision and plan


@pytest.mark.parametrize("seed", range(4))
def test_dropless_plan_matches_a_brute_force_grouping(seed):
    """Guards decide_and_plan_dropless's ``torch.where(flat_cand, flat_expert, E)`` and ``row_of_slot``'s fill
    ``rows`` (the zero row R = n * s for non-candidates), against a loop that sorts the candidate pairs by
    expert in (slot, token) order."""
    n, s, E = 7, 2, 3
    expert, candidate = _random_pairs(seed, n, s, E, p_candidate=0.6)
    decision, plan = decide_and_plan_dropless(expert, candidate, E)
    rows = n * s
    _, position, load, _, _ = _brute_capacity(expert, candidate, rows, E)
    assert torch.equal(decision.load, load)
    assert torch.equal(decision.kept, load)
    assert torch.equal(decision.keep, candidate)
    assert torch.equal(decision.position[candidate], position[candidate])
    assert torch.equal(decision.skip_weight, candidate.float())
    starts = [0] * E
    for e in range(1, E):
        starts[e] = starts[e - 1] + int(load[e - 1])
    total = int(load.sum())
    assert plan.offsets.tolist() == [starts[e] + int(load[e]) for e in range(E)]
    want_row = torch.full((n, s), rows, dtype=torch.long)
    want_token = torch.full((rows,), n, dtype=torch.long)
    want_expert = torch.full((rows,), E, dtype=torch.long)
    for t in range(n):
        for j in range(s):
            if candidate[t, j]:
                e = int(expert[t, j])
                r = starts[e] + int(position[t, j])
                want_row[t, j] = r
                want_token[r] = t
                want_expert[r] = e
    assert torch.equal(plan.row_of_slot, want_row)
    assert torch.equal(plan.token_of_row, want_token)
    assert torch.equal(plan.expert_of_row, want_expert)
    assert torch.equal(plan.expert_of_row[total:], torch.full((rows - total,), E))


def test_dropless_non_candidates_take_no_expert_row():
    """Hand case: the last expert has only non-candidate pairs: its load is 0 and those pairs sit in the zero
    row R = n * s, not in a row of the last expert nor in row R - 1."""
    expert = torch.tensor([[0, 2], [1, 2]])
    candidate = torch.tensor([[True, False], [True, False]])
    decision, plan = decide_and_plan_dropless(expert, candidate, 3)
    assert decision.load.tolist() == [1, 1, 0]
    assert plan.offsets.tolist() == [1, 2, 2]
    assert plan.row_of_slot.tolist() == [[0, 4], [1, 4]]
    assert plan.token_of_row.tolist() == [0, 1, 2, 2]
    assert plan.expert_of_row.tolist() == [0, 1, 3, 3]


# --------------------------------------------------------------------------- DispatchPlan.build


@pytest.mark.parametrize("seed", range(3))
def test_dispatch_plan_rows_are_expert_times_capacity_plus_position(seed):
    """Guards ``position.add(expert, alpha=C)`` = ``expert * C + position`` and the fill ``E * C`` (the zero row)
    of dropped pairs, against a loop, at E = 3, C = 2 (where expert + C * position differs)."""
    n, s, E, C = 8, 2, 3, 2
    expert, candidate = _random_pairs(seed, n, s, E)
    d = apply_capacity(expert, candidate, C, E)
    plan = DispatchPlan.build(expert, d.keep, d.position, E, C)
    want_row = torch.full((n, s), E * C, dtype=torch.long)
    want_token = torch.full((E * C,), n, dtype=torch.long)
    for t in range(n):
        for j in range(s):
            if d.keep[t, j]:
                r = int(expert[t, j]) * C + int(d.position[t, j])
                want_row[t, j] = r
                want_token[r] = t
    assert torch.equal(plan.row_of_slot, want_row)
    assert torch.equal(plan.token_of_row, want_token)


def test_dispatch_plan_hand_rows():
    """Hand case: E = 2, C = 3; kept (expert, position) = (1, 0), (0, 2), (1, 2); one dropped pair -> row 6."""
    expert = torch.tensor([[1], [0], [1], [0]])
    keep = torch.tensor([[True], [True], [True], [False]])
    position = torch.tensor([[0], [2], [2], [0]])
    plan = DispatchPlan.build(expert, keep, position, 2, 3)
    assert plan.row_of_slot.tolist() == [[3], [2], [5], [6]]
    assert plan.token_of_row.tolist() == [4, 4, 1, 0, 4, 2]


@pytest.mark.parametrize("bad", [5, -1])
def test_dispatch_plan_out_of_range_kept_expert_is_a_value_error(bad):
    """Guards ``torch.where(placed, ...)``: a kept pair with an expert outside [0, E) must reach the
    documented ValueError naming it, not fail inside the scatter with an index error."""
    expert = torch.tensor([[0], [bad]])
    keep = torch.tensor([[True], [True]])
    position = torch.tensor([[0], [1]])
    with pytest.raises(ValueError, match=r"expert\[1, 0\] = .* outside \[0, num_experts=3\)"):
        DispatchPlan.build(expert, keep, position, 3, 2)


# --------------------------------------------------------------------------- load_stats (load CV)


def _decision_with_kept(kept: list[int]):
    """A decision whose kept load per expert is ``kept`` (one slot, no drops)."""
    ex = [e for e, c in enumerate(kept) for _ in range(c)]
    n = len(ex)
    expert = torch.tensor(ex, dtype=torch.long).reshape(n, 1)
    candidate = torch.ones(n, 1, dtype=torch.bool)
    return candidate, apply_capacity(expert, candidate, max(n, 1), len(kept))


@pytest.mark.parametrize("kept", [[0, 0, 1], [3, 1, 0, 4], [2, 2, 2], [5, 0], [1, 0, 0, 0, 0, 0, 0, 9]])
def test_load_cv_is_numpys_population_std_over_mean(kept):
    """Guards ``torch.std_mean(kept, correction=0)`` and the 1e-12 floor of the mean: the CV is numpy's population
    std (ddof=0) over the mean, also where the mean is below 1 ([0, 0, 1]: sqrt(2)), where a floor of 1 is wrong."""
    proposed, d = _decision_with_kept(kept)
    stats = load_stats(proposed, d, max(sum(kept), 1))
    x = np.asarray(kept, dtype=np.float64)
    expected = x.std(ddof=0) / x.mean()
    assert math.isclose(float(stats["load_cv"]), expected, rel_tol=1e-6), (float(stats["load_cv"]), expected)
    assert stats["load_cv"].shape == ()


def test_load_cv_hand_value_below_unit_mean():
    """Hand value: loads [0, 0, 1] have mean 1/3 and population std sqrt(2)/3, so the CV is sqrt(2)."""
    proposed, d = _decision_with_kept([0, 0, 1])
    assert math.isclose(float(load_stats(proposed, d, 1)["load_cv"]), math.sqrt(2), rel_tol=1e-6)


def test_load_cv_is_zero_without_load_and_with_one_expert():
    """0 (finite) when no pair is kept (mean 0) and with a single expert."""
    expert = torch.tensor([[0], [1]])
    candidate = torch.zeros(2, 1, dtype=torch.bool)
    d = apply_capacity(expert, candidate, 2, 2)
    assert float(load_stats(candidate, d, 2)["load_cv"]) == 0.0
    proposed, d1 = _decision_with_kept([4])
    assert float(load_stats(proposed, d1, 4)["load_cv"]) == 0.0


# --------------------------------------------------------------------------- switch_balance


def _switch_reference(probs: torch.Tensor) -> np.ndarray:
    """Fedus et al. eq. 4 in float64 by loops: E * sum_e f_e P_e, f_e = argmax fraction, P_e = mean prob."""
    p = probs.detach().double().numpy()
    *batch, n, E = p.shape
    flat = p.reshape(-1, n, E)
    out = []
    for b in range(flat.shape[0]):
        f = np.zeros(E)
        for t in range(n):
            f[int(np.argmax(flat[b, t]))] += 1.0 / n
        P = flat[b].mean(0)
        out.append(E * float((f * P).sum()))
    return np.asarray(out).reshape(batch)


@pytest.mark.parametrize("shape", [(5, 4), (3, 7, 5), (2, 2, 16, 3)])
def test_switch_balance_is_eq4_in_float64(shape):
    """Guards the folded scalar ``(counts * P).sum(-1) * (E / n)``: equal to E * sum_e (counts_e / n) P_e by a loop."""
    g = torch.Generator().manual_seed(len(shape))
    probs = torch.randn(*shape, generator=g, dtype=torch.float64).softmax(-1)
    got = switch_balance(probs)
    np.testing.assert_allclose(got.numpy(), _switch_reference(probs), rtol=1e-12, atol=0)


def test_switch_balance_gradient_is_e_counts_over_n_squared():
    """d loss / d p[t, e] = E * counts_e / n**2 (argmax counts are constants): P_e must stay differentiable."""
    g = torch.Generator().manual_seed(1)
    n, E = 6, 4
    probs = torch.randn(n, E, generator=g, dtype=torch.float64).softmax(-1).requires_grad_()
    (grad,) = torch.autograd.grad(switch_balance(probs), probs)
    counts = torch.bincount(probs.detach().argmax(-1), minlength=E).double()
    torch.testing.assert_close(grad, (E * counts / n**2).expand(n, E))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_switch_balance_keeps_the_probabilities_dtype(dtype):
    """The loss is in the router probabilities' dtype (the counts are made in that dtype), not promoted."""
    probs = torch.randn(8, 4, generator=torch.Generator().manual_seed(2)).softmax(-1).to(dtype)
    loss = switch_balance(probs)
    assert loss.dtype == dtype
    np.testing.assert_allclose(float(loss), float(_switch_reference(probs)), rtol=2e-2)


# --------------------------------------------------------------------------- record_routing


class _Recorder(RoutingRecord, nn.Module):
    pass


def test_recorded_stats_are_detached_and_equal():
    """Guards ``value.detach() if value.requires_grad else value``: a statistic with a graph is recorded detached
    (routing_stats documents detached tensors), one without is recorded with its value unchanged."""
    m = _Recorder()
    w = torch.ones(3, requires_grad=True)
    with_graph = w * 2
    plain = torch.tensor([1.0, 2.0])
    m.record_routing({}, {"g": with_graph, "p": plain})
    stats = routing_stats(m)[""]
    assert not stats["g"].requires_grad and stats["g"].grad_fn is None
    assert torch.equal(stats["g"], torch.full((3,), 2.0))
    assert not stats["p"].requires_grad
    assert torch.equal(stats["p"], torch.tensor([1.0, 2.0]))


def test_the_record_does_not_alias_the_callers_mapping():
    """The record holds its own mapping: the caller changing its dict after the call (no statistic has a graph)
    changes neither last_stats nor routing_stats."""
    m = _Recorder()
    stats = {"load_cv": torch.tensor(0.5), "tokens_per_expert": torch.tensor([1, 2])}
    m.record_routing({}, stats)
    stats["load_cv"] = torch.tensor(9.0)
    stats["extra"] = torch.tensor(1.0)
    del stats["tokens_per_expert"]
    got = m.last_stats
    assert set(got) == {"load_cv", "tokens_per_expert"}
    assert float(got["load_cv"]) == 0.5
    assert set(routing_stats(m)[""]) == {"load_cv", "tokens_per_expert"}
