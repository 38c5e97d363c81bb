"""Mutation round on the routes' value check and the non-blocking host-to-device copies.

Contracts the existing tests left open (each test below failed on one deliberate bug, a mutant, and
passes on the real code):

* :meth:`routelab.layers.MoE.plan` checks the routes of a router that does not declare
  ``experts_in_range`` on the dropless grouped path too (its own branch, one sort for the decision
  and the plan), with the same clear error as under a capacity;
* :func:`routelab._checks.to_device` to CUDA: the dtype converted on the host, the data staged in
  pinned memory and copied with ``non_blocking=True`` (no wait for the stream); the assignment
  solver's host results (``assignment.balanced._to_device``) travel the same way, bit for bit.
  These run on the CPU with a stand-in for the device copy (a machine without CUDA never reaches
  that branch; ``tests/test_device_scalar.py::test_to_device_on_cuda_does_not_sync_and_owns_its_data``
  checks the real copy on a GPU);
* ExpertParallelMoE's rank offsets reach the device without a blocking copy of host data;
* ``tests/host_syncs.py``: one copy is one record (host data sent to the literal ``"cpu"``, a
  factory given a device, then moved), and ``torch.from_numpy`` is restored on exit.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
import torch.distributed as dist

from host_syncs import record_host_syncs
from routelab._checks import to_device
from routelab.assignment.balanced import _to_device
from routelab.layers import MoE
from routelab.routers import TopKRouter
from routelab.routers.base import routes_need_value_check

RANGE_ERROR = r"expert must hold expert indices in \[0, num_experts=4\)"


class OutOfRange(TopKRouter):
    """Names the expert ``E`` for every slot and does not declare ``experts_in_range`` again."""

    def route(self, logits, capacity):
        routes = super().route(logits, capacity)
        return dataclasses.replace(routes, expert=torch.full_like(routes.expert, self.num_experts))


@pytest.mark.parametrize("dispatch", ["grouped", "auto"])
def test_an_undeclared_router_is_checked_on_the_dropless_grouped_path(dispatch):
    """Dropless and grouped, the layer decides and plans in one sort (``decide_and_plan_dropless``);
    a router that does not vouch for its experts must still get the value check there and its
    clear error, not an index error (or a silent wrong route) deeper in the plan."""
    moe = MoE(8, 16, 4, router=OutOfRange(8, 4, k=1), capacity_factor=None, dispatch=dispatch)
    if not moe.uses_grouped(1, torch.device("cpu")):
        pytest.skip("grouped matmuls do not run on this CPU")
    assert routes_need_value_check(moe.router, moe.drop_policy)
    with pytest.raises(ValueError, match=RANGE_ERROR):
        moe(torch.randn(12, 8))


@pytest.fixture
def fake_cuda_copy(monkeypatch):
    """A stand-in for the host-to-CUDA copy on a machine without CUDA: ``pin_memory`` returns a
    marked host copy, ``Tensor.to`` a CUDA device returns a host copy and records what was copied
    (from pinned memory? non-blocking? which dtype?). Every other ``.to`` is the real one."""
    real_to = torch.Tensor.to
    pinned: list[torch.Tensor] = []  # (kept alive, so that their ids are not reused)
    copies: list[dict] = []

    def pin_memory(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        out = self.clone()
        pinned.append(out)
        return out

    def to(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        target = kwargs.get("device", args[0] if args else None)
        if isinstance(target, (str, torch.device)) and torch.device(target).type == "cuda":
            rest = [a for a in args[1:] if isinstance(a, bool)]
            copies.append({"pinned": any(p is self for p in pinned), "dtype": self.dtype,
                           "non_blocking": kwargs.get("non_blocking", rest[0] if rest else False),
                           "dtype_arg": kwargs.get("dtype", next((a for a in args[1:] if isinstance(a, torch.dtype)),
                                                                 None))})
            return self.clone()
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(torch.Tensor, "to", to)
    return copies


@pytest.mark.parametrize("device", ["cuda", torch.device("cuda", 0)])
def test_to_device_on_cuda_converts_on_the_host_and_copies_from_pinned_memory_without_blocking(fake_cuda_copy,
                                                                                                device):
    """The documented CUDA path: one copy, of a pinned host block already in ``dtype``, with
    ``non_blocking=True`` (a plain ``.to("cuda")`` from pageable memory waits for the stream)."""
    host = torch.from_numpy(np.array([0.1, -2.5, 7.0]))
    got = to_device(host, device, torch.float32)
    assert fake_cuda_copy == [{"pinned": True, "dtype": torch.float32, "non_blocking": True, "dtype_arg": None}]
    assert torch.equal(got, host.to(torch.float32))
    fake_cuda_copy.clear()
    ints = torch.arange(5)
    got = to_device(ints, device)  # no dtype: its own
    assert fake_cuda_copy == [{"pinned": True, "dtype": torch.int64, "non_blocking": True, "dtype_arg": None}]
    assert torch.equal(got, ints)


def test_to_device_takes_the_plain_copy_while_a_cuda_graph_is_captured(fake_cuda_copy, monkeypatch):
    """Under CUDA graph capture the pinned, non-blocking copy would be captured reading a pinned
    block that the caching allocator hands on after the call, so each replay would read whatever is
    there then: :func:`to_device` takes the plain copy, which cannot be captured and raises there."""
    import routelab._checks

    monkeypatch.setattr(routelab._checks, "_capturing", lambda: True)
    to_device(torch.arange(4), "cuda")
    assert fake_cuda_copy == [{"pinned": False, "dtype": torch.int64, "non_blocking": False, "dtype_arg": None}]


def test_the_solvers_host_results_reach_the_device_in_one_non_blocking_copy_bit_for_bit(fake_cuda_copy):
    """``assignment.balanced._to_device`` (the host solve's answer on its way back to a GPU): one
    transfer through :func:`to_device` (pinned, non-blocking), and every float64 bit pattern
    (``-0.0``, a subnormal, inf, a NaN payload) and long comes back exactly, in its shape."""
    expert = torch.tensor([[3, 0, 2], [1, 1, 0]])
    odd = torch.tensor([-0.0, 5e-324, math.inf, -math.inf, 1.0 / 3.0, 2.0**-1074 * 3], dtype=torch.float64)
    nan = torch.tensor([0x7FF8_0000_DEAD_BEEF]).view(torch.float64)
    floats = torch.cat([odd, nan]).view(7, 1)
    scale = torch.tensor([-3.0, 12.0], dtype=torch.float64)
    moved = _to_device((expert, floats, scale), torch.device("cuda"))
    assert fake_cuda_copy == [{"pinned": True, "dtype": torch.int64, "non_blocking": True, "dtype_arg": None}]
    for got, want in zip(moved, (expert, floats, scale)):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got.view(torch.int64), want.view(torch.int64))


def test_noise_from_a_cpu_generator_reaches_cuda_through_pinned_memory(fake_cuda_copy):
    """The library's advice for reproducible noise is a seeded CPU generator; with a CUDA layer the
    noise is drawn on the host (the same numbers on every device) and sent as :func:`to_device`
    sends: pinned, non-blocking (a plain copy would wait for the stream at every step)."""
    from routelab._checks import random_tensor

    got = random_tensor(torch.randn, (3, 4), dtype=torch.float32, device="cuda",
                        generator=torch.Generator().manual_seed(5))
    assert fake_cuda_copy == [{"pinned": True, "dtype": torch.float32, "non_blocking": True, "dtype_arg": None}]
    assert torch.equal(got, torch.randn(3, 4, generator=torch.Generator().manual_seed(5)))


def _rank_offsets_worker(rank: int, world: int) -> list[str]:
    from routelab.parallel import ExpertParallelMoE

    torch.manual_seed(0)
    ep = ExpertParallelMoE(6, 10, 4, router="topk", k=2, capacity_factor=1.0, seed=3)
    x = torch.randn(5 + 2 * rank, 6)
    with record_host_syncs() as found:
        ep(x)
    return [f"{f.op} at {f.where}" for f in found if f.op == "Tensor.to(device) of host data"]


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="torch.distributed with gloo")
def test_expert_parallel_sends_its_rank_offsets_to_the_device_without_a_blocking_copy():
    """The offsets of the ranks' tokens (a Python list) go to the device through :func:`to_device`:
    on CUDA a ``torch.tensor(offsets).to(device)`` waits for the stream every forward."""
    from routelab.parallel import run_workers

    assert run_workers(_rank_offsets_worker, 2, timeout=60) == [[], []]


def test_host_data_sent_to_the_literal_cpu_is_no_record_and_device_data_one():
    """``torch.from_numpy(a).to("cpu")`` reads no GPU (its data is on the host already): no record,
    neither as a copy to the host nor as one of host data. A tensor made on the device, sent to the
    literal ``"cpu"``, is one record, and what it returns is host data (reading it again is none)."""
    device = torch.zeros(1).device
    with record_host_syncs() as found:
        torch.from_numpy(np.zeros(3)).to("cpu")
        torch.tensor([1.0, 2.0]).to(device="cpu")
        back = torch.zeros(3, device=device).to("cpu")
        back.numpy()
        back.tolist()
        torch.ones(2, device=device).cpu().numpy()
    assert [f.op for f in found] == ["Tensor.to(cpu)", "Tensor.cpu"]


def test_a_factory_given_a_device_is_one_record_however_it_is_moved_after():
    """``torch.tensor(data, device=d)`` is recorded where it copies; what it returns is on ``d``
    (no longer host data), so moving it on is not a second copy of host data."""
    device = torch.zeros(1).device
    with record_host_syncs() as found:
        torch.tensor([1.0, 2.0], device=device).to(device)
        torch.as_tensor(np.ones(2), device=device).to(device=device)
    assert [f.op for f in found] == ["torch.tensor(host data, device=)", "torch.as_tensor(host data, device=)"]


def test_the_recorder_puts_torch_from_numpy_back():
    """After the recorder (normal exit or an error inside it) ``torch.from_numpy`` is torch's own
    function again, not the recorder's tagging wrapper."""
    original = torch.from_numpy
    with record_host_syncs():
        assert torch.from_numpy is not original  # (watched inside)
    assert torch.from_numpy is original
    with pytest.raises(RuntimeError, match="inside"), record_host_syncs():
        raise RuntimeError("inside")
    assert torch.from_numpy is original
