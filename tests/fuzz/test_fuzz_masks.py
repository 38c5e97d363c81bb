"""Fuzz tests of token masks, the noise replay and the compile exclusion (routelab.routing's
real_tokens, scatter_routes, masked_rule, NoiseReplay, eager) and of ``MoE(x, mask=...)``.

Oracles: the same rule or layer on the real tokens alone (``x[mask]``), torch's ``nonzero``,
and the generator's own stream.
"""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

import routelab.estimators as Est
import routelab.layers as L
import routelab.routing as R
from fuzz_strategies import call, fresh, fuzz, guarded, same_bits, seeds

#: The routing callables covered here (test_fuzz_routing requires a fuzz test for each).
COVERED_MASKS = {"NoiseReplay", "eager", "masked_rule", "real_tokens", "scatter_routes"}
FIELDS = ("expert", "gate", "keep", "weight", "log_prob")


def _rule(name: str, logits: torch.Tensor, noise: torch.Tensor, k: int, training: bool, seed: int, **kw):
    E = logits.shape[-1]
    if name == "softmax":
        return R.softmax_routes(logits, importance_coef=0.1, **kw)
    if name == "topk":
        return R.topk_routes(logits, k, **kw)
    if name == "noisy_topk":
        return R.noisy_topk_routes(logits, noise, k, training=training, generator=fresh(seed), **kw)
    if name == "batchwise":
        return R.batchwise_routes(logits, k, torch.full((E,), 1.0 / E), training=training, **kw)
    if name == "base":
        return R.balanced_routes(logits, balanced=training, **kw)
    if name == "sinkhorn":
        return R.sinkhorn_routes(logits, k, balanced=training, balance_coef=0.1, **kw)
    return Est.gumbel_matching_routes(logits, training=training, generator=fresh(seed), **kw)


@fuzz(80)
@given(
    name=st.sampled_from(("softmax", "topk", "noisy_topk", "batchwise", "base", "sinkhorn", "gumbel_matching")),
    n=st.integers(0, 12),
    E=st.integers(1, 5),
    k=st.integers(1, 3),
    training=st.booleans(),
    bad=st.sampled_from((None, None, None, "dtype", "shape", "type")),
    seed=seeds,
)
def test_masked_rules_route_the_real_tokens_alone(name, n, E, k, training, bad, seed) -> None:
    """rule(..., mask=m) == scatter_routes(rule on the real tokens): same bits, same aux; a bad
    mask is a ValueError/TypeError naming mask."""
    k = min(k, E)
    g = fresh(seed)
    logits = torch.randn(n, E, generator=g)
    noise = torch.rand(n, E, generator=g) + 0.1
    mask = torch.rand(n, generator=g) < 0.6
    if bad == "dtype":
        mask = mask.float()
    elif bad == "shape":
        mask = torch.ones(n + 1, dtype=torch.bool)
    elif bad == "type":
        mask = mask.tolist()
    ok, got = call(_rule, name, logits, noise, k, training, seed, mask=mask, names=("mask",), valid=bad is None,
                   what=f"{name} rule with a mask")
    if not ok:
        return
    idx = torch.nonzero(mask).flatten()
    assert same_bits(R.real_tokens(mask), idx), "real_tokens != nonzero"
    want = R.scatter_routes(guarded(_rule, name, logits[mask], noise[mask], k, training, seed), idx, n)
    for f in FIELDS:
        assert same_bits(getattr(got, f), getattr(want, f)), f"{name}: masked rule's {f} differs"
    assert got.aux.keys() == want.aux.keys() and all(same_bits(got.aux[a], want.aux[a]) for a in got.aux)
    assert not got.keep[~mask].any(), "a masked token was routed"


@fuzz(40)
@given(n=st.integers(0, 8), real=st.integers(0, 8), slots=st.integers(1, 3), kind=st.sampled_from(
    ("ok", "float_index", "short_index", "small_n", "out_of_range", "not_routes")), seed=seeds)
def test_scatter_routes(n, real, slots, kind, seed) -> None:
    """Rows land at their index; the others are routed nowhere; bad arguments are named."""
    real = min(real, n)
    g = fresh(seed)
    idx = torch.randperm(n, generator=g)[:real].sort().values
    routes = R.topk_routes(torch.randn(real, 4, generator=g), min(slots, 4))
    args = [routes, idx, n]
    valid = kind == "ok" or (kind == "out_of_range" and real == 0)
    if kind == "float_index":
        args[1] = idx.float()
    elif kind == "short_index":
        args[1] = idx[:-1] if real else torch.zeros(1, dtype=torch.long)
    elif kind == "small_n":
        args[2] = real - 1
    elif kind == "out_of_range" and real:
        args[1] = idx.clone()
        args[1][-1] = n
    elif kind == "not_routes":
        args[0] = {"expert": routes.expert}
    ok, out = call(R.scatter_routes, *args, names=("index", "num_tokens", "routes"), valid=valid,
                   what="scatter_routes")
    if not ok:
        return
    rest = torch.ones(n, dtype=torch.bool)
    rest[idx] = False
    for f in FIELDS:
        assert same_bits(getattr(out, f)[idx], getattr(routes, f)), f
        assert not bool(getattr(out, f)[rest].bool().any()), f"{f} of an unrouted token is not 0"


@fuzz(30)
@given(steps=st.lists(st.sampled_from(("forward", "recompute")), min_size=1, max_size=8), seed=seeds)
def test_noise_replay_replays_the_last_forward(steps, seed) -> None:
    """Forward draws advance the generator; a recomputation (inside a backward pass) draws exactly
    the most recent forward's numbers and leaves the generator where it was. Each backward pass
    starts again from the most recent record (a record is not consumed: ``retain_graph``'s second
    backward replays the same noise)."""
    gen = fresh(seed)
    replay = guarded(R.NoiseReplay, depth=8)
    drawn: list[torch.Tensor] = []
    for step in steps:
        if step == "forward":
            with replay.draw(gen):
                drawn.append(torch.rand(2, generator=gen))
            continue
        x = torch.ones((), requires_grad=True)
        result = {}

        def hook(grad: torch.Tensor, result: dict = result) -> torch.Tensor:
            before = gen.get_state()
            try:
                with replay.draw(gen):
                    result["value"] = torch.rand(2, generator=gen)
            except RuntimeError as exc:
                result["error"] = exc
            result["untouched"] = torch.equal(gen.get_state(), before)
            return grad

        x.register_hook(hook)
        (2 * x).backward()
        if drawn:
            assert torch.equal(result["value"], drawn[-1]) and result["untouched"]
        else:
            assert "no recorded" in str(result["error"])
    ok, _ = call(R.NoiseReplay, depth=0, names=("depth",), valid=False, what="NoiseReplay(depth=0)")


def test_eager_and_masked_rule_keep_the_function() -> None:
    """eager(fn) computes fn; masked_rule adds a mask keyword to the signature."""
    import inspect

    f = R.eager(lambda t: t * 2)
    assert torch.equal(f(torch.ones(2)), torch.full((2,), 2.0))
    assert "mask" in inspect.signature(R.topk_routes).parameters
    rule = R.masked_rule("logits")(lambda logits, k: R.topk_routes(logits, k))
    m = torch.tensor([True, False, True])
    out = rule(torch.randn(3, 2), 1, mask=m)
    assert not out.keep[1].any() and out.keep[[0, 2]].all()


@fuzz(40)
@given(
    router=st.sampled_from(("softmax", "topk", "switch", "noisy_topk", "batchwise", "base", "sinkhorn",
                            "gumbel_matching")),
    lead=st.sampled_from(((5,), (2, 4), (3, 3))),
    cf=st.sampled_from((None, 1.0, 2.0)),
    training=st.booleans(),
    seed=seeds,
)
def test_moe_with_mask_equals_moe_on_real_tokens(router, lead, cf, training, seed) -> None:
    """MoE(x, mask) == MoE(x[mask]) on the real tokens (same generator), exactly 0 elsewhere."""
    def build():
        torch.manual_seed(seed % 1000)
        moe = L.MoE(4, 8, 3, router=router, capacity_factor=cf, generator=fresh(seed))
        torch.nn.init.normal_(moe.router.proj.weight)
        return moe.train(training)

    g = fresh(seed + 1)
    x = torch.randn(*lead, 4, generator=g)
    mask = torch.rand(lead, generator=g) < 0.7
    _, (y, routes) = call(build(), x, mask=mask, names=("x",), valid=True, what=f"MoE({router}) with a mask")
    _, (y_real, routes_real) = call(build(), x[mask], names=("x",), valid=True, what=f"MoE({router}) real tokens")
    assert bool((y[~mask] == 0).all()), "masked outputs must be exactly 0"
    assert torch.allclose(y[mask], y_real, rtol=0, atol=1e-6), "real tokens differ from the unpadded batch"
    assert same_bits(routes.stats["tokens_per_expert"], routes_real.stats["tokens_per_expert"])
