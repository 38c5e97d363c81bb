"""Contracts of :class:`routelab.Routes` that mutation testing of ``routes.py`` found unguarded.

Each test checks one documented behaviour against an independent truth (a hand-computed value, a
documented dtype/device, an autograd identity or a documented error) so that a small change to
``src/routelab/routes.py`` that breaks it is caught.
"""

from __future__ import annotations

import pytest
import torch

from routelab import Routes


def _fields(shape: tuple[int, ...] = (3, 2)) -> dict[str, torch.Tensor]:
    return {
        "expert": torch.zeros(shape, dtype=torch.long),
        "gate": torch.ones(shape),
        "keep": torch.ones(shape, dtype=torch.bool),
        "weight": torch.ones(shape),
        "log_prob": torch.zeros(shape),
    }


# ---------------------------------------------------------------- validation of stats


def test_stats_values_must_be_tensors() -> None:
    """``stats`` is validated like ``aux``: a non-tensor value (or a non-dict) is a TypeError naming it."""
    with pytest.raises(TypeError, match=r"Routes\.stats\['load'\] must be a torch\.Tensor, got int"):
        Routes(**_fields(), stats={"load": 3})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match=r"Routes\.stats must be a dict\[str, Tensor\], got list"):
        Routes(**_fields(), stats=[torch.tensor(1.0)])  # type: ignore[arg-type]


# ---------------------------------------------------------------- from_expert


def test_from_expert_rejects_bool_masks() -> None:
    """A boolean mask is not a tensor of expert indices: ``from_expert`` refuses it rather than casting to 0/1."""
    with pytest.raises(ValueError, match=r"integer tensor of expert indices, got dtype torch\.bool"):
        Routes.from_expert(torch.tensor([True, False, True]))


def test_from_expert_without_slot_dim_needs_two_dims() -> None:
    """With ``add_slot_dim=False`` a 1-D ``expert`` is refused by ``from_expert`` itself, with its own message."""
    with pytest.raises(ValueError, match=r"^expert must have shape \[\.\.\., tokens, slots\], got shape \(2,\)\.$"):
        Routes.from_expert(torch.tensor([0, 1]), add_slot_dim=False)
    # The same 1-D tensor is fine when a slot dim is added.
    assert Routes.from_expert(torch.tensor([0, 1])).expert.shape == (2, 1)


def test_from_expert_defaults_live_on_expert_device() -> None:
    """Every default (gate, keep, weight, log_prob) is created on ``expert``'s device (``meta`` here)."""
    r = Routes.from_expert(torch.zeros(4, dtype=torch.long, device="meta"))
    for name in ("expert", "gate", "keep", "weight", "log_prob"):
        assert getattr(r, name).device.type == "meta", name
    assert r.weight.dtype == torch.get_default_dtype() and r.keep.dtype == torch.bool


# ---------------------------------------------------------------- diagnostics


def test_tokens_per_expert_rejects_zero_experts_even_when_empty() -> None:
    """``num_experts < 1`` is a ValueError naming the argument, also for a record with no kept slot."""
    empty = Routes.from_expert(torch.zeros(0, dtype=torch.long))
    with pytest.raises(ValueError, match=r"num_experts must be >= 1, got 0"):
        empty.tokens_per_expert(0)
    full = Routes.from_expert(torch.tensor([0, 0]))
    with pytest.raises(ValueError, match=r"num_experts must be >= 1, got 0"):
        full.tokens_per_expert(0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
def test_dropped_fraction_is_float32_whatever_the_gate_dtype(dtype: torch.dtype) -> None:
    """``dropped_fraction`` is documented as float32, independent of the float dtype of the record."""
    keep = torch.tensor([[True, False, False], [True, True, True]])  # 2 of 6 dropped
    r = Routes.from_expert(
        torch.zeros(2, 3, dtype=torch.long), gate=torch.ones(2, 3, dtype=dtype), keep=keep, add_slot_dim=False
    )
    assert r.gate.dtype == dtype
    frac = r.dropped_fraction()
    assert frac.dtype == torch.float32
    assert frac.shape == ()
    assert float(frac) == pytest.approx(2 / 6)


# ---------------------------------------------------------------- movement


def test_to_moves_aux_and_stats_too() -> None:
    """``to(device)`` moves ``aux`` and ``stats`` along with the per-slot fields (``meta`` here)."""
    r = Routes(**_fields(), aux={"balance": torch.tensor(0.5)}, stats={"load": torch.tensor([3, 3])})
    moved = r.to("meta")
    assert moved.expert.device.type == "meta" and moved.gate.device.type == "meta"
    assert moved.aux["balance"].device.type == "meta"
    assert moved.stats["load"].device.type == "meta"
    assert moved.stats["load"].dtype == torch.long
    # The original is left where it was.
    assert r.aux["balance"].device.type == "cpu" and r.expert.device.type == "cpu"


def test_to_keeps_autograd_history() -> None:
    """``to`` is differentiable: gradients flow from the moved gate/log_prob back to the originals."""
    gate = torch.tensor([[0.25], [0.75]], requires_grad=True)
    log_prob = torch.tensor([[-1.0], [-2.0]], requires_grad=True)
    r = Routes.from_expert(torch.tensor([[0], [1]]), gate=gate, log_prob=log_prob, add_slot_dim=False)
    moved = r.to("cpu")
    assert moved.gate.requires_grad and moved.log_prob.requires_grad
    (moved.gate * torch.tensor([[2.0], [3.0]])).sum().add(moved.log_prob.sum()).backward()
    assert torch.equal(gate.grad, torch.tensor([[2.0], [3.0]]))
    assert torch.equal(log_prob.grad, torch.ones(2, 1))
