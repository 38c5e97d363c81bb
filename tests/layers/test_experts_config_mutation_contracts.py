"""Contracts of StackedExperts, the grouped-matmul wrapper and MoEConfig that mutation testing found unguarded.

Each test checks behaviour against an independent truth (nn.Linear's documented initialisation
bounds, the per-expert definition of a (gated) expert, the dtype policy, the probe's documented
verdicts, the config's documented validation); see its docstring for what it guards.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from routelab.layers import MoE, MoEConfig, StackedExperts, _grouped
from routelab.layers._grouped import grouped_mm_supported

CPU = torch.device("cpu")
needs_grouped = pytest.mark.skipif(not grouped_mm_supported(CPU, torch.float32, (16, 32)),
                                   reason="torch's grouped matmul does not run on this CPU build")


def _grouped_layout(sizes: list[int], extra: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``offsets`` (int32 cumulative sizes) and ``expert_of_row`` (``E`` for the ``extra`` rows of no expert)."""
    offsets = torch.tensor(sizes).cumsum(0).to(torch.int32)
    expert_of_row = torch.cat([torch.full((n,), e) for e, n in enumerate(sizes)] + [torch.full((extra,), len(sizes))])
    return offsets, expert_of_row.long()


def test_each_stacked_weight_is_initialised_within_its_own_fan_in_bound() -> None:
    """reset_parameters: like nn.Linear, w1/b1 and w3/b3 are uniform in +-1/sqrt(d_model) and w2/b2 in
    +-1/sqrt(d_hidden) (the fan-in of each layer). With d_model != d_hidden a wrong fan-in is visible:
    the largest |w| of a few thousand uniform draws lies within 10% of the bound."""
    torch.manual_seed(0)
    d_model, d_hidden = 64, 4
    experts = StackedExperts(d_model, d_hidden, 16, activation="swiglu", bias=True)
    for name, fan_in in (("w1", d_model), ("b1", d_model), ("w3", d_model), ("b3", d_model),
                         ("w2", d_hidden), ("b2", d_hidden)):
        t = getattr(experts, name).detach()
        bound = 1.0 / math.sqrt(fan_in)
        assert t.abs().max() <= bound, name
        if t.numel() >= 1000:
            assert t.abs().max() >= 0.9 * bound, name
        assert t.abs().mean() == pytest.approx(bound / 2, rel=0.25), name  # E|U(-b, b)| = b / 2


def test_from_hf_fused_takes_the_gate_from_the_first_half() -> None:
    """from_hf_fused: transformers' ``gate, up = (x @ gate_up_proj[e].T).chunk(2)`` puts the gate (the
    activated branch) first; swapping the halves computes silu(up) * gate, another function."""
    torch.manual_seed(0)
    E, hidden, d = 3, 5, 4
    gate_up, down = torch.randn(E, 2 * hidden, d), torch.randn(E, d, hidden)
    experts = StackedExperts.from_hf_fused(gate_up, down)
    x = torch.randn(E, 6, d)
    want = torch.stack([(F.silu((x[e] @ gate_up[e].T).chunk(2, -1)[0]) * (x[e] @ gate_up[e].T).chunk(2, -1)[1])
                        @ down[e].T for e in range(E)])
    torch.testing.assert_close(experts(x), want, rtol=1e-5, atol=1e-5)
    assert experts.w1.data_ptr() != gate_up.data_ptr()


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_buffers_forward_returns_the_inputs_dtype(dtype: torch.dtype) -> None:
    """The dtype policy: buffers of any floating dtype are computed in the parameters' dtype (float32)
    and returned in their own dtype, with the float32 computation's values."""
    torch.manual_seed(0)
    experts = StackedExperts(8, 12, 3, activation="swiglu")
    x = torch.randn(3, 5, 8).to(dtype)
    y = experts(x)
    assert y.dtype == dtype
    torch.testing.assert_close(y, experts(x.float()).to(dtype))


def test_expert_alone_equals_the_batched_experts_with_gated_biases() -> None:
    """expert(e, x) (the per-expert reference) includes every bias of a gated expert, b3 of the up
    branch too: it equals experts(buffers)[e] and the GLU definition with biases."""
    torch.manual_seed(0)
    experts = StackedExperts(5, 7, 3, activation="gelu", gated=True, bias=True)
    x = torch.randn(3, 4, 5)
    batched = experts(x)
    for e in range(3):
        want = (F.gelu(x[e] @ experts.w1[e] + experts.b1[e, 0]) * (x[e] @ experts.w3[e] + experts.b3[e, 0])) \
            @ experts.w2[e] + experts.b2[e, 0]
        torch.testing.assert_close(experts.expert(e, x[e]), want)
        torch.testing.assert_close(experts.expert(e, x[e]), batched[e])


@needs_grouped
@pytest.mark.parametrize("gated", [False, True])
def test_grouped_rows_get_their_own_experts_biases(gated: bool) -> None:
    """forward_grouped with biases equals expert(e, rows of e) for every expert, an empty one
    included, and does not touch the rows of no expert's neighbours (biases not shifted)."""
    torch.manual_seed(0)
    experts = StackedExperts(16, 32, 4, activation="silu", gated=gated, bias=True)
    with torch.no_grad():
        for b in (experts.b1, experts.b2, experts.b3):
            if b is not None:
                b.copy_(torch.arange(4.0).view(4, 1, 1) * 3 + torch.randn_like(b))  # biases differ by expert
    sizes = [3, 0, 5, 2]
    offsets, expert_of_row = _grouped_layout(sizes, extra=2)
    rows = torch.randn(sum(sizes) + 2, 16)
    y = experts(rows, offsets=offsets, expert_of_row=expert_of_row)
    start = 0
    for e, n in enumerate(sizes):
        torch.testing.assert_close(y[start:start + n], experts.expert(e, rows[start:start + n]), rtol=1e-5, atol=1e-5)
        start += n


@needs_grouped
def test_grouped_forward_returns_the_rows_dtype() -> None:
    """The dtype policy on the grouped layout: float64 rows are computed in float32 and returned in
    float64."""
    torch.manual_seed(0)
    experts = StackedExperts(16, 32, 2)
    offsets, expert_of_row = _grouped_layout([2, 3], extra=0)
    rows = torch.randn(5, 16, dtype=torch.float64)
    y = experts(rows, offsets=offsets, expert_of_row=expert_of_row)
    assert y.dtype == torch.float64
    torch.testing.assert_close(y, experts(rows.float(), offsets=offsets, expert_of_row=expert_of_row).double())


def test_only_one_of_offsets_and_expert_of_row_is_a_clear_error() -> None:
    """forward: the grouped layout needs offsets and expert_of_row together; one alone is refused
    with that message (not taken for buffers and refused for their shape)."""
    experts = StackedExperts(16, 32, 2)
    offsets, expert_of_row = _grouped_layout([2, 3], extra=0)
    rows = torch.randn(5, 16)
    with pytest.raises(ValueError, match="offsets and expert_of_row together"):
        experts(rows, offsets=offsets)
    with pytest.raises(ValueError, match="offsets and expert_of_row together"):
        experts(rows, expert_of_row=expert_of_row)


def test_a_callable_activation_with_gated_true_builds_gated_experts() -> None:
    """resolve_activation: a callable keeps the ``gated`` flag (gated=True with F.silu is SwiGLU)."""
    torch.manual_seed(0)
    experts = StackedExperts(4, 6, 2, activation=F.silu, gated=True, bias=False)
    assert experts.gated and experts.w3 is not None
    x = torch.randn(2, 3, 4)
    want = torch.stack([(F.silu(x[e] @ experts.w1[e]) * (x[e] @ experts.w3[e])) @ experts.w2[e] for e in range(2)])
    torch.testing.assert_close(experts(x), want)
    assert MoEConfig(4, 6, 2, activation=F.silu, gated=True).gated
    assert not StackedExperts(4, 6, 2, activation=F.silu).gated


def _misaligned_copy(t: torch.Tensor) -> nn.Parameter:
    """``t``'s values in storage that starts 4 bytes past a 16-byte boundary (as memory-mapped weights may)."""
    base = torch.empty(t.numel() + 4, dtype=t.dtype)
    offset = next(i for i in range(1, 4) if (base.data_ptr() + i * t.element_size()) % 16)
    view = base[offset:offset + t.numel()].view_as(t)
    view.copy_(t.detach())
    return nn.Parameter(view)


@needs_grouped
@pytest.mark.parametrize("name", ["w1", "w2", "w3"])
def test_a_misaligned_weight_of_any_layer_refuses_grouped(name: str) -> None:
    """grouped_unsupported_reason checks the storage alignment of every stacked weight, the gated
    experts' w3 included: one misaligned weight means the buffers layout, with that reason."""
    experts = StackedExperts(16, 32, 4, activation="swiglu")
    assert experts.grouped_supported(CPU)
    setattr(experts, name, _misaligned_copy(getattr(experts, name)))
    assert getattr(experts, name).data_ptr() % 16
    assert not experts.grouped_supported(CPU)
    assert "storage must start at a multiple of 16 bytes" in experts.grouped_unsupported_reason(CPU)


def test_the_probe_verdict_is_kept_per_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe's cache is per device and dtype: float32 running grouped on the CPU says nothing of
    float64 (which torch's CPU kernel refuses), in either order of first use."""
    f32, f64 = _grouped._probe(CPU, torch.float32), _grouped._probe(CPU, torch.float64)  # uncached truths
    if f32 is not None or f64 is None:
        pytest.skip("needs float32 grouped and float64 refused on this CPU build")
    monkeypatch.setattr(_grouped, "_PROBED", {})
    assert _grouped.grouped_mm_unsupported_reason(CPU, torch.float32, (16, 16)) is None
    assert _grouped.grouped_mm_unsupported_reason(CPU, torch.float64, (16, 16)) == f64
    monkeypatch.setattr(_grouped, "_PROBED", {})
    assert _grouped.grouped_mm_unsupported_reason(CPU, torch.float64, (16, 16)) == f64
    assert _grouped.grouped_mm_unsupported_reason(CPU, torch.float32, (16, 16)) is None
    assert _grouped.grouped_mm_unsupported_reason(CPU, torch.float64, (16, 16)) == f64


def test_the_probe_refuses_a_grouped_matmul_that_computes_the_wrong_product(monkeypatch: pytest.MonkeyPatch) -> None:
    """_probe compares the grouped product with per-group matmuls: an operator that multiplies every
    row by the first group's weight is refused as a mismatch, one that raises with its own message,
    and grouped_mm_supported then says no (the experts fall back to buffers)."""
    def first_weight_only(rows: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        return rows @ weight[0]

    def raising(rows: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("no kernel for this\nsecond line")

    monkeypatch.setattr(_grouped, "_OPERATOR", first_weight_only)
    reason = _grouped._probe(CPU, torch.float32)
    assert reason is not None and reason.startswith("a tiny grouped product did not match per-expert matmuls on cpu")
    monkeypatch.setattr(_grouped, "_PROBED", {})
    assert not _grouped.grouped_mm_supported(CPU, torch.float32, (16, 16))
    monkeypatch.setattr(_grouped, "_OPERATOR", raising)
    assert _grouped._probe(CPU, torch.float32).endswith(": no kernel for this")


def test_under_compile_bfloat16_keeps_the_probes_negative_verdict(monkeypatch: pytest.MonkeyPatch) -> None:
    """While torch.compile traces, bfloat16 answers with the probe's earlier verdict (a no stays a
    no); other dtypes are refused naming torch.compile."""
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    monkeypatch.setattr(_grouped, "_PROBED", {("cpu", None, torch.bfloat16): "the probe said no"})
    assert _grouped.grouped_mm_unsupported_reason(CPU, torch.bfloat16, (16, 16)) == "the probe said no"
    assert "under torch.compile only bfloat16" in _grouped.grouped_mm_unsupported_reason(CPU, torch.float32, (16, 16))
    monkeypatch.setattr(_grouped, "_PROBED", {("cpu", None, torch.bfloat16): None})
    assert _grouped.grouped_mm_unsupported_reason(CPU, torch.bfloat16, (16, 16)) is None


def test_a_tensor_without_readable_storage_counts_as_misaligned() -> None:
    """Inside torch.func transforms a tensor's storage cannot be read: _misaligned says True there
    (grouped_mm_supported then says no and the buffers layout is used), and reads real storage
    outside."""
    seen = []

    def f(x: torch.Tensor) -> torch.Tensor:
        seen.append(_grouped._misaligned(x))
        seen.append(grouped_mm_supported(CPU, torch.float32, (16, 16), [x]))
        return x.sum()

    torch.func.grad(f)(torch.randn(16))
    assert seen == [True, False]
    assert not _grouped._misaligned(torch.empty(16))  # a fresh allocation is aligned


def test_replace_with_a_router_instance_drops_k_and_router_kwargs() -> None:
    """replace(router=instance) on a config with a router name drops its k and router_kwargs (they
    configure routers built by name) instead of refusing them."""
    config = MoEConfig(8, 16, 4, router="topk", k=2, router_kwargs={"renormalize": True})
    router = MoE(8, 16, 4, router="topk", k=1).router
    replaced = config.replace(router=router)
    assert replaced.router is router and replaced.k is None and replaced.router_kwargs is None
    assert MoEConfig(8, 16, 4, router=router).replace(d_hidden=32).d_hidden == 32
    with pytest.raises(ValueError, match="pass k and router_kwargs only with a router name"):
        config.replace(router=router, k=2)


def test_config_normalises_numpy_k_and_flags_to_python_types() -> None:
    """k given as a NumPy integer is kept as a Python int, NumPy bools as Python bools (a config is
    compared, hashed and serialised by its fields)."""
    config = MoEConfig(8, 16, 4, router="topk", k=np.int64(2), bias=np.bool_(False),
                       importance_weighting=np.bool_(True))
    assert type(config.k) is int and config.k == 2
    assert config.bias is False and config.importance_weighting is True
    assert config == MoEConfig(8, 16, 4, router="topk", k=2, bias=False, importance_weighting=True)


def test_config_refuses_non_flag_check_finite_and_bias() -> None:
    """check_finite is True, False or None; bias is True or False: 1, 0 or a string are refused
    naming the field (bool("False") is True)."""
    for bad in (1, 0, "False"):
        with pytest.raises(ValueError, match="check_finite must be True, False or None"):
            MoEConfig(8, 16, 4, check_finite=bad)
        with pytest.raises(TypeError, match="bias must be True or False"):
            MoEConfig(8, 16, 4, bias=bad)
    assert MoEConfig(8, 16, 4, check_finite=None).check_finite is None


@pytest.mark.parametrize("activation", ["swiglu", "geglu", "reglu"])
def test_a_gated_activation_name_makes_the_config_gated(activation: str) -> None:
    """A gated name implies gated=True in the config itself, so a layer built from it, and from its
    replace() and layer_kwargs() round trips, has gated experts."""
    config = MoEConfig(8, 16, 4, activation=activation, bias=False)
    assert config.gated is True
    assert config.replace(d_hidden=32).gated is True
    assert MoEConfig(**config.layer_kwargs()) == config
    moe = MoE.from_config(config)
    assert moe.experts.gated and moe.experts.w3 is not None


def test_check_finite_takes_a_numpy_bool_as_every_flag_does() -> None:
    """``MoEConfig(check_finite=np.bool_(False))`` is a flag as ``bias=np.bool_(False)`` is (it raised,
    found by the mutation review); stored as a Python bool; anything else is refused as a type error
    that is also a ValueError."""
    from routelab._checks import ArgumentTypeError

    cfg = MoEConfig(8, 16, 4, check_finite=np.bool_(False), bias=np.bool_(False))
    assert cfg.check_finite is False and cfg.bias is False
    with pytest.raises(ArgumentTypeError, match="check_finite must be True, False or None, got 'no'"):
        MoEConfig(8, 16, 4, check_finite="no")


def test_one_expert_alone_casts_as_forward_does() -> None:
    """``StackedExperts.expert(e, x)`` computes in the parameters' dtype and returns ``x``'s (a float64
    ``x`` against float32 weights raised a dtype error while ``forward`` casts it)."""
    torch.manual_seed(0)
    experts = StackedExperts(8, 16, 3)
    x = torch.randn(5, 8, dtype=torch.float64)
    got = experts.expert(1, x)
    assert got.dtype == torch.float64
    buffers = torch.zeros(3, 5, 8, dtype=torch.float64)
    buffers[1] = x
    torch.testing.assert_close(got, experts(buffers)[1], rtol=1e-5, atol=1e-6)  # (matmul vs bmm rounding)
