"""Host syncs of the MoE layer's training step, counted on the CPU (CI has no GPU).

A host sync stops a step from being captured in a CUDA graph and makes an eager layer wait for its
GPU. ``tests/host_syncs.py`` finds the operations that sync on CUDA on any device, so the README's
promises are checked here on every run: with ``check_finite=False`` a top-k, Switch, noisy top-k,
softmax or batchwise layer with a capacity factor (and the first four dropless on the grouped
layout) makes none in forward + backward; the default checks cost two, a token mask one, dropless
buffers one. Both gather paths are covered: the CPU's default and the adjoint gathers that GPUs use.
The real CUDA check (``torch.cuda.set_sync_debug_mode``) is in test_moe_dispatch.py.
"""

from __future__ import annotations

import pytest
import torch

import routelab.routing._gather as gather
from host_syncs import record_host_syncs
from routelab.layers import MoE

D, H, E, N = 32, 64, 8, 64

SYNC_FREE_ROUTERS = [("topk", {"k": 2}), ("switch", {}), ("noisy_topk", {"k": 2}), ("softmax", {}),
                     ("batchwise", {"k": 2})]


@pytest.fixture(params=["cpu gathers", "gpu gathers"])
def gather_path(request, monkeypatch) -> str:
    if request.param == "gpu gathers":
        monkeypatch.setattr(gather, "_adjoint_by_default", lambda t: True)
    return request.param


def _step_syncs(moe: MoE, mask: torch.Tensor | None = None) -> list:
    """The host syncs of one forward + backward, after a warm-up step (which may probe once)."""
    x = torch.randn(N, D, generator=torch.Generator().manual_seed(0), requires_grad=True)
    moe(x, mask)[0].sum().backward()
    with record_host_syncs() as found:
        y, _ = moe(x, mask)
        y.backward(torch.ones_like(y))
    return found


def test_the_recorder_sees_what_syncs_on_cuda_and_nothing_else() -> None:
    t = torch.tensor([0.0, 1.0, 2.0])
    with record_host_syncs() as found:
        (t * 2 + 1).sort()
        t.topk(2)
        torch.zeros(3).scatter_add_(0, torch.tensor([0, 0, 2]), t)
    assert found == []
    with record_host_syncs() as found:
        t.sum().item()
        bool(t.any())
        t.nonzero()
        t[t > 0]
        t.masked_select(t > 0)
        torch.allclose(t, t)
        t.tolist()
        t.cpu()
        t.to("cpu")
        t.to(torch.float64)  # not a copy to the host
    assert [s.op.split(".")[0] if s.op.startswith("aten") else s.op for s in found] == [
        "aten", "aten", "aten", "aten", "aten", "aten", "Tensor.tolist", "Tensor.cpu", "Tensor.to(cpu)"]
    assert all("test_host_syncs.py" in s.where for s in found)


def test_the_recorder_sees_copies_of_host_data_to_the_device() -> None:
    """``torch.tensor(3.14, device="cuda")`` waits for the stream (pytorch#190217); a fill does not.
    On the CPU a ``device=`` argument is taken as the caller's device (a GPU's in a GPU run) unless
    it is the literal ``"cpu"``."""
    t = torch.tensor([0.0, 1.0, 2.0])
    with record_host_syncs() as found:
        torch.full((), 3.0, device=t.device)
        t.new_full((), 3.0)
        torch.tensor(3.0)  # (stays on the host: no device named)
        torch.tensor([1, 2], device="cpu")
        torch.as_tensor(t, device=t.device)  # (a tensor already: no host data)
    assert found == []
    with record_host_syncs() as found:
        torch.tensor(3.0, device=t.device)
        torch.as_tensor([1.0, 2.0], dtype=torch.float32, device=t.device)
        t.new_tensor(2.0)
    assert [s.op for s in found] == ["torch.tensor(host data, device=)", "torch.as_tensor(host data, device=)",
                                     "Tensor.new_tensor(host data)"]
    assert torch.tensor is not None and torch.tensor(1.0).item() == 1.0  # the factories are restored


def test_the_recorder_sees_host_data_moved_to_the_device_in_a_second_step() -> None:
    """``torch.from_numpy(a).to(d)`` and ``torch.tensor(data).to(d)`` are the same blocking copy as
    ``torch.tensor(data, device=d)``; a dtype-only ``.to`` keeps the data on the host (still
    watched), ``non_blocking=True`` (from pinned memory) is no wait; the result of an operator on
    host data alone is host data, one with a tensor made on the device among its inputs is not."""
    import numpy as np

    device = torch.zeros(1).device
    with record_host_syncs() as found:
        torch.from_numpy(np.zeros(3)).to(device)
        torch.tensor([1, 2]).to(torch.float64).to(dtype=torch.float32).to(device=device)
        torch.as_tensor(np.ones(2)).to(device, torch.float32)
        torch.from_numpy(np.zeros((2, 3))).double().reshape(3, 2).t().to(device)  # views and casts
        torch.from_numpy(np.zeros(3)).to(device, torch.float32, False)  # (positional non_blocking)
        torch.tensor([1.0]).to(torch.zeros(1))  # (another tensor's device)
        torch.randn(3, generator=torch.Generator().manual_seed(0), device=device).to(device)  # drawn on the host
        torch.rand(2).to(device)
        torch.zeros(3).to(device)
        (torch.tensor([1.0]) + 1).to(device)  # computed on the host
        torch.stack([torch.from_numpy(np.ones(2)), torch.zeros(2, dtype=torch.float64)]).sum(0).to(device)
    assert [f.op for f in found] == ["Tensor.to(device) of host data"] * 11
    assert all("test_host_syncs.py" in f.where for f in found)
    with record_host_syncs() as found:
        torch.from_numpy(np.zeros(3)).to(device, non_blocking=True)
        torch.from_numpy(np.zeros(3)).to(device, torch.float32, True)
        torch.zeros(3, device=device).to(device)
        (torch.tensor([1.0]) + torch.ones(1, device=device)).to(device)  # (on a GPU: a device tensor)
    assert found == []
    assert torch.from_numpy is not None and torch.from_numpy(np.ones(1)).item() == 1.0  # restored


@pytest.mark.parametrize(("router", "kw"), SYNC_FREE_ROUTERS, ids=[r for r, _ in SYNC_FREE_ROUTERS])
def test_an_unchecked_layer_with_capacity_makes_no_host_sync(router, kw, gather_path) -> None:
    torch.manual_seed(0)
    moe = MoE(D, H, E, router=router, capacity_factor=1.0, check_finite=False, **kw)
    assert _step_syncs(moe) == []


@pytest.mark.parametrize(("router", "kw"), SYNC_FREE_ROUTERS[:4], ids=[r for r, _ in SYNC_FREE_ROUTERS[:4]])
def test_an_unchecked_dropless_grouped_layer_makes_no_host_sync(router, kw, gather_path) -> None:
    torch.manual_seed(0)
    moe = MoE(D, H, E, router=router, capacity_factor=None, check_finite=False, **kw)
    if not moe.uses_grouped(moe.router.slots, torch.device("cpu")):
        pytest.skip("grouped matmuls do not run on this CPU: dropless runs on buffers")
    assert _step_syncs(moe) == []


def test_what_each_sync_costs(gather_path) -> None:
    torch.manual_seed(0)
    # The default checks: the router's finite check of its scores. A built-in router's experts are
    # in range by construction, so the routes' value check (a second sync) runs only where the
    # capacity step ranks by the gates (NaN priorities).
    checked = _step_syncs(MoE(D, H, E, router="topk", k=2, capacity_factor=1.0))
    assert [s.where.split(":")[0] for s in checked] == ["routelab/_checks.py"], checked
    by_score = _step_syncs(MoE(D, H, E, router="topk", k=2, capacity_factor=1.0, drop_policy="score"))
    assert [s.where.split(":")[0] for s in by_score] == ["routelab/_checks.py", "routelab/routing/capacity.py"], \
        by_score
    mask = torch.rand(N, generator=torch.Generator().manual_seed(1)) > 0.3
    masked = _step_syncs(MoE(D, H, E, router="topk", k=2, capacity_factor=1.0, check_finite=False), mask)
    assert [s.op for s in masked] == ["aten.nonzero.default"], masked
    dropless = _step_syncs(MoE(D, H, E, router="topk", k=2, capacity_factor=None, check_finite=False,
                               dispatch="buffers"))
    assert len(dropless) == 1 and dropless[0].where.startswith("routelab/layers/moe.py"), dropless


def test_batchwise_gating_keeps_its_nan_checks_by_default() -> None:
    """check_finite=False is what turns the batchwise NaN checks off; by default they stay."""
    torch.manual_seed(0)
    found = _step_syncs(MoE(D, H, E, router="batchwise", k=2, capacity_factor=1.0))
    assert any(s.where.startswith("routelab/gates/batchwise.py") for s in found), found


def test_an_unchecked_mae_layer_makes_no_host_sync() -> None:
    """MAE (Peng et al.) with its gate, as a self-attention block, causal or not: no host sync with
    check_finite=False; the default check costs one."""
    from routelab.layers import MixtureOfAttentiveExperts

    x = torch.randn(3, 6, 16, generator=torch.Generator().manual_seed(0))
    for check, want in ((False, 0), (True, 1)):
        torch.manual_seed(0)
        mae = MixtureOfAttentiveExperts(16, 4, batch_first=True, check_finite=check)
        causal = torch.triu(torch.ones(6, 6, dtype=torch.bool), diagonal=1)
        for attn_mask, causal_gate in ((None, None), (causal, True)):
            mae(x, x, x, attn_mask=attn_mask, causal_gate=causal_gate)[0].sum().backward()
            with record_host_syncs() as found:
                mae(x, x, x, attn_mask=attn_mask, causal_gate=causal_gate)[0].sum().backward()
            assert len(found) == want, found


def test_a_multigate_moe_skipping_experts_reads_one_flag_vector() -> None:
    """A list of experts under exact-zero gates: one sync for the input check, one for which
    experts are needed (it was one per expert)."""
    from routelab.gates import DSelectK
    from routelab.layers import MultiGateMoE

    torch.manual_seed(0)
    experts = [torch.nn.Linear(8, 4) for _ in range(6)]
    moe = MultiGateMoE(experts, [DSelectK(6, 2), DSelectK(6, 2)])
    x = torch.randn(5, 8)
    sum(o.sum() for o in moe(x)).backward()
    with record_host_syncs() as found:
        sum(o.sum() for o in moe(x)).backward()
    assert len(found) == 2, found


def test_an_unchecked_multigate_moe_with_per_example_gates_reads_only_its_flags() -> None:
    """check_finite=False on the layer and on its per-example gates: only the one read of which
    experts are needed is left (both gates give exact zeros a zero gradient, so the layer may skip)."""
    from routelab.gates import DSelectK, SoftmaxGate
    from routelab.layers import MultiGateMoE

    torch.manual_seed(0)
    gates = [DSelectK(6, 2, per_example=True, input_dim=8), SoftmaxGate(6, per_example=True, input_dim=8)]
    for gate in gates:
        gate.check_finite = False
    moe = MultiGateMoE([torch.nn.Linear(8, 4) for _ in range(6)], gates, check_finite=False)
    x = torch.randn(5, 8)
    sum(o.sum() for o in moe(x)).backward()
    with record_host_syncs() as found:
        sum(o.sum() for o in moe(x)).backward()
    assert [s.where.split(":")[0] for s in found] == ["routelab/layers/multigate.py"], found
    with pytest.raises(TypeError, match="check_finite must be True or False"):
        MultiGateMoE([torch.nn.Linear(8, 4)], [SoftmaxGate(1)], check_finite=None)


def _moe_step(moe: MoE, x: torch.Tensor) -> None:
    """One forward + backward; every tensor of the routes (their statistics too) on the input's device."""
    y, routes = moe(x)
    y.sum().backward()
    tensors = {f"stats[{k!r}]": v for k, v in routes.stats.items()}
    tensors.update((f"aux[{k!r}]", v) for k, v in routes.aux.items())
    tensors.update(expert=routes.expert, weight=routes.weight, keep=routes.keep)
    for name, value in tensors.items():
        if isinstance(value, torch.Tensor):
            assert value.device == x.device, (name, value.device)


def _default_device_cases():
    """(name, build, inputs, step) for each layer: ``step(layer, inputs())`` is one forward + backward."""
    from routelab.gates import DSelectK, SoftmaxGate
    from routelab.layers import MixtureOfAttentiveExperts, MultiGateMoE
    from routelab.routers import ROUTERS

    def moe_case(router, cf, train):
        return (f"{router}-capacity-{cf}-{'train' if train else 'eval'}",
                lambda: MoE(D, H, E, router=router, capacity_factor=cf, check_finite=False).train(train),
                lambda: (torch.randn(N, D, requires_grad=True),),
                _moe_step)

    def mae_inputs():
        return torch.randn(3, 6, 16), torch.triu(torch.ones(6, 6, dtype=torch.bool), diagonal=1)

    cases = [moe_case(router, cf, train) for router in ROUTERS for cf in (1.0, None) for train in (True, False)]
    cases.append(("mae-causal", lambda: MixtureOfAttentiveExperts(16, 4, batch_first=True, check_finite=False),
                  mae_inputs, lambda mae, x, m: mae(x, x, x, attn_mask=m, causal_gate=True)[0].sum().backward()))
    cases.append(("multigate-dselect-softmax-per-example",
                  lambda: MultiGateMoE([torch.nn.Linear(8, 4) for _ in range(6)],
                                       [DSelectK(6, 2, per_example=True, input_dim=8),
                                        SoftmaxGate(6, per_example=True, input_dim=8)]),
                  lambda: (torch.randn(5, 8),), lambda moe, x: sum(o.sum() for o in moe(x)).backward()))
    return cases


@pytest.mark.parametrize(("name", "build", "inputs", "step"), _default_device_cases(),
                         ids=[case[0] for case in _default_device_cases()])
def test_a_step_makes_no_tensor_on_the_default_device(name, build, inputs, step, monkeypatch) -> None:
    """A tensor made without a device (``torch.zeros(())`` in an operation with the layer's tensors)
    is a copy from the host each step on CUDA, a host sync (batchwise's threshold loss had one:
    found by torch's sync debug mode on an H200, 2026-11-27), and under a user's
    ``torch.set_default_device("cuda")`` a host-side buffer lands on the GPU (the assignment
    solvers' scratch, Sinkhorn's numba output, the grouped-matmul probe's references had that).
    With ``meta`` as the default device such a tensor lands on ``meta`` and does not mix with the
    CPU layer's: the step fails here. The first step (the probe run afresh) and a later one."""
    import routelab.layers._grouped as grouped

    monkeypatch.setattr(grouped, "_PROBED", {})
    torch.manual_seed(0)
    layer = build()
    for _ in range(2):
        args = inputs()
        with torch.device("meta"):
            step(layer, *args)


def _cuda_step_without_sync(moe: MoE) -> None:
    """One bfloat16 training step of ``moe`` on CUDA under torch's sync debug mode "error" (any
    host sync raises), after a warm-up step (the grouped probe synchronises once)."""
    x = torch.randn(256, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    moe(x)[0].sum().backward()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y, _ = moe(x)
        y.backward(torch.ones_like(y))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(x.grad).all()


@pytest.mark.requires_cuda
def test_noise_from_a_seeded_cpu_generator_makes_no_host_sync_on_cuda() -> None:
    """The library's advice for reproducible noise, a seeded CPU generator, on a CUDA layer: the
    noise is drawn on the host and sent through pinned memory (a plain copy waits for the stream)."""
    torch.manual_seed(0)
    _cuda_step_without_sync(MoE(64, 128, E, router="noisy_topk", capacity_factor=1.0, check_finite=False,
                                device="cuda", dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0)))


@pytest.mark.requires_cuda
@pytest.mark.parametrize(("router", "kw"), SYNC_FREE_ROUTERS, ids=[r for r, _ in SYNC_FREE_ROUTERS])
def test_the_same_training_step_makes_no_host_sync_on_cuda(router, kw) -> None:
    """The CUDA truth behind the counts above: torch's sync debug mode turns any sync into an error.
    bfloat16 (the dtype whose dropless layer runs grouped on CUDA), forward and backward."""
    for capacity_factor in (1.0, None) if router != "batchwise" else (1.0,):
        torch.manual_seed(0)
        moe = MoE(64, 128, E, router=router, capacity_factor=capacity_factor, check_finite=False,
                  device="cuda", dtype=torch.bfloat16, **kw)
        moe.router.cuda()
        _cuda_step_without_sync(moe)


def test_a_compile_after_the_recorder_traces_torch_functions_it_wrapped() -> None:
    """torch.compile's trace rules cache torch's functions by name the first time they are needed; if
    that happens inside the recorder (whose wrappers stand in for torch.arange & co.), the recorder
    clears them on exit, so a later compile still traces torch.arange (3 test_hf compile tests failed
    when the host-sync files ran alone, before it did)."""
    from torch._dynamo import trace_rules

    trace_rules.clear_lru_cache()
    with record_host_syncs():
        trace_rules.get_torch_obj_rule_map()  # built with the wrappers
    torch._dynamo.reset()
    compiled = torch.compile(lambda n: torch.arange(4) * n, backend="eager", fullgraph=True)
    assert compiled(torch.tensor(2)).tolist() == [0, 2, 4, 6]
