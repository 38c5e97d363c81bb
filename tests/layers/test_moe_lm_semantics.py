"""Language-model semantics of the MoE layer at inference (issue 15, item 7).

In ``eval()`` with the defaults (dropless ``eval_capacity_factor=None``; per-token inference of the
balanced routers), a sequence's outputs must not depend on its batch-mates nor on its own future
tokens, for every router. Oracle: the same layer on the sequence alone and on its prefixes. The
options that do make outputs batch-dependent (``eval_capacity_factor``, ``eval_balanced=True``,
``inference="batchwise"``) are shown to, so that the independence checks can fail.
"""

from __future__ import annotations

import pytest
import torch

from routelab.layers import MoE, MoEConfig

D, H, E = 8, 16, 4
ROUTER_K = {"softmax": None, "topk": 2, "switch": 1, "noisy_topk": 2, "batchwise": 2, "base": 1, "sinkhorn": 2,
            "gumbel_matching": 1}
EVERY_ROUTER = ["softmax", "topk", "switch", "noisy_topk", "batchwise", "base", "sinkhorn", "gumbel_matching"]
ATOL = 1e-6  # a different batch changes the buffer sizes of the batched matmuls, not the math


def trained_layer(name: str, *, seed: int = 0, **kw) -> MoE:
    """A layer after a few training steps (learned batchwise thresholds, non-zero noisy weights)."""
    torch.manual_seed(seed)
    moe = MoE(D, H, E, router=name, k=ROUTER_K[name], capacity_factor=1.0,
              generator=torch.Generator().manual_seed(seed), **kw)
    with torch.no_grad():
        moe.router.proj.weight.normal_(0, 1.0)
    opt = torch.optim.SGD(moe.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(seed + 1)
    for _ in range(3):
        y, routes = moe(torch.randn(4, 6, D, generator=g) + 1.0)
        loss = (y ** 2).mean() + sum(routes.aux.values(), torch.zeros(()))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return moe.eval()


def batch_and_sequence(seed: int = 7) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(5, 9, D, generator=g) + torch.randn(5, 1, D, generator=g)  # per-sequence offsets


@pytest.mark.parametrize("name", EVERY_ROUTER)
def test_eval_outputs_do_not_depend_on_batch_mates_or_future_tokens(name: str) -> None:
    moe = trained_layer(name)
    x = batch_and_sequence()
    with torch.no_grad():
        y_batch, _ = moe(x)
        for b in range(x.shape[0]):
            y_alone, _ = moe(x[b:b + 1])
            torch.testing.assert_close(y_batch[b:b + 1], y_alone, rtol=0, atol=ATOL,
                                       msg=f"{name}: sequence {b} depends on its batch-mates")
        for t in (1, 4, 8):
            y_prefix, _ = moe(x[:, :t])
            torch.testing.assert_close(y_batch[:, :t], y_prefix, rtol=0, atol=ATOL,
                                       msg=f"{name}: the first {t} tokens depend on later tokens")


@pytest.mark.parametrize("name, option", [
    ("topk", {"eval_capacity_factor": 1.0}),
    ("base", {"router_kwargs": {"eval_balanced": True}}),
    ("gumbel_matching", {"router_kwargs": {"eval_balanced": True}}),
    ("sinkhorn", {"router_kwargs": {"eval_balanced": True}}),
    ("batchwise", {"router_kwargs": {"inference": "batchwise"}}),
])
def test_batch_level_eval_options_do_depend_on_batch_mates(name: str, option: dict) -> None:
    """The opt-in batch-level inference modes still work, and make the check above fail."""
    moe = trained_layer(name, **option)
    x = batch_and_sequence()
    x[1:] += 4.0 * torch.randn(1, 1, D, generator=torch.Generator().manual_seed(3))  # batch-mates unlike seq 0
    with torch.no_grad():
        y_batch, _ = moe(x)
        diffs = [float((y_batch[b:b + 1] - moe(x[b:b + 1])[0]).abs().max()) for b in range(x.shape[0])]
    assert max(diffs) > 1e-3, f"{name} with {option}: expected batch-dependent outputs, max diff {max(diffs)}"


def test_eval_capacity_factor_sets_the_inference_capacity() -> None:
    moe = MoE(D, H, E, router="topk", k=2, capacity_factor=1.25, eval_capacity_factor=0.5)
    x = torch.randn(40, D)
    assert int(moe(x)[1].stats["capacity"]) == 25  # ceil(1.25 * 40 * 2 / 4)
    moe.eval()
    assert int(moe(x)[1].stats["capacity"]) == 10  # ceil(0.5 * 40 * 2 / 4)
    moe.eval_capacity_factor = None
    _, routes = moe(x)
    assert float(routes.stats["dropped_fraction"]) == 0.0  # dropless: the buffer is the largest load
    assert int(routes.stats["capacity"]) == int(routes.stats["tokens_per_expert"].max())


def test_eval_defaults_are_dropless_and_per_token() -> None:
    moe = MoE(D, H, E, router="base")
    assert moe.eval_capacity_factor is None and moe.router.eval_balanced is False
    assert MoE(D, H, E, router="gumbel_matching").router.eval_balanced is False
    assert MoE(D, H, E, router="sinkhorn").router.eval_balanced is False
    assert MoE(D, H, E, router="batchwise").router.inference == "threshold"


def test_config_carries_eval_capacity_factor_and_check_finite() -> None:
    config = MoEConfig(D, H, E, router="topk", k=2, eval_capacity_factor=2.0, check_finite=False)
    moe = MoE.from_config(config)
    assert moe.eval_capacity_factor == 2.0 and moe.router.check_finite is False
    again = moe.config
    assert again.eval_capacity_factor == 2.0 and again.check_finite is False
    with pytest.raises(ValueError, match="eval_capacity_factor must be a finite number > 0"):
        MoEConfig(D, H, E, eval_capacity_factor=0.0)
    with pytest.raises(ValueError, match="eval_capacity_factor"):
        MoE(D, H, E, eval_capacity_factor=float("nan"))
    with pytest.raises(ValueError, match="check_finite"):
        MoEConfig(D, H, E, check_finite="no")


def test_check_finite_false_skips_the_check() -> None:
    x = torch.full((3, D), float("nan"))
    with pytest.raises(ValueError, match="not finite"):
        MoE(D, H, E)(x)
    y, _ = MoE(D, H, E, check_finite=False)(x)  # no error: the caller opted out of the check
    assert y.shape == x.shape


def test_a_layer_built_from_another_layers_config_has_a_router_of_its_own() -> None:
    """A review case: ``config`` described a router built by name by the instance, so
    ``MoE.from_config(layer.config)`` shared it (tied parameters) and dropped ``k`` and
    ``router_kwargs`` (``config.replace(router="base")`` went to k = 1)."""
    config = MoEConfig(D, H, E, router="noisy_topk", k=2, router_kwargs={"load_coef": 0.5})
    moe = MoE.from_config(config)
    assert moe.config == config
    clone = MoE.from_config(moe.config)
    assert clone.router is not moe.router and clone.router.proj.weight is not moe.router.proj.weight
    assert clone.router.k == 2 and clone.router.load_coef == 0.5
    assert MoE.from_config(moe.config.replace(router="topk", router_kwargs=None)).router.k == 2
    moe.router.check_finite = False  # a change since construction is described
    assert moe.config.check_finite is False
    own = MoE(D, H, E, router=moe.router)  # an instance is described as the instance (and shared)
    assert own.config.router is moe.router
    moe.router = clone.router  # assigned since: the instance
    assert moe.config.router is clone.router


def test_a_router_reconfigured_since_construction_is_described_as_it_is() -> None:
    """A review case: ``config`` described a router built by name by its construction options even
    after they changed, and ``config.replace(router=instance)`` raised for a config with ``k``."""
    moe = MoE(D, H, E, router="topk", k=2)
    moe.router.balance_coef = 0.0
    assert moe.config.router is moe.router  # changed since: the instance, as it is
    fresh = MoE(D, H, E, router="topk", k=2)
    other = MoE(D, H, E, router="topk", k=1).router
    replaced = fresh.config.replace(router=other)
    assert replaced.router is other and replaced.k is None and replaced.router_kwargs is None


@pytest.mark.parametrize("router", ["topk", "noisy_topk", "batchwise", "sinkhorn", "base"])
def test_setting_a_routers_k_changes_its_routes_capacity_and_config(router: str) -> None:
    """A review case: ``router.k = 3`` changed the routes but not ``slots``, so the layer sized its
    capacity for the old ``k`` and ``config`` described the layer by name with ``k=2``
    (``MoE.from_config(layer.config)`` silently built another layer). ``k`` is ``slots`` now."""
    moe = MoE(D, H, E, router=router, k=2)
    moe.router.k = 3
    assert moe.router.slots == 3 and moe.capacity(64) == MoE(D, H, E, router=router, k=3).capacity(64)
    assert moe.config.router is moe.router  # reconfigured since: the instance, as it is
    _, routes = moe(torch.randn(16, D))
    assert routes.expert.shape[-1] >= 3
    with pytest.raises(ValueError, match="k must be an integer in"):
        moe.router.k = E + 1


def test_a_config_takes_only_its_routers_options_and_k() -> None:
    """A review case: ``replace(router=...)`` kept the old router's options and ``k`` and was
    accepted; only building the layer failed. Now the config refuses them, naming what to pass."""
    config = MoEConfig(D, H, E, router="batchwise", k=2, router_kwargs={"threshold_coef": 0.5})
    with pytest.raises(ValueError, match=r"takes no option 'threshold_coef'.*pass k=, router_kwargs="):
        config.replace(router="topk")
    assert config.replace(router="topk", router_kwargs=None).k == 2
    with pytest.raises(ValueError, match=r"got k=2 but supports.*pass k= with it"):
        MoEConfig(D, H, E, router="topk", k=2).replace(router="softmax")
    with pytest.raises(ValueError, match="takes no option 'sweeps'"):
        MoEConfig(D, H, E, router="topk", router_kwargs={"sweeps": 3})
    with pytest.raises(ValueError, match="k must be an integer in"):
        MoEConfig(D, H, E, router="topk", k=E + 1)
    with pytest.raises(ValueError, match="router_kwargs must be a dict"):
        MoEConfig(D, H, E, router="topk", router_kwargs=[("renormalize", True)])


def test_a_layer_pickled_before_router_specs_still_describes_itself() -> None:
    """A review case: a layer unpickled from a version without ``_router_spec`` had no ``config``."""
    moe = MoE(D, H, E, router="topk", k=2)
    del moe.__dict__["_router_spec"]  # as a layer pickled before the attribute existed
    assert moe.config.router is moe.router
