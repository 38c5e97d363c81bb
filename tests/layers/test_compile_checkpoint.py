"""torch.compile and activation checkpointing of the MoE layer (issue 15, item 8).

Oracles: the uncheckpointed computation with the same generator state (gradients), the eager
layer (compiled outputs), and Dynamo's own graph-break count (``torch._dynamo.explain``).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from routelab.layers import MoE
from routelab.replay import NoiseReplay

D, H, E = 8, 16, 4
EVERY_ROUTER = ["softmax", "topk", "switch", "noisy_topk", "batchwise", "base", "sinkhorn", "gumbel_matching"]
ROUTER_K = {"softmax": None, "topk": 2, "switch": 1, "noisy_topk": 2, "batchwise": 2, "base": 1, "sinkhorn": 2,
            "gumbel_matching": 1}
#: The stochastic cases: (router, layer options).
STOCHASTIC = {
    "noisy_topk": ("noisy_topk", {}),
    "gumbel_matching": ("gumbel_matching", {}),
    "random_drop": ("topk", {"drop_policy": "random", "capacity_factor": 0.5}),
}


def build(name: str, generator: torch.Generator | None, **kw) -> MoE:
    torch.manual_seed(0)
    moe = MoE(D, H, E, router=name, k=ROUTER_K[name], generator=generator, **kw)
    with torch.no_grad():
        moe.router.proj.weight.normal_(0, 1.0)
        if name == "noisy_topk":
            moe.router.noise.weight.normal_(0, 0.5)
    return moe


def inputs() -> torch.Tensor:
    return torch.randn(3, 6, D, generator=torch.Generator().manual_seed(11))


# ---------------------------------------------------------------- checkpointing


def gradients(case: str, *, mode: str, seeded_generator: bool, layers: int = 1) -> list[torch.Tensor]:
    """Gradients of a loss through ``layers`` MoE layers (sharing one generator), each layer run
    plainly (``mode="plain"``) or under ``torch.utils.checkpoint`` (``"reentrant"``/``"nonreentrant"``),
    twice in a row (two training steps: the replay must follow the generator across calls)."""
    name, options = STOCHASTIC[case]
    gen = torch.Generator().manual_seed(1234) if seeded_generator else None
    moes = [build(name, gen, **options) for _ in range(layers)]
    torch.manual_seed(99)  # the global RNG, for generator=None
    grads = []
    for _step in range(2):
        x = inputs().requires_grad_(True)
        h, aux = x, torch.zeros(())
        for moe in moes:
            def block(t: torch.Tensor, moe: MoE = moe) -> tuple[torch.Tensor, torch.Tensor]:
                y, routes = moe(t)
                return t + y, sum(routes.aux.values(), torch.zeros(()))

            if mode == "plain":
                h, a = block(h)
            else:
                h, a = checkpoint(block, h, use_reentrant=mode == "reentrant")
            aux = aux + a
        loss = (h * torch.linspace(-1, 1, D)).sum() + aux
        params = [p for moe in moes for p in moe.parameters()]
        for p in params:
            p.grad = None
        loss.backward()  # (not autograd.grad: the re-entrant checkpoint needs .backward())
        grads += [x.grad] + [torch.zeros_like(p) if p.grad is None else p.grad for p in params]
    return grads


@pytest.mark.parametrize("seeded_generator", [True, False], ids=["generator", "global_rng"])
@pytest.mark.parametrize("mode", ["reentrant", "nonreentrant"])
@pytest.mark.parametrize("case", sorted(STOCHASTIC))
def test_checkpointing_gives_the_uncheckpointed_gradients(case: str, mode: str, seeded_generator: bool) -> None:
    want = gradients(case, mode="plain", seeded_generator=seeded_generator, layers=2)
    got = gradients(case, mode=mode, seeded_generator=seeded_generator, layers=2)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-6)


@pytest.mark.parametrize("mode", ["reentrant", "nonreentrant"])
@pytest.mark.parametrize("case", sorted(STOCHASTIC))
def test_an_eval_forward_between_a_checkpointed_forward_and_its_backward_changes_no_gradient(case: str,
                                                                                            mode: str) -> None:
    """A review case: the random drop policy recorded its draw in eval mode too, so a validation
    forward (eval, no_grad) between a checkpointed forward and its backward pushed the record that
    the recomputation then replayed: gradients off by 0.16, silently."""
    name, options = STOCHASTIC[case]

    def grads(checkpointed: bool) -> list[torch.Tensor]:
        moe = build(name, torch.Generator().manual_seed(1234), **options)
        x = inputs().requires_grad_(True)
        if checkpointed:
            y = checkpoint(lambda t: moe(t)[0], x, use_reentrant=mode == "reentrant")
        else:
            y = moe(x)[0]
        moe.eval()
        with torch.no_grad():
            moe(torch.randn(2, 5, D, generator=torch.Generator().manual_seed(3)))
        moe.train()
        (y * torch.linspace(-1, 1, D)).sum().backward()
        return [x.grad] + [torch.zeros_like(p) if p.grad is None else p.grad for p in moe.parameters()]

    for g, w in zip(grads(True), grads(False), strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-6)


@pytest.mark.parametrize("warm_up", [False, True], ids=["first_forward", "after_a_plain_forward"])
@pytest.mark.parametrize("case", sorted(STOCHASTIC))
def test_a_second_backward_through_a_checkpointed_layer_gives_the_uncheckpointed_gradients(case: str,
                                                                                          warm_up: bool) -> None:
    """A review case: a replay consumed its record, so a second backward pass through the same
    graph (``retain_graph=True``: a gradient penalty, per-loss gradient norms) raised "no recorded
    forward noise", or, after an earlier uncheckpointed forward, replayed that forward's noise
    (gradients off by 0.56, silently)."""
    name, options = STOCHASTIC[case]

    def grads(checkpointed: bool) -> list[torch.Tensor]:
        moe = build(name, torch.Generator().manual_seed(1234), **options)
        if warm_up:
            moe(inputs())
        x = inputs().requires_grad_(True)
        y = checkpoint(lambda t: moe(t)[0], x, use_reentrant=False) if checkpointed else moe(x)[0]
        loss = (y * torch.linspace(-1, 1, D)).sum()
        first = torch.autograd.grad(loss, [x, *moe.parameters()], retain_graph=True, allow_unused=True)
        second = torch.autograd.grad(loss, [x, *moe.parameters()], allow_unused=True)
        return [torch.zeros(()) if g is None else g for g in (*first, *second)]

    for g, w in zip(grads(True), grads(False), strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-6)


@pytest.mark.parametrize("case", sorted(STOCHASTIC))
def test_without_the_replay_checkpointing_would_change_the_gradients(case: str, monkeypatch) -> None:
    """The check above can fail: with the replay switched off, a seeded generator draws new noise
    in the recomputation and the gradients differ (the issue measured 0.18 and 0.30)."""
    want = gradients(case, mode="plain", seeded_generator=True)
    monkeypatch.setattr(NoiseReplay, "draw", lambda self, generator: contextlib.nullcontext())
    got = gradients(case, mode="nonreentrant", seeded_generator=True)
    assert max(float((g - w).abs().max()) for g, w in zip(got, want, strict=True)) > 1e-4


def test_replay_leaves_the_generator_stream_untouched() -> None:
    """A recomputation replays the recorded state and restores the generator afterwards."""
    gen = torch.Generator().manual_seed(5)
    replay = NoiseReplay(depth=2)
    with replay.draw(gen):
        first = torch.rand(3, generator=gen)
    after = gen.get_state()
    x = torch.ones((), requires_grad=True)

    def recompute(grad: torch.Tensor) -> torch.Tensor:
        with replay.draw(gen):  # inside backward: a recomputation
            again = torch.rand(3, generator=gen)
        assert torch.equal(again, first)
        return grad

    x.register_hook(recompute)
    (x * 2).backward()
    (x * 2).backward()  # another backward pass replays the same record (it is not consumed)
    assert torch.equal(gen.get_state(), after) and len(replay) == 1
    with pytest.raises(TypeError, match="generator must be a torch.Generator"):
        with replay.draw(3):
            pass
    with pytest.raises(ValueError, match="depth"):
        NoiseReplay(depth=0)


# ---------------------------------------------------------------- torch.compile

try:
    import torch._dynamo as dynamo
except ImportError:  # pragma: no cover - a torch build without Dynamo
    dynamo = None
#: Dynamo tests skip cleanly where torch.compile is unavailable (no Dynamo, unsupported Python).
needs_compile = pytest.mark.skipif(dynamo is None or not dynamo.is_dynamo_supported(),
                                   reason="torch.compile (Dynamo) is not available here")


def _explain(moe: MoE, x: torch.Tensor):
    dynamo.reset()
    return dynamo.explain(lambda t: moe(t)[0])(x)


@pytest.mark.compile
@needs_compile
@pytest.mark.parametrize("capacity_factor", [1.0, None], ids=["cf1", "dropless"])
@pytest.mark.parametrize("name", ["softmax", "topk", "switch", "noisy_topk", "batchwise"])
def test_token_routers_compile_without_graph_breaks(name: str, capacity_factor) -> None:
    moe = build(name, None, capacity_factor=capacity_factor)
    explanation = _explain(moe, inputs())
    reasons = [str(b.reason).splitlines()[0] for b in explanation.break_reasons]
    assert explanation.graph_break_count == 0, reasons
    assert explanation.graph_count == 1


@pytest.mark.compile
@needs_compile
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("name", EVERY_ROUTER)
def test_every_router_runs_under_torch_compile(name: str, training: bool) -> None:
    """No router crashes Dynamo (the solvers run eagerly); compiled outputs and gradients equal the
    eager layer's (the stochastic ones with the same global RNG state)."""
    moe = build(name, None).train(training)
    x = inputs()
    torch.manual_seed(3)
    xe = x.clone().requires_grad_(True)
    ye = moe(xe)[0]
    ye.sum().backward()
    dynamo.reset()
    compiled = torch.compile(lambda t: moe(t)[0], backend="eager")
    torch.manual_seed(3)
    xc = x.clone().requires_grad_(True)
    yc = compiled(xc)
    yc.sum().backward()
    torch.testing.assert_close(yc, ye, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(xc.grad, xe.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.compile
@needs_compile
@pytest.mark.parametrize("name", ["batchwise", "topk"])
def test_inductor_compiled_training_step_equals_eager(name: str) -> None:
    """The real compiler (inductor, not the eager backend): outputs, gates, the auxiliary loss and
    every gradient equal the eager layer's in training. Inductor once read batchwise gating's mask
    before the scatter that built it had run (every gate of some tokens zero), because the mask
    also fed the threshold loss; the mask is now built without a scatter."""
    moe = build(name, None)
    x = inputs()

    def step(fn):
        for p in moe.parameters():
            p.grad = None
        xi = x.clone().requires_grad_(True)
        y, routes = fn(xi)
        (y.square().sum() + sum(routes.aux.values())).backward()
        return [y, routes.gate, *routes.aux.values(), xi.grad, *(p.grad for p in moe.parameters())]

    eager = step(moe)
    dynamo.reset()
    compiled = step(torch.compile(moe, fullgraph=True))
    assert len(compiled) == len(eager)
    for got, want in zip(compiled, eager, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.compile
@needs_compile
@pytest.mark.parametrize("name", ["topk", "batchwise"])
@pytest.mark.parametrize("capacity_factor", [1.0, None])
def test_dynamic_shapes_compile_whole(capacity_factor: float | None, name: str) -> None:
    """``dynamic=True``: one graph for every token count (the capacity factor, a symbolic float
    there, is not checked with math.isfinite while tracing; nor is batchwise's threshold_coef, a
    review case: 6 graph breaks), equal to the eager layer."""
    moe = build(name, None, capacity_factor=capacity_factor)
    dynamo.reset()
    compiled = torch.compile(lambda t: moe(t)[0], backend="aot_eager", dynamic=True, fullgraph=True)
    for n in (12, 20):
        x = torch.randn(n, D, generator=torch.Generator().manual_seed(n))
        torch.testing.assert_close(compiled(x), moe(x)[0], rtol=1e-5, atol=1e-6)


@pytest.mark.compile
@needs_compile
def test_dropless_buffers_of_a_router_naming_an_expert_twice_compile_as_eager() -> None:
    """A review case: a custom router that names one expert in both slots of every token. Compiled
    dropless buffers hold C = tokens rows per expert, so the layer must not place more pairs than
    that in eager mode either (the plan of a capacity of every pair did, and the compiled output
    then differed by 0.2)."""
    from routelab.routers import TopKRouter
    from routelab.routes import Routes

    class Twice(TopKRouter):
        def route(self, logits, capacity):
            r = super().route(logits, capacity)
            return Routes(expert=torch.zeros_like(r.expert), gate=r.gate, keep=r.keep, weight=r.weight,
                          log_prob=r.log_prob, aux=r.aux, stats=r.stats)

    torch.manual_seed(0)
    moe = MoE(8, 16, 4, router=Twice(8, 4, 2), capacity_factor=None, dispatch="buffers")
    x = torch.randn(6, 8)
    eager_y, _ = moe(x)
    dynamo.reset()
    y, _ = torch.compile(moe, backend="eager", fullgraph=True)(x)
    torch.testing.assert_close(y, eager_y, rtol=1e-5, atol=1e-6)


@pytest.mark.compile
@needs_compile
def test_dropless_under_compile_uses_the_worst_case_buffer() -> None:
    moe = build("topk", None, capacity_factor=None)
    x = inputs()
    eager_y, eager_routes = moe(x)
    dynamo.reset()
    y, routes = torch.compile(moe, backend="eager")(x)
    torch.testing.assert_close(y, eager_y, rtol=1e-5, atol=1e-6)
    assert int(routes.stats["capacity"]) == x.shape[0] * x.shape[1]  # C = tokens, no host sync
    assert int(eager_routes.stats["capacity"]) == int(eager_routes.stats["tokens_per_expert"].max())


@pytest.mark.compile
@needs_compile
@pytest.mark.parametrize("case", sorted(STOCHASTIC))
def test_stochastic_routers_without_a_generator_compile_for_every_token_count(case: str) -> None:
    """A review case: noisy top-k and the random drop policy drew with ``generator=None`` passed
    explicitly, an overload that rejects the symbolic shapes Dynamo switches to at the second token
    count (a crash there). Drawn from the global generator, the compiled layer equals the eager
    one under the same seed at every count."""
    name, options = STOCHASTIC[case]
    moe = build(name, None, **options)
    dynamo.reset()
    compiled = torch.compile(lambda t: moe(t)[0], backend="eager")
    for n in (12, 20, 28):
        x = torch.randn(n, D, generator=torch.Generator().manual_seed(n))
        torch.manual_seed(n)
        got = compiled(x)
        torch.manual_seed(n)
        torch.testing.assert_close(got, moe(x)[0], rtol=1e-5, atol=1e-6)


@pytest.mark.compile
@needs_compile
@pytest.mark.parametrize("case", ["multigate-dselect", "multigate-topk-gate", "mae"])
def test_the_other_layers_compile_whole_with_their_default_checks(case: str) -> None:
    """A review case: MultiGateMoE, the per-example gates and the MAE layer ran their NaN/inf checks
    while Dynamo traced, a data-dependent branch: ``fullgraph=True`` failed with Dynamo's error,
    naming no routelab option. The checks are skipped while tracing, as MoE's; eager equality."""
    from routelab.gates import DSelectK, TopKGate
    from routelab.layers import MixtureOfAttentiveExperts, MultiGateMoE, StackedLinear

    torch.manual_seed(0)
    if case == "mae":
        module = MixtureOfAttentiveExperts(8, 4, batch_first=True).eval()
        q = torch.randn(2, 5, 8)
        args = (q, q, q)
    else:
        gate = (DSelectK(4, 2, per_example=True, input_dim=D) if case == "multigate-dselect"
                else TopKGate(4, 2, per_example=True, input_dim=D))
        module = MultiGateMoE(StackedLinear(4, D, 6), [gate]).eval()
        args = (torch.randn(3, D),)
    dynamo.reset()
    explanation = dynamo.explain(module)(*args)
    assert explanation.graph_break_count == 0, [str(b.reason).splitlines()[0] for b in explanation.break_reasons]
    dynamo.reset()
    compiled = torch.compile(module, fullgraph=True, backend="eager")(*args)
    torch.testing.assert_close(compiled, module(*args), rtol=0, atol=0)


@pytest.mark.compile
@needs_compile
def test_a_compiled_mae_layer_with_a_mask_asks_for_causal_gate() -> None:
    """Whether an ``attn_mask`` is causal is read from its values (a host read): under compile the
    layer asks for ``causal_gate`` instead, and with it compiles whole."""
    from routelab.layers import MixtureOfAttentiveExperts

    torch.manual_seed(0)
    mae = MixtureOfAttentiveExperts(8, 4, batch_first=True).eval()
    q = torch.randn(2, 5, 8)
    mask = torch.nn.Transformer.generate_square_subsequent_mask(5)
    dynamo.reset()
    with pytest.raises(Exception, match="pass causal_gate=True"):
        torch.compile(mae, fullgraph=True, backend="eager")(q, q, q, attn_mask=mask)
    dynamo.reset()
    compiled = torch.compile(mae, fullgraph=True, backend="eager")(q, q, q, attn_mask=mask, causal_gate=True)
    torch.testing.assert_close(compiled, mae(q, q, q, attn_mask=mask), rtol=0, atol=0)


def test_a_dropless_random_policy_draws_nothing() -> None:
    """A review case: ``drop_policy="random"`` drew its ranks where nothing can drop (a dropless
    eval forward), so how often one validated changed the training noise of the same seed."""
    moe = build("topk", torch.Generator().manual_seed(1), drop_policy="random", capacity_factor=0.5).eval()
    before = moe.generator.get_state()
    with torch.no_grad():
        y, routes = moe(inputs())  # eval_capacity_factor None: dropless
    assert torch.equal(moe.generator.get_state(), before) and bool(routes.keep.all())
    moe.train()
    moe(inputs())  # capacity factor 0.5: drops, and draws
    assert not torch.equal(moe.generator.get_state(), before)


@pytest.mark.compile
@needs_compile
@pytest.mark.skipif(dynamo is None or not hasattr(dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint"),
                    reason="this torch's Dynamo has no skip_fwd_side_effects_in_bwd_under_checkpoint")
@pytest.mark.parametrize("name", ["topk", "batchwise"])
def test_a_checkpointed_layer_compiles_whole_with_dynamos_side_effect_flag(name: str) -> None:
    """The README's recipe: the routing record is a side effect Dynamo refuses inside a checkpointed
    region; with ``skip_fwd_side_effects_in_bwd_under_checkpoint`` the region compiles with
    ``fullgraph=True``, and the outputs, gradients and ``aux_loss`` equal the eager layer's."""
    import routelab

    def step(moe: MoE, compiled: bool) -> list[torch.Tensor]:
        def f(t: torch.Tensor) -> torch.Tensor:
            return checkpoint(lambda u: moe(u)[0], t, use_reentrant=False)

        run = torch.compile(f, backend="aot_eager", fullgraph=True) if compiled else f
        x = inputs().requires_grad_(True)
        y = run(x)
        loss = (y * torch.linspace(-1, 1, D)).sum() + routelab.aux_loss(moe)
        loss.backward()
        return [y, routelab.aux_loss(moe).detach(), x.grad, *(p.grad for p in moe.parameters())]

    with dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True):
        dynamo.reset()
        got = step(build(name, None, check_finite=False), compiled=True)
    want = step(build(name, None, check_finite=False), compiled=False)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
