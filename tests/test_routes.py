"""Tests for routelab.Routes: validation, defaults, diagnostics."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from routelab import Routes


def make_routes(shape: tuple[int, ...] = (5, 2), num_experts: int = 3, seed: int = 0) -> Routes:
    g = torch.Generator().manual_seed(seed)
    return Routes(
        expert=torch.randint(0, num_experts, shape, generator=g),
        gate=torch.rand(shape, generator=g),
        keep=torch.rand(shape, generator=g) < 0.7,
        weight=torch.ones(shape),
        log_prob=torch.zeros(shape),
    )


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize("name", ["gate", "keep", "weight", "log_prob"])
def test_shape_mismatch_names_the_field(name: str) -> None:
    r = make_routes()
    kwargs = {f: getattr(r, f) for f in ("expert", "gate", "keep", "weight", "log_prob")}
    kwargs[name] = kwargs[name][:-1]  # one token short
    with pytest.raises(ValueError, match=rf"Routes\.{name} has shape"):
        Routes(**kwargs)


@pytest.mark.parametrize("name", ["gate", "keep", "weight", "log_prob"])
def test_device_mismatch_names_the_field(name: str) -> None:
    """A field on another device than ``expert`` (``meta``: another device on any machine)."""
    r = make_routes()
    kwargs = {f: getattr(r, f) for f in ("expert", "gate", "keep", "weight", "log_prob")}
    kwargs[name] = kwargs[name].to("meta")
    with pytest.raises(ValueError, match=rf"Routes\.{name} is on meta.*{name}\.to\(expert\.device\)"):
        Routes(**kwargs)


def test_expert_must_be_long() -> None:
    r = make_routes()
    with pytest.raises(ValueError, match=r"expert.*torch\.long.*expert\.long\(\)"):
        Routes(r.expert.int(), r.gate, r.keep, r.weight, r.log_prob)
    with pytest.raises(ValueError, match=r"expert.*torch\.long"):
        Routes(r.expert.float(), r.gate, r.keep, r.weight, r.log_prob)


def test_keep_must_be_bool() -> None:
    r = make_routes()
    with pytest.raises(ValueError, match=r"keep.*torch\.bool.*keep\.bool\(\)"):
        Routes(r.expert, r.gate, r.keep.long(), r.weight, r.log_prob)


@pytest.mark.parametrize("name", ["gate", "weight", "log_prob"])
def test_float_fields_must_be_floating(name: str) -> None:
    r = make_routes()
    kwargs = {f: getattr(r, f) for f in ("expert", "gate", "keep", "weight", "log_prob")}
    kwargs[name] = kwargs[name].long()
    with pytest.raises(ValueError, match=rf"Routes\.{name} must be a floating-point"):
        Routes(**kwargs)


def test_needs_a_slot_dim() -> None:
    e = torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match=r"at least 2 dims.*from_expert"):
        Routes(e, torch.ones(4), torch.ones(4, dtype=torch.bool), torch.ones(4), torch.zeros(4))


def test_non_tensor_and_bad_aux_are_rejected() -> None:
    r = make_routes()
    with pytest.raises(TypeError, match=r"Routes\.gate must be a torch\.Tensor"):
        Routes(r.expert, [[1.0]], r.keep, r.weight, r.log_prob)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"Routes\.aux\['balance'\]"):
        Routes(r.expert, r.gate, r.keep, r.weight, r.log_prob, aux={"balance": 1.0})  # type: ignore[dict-item]


# ---------------------------------------------------------------- from_expert


def test_from_expert_defaults() -> None:
    expert = torch.tensor([[0, 2, 1], [1, 1, 0]], dtype=torch.int32)  # [batch=2, tokens=3]
    r = Routes.from_expert(expert)
    assert r.expert.shape == (2, 3, 1)
    assert r.expert.dtype == torch.long
    assert torch.equal(r.expert[..., 0], expert.long())
    assert r.num_slots == 1 and r.num_tokens == 3 and r.batch_shape == (2,)
    assert torch.equal(r.gate, torch.ones(2, 3, 1))
    assert torch.equal(r.weight, torch.ones(2, 3, 1))
    assert torch.equal(r.log_prob, torch.zeros(2, 3, 1))
    assert r.keep.dtype == torch.bool and bool(r.keep.all())
    assert r.aux == {} and r.stats == {}


def test_from_expert_uses_given_fields_and_gate_dtype() -> None:
    expert = torch.tensor([2, 0])
    gate = torch.tensor([0.25, 0.75], dtype=torch.float64, requires_grad=True)
    keep = torch.tensor([True, False])
    r = Routes.from_expert(expert, gate=gate, keep=keep)
    assert r.gate.shape == (2, 1) and r.gate.requires_grad
    assert r.weight.dtype == torch.float64 and r.log_prob.dtype == torch.float64
    assert torch.equal(r.keep[:, 0], keep)


def test_from_expert_without_adding_slot_dim() -> None:
    expert = torch.tensor([[0, 1], [2, 0], [1, 2]])  # [tokens=3, slots=2]
    r = Routes.from_expert(expert, add_slot_dim=False)
    assert r.expert.shape == (3, 2) and r.num_slots == 2


def test_from_expert_rejects_scores() -> None:
    with pytest.raises(ValueError, match="integer tensor"):
        Routes.from_expert(torch.rand(4, 3))


# ---------------------------------------------------------------- diagnostics


def manual_counts(r: Routes, num_experts: int) -> torch.Tensor:
    rows = math.prod(r.batch_shape)
    flat_e = r.expert.reshape(rows, r.num_tokens, r.num_slots)
    flat_k = r.keep.reshape(flat_e.shape)
    out = torch.zeros(flat_e.shape[0], num_experts, dtype=torch.long)
    for b in range(flat_e.shape[0]):
        for t in range(r.num_tokens):
            for s in range(r.num_slots):
                if flat_k[b, t, s]:
                    out[b, flat_e[b, t, s]] += 1
    return out.reshape(*r.batch_shape, num_experts)


@settings(max_examples=40, deadline=None)
@given(
    batch=st.lists(st.integers(0, 3), max_size=2),
    tokens=st.integers(0, 7),
    slots=st.integers(1, 3),
    num_experts=st.integers(1, 5),
    seed=st.integers(0, 2**16),
)
def test_tokens_per_expert_matches_manual_count(
    batch: list[int], tokens: int, slots: int, num_experts: int, seed: int
) -> None:
    r = make_routes((*batch, tokens, slots), num_experts=num_experts, seed=seed)
    counts = r.tokens_per_expert(num_experts)
    assert counts.dtype == torch.long
    assert counts.shape == (*batch, num_experts)
    assert torch.equal(counts, manual_counts(r, num_experts))
    assert torch.equal(counts.sum(-1), r.keep.sum(dim=(-2, -1)))


def test_tokens_per_expert_ignores_dropped_out_of_range_slots() -> None:
    r = Routes.from_expert(torch.tensor([0, 7, 1]), keep=torch.tensor([True, False, True]))
    assert r.tokens_per_expert(2).tolist() == [1, 1]


def test_tokens_per_expert_rejects_kept_out_of_range() -> None:
    r = Routes.from_expert(torch.tensor([0, 3]))
    with pytest.raises(ValueError, match=r"\[0, 3\)"):
        r.tokens_per_expert(3)


def test_dropped_fraction() -> None:
    keep = torch.tensor([[[True, False], [True, True]], [[False, False], [True, True]]])
    r = Routes.from_expert(torch.zeros(2, 2, 2, dtype=torch.long), keep=keep, add_slot_dim=False)
    assert torch.allclose(r.dropped_fraction(), torch.tensor([0.25, 0.5]))
    empty = Routes.from_expert(torch.zeros(0, dtype=torch.long))
    assert float(empty.dropped_fraction()) == 0.0


def test_to_moves_everything_and_keeps_dtypes() -> None:
    r = make_routes()
    r.aux["balance"] = torch.tensor(0.5)
    r.stats["load"] = r.tokens_per_expert(3)
    moved = r.to("cpu")
    assert moved is not r
    assert moved.expert.dtype == torch.long and moved.keep.dtype == torch.bool
    assert torch.equal(moved.gate, r.gate)
    assert set(moved.aux) == {"balance"} and set(moved.stats) == {"load"}
    assert "tokens=5" in repr(moved)
