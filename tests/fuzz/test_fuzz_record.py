"""Fuzz tests of routelab.routing.load_stats (against loop references) and of the last-forward record
(RoutingRecord, aux_loss, routing_stats) over random module trees."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import routelab
import routelab.routing as R
from fuzz_strategies import fuzz, seeds

COVERED_ROUTING_RECORD = {"RoutingRecord", "aux_loss", "load_stats", "routing_stats"}


@fuzz(80)
@given(n=st.integers(0, 12), s=st.integers(1, 3), E=st.integers(1, 6), capacity=st.integers(0, 14),
       cand_p=st.sampled_from((0.0, 0.5, 1.0)), seed=seeds)
def test_load_stats(n, s, E, capacity, cand_p, seed) -> None:
    """Kept pairs per expert, dropped fraction, load CV and tokens without expert, by loops."""
    g = torch.Generator().manual_seed(seed)
    expert = torch.randint(0, E, (n, s), generator=g)
    candidate = torch.rand(n, s, generator=g) < cand_p
    decision = R.apply_capacity(expert, candidate, capacity, E)
    stats = R.load_stats(candidate, decision, capacity)
    kept = [0] * E
    for t in range(n):
        for j in range(s):
            if decision.keep[t, j]:
                assert candidate[t, j]
                kept[int(expert[t, j])] += 1
    assert stats["tokens_per_expert"].tolist() == kept
    proposed = int(candidate.sum())
    assert float(stats["dropped_fraction"]) == pytest.approx((proposed - sum(kept)) / max(proposed, 1))
    mean = sum(kept) / E
    cv = 0.0 if E == 1 else (sum((c - mean) ** 2 for c in kept) / E) ** 0.5 / max(mean, 1e-12)
    assert float(stats["load_cv"]) == pytest.approx(cv, rel=1e-5, abs=1e-6)
    none = sum(1 for t in range(n) if not bool(decision.keep[t].any()))
    assert float(stats["tokens_dropped"]) == pytest.approx(none / n if n else 0.0)
    assert int(stats["capacity"]) == capacity


class _Recorder(R.RoutingRecord, torch.nn.Module):
    def __init__(self, children: list[torch.nn.Module]) -> None:
        super().__init__()
        self.kids = torch.nn.ModuleList(children)


@fuzz(60)
@given(shape=st.lists(st.integers(0, 3), min_size=1, max_size=4), recorded=st.lists(st.booleans(), max_size=12),
       seed=seeds)
def test_aux_loss_and_routing_stats_over_module_trees(shape, recorded, seed) -> None:
    """aux_loss = the sum over recording modules of their last aux values; routing_stats names them."""
    g = torch.Generator().manual_seed(seed)
    modules: list[_Recorder] = []

    def build(depth: int) -> torch.nn.Module:
        kids = [build(depth + 1) for _ in range(shape[depth])] if depth < len(shape) - 1 else []
        m = _Recorder(kids) if len(modules) % 2 == 0 else torch.nn.Sequential(*kids)
        if isinstance(m, _Recorder):
            modules.append(m)
        else:
            modules.append(None)  # type: ignore[arg-type]
        return m

    root = build(0)
    recorders = [m for m in modules if m is not None]
    expected = torch.zeros(())
    names = set()
    by_module = {id(m): name for name, m in root.named_modules()}
    for i, m in enumerate(recorders):
        if i < len(recorded) and recorded[i]:
            for _ in range(2):  # only the last record counts
                aux = {"a": torch.randn((), generator=g), "b": torch.randn(3, generator=g)}
                m.record_routing(aux, {"tokens_per_expert": torch.arange(3)})
            expected = expected + aux["a"] + aux["b"].sum()
            names.add(by_module[id(m)])
    total = routelab.aux_loss(root)
    assert total.shape == () and torch.allclose(total, expected, atol=1e-5)
    assert set(routelab.routing_stats(root)) == names
