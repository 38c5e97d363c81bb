"""routelab.aux_loss and routelab.routing_stats over routelab MoE layers (routelab.routing.record)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import routelab
from routelab.layers import MoE


class Net(torch.nn.Module):
    def __init__(self, router: str = "topk", **kw) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = MoE(8, 16, 4, router=router, **kw)
        self.b = MoE(8, 16, 4, router=router, **kw)

    def forward(self, x, ckpt: bool = False):
        ya, ra = checkpoint(self.a, x, use_reentrant=False) if ckpt else self.a(x)
        yb, rb = self.b(x + ya)
        return x + ya + yb, (ra, rb)


def test_aux_loss_is_the_sum_of_the_layers_returned_aux():
    net = Net("noisy_topk", k=2)
    y, routes = net(torch.randn(12, 8))
    expected = sum(sum(r.aux.values()) for r in routes)
    assert torch.allclose(routelab.aux_loss(net), expected)
    assert routelab.aux_loss(net).requires_grad


def test_aux_loss_without_routelab_modules_is_a_zero_on_the_models_device():
    zero = routelab.aux_loss(torch.nn.Linear(3, 3))
    assert zero.shape == () and float(zero) == 0.0 and zero.device.type == "cpu"
    assert float(routelab.aux_loss(Net())) == 0.0  # before the first forward
    with pytest.raises(TypeError, match="nn.Module"):
        routelab.aux_loss("model")
    with pytest.raises(TypeError, match="nn.Module"):
        routelab.routing_stats(3)


def test_routing_stats_are_the_last_forwards_per_layer():
    net = Net(capacity_factor=0.5)
    net(torch.randn(20, 8))
    _, routes = net(torch.randn(16, 8))
    stats = routelab.routing_stats(net)
    assert list(stats) == ["a", "b"]
    for layer, r in zip(stats.values(), routes, strict=True):
        for key in ("tokens_per_expert", "dropped_fraction", "load_cv", "tokens_dropped", "capacity"):
            assert torch.equal(layer[key], r.stats[key])
        assert not layer["load_cv"].requires_grad
        assert int(layer["tokens_per_expert"].sum()) <= 16


def test_only_the_last_forward_is_kept():
    net = Net("topk", k=2)
    _, routes = net(torch.randn(12, 8))
    first = weakref.ref(routes[0].aux["balance"])
    del routes
    net(torch.randn(12, 8))
    gc.collect()
    assert first() is None  # the first forward's loss (and its graph) is gone


def test_the_last_record_is_released_before_the_next_forward_routes():
    """The record goes when the next forward starts, not when it ends: otherwise its graph keeps the
    router's AccumulateGrad nodes alive from step to step, on the stream of the first step, and a
    training step captured in a CUDA graph fails in backward (the GPU test in test_moe_dispatch)."""
    moe = MoE(8, 16, 4, router="topk", k=2)
    y, routes = moe(torch.randn(12, 8))
    y.sum().backward()
    previous = weakref.ref(routes.aux["balance"])
    del y, routes
    gc.collect()
    assert previous() is not None  # the record holds it until the next forward
    released = []
    moe.router.register_forward_pre_hook(lambda module, args: released.append(previous() is None))
    moe(torch.randn(12, 8))
    assert released == [True]
    assert "balance" in moe.last_aux  # and the new forward recorded its own


def test_a_forward_that_fails_leaves_no_stale_record():
    moe = MoE(8, 16, 4, router="topk")
    moe(torch.randn(12, 8))
    assert moe.last_aux
    with pytest.raises(ValueError, match="d_model"):
        moe(torch.randn(12, 5))
    assert moe.last_aux == {} and moe.last_stats == {}
    assert float(routelab.aux_loss(moe)) == 0.0


@pytest.mark.parametrize("early_stop", [True, False])
def test_the_record_outlives_a_checkpointed_backward(early_stop):
    """Non-reentrant checkpointing recomputes the layer inside backward and, by default, stops once
    it has rebuilt what it needs, possibly before the layer records: the step's record must stay
    (statistics logged after backward)."""
    torch.manual_seed(0)
    norm, moe = torch.nn.LayerNorm(8), MoE(8, 16, 4, router="topk", k=2, dispatch="buffers")
    h = torch.randn(12, 8, requires_grad=True)
    with torch.utils.checkpoint.set_checkpoint_early_stop(early_stop):
        y = checkpoint(lambda t: t + moe(norm(t))[0], h, use_reentrant=False)
        before = routelab.routing_stats(moe)[""]["tokens_per_expert"].clone()
        loss = routelab.aux_loss(moe)
        (y.square().mean() + loss).backward()
    assert torch.equal(routelab.routing_stats(moe)[""]["tokens_per_expert"], before)
    assert torch.allclose(routelab.aux_loss(moe).detach(), loss.detach())


def test_checkpointing_gives_the_same_aux_gradients():
    grads = []
    for ckpt in (False, True):
        net = Net("topk", k=2)
        x = torch.randn(12, 8, generator=torch.Generator().manual_seed(3))
        y, _ = net(x, ckpt=ckpt)
        (y.square().mean() + routelab.aux_loss(net)).backward()
        grads.append([p.grad.clone() for p in net.parameters()])
    for g0, g1 in zip(*grads, strict=True):
        assert torch.allclose(g0, g1, atol=1e-6)


class OnePerTask(torch.nn.Module):
    """One MoE layer per task: each step runs one of them (as LayerDrop or a skipped encoder would)."""

    def __init__(self, ckpt: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = MoE(8, 16, 4, router="noisy_topk", k=2), MoE(8, 16, 4, router="noisy_topk", k=2)
        self.ckpt = ckpt

    def forward(self, x, task: int):
        layer = self.a if task == 0 else self.b
        return checkpoint(layer, x, use_reentrant=False)[0] if self.ckpt else layer(x)[0]


@pytest.mark.parametrize("ckpt", [False, True])
def test_a_layer_that_did_not_run_this_step_adds_nothing(ckpt):
    """A review case: a layer that did not run kept its earlier step's record, whose graph that
    step's backward had freed, so the next aux_loss's backward failed ("backward through the graph
    a second time"). Oracle: each step's aux_loss is the aux of the layer that ran, and after
    backward (for logging) still is; the gradients equal those of that layer's returned aux."""
    net = OnePerTask(ckpt)
    x = torch.randn(12, 8, generator=torch.Generator().manual_seed(1))
    for task in (0, 1, 0, 1, 1):
        layer = net.a if task == 0 else net.b
        net.zero_grad()
        y = net(x, task)
        expected = sum(layer.last_aux.values())
        loss = routelab.aux_loss(net)
        torch.testing.assert_close(loss, expected)
        (y.square().mean() + loss).backward()
        torch.testing.assert_close(routelab.aux_loss(net), expected.detach())  # logging after backward
        idle = net.b if task == 0 else net.a
        assert all(p.grad is None or not p.grad.abs().sum() for p in idle.parameters())
        assert layer.router.proj.weight.grad.abs().sum() > 0


def test_records_consumed_by_a_backward_release_their_graph():
    """A layer that did not run keeps a consumed record; once another layer has run, aux_loss
    detaches it (its graph released), and keeps the step's record differentiable until then."""
    net = OnePerTask()
    y = net(torch.randn(12, 8), 0)
    (y.sum() + routelab.aux_loss(net)).backward()
    assert any(v.requires_grad for v in net.a.last_aux.values())  # a retain_graph=True backward may reuse it
    net(torch.randn(12, 8), 1)
    routelab.aux_loss(net)
    assert net.a.last_aux and not any(v.requires_grad for v in net.a.last_aux.values())


def test_reentrant_checkpointing_warns_that_aux_loss_trains_nothing():
    """Reentrant checkpointing runs the forward under no_grad: the recorded losses have no graph,
    which aux_loss says. An eval forward under no_grad is not warned about."""
    torch.manual_seed(0)
    moe = MoE(8, 16, 4, router="noisy_topk", k=2)
    x = torch.randn(12, 8, requires_grad=True)
    out = checkpoint(lambda t: moe(t)[0], x, use_reentrant=True)
    with pytest.warns(UserWarning, match="without gradient.*use_reentrant=False"):
        assert not routelab.aux_loss(moe).requires_grad
    out.sum().backward()
    moe.eval()
    with torch.no_grad():
        moe(x)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        routelab.aux_loss(moe)


def test_under_reentrant_checkpointing_the_aux_losses_train_as_an_output_of_the_checkpoint():
    """The README's recipe for reentrant checkpointing (a review found its earlier advice, to sum
    the ``routes.aux`` a call returns, trained nothing: they have no graph there either): the
    losses' sum returned by the checkpointed function carries the gradient of the plain forward.
    Oracle: the same step without checkpointing (batchwise gating's thresholds learn from their
    loss alone)."""
    torch.manual_seed(0)
    moe = MoE(8, 16, 4, router="batchwise", k=2)
    x = torch.randn(16, 8, requires_grad=True)  # (a reentrant checkpoint's outputs need an input that does)

    def step(use_checkpoint: bool) -> dict[str, torch.Tensor]:
        moe.zero_grad()
        if use_checkpoint:
            _, routes = checkpoint(moe, x, use_reentrant=True)
            assert not any(v.requires_grad for v in routes.aux.values())  # the advice that trained nothing
            y, aux = checkpoint(lambda t: (lambda y, r: (y, sum(r.aux.values())))(*moe(t)), x, use_reentrant=True)
        else:
            y, routes = moe(x)
            aux = sum(routes.aux.values())
        (y.square().mean() + aux).backward()
        return {name: p.grad.clone() for name, p in moe.named_parameters()}

    plain, checkpointed = step(False), step(True)
    assert plain["router.thresholds"].abs().sum() > 0
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, msg=name)


def test_a_retained_graph_keeps_its_aux_gradient():
    """A review case: ``autograd.grad(aux_loss, retain_graph=True)`` (GradNorm, logging gradient
    norms) consumed the records and detached them, so the step's real backward lost the aux
    gradient. Oracle: the router's gradient with the aux term minus without it equals the aux
    term's own gradient."""
    torch.manual_seed(0)
    moe = MoE(8, 16, 4, router="noisy_topk", k=2)
    x = torch.randn(12, 8)
    y, routes = moe(x)
    w = moe.router.proj.weight
    (aux_grad,) = torch.autograd.grad(routelab.aux_loss(moe), [w], retain_graph=True)
    (task_grad,) = torch.autograd.grad(y.sum(), [w], retain_graph=True)
    second = routelab.aux_loss(moe)
    assert second.requires_grad
    (y.sum() + second).backward()
    torch.testing.assert_close(w.grad, task_grad + aux_grad)


def test_results_summed_into_one_loss_are_consumed_by_one_backward():
    """A review case: two aux_loss results (encoder, decoder) in one loss were numbered as two
    backward passes, so logging after backward returned the decoder's losses only."""
    net = Net("noisy_topk", k=2)
    y, routes = net(torch.randn(12, 8))
    expected = sum(sum(r.aux.values()) for r in routes).detach()
    (y.sum() + routelab.aux_loss(net.a) + routelab.aux_loss(net.b)).backward()
    torch.testing.assert_close(routelab.aux_loss(net), expected)


def test_a_checkpointed_backward_of_two_forwards_leaves_the_latest_record() -> None:
    """Review finding: activation checkpointing recomputes in backward, in reverse order, and every
    recomputation replaced the record: after a backward through two calls (a DPO pair, say),
    aux_loss and routing_stats gave the first call's values, unlike the same step without
    checkpointing. A recomputation now leaves the record in place."""
    results = []
    for use_checkpoint in (False, True):
        torch.manual_seed(0)
        moe = MoE(8, 16, 4, router="topk", k=2)
        a, b = torch.randn(8, 8, generator=torch.Generator().manual_seed(1)), torch.randn(8, 8)

        def run(x: torch.Tensor, moe: MoE = moe) -> torch.Tensor:
            return moe(x)[0]

        # (early stop off: the recomputation runs the whole forward, its record included, as a
        # patched transformers gate's does, which records before the experts)
        with torch.utils.checkpoint.set_checkpoint_early_stop(False):
            ya = checkpoint(run, a, use_reentrant=False) if use_checkpoint else run(a)
            yb = checkpoint(run, b, use_reentrant=False) if use_checkpoint else run(b)
        before = float(routelab.aux_loss(moe).detach())
        stats = routelab.routing_stats(moe)[""]["tokens_per_expert"].clone()
        (ya.square().mean() + yb.square().mean() + routelab.aux_loss(moe)).backward()
        after = float(routelab.aux_loss(moe).detach())
        assert after == before
        assert torch.equal(routelab.routing_stats(moe)[""]["tokens_per_expert"], stats)
        results.append((before, stats))
    assert results[0][0] == results[1][0] and torch.equal(results[0][1], results[1][1])
