"""Documented contracts of routelab.parallel that a mutation review (s41) found untested.

* ``clip_grad_norm_``: the inf-norm counts the replicated (router) gradients; a NaN there wins
  over an inf in a shard; ``error_if_nonfinite`` raises on every rank; a model's norm is
  reduced over its layers' process group, not the default group.
* ``all_to_all`` / ``all_gather_rows``: inconsistent counts are rejected, at world size 1 (the
  shortcuts) and, for ``all_gather_rows``, at world size 2.
* ``ExpertParallelMoE``: ranks whose plans send different row counts are told so ("receiving
  ... rows per rank"), not only that the fingerprints differ; seeded experts are initialised
  within ``nn.Linear``'s bound; a ``generator``'s state is broadcast from rank 0 at construction.
* ``run_workers``: a ``world_size`` that is not a positive int is rejected.

Independent truths: ``torch.nn.utils.clip_grad_norm_`` / ``get_total_norm`` on the equivalent
single-process parameters or model, the counts the caller passed, ``nn.Linear``'s documented bound
``1/sqrt(fan_in)``, and a generator seeded as rank 0's. Every test starts its ranks
with routelab.parallel.run_workers (forked, single-threaded gloo processes, a deadline on the
whole run); the layers are tiny (d_model 6, 4 experts).
"""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.distributed as dist

from routelab.layers import MoE
from routelab.parallel import ExpertParallelMoE, all_gather_rows, all_to_all, clip_grad_norm_, run_workers

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is needed")

D, H = 6, 10


def _params(values: list[list[float]]) -> list[torch.nn.Parameter]:
    """Parameters whose gradients are ``values``."""
    out = []
    for v in values:
        p = torch.nn.Parameter(torch.zeros(len(v)))
        p.grad = torch.tensor(v)
        out.append(p)
    return out


# ---------------------------------------------------------------- clip_grad_norm_: norms

def _router_largest_worker(rank: int, world: int) -> list[tuple[float, float]]:
    # The router's gradient [10, 0, 0] (the same on every rank) holds the largest entry; rank r's
    # expert shard holds [1 + r, 0]. The single-process model holds the router and both shards.
    out = []
    for norm_type in (float("inf"), 2.0):
        router, expert = _params([[10.0, 0.0, 0.0], [1.0 + rank, 0.0]])
        ref = _params([[10.0, 0.0, 0.0], [1.0, 0.0], [2.0, 0.0]])
        want = torch.nn.utils.clip_grad_norm_(ref, 1.0, norm_type)
        got = clip_grad_norm_([router, expert], 1.0, norm_type, sharded_parameters=[expert])
        assert torch.allclose(got, want, rtol=1e-6, atol=0), (norm_type, float(got), float(want))
        # clipped by the global norm, as the single-process parameters were
        assert torch.allclose(router.grad, ref[0].grad, rtol=1e-6, atol=0)
        assert torch.allclose(expert.grad, ref[1 + rank].grad, rtol=1e-6, atol=0)
        out.append((float(got), float(want)))
    return out


def test_the_inf_norm_counts_the_router_gradient_when_it_holds_the_largest_entry():
    a, b = run_workers(_router_largest_worker, 2, timeout=30)
    assert a == b
    assert a[0][0] == 10.0  # max(10, 1, 2)
    assert a[1][0] == pytest.approx(math.sqrt(100 + 1 + 4), rel=1e-6)


def _nan_router_worker(rank: int, world: int) -> list[float]:
    # A NaN in the router's gradient (every rank), an inf in rank 1's expert shard.
    out = []
    for norm_type in (2.0, float("inf")):
        router, expert = _params([[math.nan, 1.0], [math.inf if rank == 1 else 1.0, 0.0]])
        want = torch.nn.utils.get_total_norm([torch.tensor([math.nan, 1.0]), torch.tensor([1.0, 0.0]),
                                              torch.tensor([math.inf, 0.0])], norm_type)
        assert math.isnan(float(want))  # torch: NaN wins over inf
        out.append(float(clip_grad_norm_([router, expert], 1.0, norm_type, sharded_parameters=[expert])))
    return out


def test_a_nan_in_the_router_gradient_wins_over_an_inf_in_a_shard_on_every_rank():
    for norms in run_workers(_nan_router_worker, 2, timeout=30):
        assert all(math.isnan(v) for v in norms), norms


def _nonfinite_error_worker(rank: int, world: int) -> dict:
    # Only rank 1's expert shard is non-finite: rank 0 must raise too (the total norm is global).
    out = {}
    for bad in (math.inf, math.nan):
        router, expert = _params([[1.0, 1.0], [bad if rank == 1 else 1.0, 0.0]])
        ref = _params([[1.0, 1.0], [1.0, 0.0], [bad, 0.0]])
        with pytest.raises(RuntimeError, match="non-finite"):  # torch on the single-process parameters
            torch.nn.utils.clip_grad_norm_(ref, 1.0, error_if_nonfinite=True)
        with pytest.raises(RuntimeError, match="error_if_nonfinite") as info:
            clip_grad_norm_([router, expert], 1.0, sharded_parameters=[expert], error_if_nonfinite=True)
        # raised before clipping: the gradients are as they were
        assert router.grad.tolist() == [1.0, 1.0]
        out[str(bad)] = str(info.value)
    # Finite gradients: no error, torch's norm.
    router, expert = _params([[1.0, 1.0], [1.0 + rank, 0.0]])
    ref = _params([[1.0, 1.0], [1.0, 0.0], [2.0, 0.0]])
    got = clip_grad_norm_([router, expert], 10.0, sharded_parameters=[expert], error_if_nonfinite=True)
    assert torch.allclose(got, torch.nn.utils.clip_grad_norm_(ref, 10.0, error_if_nonfinite=True), rtol=1e-6)
    return out


def test_error_if_nonfinite_raises_on_every_rank_before_clipping():
    for out in run_workers(_nonfinite_error_worker, 2, timeout=30):
        assert "is inf" in out["inf"] and "is nan" in out["nan"], out


def _subgroup_clip_worker(rank: int, world: int) -> dict:
    # Two independent expert-parallel models, over ranks {0, 1} and {2, 3}, with gradients of very
    # different sizes: each model's norm is that of its own single-process model.
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    g, local = rank // 2, rank % 2
    torch.manual_seed(g)
    moe = MoE(D, H, 4, router="topk", k=2)
    ep = ExpertParallelMoE.from_moe(moe, groups[g])
    x = torch.randn(8, D, generator=torch.Generator().manual_seed(g)) * (1 + 5 * g)  # the group's batch
    mine = slice(4 * local, 4 * local + 4)
    y_ref, r_ref = moe(x)
    ((x + y_ref).pow(2).sum() + sum(r_ref.aux.values())).backward()
    want = torch.nn.utils.clip_grad_norm_(moe.parameters(), 0.5)
    y, r = ep(x[mine])
    ((x[mine] + y).pow(2).sum() + sum(r.aux.values()) / 2).backward()
    ep.reduce_replicated_grads()
    got = clip_grad_norm_(ep, 0.5)  # process_group=None: that of the model's layers
    assert torch.allclose(got, want, rtol=1e-5, atol=0), (rank, float(got), float(want))
    assert torch.allclose(ep.router.proj.weight.grad, moe.router.proj.weight.grad, atol=1e-5)
    lo, hi = ep.expert_offset, ep.expert_offset + ep.local_experts
    assert torch.allclose(ep.experts.w1.grad, moe.experts.w1.grad[lo:hi], atol=1e-5)
    return {"got": float(got), "want": float(want)}


def test_clipping_a_model_reduces_over_its_layers_process_group():
    out = run_workers(_subgroup_clip_worker, 4, timeout=60)
    assert out[0] == out[1] and out[2] == out[3]
    assert out[0]["want"] != pytest.approx(out[2]["want"], rel=0.1)  # the two models differ


# ---------------------------------------------------------------- count checks of the collectives

def _world_one_counts_worker(rank: int, world: int) -> None:
    x = torch.arange(6.0).reshape(3, 2)
    assert torch.equal(all_to_all(x, [3], [3]), x)
    with pytest.raises(ValueError, match=re.escape("send_counts=[3], recv_counts=[2]")):
        all_to_all(x, [3], [2])  # one rank receives what it sends
    assert torch.equal(all_gather_rows(x, [3]), x)
    with pytest.raises(ValueError, match="counts says this rank has 5 rows but x has 3"):
        all_gather_rows(x, [5])


def test_the_world_size_one_shortcuts_reject_inconsistent_counts():
    run_workers(_world_one_counts_worker, 1, timeout=30)


def _gather_counts_worker(rank: int, world: int) -> None:
    # Each rank's own entry of counts is wrong: every rank raises before the exchange.
    x = torch.full((3, 2), float(rank))
    counts = [3, 3]
    counts[rank] = 5
    with pytest.raises(ValueError, match="counts says this rank has 5 rows but x has 3"):
        all_gather_rows(x, counts)
    assert torch.equal(all_gather_rows(x, [3, 3]), torch.cat([torch.zeros(3, 2), torch.ones(3, 2)]))


def test_all_gather_rows_rejects_counts_that_disagree_with_the_rows():
    run_workers(_gather_counts_worker, 2, timeout=20)


# ---------------------------------------------------------------- diverging decisions

def _diverging_counts_worker(rank: int, world: int) -> str:
    # Each rank seeds its generator differently: random drops give the ranks different plans,
    # whose row counts differ.
    gen = torch.Generator().manual_seed(rank)
    torch.manual_seed(0)
    moe = MoE(D, H, 4, router="topk", k=2, capacity_factor=0.5, drop_policy="random", generator=gen)
    ep = ExpertParallelMoE.from_moe(moe)
    torch.manual_seed(1)
    with pytest.raises(RuntimeError, match="decisions differ across ranks") as info:
        ep(torch.randn(32, D))
    return str(info.value)


def test_diverging_row_counts_are_reported_as_counts():
    """Ranks whose decisions diverge raise quickly (each rank's RuntimeError, not the TimeoutError
    of a hang), and a rank whose received row counts differ from its plan says so with both counts."""
    counted = 0
    for message in run_workers(_diverging_counts_worker, 2, timeout=30):
        m = re.search(r"receiving (\[[\d, ]+\]) rows per rank, the plan says (\[[\d, ]+\])", message)
        if m:
            assert m.group(1) != m.group(2), message
            counted += 1
        else:
            assert "fingerprints" in message, message
    assert counted >= 1


# ---------------------------------------------------------------- expert initialisation

def _init_worker(rank: int, world: int) -> dict:
    ep = ExpertParallelMoE(D, H, 4, router="topk", k=2, activation="swiglu", seed=3)
    ex = ep.experts
    return {name: getattr(ex, name).detach().clone() for name in ("w1", "b1", "w2", "b2", "w3", "b3")}


def test_seeded_experts_are_initialised_within_nn_linears_bound():
    """``init_experts`` initialises like ``nn.Linear``: weights and biases uniform in
    ``[-1/sqrt(fan_in), 1/sqrt(fan_in)]`` (torch's documented default; fan_in = d_model for w1, w3,
    d_hidden for w2), the weights (120 values per rank) filling that range."""
    fan_in = {"w1": D, "b1": D, "w3": D, "b3": D, "w2": H, "b2": H}
    shards = run_workers(_init_worker, 2, timeout=30)
    for name, fan in fan_in.items():
        values = torch.cat([s[name] for s in shards])
        bound = 1.0 / math.sqrt(fan)
        assert values.abs().max() <= bound, (name, float(values.abs().max()), bound)
        if values.numel() >= 60:  # P(max |u| < 0.8 bound) = 0.8^60 < 2e-6
            assert values.abs().max() > 0.8 * bound, (name, float(values.abs().max()), bound)


# ---------------------------------------------------------------- the generator broadcast

def _generator_broadcast_worker(rank: int, world: int) -> bool:
    gen = torch.Generator().manual_seed(10 + rank)  # a different seed on every rank
    torch.manual_seed(0)
    ep = ExpertParallelMoE(D, H, 4, router="noisy_topk", k=2, capacity_factor=0.5, drop_policy="random",
                           generator=gen, seed=1)
    assert ep.router.generator is gen
    assert torch.equal(gen.get_state(), torch.Generator().manual_seed(10).get_state())  # rank 0's
    y, _ = ep(torch.randn(16, D, generator=torch.Generator().manual_seed(rank)))  # the same decisions: no error
    states = [torch.empty_like(gen.get_state()) for _ in range(world)]
    dist.all_gather(states, gen.get_state())
    return all(torch.equal(s, states[0]) for s in states)  # and it advanced identically


def test_the_routers_generator_is_broadcast_from_rank_0_at_construction():
    """Documented: a ``generator``'s state is broadcast from rank 0 at construction and then
    advances identically everywhere (the noisy router and random drops draw from it)."""
    assert run_workers(_generator_broadcast_worker, 2, timeout=30) == [True, True]


# ---------------------------------------------------------------- run_workers' arguments

def _rank_worker(rank: int, world: int) -> int:
    return rank


@pytest.mark.parametrize("world_size", [0, -1, True, 2.0])
def test_run_workers_rejects_a_world_size_that_is_not_a_positive_int(world_size):
    """0 ranks would return ``[]`` (every check over the ranks passing vacuously), True one rank."""
    with pytest.raises(ValueError, match="world_size must be a positive integer"):
        run_workers(_rank_worker, world_size, timeout=10)


# ---------------------------------------------------------------- ranks that differ in what needs a gradient

def _uneven_grads_worker(rank: int, world: int, case: str) -> dict:
    # Rank r holds tokens 4r..4r+3 of the global batch. "frozen": rank 1 froze its router copy
    # (its router features then need no gradient). "no_grad": rank 1 has no router gradient at
    # all when the reduction starts (set to None after its backward).
    torch.manual_seed(0)
    ep = ExpertParallelMoE.from_moe(MoE(D, H, 4, router="topk", k=2))
    if case == "frozen" and rank == 1:
        ep.router.requires_grad_(False)
    torch.manual_seed(1)
    x = torch.randn(8, D)
    ep(x[4 * rank:4 * rank + 4])[0].sum().backward()
    own = None if ep.router.proj.weight.grad is None else ep.router.proj.weight.grad.clone()
    if case == "no_grad" and rank == 1:
        ep.router.zero_grad(set_to_none=True)
    ep.reduce_replicated_grads()
    return {"own": own, "reduced": ep.router.proj.weight.grad.clone()}


@pytest.mark.parametrize("case", ["frozen", "no_grad"])
def test_a_rank_without_a_router_gradient_neither_hangs_nor_changes_the_sum(case: str):
    """The reduction sums what the ranks hold: rank 1 contributes nothing, so every rank ends with
    the router gradient of rank 0's loss alone, which is the single-process layer's gradient of
    the loss of the global batch's first four tokens (top-k's gate of a token depends on its own
    logits only). Before the collectives' inputs were made to need a gradient under grad mode,
    a router frozen on one rank hung the backward: that rank skipped the all-gather's backward
    the other rank waited in."""
    out = run_workers(_uneven_grads_worker, 2, case, timeout=60)
    torch.manual_seed(0)
    ref = MoE(D, H, 4, router="topk", k=2)
    torch.manual_seed(1)
    x = torch.randn(8, D)
    ref(x)[0][:4].sum().backward()
    want = ref.router.proj.weight.grad
    for rank in range(2):
        torch.testing.assert_close(out[rank]["reduced"], want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out[0]["own"], want, rtol=1e-5, atol=1e-6)
