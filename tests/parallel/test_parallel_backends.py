"""ExpertParallelMoE at world size 1 on each backend, and gloo (CPU) == NCCL (CUDA).

Every test is parameterised by backend: the gloo variant runs anywhere (CPU), the NCCL variant
needs a CUDA device and torch's NCCL (``requires_cuda(nccl=True)``: skipped without, a failure
under ``ROUTELAB_REQUIRE_CUDA=1``). Each backend runs in its own process started by
:func:`routelab.parallel.run_workers` (gloo: forked; NCCL: spawned, so the pytest process's
CUDA state is never forked), with a deadline on the whole run.

At world size 1 the layer's token exchanges are identities (comm.py short-circuits them), so
the NCCL collectives exercised here are the constructor's broadcasts, ``reduce_replicated_grads``'
all-reduce, and one direct ``all_to_all_single`` through the autograd function the layer uses
for ``world > 1``. Multi-rank NCCL (real token exchanges between GPUs) needs several GPUs: with
one GPU, ``run_workers(..., backend="nccl")`` would put every rank on it, which NCCL rejects
for ranks of one communicator sharing a device.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from test_parallel import D, E, H, _close, _loss

from routelab.layers import MoE
from routelab.parallel import ExpertParallelMoE, default_backend, init_distributed, run_workers
from routelab.parallel.comm import _AllToAll

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

BACKENDS = [
    pytest.param("gloo", marks=pytest.mark.skipif(dist.is_available() and not dist.is_gloo_available(),
                                                  reason="torch.distributed without gloo")),
    pytest.param("nccl", marks=pytest.mark.requires_cuda(nccl=True)),
]

# Deterministic routers only (no generator: the same decisions on CPU and CUDA without sharing a
# random stream across devices), in capacity and dropless modes, with drops and top-2.
CONFIGS = [
    {"router": "topk", "capacity_factor": 1.0},
    {"router": "topk", "k": 2, "capacity_factor": 0.5, "drop_policy": "score"},
    {"router": "topk", "k": 2, "capacity_factor": None},
    {"router": "base", "capacity_factor": 1.0},
    {"router": "sinkhorn", "k": 2, "capacity_factor": 0.75},
    {"router": "topk", "capacity_factor": 1.0, "activation": "swiglu", "bias": False},
]
N_TOKENS = 16
TIMEOUT = {"gloo": 60.0, "nccl": 180.0}  # spawned NCCL ranks first import torch and start CUDA
# CPU vs CUDA float32: different kernels, different summation orders; decisions must agree exactly.
CROSS_ATOL, CROSS_RTOL = 1e-5, 1e-4


def _device(backend: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def _reference(cfg: dict, seed: int, device: torch.device) -> MoE:
    """The single-process layer, built on the CPU from ``seed`` (the same weights for every backend)."""
    torch.manual_seed(seed)
    moe = MoE(D, H, E, router=cfg["router"], k=cfg.get("k"), capacity_factor=cfg["capacity_factor"],
              drop_policy=cfg.get("drop_policy", "position"), activation=cfg.get("activation", "gelu"),
              bias=cfg.get("bias", True))
    with torch.no_grad():  # nontrivial router weights
        for p in moe.router.parameters():
            p.normal_(0.0, 0.7) if p.dim() > 1 else p.uniform_(0.1, 0.4)
    return moe.to(device)


def _cpu(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().cpu()


def _world_one_worker(rank: int, world: int, backend: str) -> list[dict]:
    """Per config: ExpertParallelMoE (world 1) == MoE on the same tokens; the results, on the CPU."""
    assert world == 1 and dist.get_backend() == backend
    dev = _device(backend)
    out = []
    for i, cfg in enumerate(CONFIGS):
        moe = _reference(cfg, seed=i, device=dev)
        gen = torch.Generator().manual_seed(10_000 + i)
        x = torch.randn(N_TOKENS, D, generator=gen).to(dev)
        w = torch.randn(N_TOKENS, D, generator=gen).to(dev)
        x_ref = x.clone().requires_grad_(True)
        y_ref, r_ref = moe(x_ref)
        _loss(y_ref, r_ref.aux, w, 1.0).backward()
        ep = ExpertParallelMoE.from_moe(moe)
        assert ep.experts.w1.device == dev and ep.local_experts == E
        x_ep = x.clone().requires_grad_(True)
        y, r = ep(x_ep)
        _loss(y, r.aux, w, 1.0).backward()
        ep.reduce_replicated_grads()  # an all-reduce over the backend (the identity at world size 1)
        errors: list[str] = []
        assert y.device == dev
        _close("y", y, y_ref, errors)
        for field in ("expert", "keep"):
            if not torch.equal(getattr(r, field), getattr(r_ref, field)):
                errors.append(f"routes.{field} differ")
        _close("routes.gate", r.gate, r_ref.gate, errors)
        _close("x.grad", x_ep.grad, x_ref.grad, errors)
        for name, p in ep.experts.named_parameters():
            _close(f"experts.{name}.grad", p.grad, getattr(moe.experts, name).grad, errors)
        for (name, p), (_, q) in zip(ep.router.named_parameters(), moe.router.named_parameters()):
            if q.grad is not None:
                _close(f"router.{name}.grad", p.grad, q.grad, errors)
        if errors:
            raise AssertionError(f"{backend} {cfg}: " + "; ".join(errors))
        out.append({
            "y": _cpu(y), "expert": _cpu(r.expert), "keep": _cpu(r.keep), "gate": _cpu(r.gate),
            "x.grad": _cpu(x_ep.grad),
            **{f"experts.{n}.grad": _cpu(p.grad) for n, p in ep.experts.named_parameters()},
            **{f"router.{n}.grad": _cpu(p.grad) for n, p in ep.router.named_parameters()},
        })
    return out


def _collectives_worker(rank: int, world: int, backend: str) -> dict:
    """The backend's collectives on this device at world size 1: the constructor's broadcasts, a
    direct differentiable all_to_all_single (the path the layer takes for world > 1), all-reduce."""
    dev = _device(backend)
    torch.manual_seed(3)
    ep = ExpertParallelMoE(D, H, E, router="topk", k=2, seed=7, device=dev)  # broadcasts seed + router
    assert ep.experts.w1.device == dev and ep.router.proj.weight.device == dev
    # The same weights in a single-process layer: equal outputs and gradients.
    moe = MoE(D, H, E, router="topk", k=2, device=dev)
    moe.load_state_dict(ep.state_dict())
    x = torch.randn(12, D, device=dev)
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ya, ra = ep(xa)
    yb, rb = moe(xb)
    errors: list[str] = []
    _close("y", ya, yb, errors)
    (ya.square().sum() + sum(ra.aux.values())).backward()
    (yb.square().sum() + sum(rb.aux.values())).backward()
    ep.reduce_replicated_grads()
    _close("x.grad", xa.grad, xb.grad, errors)
    _close("router.proj.weight.grad", ep.router.proj.weight.grad, moe.router.proj.weight.grad, errors)
    _close("experts.w1.grad", ep.experts.w1.grad, moe.experts.w1.grad, errors)
    # all_to_all_single through the layer's autograd function: one rank sends itself its rows.
    z = torch.arange(10.0, device=dev).reshape(5, 2).requires_grad_(True)
    moved = _AllToAll.apply(z, [5], [5], None)
    if not torch.equal(moved, z.detach()):
        errors.append("all_to_all_single changed the rows")
    (moved * 3).sum().backward()
    if not torch.equal(z.grad, torch.full_like(z, 3.0)):
        errors.append("all_to_all_single's backward")
    if errors:
        raise AssertionError(f"{backend}: " + "; ".join(errors))
    return {"backend": dist.get_backend(), "device": str(ya.device)}


@pytest.mark.parametrize("backend", BACKENDS)
def test_world_size_one_equals_single_process(backend: str) -> None:
    (results,) = run_workers(_world_one_worker, 1, backend, backend=backend, timeout=TIMEOUT[backend])
    assert len(results) == len(CONFIGS)


@pytest.mark.parametrize("backend", BACKENDS)
def test_world_size_one_collectives_and_constructor(backend: str) -> None:
    (info,) = run_workers(_collectives_worker, 1, backend, backend=backend, timeout=TIMEOUT[backend])
    assert info["backend"] == backend
    assert info["device"].startswith("cuda" if backend == "nccl" else "cpu")


@pytest.mark.requires_cuda(nccl=True)
def test_gloo_and_nccl_agree() -> None:
    """The same layer, inputs and seeds under gloo (CPU) and NCCL (CUDA): equal decisions, outputs
    and gradients within float32 tolerance."""
    (gloo,) = run_workers(_world_one_worker, 1, "gloo", backend="gloo", timeout=TIMEOUT["gloo"])
    (nccl,) = run_workers(_world_one_worker, 1, "nccl", backend="nccl", timeout=TIMEOUT["nccl"])
    assert len(gloo) == len(nccl) == len(CONFIGS)
    errors: list[str] = []
    for cfg, a, b in zip(CONFIGS, gloo, nccl):
        assert a.keys() == b.keys()
        for key in a:
            if a[key] is None or b[key] is None:
                if (a[key] is None) != (b[key] is None):
                    errors.append(f"{cfg} {key}: None on one backend only")
            elif key in ("expert", "keep"):
                if not torch.equal(a[key], b[key]):
                    errors.append(f"{cfg} routes.{key} differ")
            elif not torch.allclose(a[key], b[key], atol=CROSS_ATOL, rtol=CROSS_RTOL):
                errors.append(f"{cfg} {key}: max |diff| {float((a[key] - b[key]).abs().max()):.3g}")
    assert not errors, "; ".join(errors)


def test_run_workers_rejects_bad_backends(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="backend must be"):
        run_workers(_world_one_worker, 1, "mpi", backend="mpi")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        run_workers(_world_one_worker, 1, "nccl", backend="nccl")
    # A review: the docstring promised one GPU could host every NCCL rank, which NCCL refuses.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    with pytest.raises(ValueError, match="one GPU per rank .* world_size=2, but 1 GPU"):
        run_workers(_world_one_worker, 2, "nccl", backend="nccl")


def test_spawned_gloo_ranks_find_the_test_functions() -> None:
    """The start method NCCL ranks use (spawn: fresh interpreters that import this module by name), on gloo."""
    (info,) = run_workers(_collectives_worker, 1, "gloo", backend="gloo", start_method="spawn",
                          timeout=TIMEOUT["nccl"])
    assert info == {"backend": "gloo", "device": "cpu"}


def test_default_backend_needs_a_gpu_per_local_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """NCCL only when every local rank gets a GPU of its own (one GPU cannot host two NCCL ranks of a group)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    assert default_backend(1) == "nccl"
    assert default_backend(2) == "gloo"  # e.g. torchrun --nproc_per_node=2 on a one-GPU machine
    monkeypatch.setattr(dist, "is_nccl_available", lambda: False)
    assert default_backend(1) == "gloo"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_backend(1) == "gloo"
    with pytest.raises(ValueError):
        default_backend(0)


def test_init_distributed_nccl_without_a_gpu_for_the_rank_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1",
                       "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="LOCAL_RANK=1 but this machine has 1 CUDA device"):
        init_distributed("nccl")
