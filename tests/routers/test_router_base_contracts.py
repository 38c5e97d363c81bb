"""The contracts every router shares, and those of the modules under it.

* :class:`routelab.routers.base.Router`: ``k`` checked at construction and by the setter; ``x``
  must be ``[tokens, d_model]`` and the error names ``x``; an integer or bool ``x`` refused, the
  error naming ``x.float()``; non-finite logits refused by default;
  masked tokens routed nowhere while the real ones route as alone; a router bias enters the logits
  on both scoring paths; the routing rule runs with autocast off; a ``capacity_factor`` below 1
  refused when a layer with a quota-filling router is built.
* :func:`routelab.routers.base.proposes_every_slot`: ``False`` for a router with a forward
  pre-hook (one that injects a ``mask`` makes ``keep`` not all True), and for each routing method
  (``route``, ``route_features``, ``forward``, ``__call__``) set on the instance.
* :class:`routelab.replay.NoiseReplay`: one stochastic router used in two checkpointed segments
  gives the gradients of the uncheckpointed computation (the truth).
* :func:`routelab.routers._scores.float32_linear`: the double backward in the gradient-penalty
  order (``d/dw`` of ``||dL/dx||^2``) against the same computed in float64 with plain ``F.linear``.
* :meth:`routelab.Routes.to`: every tensor moves, ``stats`` included (to the ``meta`` device, a
  device other than the CPU on any machine).
* :func:`routelab.routing.eager.eager`: the function runs eagerly inside a compiled caller (it
  sees ``torch.compiler.is_compiling()`` False), not traced, and so do the functions it calls
  (the exclusion is recursive).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from routelab import Routes
from routelab.layers import MoE
from routelab.routers import BASERouter, NoisyTopKRouter, TopKRouter
from routelab.routers._scores import float32_linear
from routelab.routers.base import Router, proposes_every_slot
from routelab.routing.eager import eager

D = 8


def randn(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# ---------------------------------------------------------------- Router (routers/base.py)


def test_k_is_checked_at_construction_and_by_the_setter():
    with pytest.raises(ValueError, match="num_experts"):
        TopKRouter(D, 4, k=5)
    router = TopKRouter(D, 4)
    for bad in (0, 5, 2.5):
        with pytest.raises(ValueError, match="k"):
            router.k = bad
    assert router.k == router.slots == 1
    router.k = 4
    assert router.slots == 4


def test_x_must_be_two_dimensional_and_the_error_names_x():
    router = TopKRouter(D, 4)
    for call in (router, router.gate):
        with pytest.raises(ValueError, match=r"x must have shape \[tokens, d_model=8\]"):
            call(randn(2, 3, D))


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool], ids=["int64", "bool"])
@pytest.mark.parametrize("router_class", [TopKRouter, BASERouter])
def test_an_x_that_is_not_floating_is_refused_naming_the_fix(router_class, dtype):
    """Token ids (or a mask) passed by mistake must not be routed as if they were features."""
    x = torch.randint(0, 5, (3, D), generator=torch.Generator().manual_seed(0)).to(dtype)
    router = router_class(D, 4)
    for call in (router, router.gate):
        with pytest.raises(ValueError, match=r"x must be a floating tensor.*x\.float\(\)"):
            call(x)


def test_nan_logits_are_refused_by_default_naming_the_router_logits():
    x = randn(6, D)
    x[2, 0] = float("nan")
    router = TopKRouter(D, 4)
    assert router.check_finite is True
    with pytest.raises(ValueError, match="router logits"):
        router(x)


def test_a_mask_routes_the_padding_nowhere_and_the_real_tokens_as_alone():
    router = BASERouter(D, 2)
    torch.nn.init.normal_(router.proj.weight, generator=torch.Generator().manual_seed(0))
    x = randn(8, D)
    mask = torch.tensor([True] * 4 + [False] * 4)
    routes = router(x, mask=mask)
    assert not routes.keep[~mask].any()
    assert torch.equal(routes.expert[mask], router(x[:4]).expert)


@pytest.mark.parametrize("in_input_dtype", [False, True], ids=["float32", "input_dtype"])
def test_a_router_bias_enters_the_logits(in_input_dtype):
    router = TopKRouter(D, 4)
    router.proj = torch.nn.Linear(D, 4, bias=True)
    with torch.no_grad():
        router.proj.weight.copy_(randn(4, D, seed=1))
        router.proj.bias.copy_(torch.tensor([5.0, 0, 0, 0]))
    router.logits_in_input_dtype = in_input_dtype
    x = randn(6, D, dtype=torch.bfloat16 if in_input_dtype else torch.float32)
    want = x.double() @ router.proj.weight.double().t() + router.proj.bias.double()
    # (bfloat16 scoring rounds the weight and the result: a few of its ulps at |logit| ~ 5)
    torch.testing.assert_close(router.logits(x).double(), want, atol=0.1 if in_input_dtype else 1e-5, rtol=0)


def test_the_routing_rule_runs_with_autocast_off():
    """A router's :meth:`~Router.route` (here one whose rule multiplies the logits by a matrix, an
    autocast-eligible op) runs in float32 inside a ``torch.autocast`` region."""
    seen = []

    class MixingRouter(Router):
        def route(self, features, capacity):
            mixed = features @ torch.eye(features.shape[-1])
            seen.append(mixed.dtype)
            return Routes.from_expert(mixed.argmax(-1))

    router = MixingRouter(D, 4, 1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        router(randn(5, D))
    assert seen == [torch.float32]


@pytest.mark.parametrize("name", ["base", "batchwise", "gumbel_matching"])
def test_a_capacity_factor_below_one_is_refused_when_built(name):
    for factor in (0.5, 0.75, 0.99):
        with pytest.raises(ValueError, match=f"capacity_factor={factor} is below 1"):
            MoE(D, 16, 4, router=name, capacity_factor=factor)
    MoE(D, 16, 4, router=name, capacity_factor=1.0)


def test_a_forward_pre_hook_makes_a_router_not_trusted_to_propose_every_slot():
    """A pre-hook can change the router's inputs: here it injects a token mask, so ``keep`` is no
    longer all True and the flag (which lets the HF patch skip a host sync) must say so."""

    def inject_mask(module, args, kwargs):
        return args, {**kwargs, "mask": torch.tensor([True, False, True])}

    router = TopKRouter(D, 4, k=2)
    assert proposes_every_slot(router)
    handle = router.register_forward_pre_hook(inject_mask, with_kwargs=True)
    assert not router(randn(3, D)).keep.all()  # the hook does drop slots
    assert not proposes_every_slot(router)
    handle.remove()
    assert proposes_every_slot(router)


@pytest.mark.parametrize("name", ["route", "route_features", "forward", "__call__"])
def test_a_routing_method_set_on_the_instance_makes_a_router_not_trusted_to_propose_every_slot(name):
    router = TopKRouter(D, 4, k=2)
    assert proposes_every_slot(router)
    setattr(router, name, lambda *args, **kwargs: None)
    assert not proposes_every_slot(router)


# ---------------------------------------------------------------- NoiseReplay (replay.py)


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_one_stochastic_router_in_two_checkpointed_segments_gives_the_uncheckpointed_gradients(use_reentrant):
    """Backward recomputes segment 2 then segment 1: each must replay its own forward's noise."""
    router = NoisyTopKRouter(D, 4, k=1)
    torch.nn.init.normal_(router.proj.weight, generator=torch.Generator().manual_seed(1))
    torch.nn.init.normal_(router.noise.weight, generator=torch.Generator().manual_seed(2))
    x = randn(16, D)

    def segment(h):
        routes = router(h)
        return h * routes.gate.sum(-1, keepdim=True) + routes.aux["load"]

    def gradients(checkpointed: bool) -> torch.Tensor:
        router.zero_grad()
        router.generator = torch.Generator().manual_seed(7)
        h = x.clone().requires_grad_(True)
        for _ in range(2):
            h = checkpoint(segment, h, use_reentrant=use_reentrant) if checkpointed else segment(h)
        h.square().sum().backward()
        return torch.cat([router.proj.weight.grad.flatten(), router.noise.weight.grad.flatten()])

    assert torch.equal(gradients(True), gradients(False))


# ---------------------------------------------------------------- float32_linear (routers/_scores.py)


@pytest.mark.parametrize(("dtype", "rtol"), [(torch.float64, 1e-5), (torch.bfloat16, 2e-2)],
                         ids=["float64", "bfloat16"])
def test_float32_linear_double_backward_gives_the_gradient_penalty_gradient_of_the_weight(dtype, rtol):
    """``d/dw ||dL/dx||^2`` (a gradient penalty on the input): the other order than test_scores'
    double-backward test, so ``grad_x``'s own dependence on the weight is exercised. Truth: the
    same in float64 with ``F.linear``; a bfloat16 ``dL/dx`` is rounded once (relative 2^-8)."""

    def penalty_gradient(linear, x, w):
        x, w = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        (gx,) = torch.autograd.grad(linear(x, w).square().sum(), x, create_graph=True)
        (gw,) = torch.autograd.grad(gx.double().square().sum(), w)
        return gw.double()

    x, w = randn(5, 6, dtype=dtype), randn(3, 6, seed=1)
    got = penalty_gradient(float32_linear, x, w)
    want = penalty_gradient(F.linear, x.double(), w.double())
    torch.testing.assert_close(got, want, rtol=0, atol=rtol * float(want.abs().max()))


# ---------------------------------------------------------------- Routes.to (routes.py)


def test_routes_to_moves_every_tensor_aux_and_stats_included():
    routes = Routes.from_expert(torch.tensor([0, 1, 1]))
    routes.aux = {"balance": torch.tensor(0.5)}
    routes.stats = {"dropped": torch.tensor(0.0), "load": torch.tensor([1, 2])}
    moved = routes.to("meta")
    tensors = [getattr(moved, name) for name in ("expert", "gate", "keep", "weight", "log_prob")]
    assert all(t.device.type == "meta" for t in tensors + [*moved.aux.values(), *moved.stats.values()])
    assert sorted(moved.aux) == ["balance"] and sorted(moved.stats) == ["dropped", "load"]
    assert moved.stats["load"].dtype == torch.long and moved.aux["balance"].dtype == torch.float32


# ---------------------------------------------------------------- eager (routing/eager.py)


def test_an_eager_function_runs_eagerly_inside_a_compiled_caller():
    calls = []

    @eager
    def solver(x):
        calls.append(torch.compiler.is_compiling())  # False when run eagerly, True while Dynamo traces it
        return x * 2

    compiled = torch.compile(lambda x: solver(x) + 1, backend="eager", fullgraph=False)
    torch.testing.assert_close(compiled(torch.ones(3)), torch.full((3,), 3.0))
    assert calls == [False]


_helper_calls: list[bool] = []


def _helper_of_an_eager_function(x: torch.Tensor) -> torch.Tensor:
    _helper_calls.append(torch.compiler.is_compiling())  # True exactly while Dynamo traces it
    return x * 2


def test_the_functions_an_eager_function_calls_run_eagerly_too():
    """``eager`` is ``torch.compiler.disable`` *recursively*: a solver's plain helpers must not be
    traced either (Dynamo would skip only the solver's own frame otherwise)."""

    @eager
    def solver(x):
        return _helper_of_an_eager_function(x) + 1

    _helper_calls.clear()
    compiled = torch.compile(lambda x: solver(x) - 1, backend="eager", fullgraph=False)
    torch.testing.assert_close(compiled(torch.ones(3)), torch.full((3,), 2.0))
    assert _helper_calls == [False]
