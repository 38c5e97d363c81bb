"""ExpertParallelMoE: the defects of a review (2026-11), each with a test that failed before its fix.

Every test starts its ranks with routelab.parallel.run_workers (forked, single-threaded gloo
processes on 127.0.0.1, a deadline on the whole run); the layers are tiny (d_model 6, 4 or 6 experts).
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed as dist

from routelab.layers import MoE
from routelab.parallel import ExpertParallelMoE, run_workers

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is needed")

D, H = 6, 10
ATOL = 1e-5


def _global_batch(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, D, generator=torch.Generator().manual_seed(seed))


def _gather(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


# ---------------------------------------------------------------- 1. a layer pickled whole

def _save_whole_layer(rank: int, world: int) -> bytes:
    torch.manual_seed(0)
    ep = ExpertParallelMoE.from_moe(MoE(D, H, 4, router="topk", k=2))
    buf = io.BytesIO()
    torch.save(ep, buf)
    return buf.getvalue()


def _load_whole_layer(rank: int, world: int, blobs: list[bytes]) -> str:
    own = torch.load(io.BytesIO(blobs[rank]), weights_only=False)  # the layer this rank saved: fine
    y, _ = own(_global_batch(8, 1)[4 * rank:4 * rank + 4])
    assert y.shape == (4, D)
    dist.barrier()
    if rank == 0:
        return ""
    # Rank 1 loads rank 0's layer (the DDP habit: rank 0 saves the model, every rank loads it): its
    # forward raises before any collective (it used to run silently as rank 0).
    other = torch.load(io.BytesIO(blobs[0]), weights_only=False)
    try:
        other(_global_batch(4, 2))
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_a_layer_pickled_whole_runs_only_as_the_rank_that_saved_it():
    blobs = run_workers(_save_whole_layer, 2, timeout=30)
    _, message = run_workers(_load_whole_layer, 2, blobs, timeout=20)
    assert "experts 0..1 of rank 0 of 2, but runs on rank 1 of 2" in message, message
    assert "state_dict() per rank" in message
    # Without any process group (e.g. a notebook loading the file): a clear error at the forward.
    layer = torch.load(io.BytesIO(blobs[1]), weights_only=False)
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="initialised torch.distributed process group at every call"):
        layer(torch.randn(3, D))


# ---------------------------------------------------------------- 2. hooks on the router

def _layer_and_shard() -> tuple[MoE, ExpertParallelMoE]:
    """A seeded top-2 ``MoE`` with a router sharp enough to route unevenly, and this rank's shard of it."""
    torch.manual_seed(0)
    moe = MoE(D, H, 4, router="topk", k=2, capacity_factor=1.0)
    with torch.no_grad():
        moe.router.proj.weight.normal_(0.0, 0.7)
    return moe, ExpertParallelMoE.from_moe(moe)


def _hooks_worker(rank: int, world: int) -> dict:
    moe, ep = _layer_and_shard()
    seen: dict[str, list] = {"moe": [], "ep": []}

    def flip(module, args):  # a pre-hook that changes the decisions: the router sees -x
        x, *rest = args
        return (-x, *rest)

    for name, layer in (("moe", moe), ("ep", ep)):
        layer.router.register_forward_pre_hook(flip)
        # A forward hook sees the proposal (MoE's batch = the global batch) and may replace it.
        layer.router.register_forward_hook(
            lambda m, args, routes, name=name: seen[name].append(
                (args[1], torch.bincount(routes.expert[routes.keep], minlength=4))))
    x = _global_batch(8, 1)
    x_ref = x.clone().requires_grad_(True)
    y_ref, r_ref = moe(x_ref)
    (y_ref * x).sum().backward()
    mine = slice(4 * rank, 4 * rank + 4)
    x_loc = x[mine].clone().requires_grad_(True)
    y, r = ep(x_loc)
    (y * x[mine]).sum().backward()
    ep.reduce_replicated_grads()
    assert len(seen["ep"]) == len(seen["moe"]) == 1
    assert seen["ep"][0][0] == seen["moe"][0][0]  # the global capacity
    assert torch.equal(seen["ep"][0][1], seen["moe"][0][1])  # the global batch's proposed load
    assert torch.equal(r.expert, r_ref.expert[mine])
    assert torch.allclose(y, y_ref[mine], atol=ATOL)
    assert torch.allclose(x_loc.grad, x_ref.grad[mine], atol=ATOL)
    assert torch.allclose(ep.router.proj.weight.grad, moe.router.proj.weight.grad, atol=ATOL)
    # A pre-hook may change the tokens' values, not their number (the other ranks expect it).
    ep.router.register_forward_pre_hook(lambda m, args: (args[0][:1], *args[1:]))
    with pytest.raises(ValueError, match="may change the tokens' values but not their number"):
        ep(x[mine])
    return {"calls": len(seen["ep"])}


def test_hooks_on_the_router_run_as_in_moe():
    assert run_workers(_hooks_worker, 2, timeout=30) == [{"calls": 1}] * 2


# ---------------------------------------------------------------- 3. the same model at any world size

def _model_worker(rank: int, world: int, seeds: tuple) -> dict:
    torch.manual_seed(0)
    l1 = ExpertParallelMoE(D, H, 6, router="topk", k=2, seed=seeds[0])
    l2 = ExpertParallelMoE(D, H, 6, router="noisy_topk", k=2, seed=seeds[1], activation="swiglu")
    head = torch.nn.Linear(D, 3)
    return {"router1": l1.router.proj.weight.detach().clone(), "router2": l2.router.proj.weight.detach().clone(),
            "head": head.weight.detach().clone(), "experts1": l1.experts.w1.detach().clone(),
            "experts2": l2.experts.w3.detach().clone(), "next_draw": torch.rand(3)}


@pytest.mark.parametrize("seeds", [(7, 8), (None, None)], ids=["seed", "no-seed"])
def test_a_seeded_model_is_the_same_at_any_world_size(seeds):
    """Building a layer draws from torch's global generator the same at every world size (the
    local experts used to be initialised there, E / W of them, before init_experts overwrote them)."""
    results = {w: run_workers(_model_worker, w, seeds, timeout=30) for w in (1, 2, 3)}
    one = results[1][0]
    for w in (2, 3):
        for key in ("router1", "router2", "head", "next_draw"):
            for r in range(w):
                assert torch.equal(results[w][r][key], one[key]), (w, r, key)
        for key in ("experts1", "experts2"):
            assert torch.equal(torch.cat([results[w][r][key] for r in range(w)]), one[key]), (w, key)


# ---------------------------------------------------------------- 4. clipping and GradScaler

def _clip_worker(rank: int, world: int) -> dict:
    from routelab.parallel import clip_grad_norm_

    moe, ep = _layer_and_shard()
    x = _global_batch(12, 1) * 3
    mine = slice(6 * rank, 6 * rank + 6)
    out: dict = {"norms": []}
    for norm_type in (2.0, 1.0, float("inf")):
        moe.zero_grad(set_to_none=True)
        ep.zero_grad(set_to_none=True)
        y_ref, r_ref = moe(x)
        ((x + y_ref).pow(2).sum() + sum(r_ref.aux.values())).backward()
        want = torch.nn.utils.clip_grad_norm_(moe.parameters(), 0.5, norm_type)
        y, r = ep(x[mine])
        ((x[mine] + y).pow(2).sum() + sum(r.aux.values()) / world).backward()
        ep.reduce_replicated_grads()
        got = clip_grad_norm_(ep, 0.5, norm_type)
        assert torch.allclose(got, want, rtol=1e-5, atol=0), (norm_type, float(got), float(want))
        out["norms"].append(float(got))
        # clipped like the single-process layer: the router, and this rank's experts
        assert torch.allclose(ep.router.proj.weight.grad, moe.router.proj.weight.grad, atol=ATOL)
        lo, hi = ep.expert_offset, ep.expert_offset + ep.local_experts
        assert torch.allclose(ep.experts.w1.grad, moe.experts.w1.grad[lo:hi], atol=ATOL)
    # Training with the clip: the router replicas stay identical (the per-rank torch norm pulled them apart).
    opt = torch.optim.SGD(ep.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(rank)
    for _ in range(4):
        xb = torch.randn(16, D, generator=g) * (1 + 3 * rank)
        y, r = ep(xb)
        opt.zero_grad()
        ((xb + y).pow(2).mean() + sum(r.aux.values()) / world).backward()
        ep.reduce_replicated_grads()
        clip_grad_norm_(ep, 1.0)
        opt.step()
        ws = _gather(ep.router.proj.weight.detach())
        assert torch.equal(ws[0], ws[1])
    # A non-finite gradient on one rank's experts: the same non-finite norm on every rank.
    if rank == 1:
        ep.experts.w1.grad[0, 0, 0] = float("inf")
    out["inf"] = float(clip_grad_norm_(ep, 1.0))
    if rank == 1:
        ep.experts.w2.grad[0, 0, 0] = float("nan")
    out["nan"] = float(clip_grad_norm_(list(ep.parameters()), 1.0, sharded_parameters=ep.expert_parameters()))
    with pytest.raises(ValueError, match="sharded_parameters="):
        clip_grad_norm_(list(ep.parameters()), 1.0)
    return out


def test_clip_grad_norm_is_the_global_norm_on_every_rank():
    a, b = run_workers(_clip_worker, 2, timeout=30)
    assert a["norms"] == b["norms"]
    assert a["inf"] == b["inf"] == float("inf")
    assert a["nan"] != a["nan"] and b["nan"] != b["nan"]


def _scaler_worker(rank: int, world: int) -> dict:
    from routelab.parallel import all_reduce_found_inf

    torch.manual_seed(0)
    ep = ExpertParallelMoE(D, H, 4, router="topk", k=2, seed=1)
    opt = torch.optim.SGD(ep.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    g = torch.Generator().manual_seed(rank)
    found = []
    for step in range(3):
        x = torch.randn(16, D, generator=g)
        y, routes = ep(x)
        loss = (x + y).pow(2).mean() + sum(routes.aux.values()) / world
        opt.zero_grad()
        scaler.scale(loss).backward()
        ep.reduce_replicated_grads()
        if step == 0 and rank == 1:
            ep.experts.w1.grad[0, 0, 0] = float("inf")  # an fp16 overflow in rank 1's experts alone
        if step == 1:
            with pytest.raises(RuntimeError, match=r"call scaler.unscale_\(optimizer\) first"):
                all_reduce_found_inf(scaler, opt)
        scaler.unscale_(opt)
        found.append(all_reduce_found_inf(scaler, opt))
        scaler.step(opt)
        scaler.update()
    ws = _gather(ep.router.proj.weight.detach())
    return {"scale": scaler.get_scale(), "found": found, "replicas equal": torch.equal(ws[0], ws[1])}


def test_grad_scaler_skips_the_step_on_every_rank():
    want = {"scale": 512.0, "found": [True, False, False], "replicas equal": True}
    assert run_workers(_scaler_worker, 2, timeout=30) == [want, want]


# ---------------------------------------------------------------- 5. from_moe keeps the router's own generator

def _router_generator_worker(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    g_layer, g_router = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    moe = MoE(D, H, 4, router="noisy_topk", k=2, capacity_factor=1.0, drop_policy="random", generator=g_layer)
    moe.router.generator = g_router  # the router draws its noise from a generator of its own
    with torch.no_grad():
        for p in moe.router.parameters():
            p.normal_(0.0, 0.7)
    s1, s2 = g_layer.get_state(), g_router.get_state()
    x = _global_batch(8, 3)
    y_ref, r_ref = moe(x)
    g_layer.set_state(s1)
    g_router.set_state(s2)
    ep = ExpertParallelMoE.from_moe(moe)
    y, r = ep(x[4 * rank:4 * rank + 4])
    return {"router generator": ep.router.generator is g_router, "layer generator": ep.generator is g_layer,
            "experts equal": torch.equal(r.expert, r_ref.expert[4 * rank:4 * rank + 4]),
            "y equal": torch.allclose(y, y_ref[4 * rank:4 * rank + 4], atol=ATOL)}


def test_from_moe_keeps_the_routers_own_generator():
    want = {"router generator": True, "layer generator": True, "experts equal": True, "y equal": True}
    assert run_workers(_router_generator_worker, 2, timeout=30) == [want, want]


# ---------------------------------------------------------------- 6. from_moe keeps frozen parameters frozen

def _frozen_worker(rank: int, world: int) -> list[str]:
    torch.manual_seed(0)
    moe = MoE(D, H, 4, router="topk", k=2)
    moe.experts.w1.requires_grad_(False)  # e.g. fine-tuning part of the experts, or the router alone
    moe.experts.b2.requires_grad_(False)
    moe.router.requires_grad_(False)
    return sorted(n for n, p in ExpertParallelMoE.from_moe(moe).named_parameters() if p.requires_grad)


def test_from_moe_keeps_frozen_parameters_frozen():
    assert run_workers(_frozen_worker, 2, timeout=30) == [["experts.b1", "experts.w2"]] * 2


# ---------------------------------------------------------------- 7. a rank outside process_group

def _non_member_worker(rank: int, world: int) -> list[str]:
    group = dist.new_group([0, 1])
    errors = []
    if rank == 2:
        for build in (lambda: ExpertParallelMoE(D, H, 4, process_group=group, seed=0),
                      lambda: ExpertParallelMoE.from_moe(MoE(D, H, 4), group)):
            try:
                build()
            except ValueError as e:
                errors.append(str(e))
    else:
        ExpertParallelMoE(D, H, 4, process_group=group, seed=0)
    dist.barrier()
    return errors


def test_a_rank_outside_the_process_group_is_told_so():
    *_, errors = run_workers(_non_member_worker, 3, timeout=30)
    assert len(errors) == 2
    for message in errors:
        assert "(global rank 2) is not a member of process_group" in message, message


# ---------------------------------------------------------------- 8. init_distributed's backend

def test_init_distributed_picks_the_same_backend_on_every_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without LOCAL_WORLD_SIZE (an env:// launcher other than torchrun) the backend used to follow
    LOCAL_RANK: NCCL on local rank 0, gloo on local rank 1 of a one-GPU machine."""
    from routelab.parallel import init_distributed

    chosen: dict[int, str] = {}
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: None)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)

    def each_rank(gpu: bool) -> dict[int, str]:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: int(gpu))
        monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
        chosen.clear()
        for rank in (0, 1):
            for key, value in {"RANK": rank, "WORLD_SIZE": 2, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": 1,
                               "LOCAL_RANK": rank}.items():
                monkeypatch.setenv(key, str(value))
            monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: chosen.__setitem__(rank, backend))
            try:
                init_distributed()
            except RuntimeError as e:
                chosen[rank] = str(e)
        return dict(chosen)

    with_gpu = each_rank(True)
    assert with_gpu[0] == with_gpu[1] and "LOCAL_WORLD_SIZE" in with_gpu[0], with_gpu
    assert each_rank(False) == {0: "gloo", 1: "gloo"}
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert each_rank(True) == {0: "gloo", 1: "gloo"}  # 2 processes, 1 GPU


# ---------------------------------------------------------------- 9. host synchronisations per forward

def _sync_worker(rank: int, world: int) -> dict:
    from torch.utils._python_dispatch import TorchDispatchMode

    reads = {"tolist": 0, "ops": []}
    syncing = {"_local_scalar_dense", "nonzero", "bincount", "masked_select", "unique"}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            bool_index = name == "index" and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                                 for i in (args[1] if len(args) > 1 else []))
            if name in syncing or bool_index:
                reads["ops"].append(name)
            return func(*args, **(kwargs or {}))

    tolist = torch.Tensor.tolist

    def counted(self):
        reads["tolist"] += 1
        return tolist(self)

    torch.manual_seed(0)
    moe = MoE(D, H, 4, router="topk", k=2, capacity_factor=1.0, check_finite=False, dispatch="buffers")
    out = {}
    for check in (False, True):
        ep = ExpertParallelMoE.from_moe(moe, check_decisions=check)
        x = _global_batch(8, 1)
        ep(x)
        reads.update(tolist=0, ops=[])
        torch.Tensor.tolist = counted
        try:
            with Count():
                y, routes = ep(x)
        finally:
            torch.Tensor.tolist = tolist
        out[check] = (reads["tolist"], list(reads["ops"]))
        assert routes.stats["global_tokens"].device == y.device
    return out


def test_a_forward_reads_the_device_once_for_its_plan():
    """One read of the token counts (the global batch size), one of the plan's counts and fingerprint,
    and with check_decisions one of the exchanged counts: no boolean indexing, no bincount."""
    for out in run_workers(_sync_worker, 2, timeout=30):
        assert out == {False: (2, []), True: (3, [])}, out
